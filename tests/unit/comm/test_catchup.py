"""Live catch-up: what arrives is what the donor snapshotted, or a clear error."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import pickle
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from unbroken.checkpoint.snapshot import HostBuffer, TensorRef, copy_into, flatten
from unbroken.checkpoint.storage.manifest import TensorEntry, entries_to_json, layout
from unbroken.comm import catchup as transfer
from unbroken.comm.catchup import CatchupServer, TransferError, fetch_state, take_snapshot
from unbroken.wire.auth import JobSecret, server_handshake
from unbroken.wire.framing import recv_sealed, send_sealed

SECRET = JobSecret.generate()


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {"w": torch.randn(700, 700, generator=g), "b": torch.randn(7, generator=g)},
        "optim": {"step": 12, "lr": [0.1, 0.2]},
        "rng": torch.get_rng_state(),
    }


def test_fetched_state_is_bitwise_the_snapshot_even_when_the_donor_moves_on() -> None:
    server = CatchupServer(SECRET)
    try:
        state = _state()
        server.publish(take_snapshot(5, state, server.pool))
        expected = {k: v.clone() for k, v in state["model"].items()}
        state["model"]["w"].add_(1.0)  # the donor trains on after its snapshot
        got = fetch_state(server.address, 5, SECRET)
    finally:
        server.close()
    assert all(torch.equal(got["model"][k], v) for k, v in expected.items())
    assert got["optim"] == {"step": 12, "lr": [0.1, 0.2]}
    torch.set_rng_state(got["rng"])  # small tensors own their storage: usable as RNG state


def test_a_served_transfer_says_where_its_time_went() -> None:
    """Each served record splits the transfer into the handshake (admitted connection to its
    request), the wait for the snapshot and a slot, and the sending: how the 40 ms that Nagle's
    algorithm added to the handshake was found."""
    server = CatchupServer(SECRET)
    try:
        server.publish(take_snapshot(5, _state(), server.pool))
        fetch_state(server.address, 5, SECRET)
        deadline = time.monotonic() + 5.0
        while not server.served and time.monotonic() < deadline:  # recorded once the last byte is sent
            time.sleep(0.01)
    finally:
        server.close()
    (record,) = server.served
    phases = [record["handshake_s"], record["wait_s"], record["send_s"]]
    assert all(p >= 0.0 for p in phases) and sum(phases) <= record["s"] + 1e-6
    assert record["bytes"] >= 700 * 700 * 4 and record["step"] == 5


@pytest.mark.parametrize("chunk", [transfer.CHUNK, 1000])
def test_received_into_the_receivers_own_tensors_where_they_fit(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    """A behind replica's tensors take the donor's bytes in place (nothing to fault in or copy
    on load); a tensor that does not fit, or that the receiver lacks, arrives in new memory."""
    monkeypatch.setattr(transfer, "CHUNK", chunk)  # small chunks: pieces cross chunk boundaries
    server = CatchupServer(SECRET)
    try:
        donor = _state()
        donor["optim"]["momentum"] = torch.randn(300, 5)
        server.publish(take_snapshot(5, donor, server.pool))
        mine = {"model": {"w": torch.zeros(700, 700), "b": torch.zeros(6)}, "optim": {"step": 0}}
        w, b = mine["model"]["w"], mine["model"]["b"]
        got = fetch_state(server.address, 5, SECRET, into=mine)
    finally:
        server.close()
    assert got["model"]["w"] is w and torch.equal(w, donor["model"]["w"])
    assert got["model"]["b"] is not b and torch.equal(got["model"]["b"], donor["model"]["b"])
    assert torch.equal(b, torch.zeros(6))  # a shape mismatch leaves the receiver's tensor alone
    assert torch.equal(got["optim"]["momentum"], donor["optim"]["momentum"])
    assert got["optim"]["step"] == 12 and torch.equal(got["rng"], donor["rng"])


def test_a_corrupted_chunk_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "CHUNK", 1 << 18)  # several chunks, so the damaged one is named
    server = CatchupServer(SECRET)
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
            fetch_state(server.address, 5, SECRET)
    finally:
        server.close()


def test_a_donors_snapshot_is_laid_out_byte_for_byte_as_a_checkpoint_shard() -> None:
    """One snapshot implementation: catch-up flattens, lays out and copies a state as the
    checkpoint tier does, so its buffer is the data section of that state's checkpoint."""
    state = _state()
    snap = take_snapshot(5, state, transfer.SnapshotPool())
    tensors, _ = flatten(state)
    entries = layout([spec for _, spec in tensors.values()])
    assert snap.entries == entries and snap.total == max(e.end for e in entries)
    shard = HostBuffer(snap.total)
    copy_into(shard, entries, tensors)
    assert torch.equal(snap.buffer.bytes[: snap.total], shard.bytes[: snap.total])
    shard.close()


def test_missing_step_and_unreachable_donor_are_clear_errors() -> None:
    server = CatchupServer(SECRET)
    try:
        server.publish(take_snapshot(5, _state(), server.pool))
        with pytest.raises(TransferError, match="no snapshot of step 6"):
            fetch_state(server.address, 6, SECRET, timeout_s=0.2)
    finally:
        server.close()
    with pytest.raises(TransferError, match="cannot reach the donor"):
        fetch_state(server.address, 5, SECRET, timeout_s=1.0)


def test_a_snapshot_copied_in_the_background_is_served_only_when_complete() -> None:
    """The bulk is copied beside the exchange; a peer never sees a half-copied buffer, and the
    state may move on once wait() returned."""
    big = torch.randn(1 << 20)  # 4 MB: copied off the calling thread
    state = {"w": big, "b": torch.randn(3), "data_position": 7}
    expected = big.clone()
    server = CatchupServer(SECRET)
    complete_when_published = []

    def publish(snap: transfer.Snapshot) -> None:
        complete_when_published.append(
            torch.equal(snap.buffer.view(next(e for e in snap.entries if e.name == "w")), expected)
        )
        server.publish(snap)

    try:
        copy = transfer.SnapshotCopy(5, state, server.pool, publish)
        assert transfer.BACKGROUND_COPY_MIN <= big.numel() * 4
        copy.wait()
        big.add_(1.0)  # the optimizer steps
        state["data_position"] = 8
        got = fetch_state(server.address, 5, SECRET)
    finally:
        server.close()
    assert complete_when_published == [True]
    assert torch.equal(got["w"], expected) and got["data_position"] == 7


class _RunsCode:
    """What a malicious donor pickles: loading it would run a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., int], tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _fake_donor(secret: JobSecret, header: Callable[[], dict]) -> tuple[socket.socket, str]:
    """A donor that holds the key but lies: it answers one request with ``header()``."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = srv.accept()
        with conn, contextlib.suppress(OSError):  # AuthError included: the fetch's side is the test
            session = server_handshake(conn, secret, transfer.PURPOSE)
            recv_sealed(conn, session, 1024)
            send_sealed(conn, session, json.dumps(header()).encode())
            time.sleep(0.5)

    threading.Thread(target=serve, daemon=True).start()
    return srv, f"127.0.0.1:{srv.getsockname()[1]}"


def test_a_donor_that_sends_code_to_run_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    """Even a donor holding the key cannot make a replica run code: the objects of a state load
    through an allow-list (on main, pickle.loads ran os.system in the receiving replica)."""
    marker = tmp_path / "ran"
    srv, address = _fake_donor(
        SECRET,
        lambda: {
            "ok": True,
            "step": 3,
            "total": 0,
            "chunk": 4096,
            "entries": [],
            "skeleton": base64.b64encode(pickle.dumps({"model": _RunsCode(marker)})).decode(),
        },
    )
    with srv, pytest.raises(TransferError, match=r"refusing to load the global (posix|os)\.system"):
        fetch_state(address, 3, SECRET, timeout_s=5.0)
    assert not marker.exists()


def _entries(*specs: tuple[str, tuple[int, ...], int, int]) -> list[dict]:
    return entries_to_json([TensorEntry("w", d, s, s, (0,) * len(s), b, e) for d, s, b, e in specs])


@pytest.mark.parametrize(
    "entries,total",
    [
        (_entries(("float32", (4,), 0, 16)), 8),  # fewer bytes announced than the layout holds
        (_entries(("float32", (4,), 64, 80)), 80),  # a tensor placed beyond where the layout puts it
        (_entries(("float32", (-4,), 0, -16)), 0),  # a negative shape
        (_entries(("os.system", (4,), 0, 16)), 16),  # not a dtype
        (_entries(("float32", (4,), 0, 16)) * 2, 32),  # one name twice
        ([{"name": "w", "dtype": "float32"}], 16),  # fields missing
        ("w", 16),  # not a list
        ([], 0),  # the skeleton refers to a tensor that is not listed
        (  # float32 elements at an odd byte: they would not view in place
            entries_to_json(
                [
                    TensorEntry("b", "uint8", (1,), (1,), (0,), 0, 1),
                    TensorEntry("w", "float32", (4,), (4,), (0,), 1, 17),
                ]
            ),
            17,
        ),
    ],
)
def test_a_header_whose_layout_does_not_hold_together_is_refused(entries: list, total: int) -> None:
    srv, address = _fake_donor(
        SECRET,
        lambda: {
            "ok": True,
            "step": 3,
            "total": total,
            "chunk": 4096,
            "entries": entries,
            "skeleton": base64.b64encode(pickle.dumps({"w": TensorRef("w", False)})).decode(),
        },
    )
    with srv, pytest.raises(TransferError, match="donor"):
        fetch_state(address, 3, SECRET, timeout_s=5.0)


def test_a_donor_without_the_key_is_refused_before_anything_is_read() -> None:
    other = JobSecret.generate()
    srv, address = _fake_donor(other, lambda: {"ok": False})
    with srv, pytest.raises(TransferError, match="failed authentication"):
        fetch_state(address, 3, SECRET, timeout_s=5.0)


def _quick_handshake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        transfer,
        "server_handshake",
        lambda sock, secret, purpose, **kw: server_handshake(sock, secret, purpose, timeout_s=0.5, **kw),
    )


def test_nobody_without_the_key_downloads_a_donors_state(monkeypatch: pytest.MonkeyPatch) -> None:
    _quick_handshake(monkeypatch)
    server = CatchupServer(SECRET)
    try:
        server.publish(take_snapshot(5, _state(), server.pool))
        with pytest.raises(TransferError, match="failed authentication"):
            fetch_state(server.address, 5, JobSecret.generate(), timeout_s=5.0)
        # A client that speaks the old, unauthenticated request gets no state either.
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10.0) as sock:
            sock.sendall(json.dumps({"step": 5, "wait_s": 1.0}).encode() + b"\n")
            got = b""
            while chunk := sock.recv(1 << 16):
                got += chunk
        assert len(got) < 64  # no ticket: at most a refusal, then the donor hung up (its deadline)
        assert torch.equal(fetch_state(server.address, 5, SECRET)["rng"], _state()["rng"])
    finally:
        server.close()


def test_silent_clients_neither_hold_a_serving_thread_nor_block_a_real_fetch() -> None:
    """Connected-but-silent clients wait in the gate (no thread each, a budget of their own)
    while a key holder's fetch is served at once."""
    server = CatchupServer(SECRET)
    host, port = server.address.rsplit(":", 1)
    threads = threading.active_count()
    silent = [socket.create_connection((host, int(port)), timeout=5.0) for _ in range(40)]
    try:
        server.publish(take_snapshot(5, _state(), server.pool))
        assert torch.equal(fetch_state(server.address, 5, SECRET, timeout_s=5.0)["rng"], _state()["rng"])
        assert threading.active_count() <= threads + 1  # at most the snapshot copy's thread
        assert 0 < server.gate.pending <= 40
    finally:
        for s in silent:
            s.close()
        server.close()


def test_more_recoveries_than_slots_queue_instead_of_failing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Twelve peers fetching from a donor with 2 transfer slots all get the state (issue 28:
    more than 8 at once used to crash the extra replicas)."""
    monkeypatch.setattr(transfer, "MAX_CONNECTIONS", 2)
    server = CatchupServer(SECRET)
    try:
        server.publish(take_snapshot(5, _state(), server.pool))
        with ThreadPoolExecutor(12) as pool:
            got = list(pool.map(lambda _: fetch_state(server.address, 5, SECRET, timeout_s=30.0), range(12)))
        assert all(torch.equal(g["rng"], _state()["rng"]) for g in got)
    finally:
        server.close()


def test_a_donor_that_sheds_a_fetch_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A donor holding as many requests as it may sheds the next; the fetch retries and succeeds
    once a place frees, instead of failing the recovery."""
    monkeypatch.setattr(transfer, "MAX_WAITING", 1)
    server = CatchupServer(SECRET)
    try:
        waiting = ThreadPoolExecutor(1)
        first = waiting.submit(fetch_state, server.address, 5, SECRET, 30.0)  # waits for step 5
        time.sleep(0.3)
        second = ThreadPoolExecutor(1).submit(fetch_state, server.address, 5, SECRET, 30.0)
        time.sleep(0.5)  # the second is shed now, and retrying
        server.publish(take_snapshot(5, _state(), server.pool))
        assert torch.equal(first.result(20)["rng"], _state()["rng"])
        assert torch.equal(second.result(20)["rng"], _state()["rng"])
    finally:
        server.close()


def test_optimizer_scheduler_and_module_state_round_trip_through_the_allow_list() -> None:
    """What torch's own state_dicts hold (OrderedDict with _metadata, tuples of betas, None
    lambdas, torch.Size, dtypes) passes the restricted loader unchanged."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "extra": {"size": torch.Size([2, 3]), "dtype": torch.bfloat16, "set": {1, 2}, "none": None},
    }
    server = CatchupServer(SECRET)
    try:
        server.publish(take_snapshot(5, state, server.pool))
        got = fetch_state(server.address, 5, SECRET)
    finally:
        server.close()
    assert isinstance(state["model"], OrderedDict)
    assert got["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert got["sched"] == state["sched"] and got["extra"] == state["extra"]
    model.load_state_dict(got["model"])
    opt.load_state_dict(got["optim"])
    sched.load_state_dict(got["sched"])


def test_the_snapshot_reserve_is_taken_ahead_only_where_the_host_has_room(tmp_path: Path) -> None:
    """A replica reserves its catch-up snapshot buffer ahead when the state is at most a quarter
    of the host's available memory; otherwise a donation allocates it when needed."""
    pool = transfer.SnapshotPool()
    assert not pool.prewarm(3 << 30, available=8 << 30)  # train_ddp's 3 GB on a crowded 24 GB host
    assert pool.take(4096).capacity >= 4096  # a donation still gets its buffer, allocated then
    assert pool.prewarm(1 << 20, available=8 << 30)
    deadline = time.monotonic() + 10
    while not pool._free and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool._free and pool._free[0].capacity >= 1 << 20
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    8000000 kB\n")
    assert transfer.host_memory_available(str(meminfo)) == 8000000 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert transfer.host_memory_available(str(meminfo)) is None
    assert transfer.host_memory_available(str(tmp_path / "absent")) is None
