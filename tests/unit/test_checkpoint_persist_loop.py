"""The persist process's loop, against a trainer that is gone by the time a write ends."""

import socket
import threading

import pytest

from unbroken.checkpoint import persist


def test_a_write_whose_trainer_is_gone_ends_the_loop_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    written = threading.Event()

    def fake_persist(job: dict, buffers: dict) -> dict:
        ours.close()  # the trainer dies while the shard is being written
        written.set()
        return {"op": "done", "slot": job["slot"], "step": 7, "ok": True}

    monkeypatch.setattr(persist, "_persist", fake_persist)
    persist.send(ours, {"op": "persist", "slot": 0})
    persist.serve(theirs)  # before the fix: BrokenPipeError out of the writer, a traceback in the job's log
    assert written.is_set()
    theirs.close()


def test_a_trainer_gone_with_a_reply_unread_ends_the_loop_quietly() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    persist.send(theirs, {"op": "done", "slot": 0, "ok": True})  # a reply the trainer never reads
    ours.close()
    persist.serve(theirs)  # before: ConnectionResetError out of its next read
    theirs.close()


def test_the_loop_still_replies_to_a_trainer_that_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    monkeypatch.setattr(persist, "_persist", lambda job, buffers: {"op": "done", "slot": job["slot"], "ok": True})
    loop = threading.Thread(target=persist.serve, args=(theirs,))
    loop.start()
    persist.send(ours, {"op": "persist", "slot": 3})
    got = persist.recv(ours)
    persist.send(ours, {"op": "exit"})
    loop.join(timeout=10)
    assert not loop.is_alive()
    assert got is not None and got[0] == {"op": "done", "slot": 3, "ok": True}
    ours.close()
    theirs.close()
