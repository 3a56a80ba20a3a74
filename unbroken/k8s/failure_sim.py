"""What the Job and JobSet controllers do when a pod fails: a pure simulation of their rules.

It reads the failure rules from a rendered JobSet (a dict, as applied) and follows the two
controllers' documented semantics, as in JobSet v0.12 (``pkg/controllers/failure_policy.go``)
and Kubernetes' Job controller:

* a Job's ``podFailurePolicy``: its rules in order, the first that matches a failed pod wins:
  ``FailJob`` fails the Job at once (reason ``PodFailurePolicy``), ``Ignore`` replaces the pod
  without counting it, ``Count`` (and no rule matching) counts it; a Job whose counted failures
  exceed its ``backoffLimit`` fails (reason ``BackoffLimitExceeded``); otherwise the pod alone
  is replaced;
* a JobSet's ``failurePolicy`` for a failed child Job: its rules in order, the first whose
  ``onJobFailureReasons``, ``onJobFailureMessagePatterns`` and ``targetReplicatedJobs`` (each
  empty: any) match runs; none matching runs ``RestartJobSet``; no policy at all fails the
  JobSet. ``FailJobSet`` fails it; ``RestartJobSet`` recreates every child Job unless the
  restarts counted towards ``maxRestarts`` reached it (then it fails); ``RestartJob`` recreates
  the failed child Job alone, under the same limit, and is refused (a controller error) when
  the cluster's RestartJob feature gate is off. The ``...AndIgnoreMaxRestarts`` variants do not
  count.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

FAILED, RUNNING = "Failed", "Running"


class GateOff(RuntimeError):
    """A RestartJob action on a cluster whose JobSet controller has the RestartJob gate off."""


@dataclasses.dataclass(frozen=True)
class PodFailure:
    """One pod of child Job ``index`` of ``replicated_job`` ended: by an exit code of
    ``container``, or (``disruption``) evicted, preempted, or its node drained or lost."""

    replicated_job: str
    index: int
    exit_code: int | None = None
    container: str | None = None
    disruption: bool = False


@dataclasses.dataclass
class Outcome:
    """What one pod failure did."""

    state: str  # the JobSet's: Running or Failed
    recreated_jobs: list[tuple[str, int]]  # child Jobs deleted and created anew
    replaced_pods: int  # pods replaced inside a Job that goes on
    job_failure: tuple[str, str] | None  # (reason, message) of the child Job that failed
    rule: str | None  # the JobSet rule that ran (None: the default, or no Job failed)
    action: str | None


def _pod_rule_matches(rule: dict[str, Any], f: PodFailure) -> bool:
    if "onExitCodes" in rule:
        req = rule["onExitCodes"]
        if f.exit_code is None or f.disruption:
            return False
        if req.get("containerName") not in (None, f.container):
            return False
        inside = f.exit_code in req["values"]
        return inside if req["operator"] == "In" else not inside
    for cond in rule.get("onPodConditions", []):
        if cond["type"] == "DisruptionTarget" and f.disruption and cond.get("status", "True") == "True":
            return True
    return False


class JobSetSim:
    """One JobSet's child Jobs and restart counters, driven by :meth:`fail_pod`."""

    def __init__(self, jobset: dict[str, Any], restart_job_gate: bool) -> None:
        self.spec = jobset["spec"]
        self.gate = restart_job_gate
        self.templates = {r["name"]: r for r in self.spec["replicatedJobs"]}
        self.attempt: dict[tuple[str, int], int] = {}  # child Job -> how many times it was created
        self.counted: dict[tuple[str, int], int] = {}  # its pod failures counted against backoffLimit
        for r in self.spec["replicatedJobs"]:
            for i in range(r["replicas"]):
                self.attempt[(r["name"], i)] = 1
                self.counted[(r["name"], i)] = 0
        self.state = RUNNING
        self.restarts = 0  # whole-JobSet restarts
        self.restarts_towards_max = 0
        self.job_restarts_towards_max = 0

    @property
    def attempts(self) -> int:
        """The JobSet's runs so far (1 + its whole restarts)."""
        return 1 + self.restarts

    def fail_pod(self, f: PodFailure) -> Outcome:
        if self.state != RUNNING:
            raise RuntimeError(f"the JobSet is {self.state} already")
        key = (f.replicated_job, f.index)
        if key not in self.attempt:
            raise KeyError(f"no child Job {key} in this JobSet")
        job = self.templates[f.replicated_job]["template"]["spec"]
        failure = self._job_controller(key, job, f)
        if failure is None:
            return Outcome(self.state, [], 1, None, None, None)
        return self._jobset_controller(key, failure)

    def _job_controller(self, key: tuple[str, int], job: dict[str, Any], f: PodFailure) -> tuple[str, str] | None:
        """The child Job's own verdict on a failed pod: the Job's failure (reason, message), or None."""
        for index, rule in enumerate(job.get("podFailurePolicy", {}).get("rules", [])):
            if _pod_rule_matches(rule, f):
                if rule["action"] == "FailJob":
                    return (
                        "PodFailurePolicy",
                        f"Container {f.container} for pod {key[0]}-{key[1]} failed with exit code {f.exit_code} "
                        f"matching FailJob rule at index {index}",
                    )
                if rule["action"] == "Ignore":
                    return None
                break  # Count (or FailIndex, not rendered): counted below
        self.counted[key] += 1
        if self.counted[key] > job.get("backoffLimit", 6):
            return ("BackoffLimitExceeded", "Job has reached the specified backoff limit")
        return None

    def _jobset_controller(self, key: tuple[str, int], failure: tuple[str, str]) -> Outcome:
        policy = self.spec.get("failurePolicy")
        if policy is None:
            self.state = FAILED
            return Outcome(self.state, [], 0, failure, None, None)
        reason, message = failure
        for rule in policy.get("rules", []):
            if rule.get("onJobFailureReasons") and reason not in rule["onJobFailureReasons"]:
                continue
            patterns = rule.get("onJobFailureMessagePatterns") or []
            if patterns and not any(re.search(p, message) for p in patterns):
                continue
            if rule.get("targetReplicatedJobs") and key[0] not in rule["targetReplicatedJobs"]:
                continue
            return self._act(rule["action"], rule["name"], key, failure, policy.get("maxRestarts", 0))
        return self._act("RestartJobSet", None, key, failure, policy.get("maxRestarts", 0))

    def _act(self, action: str, rule: str | None, key: tuple[str, int], failure: tuple[str, str], cap: int) -> Outcome:
        total = self.restarts_towards_max + (self.job_restarts_towards_max if self.gate else 0)
        if action == "FailJobSet":
            self.state = FAILED
            return Outcome(self.state, [], 0, failure, rule, action)
        if action in ("RestartJob", "RestartJobAndIgnoreMaxRestarts"):
            if not self.gate:
                raise GateOff(f"{action} cannot be used when the JobSet controller's RestartJob feature gate is off")
            if action == "RestartJob" and total >= cap:
                self.state = FAILED
                return Outcome(self.state, [], 0, failure, rule, action)
            if action == "RestartJob":
                self.job_restarts_towards_max += 1
            self._recreate([key])
            return Outcome(self.state, [key], 0, failure, rule, action)
        if action in ("RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"):
            if action == "RestartJobSet" and total >= cap:
                self.state = FAILED
                return Outcome(self.state, [], 0, failure, rule, action)
            self.restarts += 1
            if action == "RestartJobSet":
                self.restarts_towards_max += 1
            every = sorted(self.attempt)
            self._recreate(every)
            return Outcome(self.state, every, 0, failure, rule, action)
        raise ValueError(f"unknown failure policy action {action!r}")

    def _recreate(self, keys: list[tuple[str, int]]) -> None:
        for k in keys:
            self.attempt[k] += 1
            self.counted[k] = 0
