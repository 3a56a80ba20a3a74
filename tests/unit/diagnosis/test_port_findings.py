"""Port verdicts from ICCL path events: a port that failed is named; one that keeps failing flaps."""

from __future__ import annotations

import pytest

from unbroken.diagnosis.rules.links import port_findings


def ev(t: float, what: str = "down", host: str = "h1", iface: str = "eth0", peer: int = 2) -> dict[str, object]:
    return {"t": t, "host": host, "interface": iface, "peer": peer, "what": what, "why": "acks stopped"}


def test_one_failure_names_the_port_as_failing_and_repeats_as_flapping() -> None:
    (f,) = port_findings([ev(10.0), ev(11.0, "failover"), ev(12.0, "up")], now=15.0)
    assert (f.state, f.host, f.interface, f.peer, f.failures) == ("failing", "h1", "eth0", 2, 1)
    (f,) = port_findings([ev(10.0), ev(12.0), ev(14.0)], now=15.0)
    assert f.state == "flapping" and f.failures == 3 and (f.first_t, f.last_t) == (10.0, 14.0)
    assert f.to_json()["class"] == "link"


def test_old_failures_and_other_ports_are_kept_apart() -> None:
    found = port_findings([ev(1.0), ev(50.0, iface="eth1"), ev(51.0, host="h0", peer=1)], now=55.0, window_s=30.0)
    assert [(f.host, f.interface, f.state) for f in found] == [("h0", "eth0", "failing"), ("h1", "eth1", "failing")]


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="flap_at"):
        port_findings([], now=0.0, flap_at=1)
