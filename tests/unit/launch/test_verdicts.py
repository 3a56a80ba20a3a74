from __future__ import annotations

import pytest

from unbroken.launch.recovery.verdicts import anomaly_step, culprit_replica, rollback_step, verdict_action
from unbroken.observe import schema as ev


def v(cls: str, replica: int | None = 1, link: list[int] | None = None, **evidence: object) -> ev.Verdict:
    return ev.Verdict(
        verdict_class=cls,
        culprit={"replica": replica, "rank": 0, "node": None, "link": link},
        confidence=0.9,
        evidence=dict(evidence),
    )


@pytest.mark.parametrize(
    ("cls", "action"),
    [
        ("noncomm_hang", "restart"),
        ("comm_hang", "restart"),
        ("straggler", "isolate"),
        ("comm_slow", "isolate"),
        ("port_failure", "ignore"),  # an ICCL hop that failed over to its backup path
    ],
)
def test_each_class_has_its_remedy(cls: str, action: str) -> None:
    assert verdict_action(v(cls), "isolate")[0] == action


def test_suspect_hardware_is_set_aside_only_onto_a_spare_slot() -> None:
    # Moved off its node when a spare slot is free; otherwise it stays: each corruption was
    # healed from a peer, and a restart in place would mend nothing.
    assert verdict_action(v("suspect_hardware"), "isolate", spare_free=True)[0] == "isolate"
    action, why = verdict_action(v("suspect_hardware"), "isolate", spare_free=False)
    assert action == "ignore" and "no spare slot" in why
    action, why = verdict_action(v("suspect_hardware"), "restart", spare_free=True)
    assert action == "ignore" and "--on-verdict restart" in why
    # Other classes do not depend on a spare: a straggler restarts in place without one.
    assert verdict_action(v("straggler"), "isolate", spare_free=False)[0] == "isolate"


def test_on_verdict_caps_the_action() -> None:
    assert verdict_action(v("straggler"), "restart")[0] == "restart"
    assert verdict_action(v("noncomm_hang"), "ignore")[0] == "ignore"
    assert verdict_action(v("noncomm_hang"), "restart")[0] == "restart"


@pytest.mark.parametrize("replica", [-1, None])
def test_a_verdict_without_a_replica_is_ignored(replica: int | None) -> None:
    assert verdict_action(v("comm_hang", replica=replica), "isolate")[0] == "ignore"


def test_link_verdicts_touch_no_process() -> None:
    assert verdict_action(v("comm_hang", replica=0, link=[0, 1]), "isolate")[0] == "ignore"
    assert verdict_action(v("comm_slow", replica=0, link=[0, 2], pattern="link"), "isolate")[0] == "ignore"
    assert verdict_action(v("comm_slow", replica=2, pattern="node"), "isolate")[0] == "isolate"


def test_metric_anomaly_follows_the_anomaly_policy() -> None:
    assert verdict_action(v("metric_anomaly", action="isolate"), "isolate")[0] == "isolate"
    assert verdict_action(v("metric_anomaly", action="rollback"), "isolate")[0] == "rollback"
    assert verdict_action(v("metric_anomaly", action="rollback"), "restart")[0] == "rollback"
    assert verdict_action(v("metric_anomaly", action="rollback"), "ignore")[0] == "ignore"
    assert verdict_action(v("metric_anomaly", action="skip_step"), "isolate")[0] == "ignore"
    assert verdict_action(v("metric_anomaly", action=None), "isolate")[0] == "ignore"


def test_old_or_unknown_classes_and_bad_settings() -> None:
    assert verdict_action(v("hang"), "isolate")[0] == "ignore"
    with pytest.raises(ValueError, match="--on-verdict must be one of"):
        verdict_action(v("straggler"), "explode")


def test_a_verdict_read_back_from_its_json_line_gets_the_same_action() -> None:
    # The launcher is handed the typed event; one parsed back from events.jsonl must agree.
    for verdict in (v("straggler"), v("metric_anomaly", action="rollback", step=7), v("comm_hang", replica=None)):
        back = ev.parse(verdict.to_json())
        assert isinstance(back, ev.Verdict)
        assert verdict_action(back, "isolate") == verdict_action(verdict, "isolate")


def test_culprit_and_anomaly_step_are_read_only_when_well_formed() -> None:
    assert culprit_replica(v("straggler", replica=2)) == 2
    assert anomaly_step(v("metric_anomaly", step=12)) == 12
    assert anomaly_step(v("metric_anomaly", step="12")) is None  # not a step: the rollback is refused
    assert anomaly_step(v("metric_anomaly")) is None


def test_rollback_goes_to_the_newest_checkpoint_before_the_bad_update() -> None:
    # checkpoint 30 holds the state before step 30's update: still good for an anomaly at 30
    assert rollback_step(30, [10, 20, 30, 40]) == 30
    assert rollback_step(37, [40, 10, 30, 20]) == 30
    assert rollback_step(5, [10, 20]) is None
    assert rollback_step(5, []) is None
