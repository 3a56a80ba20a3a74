"""ICCL port events travel in the ranks' telemetry and come out as port verdicts naming the port."""

from __future__ import annotations

import pytest

from unbroken.diagnosis.master.master import DiagnosisMaster
from unbroken.diagnosis.telemetry import PathEvent, TelemetryBatch, TelemetryError
from unbroken.diagnosis.verdict import PORT_FAILURE


def batch(*events: PathEvent) -> TelemetryBatch:
    return TelemetryBatch(now_ns=1, paths=list(events))


def test_path_events_round_trip_and_malformed_ones_are_refused() -> None:
    sent = batch(PathEvent(0.5, "h1", "eth0", 2, "down", "reset by peer"))
    assert TelemetryBatch.from_msg(sent.to_msg()).paths == sent.paths
    for row in (
        [0.5, "h1", "eth0", 2, "exploded", ""],  # not an event the ring logs
        [-1.0, "h1", "eth0", 2, "down", ""],  # an age below zero
        [0.5, "h" * 300, "eth0", 2, "down", ""],  # a name past the bound
        [0.5, "h1", "eth0", 2, "down"],  # a field short
    ):
        with pytest.raises(TelemetryError):
            TelemetryBatch.from_msg({"now_ns": 1, "paths": [row]})
    with pytest.raises(TelemetryError):
        TelemetryBatch.from_msg({"now_ns": 1, "paths": [[0.5, "h", "e", 1, "down", ""]] * 65})


def test_a_port_that_fails_is_named_failing_then_flapping_and_each_is_reported_once() -> None:
    m = DiagnosisMaster()
    now = 1000.0
    m.ingest((1, 0), "h1", batch(PathEvent(0.2, "h1", "eth0", 2, "down", "reset")), now)
    first = [v for v in m.evaluate(now) if v.kind == PORT_FAILURE]
    assert len(first) == 1
    v = first[0]
    assert (v.evidence["host"], v.evidence["interface"], v.evidence["peer"]) == ("h1", "eth0", 2)
    assert v.evidence["state"] == "failing" and v.culprit.replica == 1 and v.culprit.link == (1, 2)
    assert [x for x in m.evaluate(now + 0.05) if x.kind == PORT_FAILURE] == []  # reported once
    m.ingest(
        (1, 0),
        "h1",
        batch(PathEvent(0.1, "h1", "eth0", 2, "up", ""), PathEvent(0.0, "h1", "eth0", 2, "down", "")),
        now + 2,
    )
    flapping = [x for x in m.evaluate(now + 2) if x.kind == PORT_FAILURE]
    assert len(flapping) == 1 and flapping[0].evidence["state"] == "flapping" and flapping[0].evidence["failures"] == 2


def test_a_port_that_failed_long_ago_is_no_longer_named() -> None:
    m = DiagnosisMaster()
    m.ingest((0, 0), "h0", batch(PathEvent(40.0, "h0", "eth1", 1, "down", "")), 1000.0)
    assert [v for v in m.evaluate(1000.0) if v.kind == PORT_FAILURE] == []
