"""The CPU-driven ring all-reduce over an in-process stand-in for a process group."""

from __future__ import annotations

import threading
import time

import torch

from unbroken.comm.ring_allreduce import ring_allreduce_sum


class Mailboxes:
    """Point-to-point messages between threads, keyed by (src, dst, tag)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.box: dict[tuple[int, int, int], torch.Tensor] = {}

    def group(self, me: int) -> _Group:
        return _Group(self, me)


class _Done:
    def wait(self) -> None:
        pass


class _Recv:
    def __init__(self, boxes: Mailboxes, key: tuple[int, int, int], into: torch.Tensor) -> None:
        self.boxes, self.key, self.into = boxes, key, into

    def wait(self) -> None:
        with self.boxes.cv:
            assert self.boxes.cv.wait_for(lambda: self.key in self.boxes.box, timeout=10)
            self.into.copy_(self.boxes.box.pop(self.key))


class _Group:
    def __init__(self, boxes: Mailboxes, me: int) -> None:
        self.boxes, self.me = boxes, me

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Done:
        with self.boxes.cv:
            self.boxes.box[(self.me, dst, tag)] = tensors[0].clone()
            self.boxes.cv.notify_all()
        return _Done()

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Recv:
        return _Recv(self.boxes, (src, self.me, tag), tensors[0])


class Hook:
    """Records transfer completions; the wire 0 -> 1 holds sends for ``delay_s``."""

    def __init__(self, me: int, delay_s: float) -> None:
        self.me, self.delay_s = me, delay_s
        self.posts: dict[tuple[str, int], float] = {}
        self.took: dict[tuple[str, int, int], float] = {}

    def posted(self, direction: str, peer: int, step: int, nbytes: int) -> int:
        self.posts[(direction, step)] = time.monotonic()
        return step

    def done(self, direction: str, peer: int, step: int, token: int) -> None:
        self.took[(direction, peer, step)] = time.monotonic() - self.posts[(direction, token)]

    def send_delay_s(self, peer: int, step: int, nbytes: int) -> float:
        return self.delay_s if (self.me, peer) == (0, 1) else 0.0


def run_ring(seq: int, delay_s: float = 0.0) -> tuple[list[torch.Tensor], list[Hook]]:
    boxes = Mailboxes()
    tensors = [torch.arange(10, dtype=torch.float64) * (r + 1) for r in range(3)]
    hooks = [Hook(r, delay_s) for r in range(3)]
    threads = [
        threading.Thread(
            target=ring_allreduce_sum, args=(boxes.group(r), tensors[r], r, 3, seq, lambda w: w.wait(), hooks[r])
        )
        for r in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return tensors, hooks


def test_every_member_ends_with_the_sum_in_both_directions() -> None:
    for seq in (0, 1):
        tensors, _ = run_ring(seq)
        for t in tensors:
            assert torch.equal(t, torch.arange(10, dtype=torch.float64) * 6)


def test_a_slow_wire_delays_its_transfers_and_not_its_senders_receives() -> None:
    """A slow 0 -> 1 wire: the receive of 1 from 0 takes the delay; 0's own receives do not."""
    tensors, hooks = run_ring(0, delay_s=0.05)
    assert torch.equal(tensors[0], torch.arange(10, dtype=torch.float64) * 6)
    slow = [s for (d, p, _), s in hooks[1].took.items() if d == "recv" and p == 0]
    own = [s for (d, p, _), s in hooks[0].took.items() if d == "recv"]
    assert min(slow) >= 0.045
    assert max(own) < 0.04  # would include the delay if the sender slept before receiving
