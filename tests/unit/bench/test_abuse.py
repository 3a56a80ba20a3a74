"""The pure figures of ``unbroken bench abuse``: when a killed replica counts as recovered, and the summary."""

from __future__ import annotations

from unbroken.bench.control_plane.abuse import recovery_s, summary


def test_recovery_ends_when_the_victim_trains_again_after_the_kill() -> None:
    events = [
        {"kind": "replica_state", "t": 5.0, "replica": 1, "new": "training"},  # before the kill
        {"kind": "replica_state", "t": 11.0, "replica": 1, "new": "recovering"},
        {"kind": "replica_state", "t": 11.5, "replica": 2, "new": "training"},  # another replica
        {"kind": "quorum", "t": 12.0, "members": [0, 1, 2]},
        {"kind": "replica_state", "t": 12.5, "replica": 1, "new": "training"},
    ]
    assert recovery_s(events, victim=1, kill_t=10.0) == 2.5
    assert recovery_s(events[:4], victim=1, kill_t=10.0) is None


def test_the_summary_adds_every_listeners_refusals_and_compares_the_recoveries() -> None:
    flooded = {
        "recovery_s": 3.0,
        "flooder": {
            "targets": {
                "store": {"legit_ok": 10, "legit_refused": 0, "held_max": 300},
                "http": {"legit_ok": 8, "legit_refused": 2, "held_max": 250},
            }
        },
    }
    s = summary({"recovery_s": 2.0}, flooded)
    assert (s["legit_connects"], s["legit_refused"], s["recovery_ratio"]) == (20, 2, 1.5)
    assert summary({"recovery_s": 2.0}, {"error": "TimeoutError"})["recovery_ratio"] is None
