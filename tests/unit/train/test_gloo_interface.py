"""Which interface Gloo's pairs of a group built by unbroken listen on (the real binds of two
ranks are checked in tests/integration/test_gloo_loopback.py)."""

from __future__ import annotations

from unbroken.train.replica_group import gloo_interface_for, loopback_interface


def test_the_choice_of_interface() -> None:
    assert gloo_interface_for("127.0.0.1") == loopback_interface() == "lo"
    assert gloo_interface_for("localhost") == "lo"
    assert gloo_interface_for("10.0.0.7") is None  # a spanning group: the launcher pins its interface
