"""The rendered failure rules, run through a simulation of the Job and JobSet controllers'
documented semantics (unbroken.k8s.failure_sim): one replica group's failure touches exactly one
child Job, a deterministic exit ends the JobSet in one attempt, the coordinator's loss replaces
one pod (its standby serves meanwhile). The simulation itself is checked against JobSet's rules
where the manifests do not exercise them (no policy, no rule matching, maxRestarts)."""

from __future__ import annotations

from typing import Any

import pytest

from unbroken.control.quorum.job_health import EXIT_CONFIG, EXIT_NO_PROGRESS
from unbroken.k8s import render
from unbroken.k8s.failure_sim import FAILED, RUNNING, GateOff, JobSetSim, PodFailure
from unbroken.k8s.k8s_settings import COORDINATOR_JOB, GROUPS_JOB, SPARES_JOB, K8sSettings
from unbroken.launch.policy import EXIT_CRASH_LOOP, EXIT_RESTART_LIMIT


def sim(gate: bool, replicas: int = 8, spares: int = 2, nodes: int = 2) -> JobSetSim:
    s = K8sSettings(
        image="img",
        command=("python", "train.py"),
        replicas=replicas,
        spares=spares,
        nodes_per_replica=nodes,
        ranks_per_replica=nodes * 8,
        restart_job_gate=gate,
    )
    return JobSetSim(render.jobset(s), restart_job_gate=gate)


def agent_exit(index: int, code: int, rjob: str = GROUPS_JOB) -> PodFailure:
    return PodFailure(rjob, index, exit_code=code, container=render.AGENT_CONTAINER)


def test_the_deterministic_exits_are_unbrokens_documented_codes() -> None:
    assert set(render.DETERMINISTIC_EXITS) == {EXIT_CONFIG, EXIT_NO_PROGRESS, EXIT_CRASH_LOOP, EXIT_RESTART_LIMIT}


@pytest.mark.parametrize("index", [0, 3, 7])
def test_with_the_gate_a_groups_failure_recreates_exactly_its_child_job(index: int) -> None:
    js = sim(gate=True)
    before = dict(js.attempt)
    out = js.fail_pod(agent_exit(index, 1))  # the agent died (OOM, a crash): its pod failed
    assert out.state == RUNNING and out.action == "RestartJob" and out.rule == render.RULE_GROUP
    assert out.recreated_jobs == [(GROUPS_JOB, index)]
    changed = {k for k in js.attempt if js.attempt[k] != before[k]}
    assert changed == {(GROUPS_JOB, index)}  # no other child Job, coordinator included, is touched
    assert js.attempts == 1  # the JobSet itself was not restarted


def test_with_the_gate_a_spare_groups_failure_recreates_only_that_spare() -> None:
    js = sim(gate=True)
    out = js.fail_pod(agent_exit(1, 137, rjob=SPARES_JOB))
    assert out.recreated_jobs == [(SPARES_JOB, 1)] and out.state == RUNNING


def test_without_the_gate_a_failed_pod_is_replaced_alone_and_no_job_fails() -> None:
    js = sim(gate=False)
    before = dict(js.attempt)
    for _ in range(50):
        out = js.fail_pod(agent_exit(2, 1))
        assert out.state == RUNNING and out.recreated_jobs == [] and out.replaced_pods == 1
    assert js.attempt == before and js.attempts == 1


@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("code", render.DETERMINISTIC_EXITS)
def test_a_deterministic_exit_ends_the_jobset_in_one_attempt(gate: bool, code: int) -> None:
    js = sim(gate=gate)
    out = js.fail_pod(agent_exit(5, code))
    assert out.state == FAILED and out.action == "FailJobSet" and out.rule == render.RULE_DETERMINISTIC
    assert out.job_failure is not None and out.job_failure[0] == "PodFailurePolicy"
    assert out.recreated_jobs == [] and js.attempts == 1


@pytest.mark.parametrize("gate", [True, False])
def test_the_coordinators_loss_replaces_its_pod_and_touches_no_job(gate: bool) -> None:
    """The active coordinator's pod dies: its Job replaces that pod (it comes back as the standby),
    while the other pod, the standby, takes over; no child Job is recreated."""
    js = sim(gate=gate)
    out = js.fail_pod(PodFailure(COORDINATOR_JOB, 0, exit_code=137, container=render.COORDINATOR_CONTAINER))
    assert out.state == RUNNING and out.recreated_jobs == [] and out.replaced_pods == 1
    out = js.fail_pod(PodFailure(COORDINATOR_JOB, 0, disruption=True))  # its node drained
    assert out.state == RUNNING and out.recreated_jobs == []
    assert js.counted[(COORDINATOR_JOB, 0)] == 1  # a disruption is not counted against backoffLimit


@pytest.mark.parametrize("gate", [True, False])
def test_an_evicted_group_pod_is_replaced_without_counting(gate: bool) -> None:
    js = sim(gate=gate)
    out = js.fail_pod(PodFailure(GROUPS_JOB, 4, disruption=True))
    assert out.state == RUNNING and out.recreated_jobs == [] and js.counted[(GROUPS_JOB, 4)] == 0


def test_restart_job_rendered_for_a_cluster_without_the_gate_is_a_controller_error() -> None:
    s = K8sSettings(image="img", command=("python", "t.py"), replicas=4, restart_job_gate=True)
    js = JobSetSim(render.jobset(s), restart_job_gate=False)
    with pytest.raises(GateOff, match="RestartJob feature gate is off"):
        js.fail_pod(agent_exit(0, 1))


def test_max_restarts_bounds_the_group_restarts() -> None:
    s = K8sSettings(image="img", command=("python", "t.py"), replicas=4, restart_job_gate=True, max_restarts=3)
    js = JobSetSim(render.jobset(s), restart_job_gate=True)
    states = [js.fail_pod(agent_exit(i % 4, 1)).state for i in range(4)]
    assert states == [RUNNING, RUNNING, RUNNING, FAILED]


# -- the simulation follows JobSet's semantics where the manifests do not exercise them ---------


def _bare(rules: list[dict[str, Any]] | None, backoff: int = 0, max_restarts: int = 2) -> dict[str, Any]:
    job = {"template": {"spec": {"backoffLimit": backoff, "template": {"spec": {"restartPolicy": "Never"}}}}}
    spec: dict[str, Any] = {
        "replicatedJobs": [{"name": "a", "replicas": 2, **job}, {"name": "b", "replicas": 1, **job}]
    }
    if rules is not None:
        spec["failurePolicy"] = {"maxRestarts": max_restarts, "rules": rules}
    return {"spec": spec}


def test_no_failure_policy_fails_the_jobset() -> None:
    js = JobSetSim(_bare(None), restart_job_gate=False)
    assert js.fail_pod(PodFailure("a", 0, exit_code=1)).state == FAILED


def test_no_matching_rule_restarts_every_child_job_until_max_restarts() -> None:
    js = JobSetSim(_bare([{"name": "onlyB", "action": "FailJobSet", "targetReplicatedJobs": ["b"]}]), False)
    out = js.fail_pod(PodFailure("a", 1, exit_code=1))
    assert out.action == "RestartJobSet" and out.rule is None
    assert sorted(out.recreated_jobs) == [("a", 0), ("a", 1), ("b", 0)] and js.attempts == 2
    js.fail_pod(PodFailure("a", 0, exit_code=1))
    assert js.fail_pod(PodFailure("a", 0, exit_code=1)).state == FAILED  # maxRestarts 2 reached


def test_the_first_matching_rule_wins_and_backoff_limit_is_counted() -> None:
    rules = [
        {"name": "r1", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]},
        {"name": "r2", "action": "RestartJobSetAndIgnoreMaxRestarts", "onJobFailureMessagePatterns": ["backoff"]},
        {"name": "r3", "action": "FailJobSet"},
    ]
    js = JobSetSim(_bare(rules, backoff=1), restart_job_gate=False)
    assert js.fail_pod(PodFailure("b", 0, exit_code=1)).recreated_jobs == []  # 1 failure <= backoffLimit 1
    out = js.fail_pod(PodFailure("b", 0, exit_code=1))
    assert out.rule == "r2" and out.job_failure is not None and out.job_failure[0] == "BackoffLimitExceeded"
    assert js.restarts_towards_max == 0 and js.attempts == 2
