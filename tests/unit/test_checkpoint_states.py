"""The checkpoint tier and buffer states are enums that read as the strings they replaced."""

from __future__ import annotations

import json
import logging

import pytest

from unbroken.checkpoint import Tier
from unbroken.checkpoint.states import SlotState


def test_a_tier_compares_prints_and_serialises_as_its_old_string(caplog: pytest.LogCaptureFixture) -> None:
    assert [t.value for t in Tier] == ["memory", "peer", "disk"]
    assert Tier.DISK == "disk" and Tier("peer") is Tier.PEER
    assert json.dumps({"source": Tier.MEMORY}) == '{"source": "memory"}'
    assert f"from the {Tier.PEER} checkpoint" == "from the peer checkpoint"
    with caplog.at_level(logging.INFO):
        logging.getLogger("test").info("resumes from the %s checkpoint", Tier.DISK)
    assert caplog.messages == ["resumes from the disk checkpoint"]


def test_an_unknown_tier_or_state_is_an_error() -> None:
    with pytest.raises(ValueError):
        Tier("tape")
    assert SlotState("inflight") is SlotState.INFLIGHT
    with pytest.raises(ValueError):
        SlotState("busy")
