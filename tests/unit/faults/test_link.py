"""Link faults of the ring transport: which sends they hold, for how long, and clear errors."""

from __future__ import annotations

import pytest

from unbroken.faults.link import LinkFault


def test_link_fault_between_two_replicas_slows_both_directions_from_its_step() -> None:
    f = LinkFault.parse("0-2:mb_s=20:step=30")
    assert f.delay_s(0, 2, 30, 20_000_000) == pytest.approx(1.0)
    assert f.delay_s(2, 0, 31, 20_000_000) == pytest.approx(1.0)
    assert f.delay_s(0, 1, 30, 20_000_000) is None
    assert f.delay_s(0, 2, 29, 20_000_000) is None


def test_a_stall_holds_one_direction_for_good() -> None:
    f = LinkFault.parse("1-0:stall:step=3")
    assert f.delay_s(1, 0, 3, 1) == float("inf")
    assert f.delay_s(0, 1, 3, 1) is None


def test_link_fault_comes_from_the_environment_through_config() -> None:
    assert LinkFault.from_env({}) is None
    assert LinkFault.from_env({"UNBROKEN_LINK_FAULT": "0-1:stall"}) == LinkFault(0, 1, stall=True)


def test_link_fault_of_a_whole_node() -> None:
    f = LinkFault.parse("2:mb_s=10:step=5")
    assert f.delay_s(0, 2, 5, 10_000_000) == pytest.approx(1.0)
    assert f.delay_s(2, 1, 5, 10_000_000) == pytest.approx(1.0)
    assert f.delay_s(0, 1, 5, 10_000_000) is None
    assert f.delay_s(0, 2, 4, 10_000_000) is None


@pytest.mark.parametrize(
    ("spec", "msg"),
    [("2:stall", "a stall names one direction"), ("1-2-3:mb_s=5", "A-B"), ("0-1", "give mb_s > 0 or stall")],
)
def test_bad_link_fault_specs(spec: str, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        LinkFault.parse(spec)
