"""The telemetry schema: what a recorder ships arrives intact, and a malformed batch is refused whole."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from unbroken.comm.recorder import FlightRecorder
from unbroken.diagnosis.telemetry import (
    MAX_COSTS,
    MAX_ROWS,
    CaughtUp,
    CheckpointPersisted,
    CheckpointSaved,
    Collective,
    SdcFound,
    TelemetryBatch,
    TelemetryError,
)


def _wire(batch: TelemetryBatch) -> dict[str, Any]:
    return json.loads(json.dumps({"op": "telemetry", **batch.to_msg()}))


def test_a_recorder_batch_survives_the_wire_field_by_field() -> None:
    rec = FlightRecorder(replica=1)
    done = rec.begin("rank0/epoch3", "allreduce", 4096, [5, 6, 7])
    rec.posted("send", 2, 0, 2048)
    stuck = rec.posted("recv", 0, 0, 2048)
    rec.done("send", 2, 0, 0)
    rec.end(done, False)  # abandoned at its deadline with a receive still open: a stall
    rec.open = rec.begin("rank0/epoch3", "allreduce", 4096, [5, 6, 7])
    rec.posted("recv", 0, 1, 1024)
    rec.record_step(7, float("nan"), 2.5, None)
    rec.note(CheckpointSaved(10, 0.002, 4096))
    rec.note(CheckpointPersisted(10, True, 0.5, 4096))
    rec.note(CaughtUp(12, 0.3, 8192))
    rec.note(SdcFound(13, 4, "results", [2], True))
    sent = rec.batch()

    got = TelemetryBatch.from_msg(_wire(sent))

    assert got.records == sent.records and got.records[0].ok is False and got.records[0].exit_ns > 0
    assert got.open == sent.open and got.open is not None and got.open.seq == 1
    assert [(t.direction, t.peer, t.ring_step) for t in got.links] == [("send", 7, 0)]  # ring peers named by replica id
    assert [(t.direction, t.peer, t.ring_step) for t in got.open_links] == [("recv", 5, 1)]
    assert len(got.stalls) == 1 and got.stalls[0].deadline_passed
    assert [(t.direction, t.ring_step) for t in got.stalls[0].transfers] == [("recv", stuck)]
    assert got.steps[0].step == 7 and math.isnan(got.steps[0].loss or 0.0) and got.steps[0].grad_norm == 2.5
    assert got.memory == sent.memory and got.now_ns == sent.now_ns
    assert (got.saved, got.persisted, got.caught_up) == (sent.saved, sent.persisted, sent.caught_up)
    assert got.saved[0].stall_s == 0.002 and got.persisted[0].ok and got.caught_up[0].nbytes == 8192
    assert got.sdc == [SdcFound(13, 4, "results", [2], True)]


@pytest.mark.parametrize(
    "row",
    [[1, 2, "wire", [0], True], [1, 2, "results", "0", True], [1, 2, "results", [0], 1], [1, 2, "results", [-1], True]],
)
def test_a_malformed_sdc_record_is_refused(row: list[object]) -> None:
    with pytest.raises(TelemetryError):
        TelemetryBatch.from_msg({"now_ns": 1, "sdc": [row]})


def test_an_open_collective_is_a_copy_the_training_thread_cannot_change_under_the_encoder() -> None:
    rec = FlightRecorder(replica=0)
    rec.open = rec.begin("g", "allreduce", 8, [0, 1])
    shipped = rec.batch().open
    rec.end(rec.open, True)
    assert shipped is not None and shipped.exit_ns == 0 and shipped.ok is False


GOOD = Collective("g", 1, "allreduce", 8, 1, 2, True, [0, 1], 0, 0).to_row()


@pytest.mark.parametrize(
    ("field", "msg"),
    [
        ("now_ns", {"now_ns": -1}),
        ("now_ns", {"now_ns": True}),
        ("10 fields", {"now_ns": 1, "records": [GOOD[:8]]}),
        ("seq", {"now_ns": 1, "records": [["g", "1", *GOOD[2:]]]}),
        ("ok", {"now_ns": 1, "records": [[*GOOD[:6], "yes", *GOOD[7:]]]}),
        ("member", {"now_ns": 1, "records": [[*GOOD[:7], [0, -1], 0, 0]]}),
        ("group", {"now_ns": 1, "records": [["g" * 1000, *GOOD[1:]]]}),
        ("records", {"now_ns": 1, "records": [GOOD] * (MAX_ROWS + 1)}),
        ("direction", {"now_ns": 1, "links": [["g", 1, "sideways", 0, 0, 8, 1, 2, 0, 0]]}),
        ("loss", {"now_ns": 1, "steps": [[1, "nan", None, None]]}),
        ("memory", {"now_ns": 1, "memory": float("inf")}),
        ("deadline_passed", {"now_ns": 1, "stalls": [["g", 1, [], "no"]]}),
        ("JSON object", ["not", "a", "batch"]),
        ("persist_s", {"now_ns": 1, "persisted": [[10, True, -1.0, 8]]}),
        ("stall_s", {"now_ns": 1, "saved": [[10, float("nan"), 8]]}),
        ("saved", {"now_ns": 1, "saved": [[10, 0.1, 8]] * (MAX_COSTS + 1)}),
    ],
)
def test_a_malformed_batch_is_refused_naming_what_is_wrong(field: str, msg: Any) -> None:
    with pytest.raises(TelemetryError, match=field):
        TelemetryBatch.from_msg(msg)


def test_an_unrecorded_follow_up_extends_its_groups_last_collective_only_if_it_completed() -> None:
    rec = FlightRecorder(0)
    done = rec.begin("g/epoch1", "allreduce", 1024, [0, 1])
    rec.end(done, True)
    before = done.exit_ns
    rec.extend_last("g/epoch2")  # another group's: untouched
    assert done.exit_ns == before
    rec.extend_last("g/epoch1")
    assert done.exit_ns > before and len(rec.ring) == 1
    failed = rec.begin("g/epoch1", "allreduce", 1024, [0, 1])
    rec.end(failed, None)
    end = failed.exit_ns
    rec.extend_last("g/epoch1")
    assert failed.exit_ns == end
