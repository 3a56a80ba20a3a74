"""The job's Prometheus metrics, built on each scrape from :class:`unbroken.observe.live.JobView`.

A custom collector, not module-level counters updated where things happen: the figures already
exist as events and rows, so nothing on the training path or in the coordinator's loop changes
to export them, and one process can serve several views (a test runs many jobs). Names follow
Prometheus conventions: the ``unbroken_`` prefix, base units in the name (``_seconds``,
``_bytes``), ``_total`` for counters, and labels for what varies (``replica``, ``cause``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from unbroken.observe.live import Histogram, JobView

STATES = (
    "launching",
    "warming_up",
    "training",
    "failed",
    "recovering",
    "catching_up",
    "isolated",
    "stopped",
    "finished",
)


class JobCollector(Collector):
    """Collects the view's state and the coordinator's live status on each scrape.

    Args:
        view: the job's events and rows.
        status: the coordinator's status now (None when there is no coordinator to ask).
    """

    def __init__(self, view: JobView, status: Callable[[], Mapping[str, Any] | None]) -> None:
        self.view = view
        self.status = status

    def collect(self) -> Iterator[Metric]:
        self.view.refresh()
        state = self.view.state(self.status())
        job, replicas = state["job"], state["replicas"]

        def gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)

        yield from gauge("unbroken_job_step", "The job's newest committed step.", job["step"])
        yield from gauge("unbroken_quorum_epoch", "The current quorum epoch.", job["epoch"])
        yield from gauge("unbroken_replicas", "Replicas the job is configured with.", job["total"])
        yield from gauge("unbroken_replicas_healthy", "Replicas training now.", job["healthy"])
        yield from gauge("unbroken_quorum_members", "Replicas in the current epoch.", len(job["members"]))

        step = GaugeMetricFamily("unbroken_replica_step", "Each replica's committed step.", labels=["replica"])
        step_s = GaugeMetricFamily(
            "unbroken_replica_step_seconds", "Each replica's compute time of its last step.", labels=["replica"]
        )
        states = GaugeMetricFamily(
            "unbroken_replica_state",
            "Each replica's lifecycle state (1 for the current one).",
            labels=["replica", "state"],
        )
        for r in replicas:
            label = str(r["replica"])
            if r["step"] is not None:
                step.add_metric([label], r["step"])
            if r["step_s"] is not None:
                step_s.add_metric([label], r["step_s"])
            for s in STATES:
                states.add_metric([label, s], 1.0 if r["state"] == s else 0.0)
        yield step
        yield step_s
        yield states

        restarts = CounterMetricFamily("unbroken_restarts", "Replica restarts by cause.", labels=["cause"])
        for cause, n in sorted(state["restarts"].items()):
            restarts.add_metric([cause], n)
        yield restarts
        verdicts = CounterMetricFamily("unbroken_verdicts", "Diagnosis verdicts by class.", labels=["class"])
        for kind, n in sorted(state["verdicts"].items()):
            verdicts.add_metric([kind], n)
        yield verdicts
        ports = GaugeMetricFamily(
            "unbroken_port_failures",
            "ICCL NIC ports named by a port verdict: failures within its 30 s window, by state (failing, flapping).",
            labels=["host", "interface", "peer", "state"],
        )
        for p in state.get("ports", []):
            ports.add_metric([p["host"], p["interface"], str(p["peer"]), p["state"]], p["failures"])
        yield ports

        yield _histogram(
            "unbroken_detection_seconds", "From an injected fault to the event that detected it.", self.view.detection
        )
        yield _histogram(
            "unbroken_recovery_seconds", "From a replica's failure to its training again.", self.view.recovery
        )
        yield _histogram(
            "unbroken_catch_up_seconds", "From joining behind to training as a full member.", self.view.catch_up
        )

        yield _histogram(
            "unbroken_checkpoint_stall_seconds",
            "How long each checkpoint save blocked the training loop.",
            self.view.checkpoint_stall,
        )
        yield _histogram(
            "unbroken_checkpoint_persist_seconds",
            "From a snapshot's write starting to its being durable on disk.",
            self.view.checkpoint_persist,
        )
        yield _histogram(
            "unbroken_catch_up_transfer_seconds",
            "A catch-up's fetch of a peer's state, from the request to the state loaded.",
            self.view.catch_up_transfer,
        )
        totals = self.view.totals
        yield CounterMetricFamily(
            "unbroken_checkpoint_snapshot_bytes",
            "Tensor bytes copied by checkpoint saves.",
            value=totals["checkpoint_snapshot_bytes"],
        )
        yield CounterMetricFamily(
            "unbroken_checkpoint_persisted_bytes",
            "Tensor bytes written durably to disk.",
            value=totals["checkpoint_persisted_bytes"],
        )
        persisted = CounterMetricFamily(
            "unbroken_checkpoint_persists", "Snapshot writes to disk by outcome.", labels=["outcome"]
        )
        persisted.add_metric(["ok"], totals["checkpoint_persisted_ok"])
        persisted.add_metric(["failed"], totals["checkpoint_persisted_failed"])
        yield persisted
        yield CounterMetricFamily(
            "unbroken_catch_up_bytes", "State bytes received from peers by catch-ups.", value=totals["catch_up_bytes"]
        )

        good = state["goodput"]
        if good is not None:
            yield from gauge(
                "unbroken_goodput_ratio", "Productive replica-seconds over capacity, so far.", good["goodput"]
            )
            yield from gauge(
                "unbroken_capacity_replica_seconds", "Replicas times the training window so far.", good["capacity_s"]
            )
            yield from gauge(
                "unbroken_productive_replica_seconds", "Replica-seconds that trained the model.", good["productive_s"]
            )
            lost = GaugeMetricFamily(
                "unbroken_lost_replica_seconds", "Capacity lost so far, by category.", labels=["category"]
            )
            for category, seconds in sorted(good["lost_s"].items()):
                lost.add_metric([category], seconds)
            yield lost


def _histogram(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, buckets=h.cumulative(), sum_value=h.sum)


def registry_for(view: JobView, status: Callable[[], Mapping[str, Any] | None]) -> CollectorRegistry:
    """A registry of its own: the process's default one would mix several jobs (and the tests')."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(view, status))
    return registry
