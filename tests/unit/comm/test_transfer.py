"""Catch-up transfer: what arrives is what the donor snapshotted, or a clear error."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from unbroken.comm import transfer
from unbroken.comm.transfer import TransferError, TransferServer, fetch_state, take_snapshot


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(700, 700, generator=g), "b": torch.randn(7, generator=g)},
            "optim": {"step": 12, "lr": [0.1, 0.2]}, "rng": torch.get_rng_state()}


def test_fetched_state_is_bitwise_the_snapshot_even_when_the_donor_moves_on() -> None:
    server = TransferServer()
    try:
        state = _state()
        server.publish(take_snapshot(5, state, server.pool))
        expected = {k: v.clone() for k, v in state["model"].items()}
        state["model"]["w"].add_(1.0)  # the donor trains on after its snapshot
        got = fetch_state(server.address, 5)
    finally:
        server.close()
    assert all(torch.equal(got["model"][k], v) for k, v in expected.items())
    assert got["optim"] == {"step": 12, "lr": [0.1, 0.2]}
    torch.set_rng_state(got["rng"])  # small tensors own their storage: usable as RNG state


@pytest.mark.parametrize("chunk", [transfer.CHUNK, 1000])
def test_received_into_the_receivers_own_tensors_where_they_fit(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    """A behind replica's tensors take the donor's bytes in place (nothing to fault in or copy
    on load); a tensor that does not fit, or that the receiver lacks, arrives in new memory."""
    monkeypatch.setattr(transfer, "CHUNK", chunk)  # small chunks: pieces cross chunk boundaries
    server = TransferServer()
    try:
        donor = _state()
        donor["optim"]["momentum"] = torch.randn(300, 5)
        server.publish(take_snapshot(5, donor, server.pool))
        mine = {"model": {"w": torch.zeros(700, 700), "b": torch.zeros(6)}, "optim": {"step": 0}}
        w, b = mine["model"]["w"], mine["model"]["b"]
        got = fetch_state(server.address, 5, into=mine)
    finally:
        server.close()
    assert got["model"]["w"] is w and torch.equal(w, donor["model"]["w"])
    assert got["model"]["b"] is not b and torch.equal(got["model"]["b"], donor["model"]["b"])
    assert torch.equal(b, torch.zeros(6))  # a shape mismatch leaves the receiver's tensor alone
    assert torch.equal(got["optim"]["momentum"], donor["optim"]["momentum"])
    assert got["optim"]["step"] == 12 and torch.equal(got["rng"], donor["rng"])


def test_a_corrupted_chunk_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "CHUNK", 1 << 18)  # several chunks, so the damaged one is named
    server = TransferServer()
    try:
        server.publish(take_snapshot(5, _state(), server.pool))
        real = transfer.checksum
        served = itertools.count()  # the serving thread's calls only: the receiver checksums too

        def flaky(chunk: memoryview, start: int = 0) -> int:  # the second chunk damaged in flight
            value = real(chunk, start)
            if threading.current_thread() is threading.main_thread() or next(served) != 1:
                return value
            return value ^ 1

        monkeypatch.setattr(transfer, "checksum", flaky)
        with pytest.raises(TransferError, match=f"checksum mismatch in the chunk at byte {1 << 18} "):
            fetch_state(server.address, 5)
    finally:
        server.close()


def test_missing_step_and_unreachable_donor_are_clear_errors() -> None:
    server = TransferServer()
    try:
        server.publish(take_snapshot(5, _state(), server.pool))
        with pytest.raises(TransferError, match="no snapshot of step 6"):
            fetch_state(server.address, 6, timeout_s=0.2)
    finally:
        server.close()
    with pytest.raises(TransferError, match="cannot reach the donor"):
        fetch_state(server.address, 5, timeout_s=1.0)


def test_a_snapshot_copied_in_the_background_is_served_only_when_complete() -> None:
    """The bulk is copied beside the exchange; a peer never sees a half-copied buffer, and the
    state may move on once wait() returned."""
    big = torch.randn(1 << 20)  # 4 MB: copied off the calling thread
    state = {"w": big, "b": torch.randn(3), "data_position": 7}
    expected = big.clone()
    server = TransferServer()
    complete_when_published = []

    def publish(snap: transfer.Snapshot) -> None:
        complete_when_published.append(torch.equal(transfer._view(snap.buffer, snap.entries[0]), expected))
        server.publish(snap)

    try:
        copy = transfer.SnapshotCopy(5, state, server.pool, publish)
        assert transfer.BACKGROUND_COPY_MIN <= big.numel() * 4
        copy.wait()
        big.add_(1.0)  # the optimizer steps
        state["data_position"] = 8
        got = fetch_state(server.address, 5)
    finally:
        server.close()
    assert complete_when_published == [True]
    assert torch.equal(got["w"], expected) and got["data_position"] == 7
