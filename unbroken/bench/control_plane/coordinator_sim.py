"""Simulated replica groups for ``unbroken bench coordinator``: one process drives many of them.

Each simulated group is one asyncio connection that speaks the coordinator's real protocol
(:func:`unbroken.control.protocol.connect_async`: the job's secret, the mutual handshake, a MAC
on every line): it says hello, heartbeats, and asks for a quorum at every step of a fixed
schedule. Nothing trains: what is measured is the coordinator. Times are ``time.monotonic()``,
one clock for every process of the machine, so the parent can compare them across processes.

The schedule is the same in every process (a plan with absolute times from the parent):

* steps ``0 .. steps-1`` start at ``t0 + k * step_time``; a group asks ``jitter * step_time``
  at most after the start (its own fixed, random offset: groups finish their compute at
  different times);
* at ``disconnect_t`` the victim closes its connection; a survivor that is told to abort (its
  exchange would fail) asks again at once with ``failed_epoch``, as a replica does;
* at ``rejoin_t`` the victim connects again, behind, and asks to be admitted;
* from ``takeover_t`` on (when a standby runs) the active coordinator is gone: every group
  reconnects through the address list and asks again.

A group records each answer (when it was asked, when it came, which epoch), the bytes it
received, and sends its records back to the parent at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import itertools
import json
import os
import random
import resource
import time
from typing import Any

from unbroken.bench.training.lockstep import Lockstep
from unbroken.control import protocol
from unbroken.control.protocol import event_loop
from unbroken.control.quorum.heartbeat import heartbeat_due
from unbroken.control.quorum.rules import members_of_runs
from unbroken.launch.node.relay import first_warm_wait
from unbroken.wire.auth import AuthError, JobSecret, Session

REJOIN_PATIENCE_S = 60.0  # how long the rejoining victim waits to be admitted before it asks again
# How long a group waits for every group's answer to the step before (an exchange's deadline).
LOCKSTEP_PATIENCE_S = 30.0


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one client process runs (pickled to it by the parent)."""

    addresses: tuple[tuple[str, int], ...]
    key: bytes
    replicas: tuple[int, ...]
    t0: float
    steps: int
    step_time: float
    jitter: float
    heartbeat_s: float
    victim: int | None = None
    disconnect_step: int | None = None  # the victim leaves half a step after this step starts
    rejoin_step: int | None = None  # and connects again half a step after this one starts
    seed: int = 0
    ranks_per_node: int = 0  # > 0: each group is a node of this many ranks through one connection
    warm: bool = False  # keep an idle connection to the standby, as a node agent's relay does

    def step_start(self, k: int) -> float:
        return self.t0 + k * self.step_time


@dataclasses.dataclass
class Answer:
    step: int
    asked: float
    answered: float
    epoch: int
    members: int
    failed: bool  # asked after an abort (the step's exchange failed)
    relayed: bool = False  # answered by the node's relay within a grant, not by the coordinator


class SimReplica:
    """One simulated replica group (one rank) and its connection."""

    def __init__(
        self, plan: Plan, replica: int, offset: float, answered: Any, held: Any = None, lockstep: Lockstep | None = None
    ) -> None:
        self.plan = plan
        self.answered = answered  # the newest step answered to any group, shared by the client processes
        # Seconds every group's schedule moved because an answer came after the next step was due
        # (shared by the client processes; None: a schedule that never moves).
        self.held = held
        # No group asks for a step before every group was answered for the one before (None: no hold).
        self.lockstep = lockstep
        if lockstep is not None:
            lockstep.join(replica, -1)
        self.replica = replica
        self.offset = offset
        self.secret = JobSecret(plan.key)
        self.answers: list[Answer] = []
        self.aborts: list[tuple[float, int]] = []
        self.connects: list[float] = []
        self.left: list[float] = []  # when it left (the victim's disconnect)
        self.bytes_in = 0
        self.bytes_at: list[int] = []  # bytes_in at each step's start
        self.step = 0
        self.epoch: int | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[int, float, bool, asyncio.Future[dict[str, Any]]]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._session: Session | None = None
        self._connected = asyncio.Event()
        self._reader_task: asyncio.Task[None] | None = None
        self._address = 0
        self._last: dict[str, Any] | None = None  # this connection's last full quorum answer
        self.closed = False
        self.heartbeat_s = plan.heartbeat_s
        self._last_sent = float("-inf")
        self._warm: tuple[int, asyncio.StreamReader, asyncio.StreamWriter, Session] | None = None
        self._warming: asyncio.Task[None] | None = None

    # -- connection ----------------------------------------------------------------------

    async def connect(self, deadline: float) -> None:
        """Connects through the address list (the next one after a failure) and says hello."""
        delay = 0.02
        while time.monotonic() < deadline:
            warm, self._warm = self._warm, None
            if self._warming is not None:
                self._warming.cancel()
                await asyncio.wait([self._warming])  # its read ends before this connection's reader starts
                self._warming = None
            if warm is not None and not warm[2].is_closing():
                self._address, reader, writer, session = warm
            else:
                host, port = self.plan.addresses[self._address % len(self.plan.addresses)]
                try:
                    reader, writer, session = await protocol.connect_async(host, port, self.secret, timeout=5.0)
                except (OSError, AuthError, asyncio.TimeoutError, RuntimeError):
                    # RuntimeError: uvloop's, for a transport the standby closed mid-handshake (at
                    # thousands of reconnects after a takeover); as a refused connection: the next.
                    self._address += 1
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.2)
                    continue
            self._writer, self._session, self._last = writer, session, None
            self._send(self._hello_msg())
            # What was asked before the loss goes right behind the hello, not after the welcome:
            # as a replica's client re-sends it (control.client), and a relay with it.
            for req_id, (step, _, failed, _) in list(self._pending.items()):
                self._send(self._ask_msg(req_id, step, self.epoch if failed else None))
            self._reader_task = asyncio.create_task(self._read(reader, session))
            await asyncio.wait_for(self._connected.wait(), max(0.1, deadline - time.monotonic()))
            self.connects.append(time.monotonic())
            n = len(self.plan.addresses)
            if self.plan.warm and n > 1:
                self._warm_up((self._address + 1) % n, first_warm_wait(failover=len(self.connects) > 1))  # as the relay
            return
        raise TimeoutError(f"replica {self.replica} could not connect")

    def _warm_up(self, index: int, wait: float) -> None:
        """One warm connection at a time (a connect raced by a reconnect once left one open)."""
        if self._warming is not None:
            self._warming.cancel()
        if self._warm is not None:
            self._warm[2].close()
            self._warm = None
        self._warming = asyncio.create_task(self._keep_warm(index, wait))

    async def _dial_warm(self, index: int, wait: float) -> bool:
        """Connects to the standby at ``index`` after ``wait`` seconds, as :attr:`_warm` (False: it failed)."""
        host, port = self.plan.addresses[index]
        if wait:
            await asyncio.sleep(wait)
        try:
            reader, writer, session = await protocol.connect_async(host, port, self.secret, timeout=10.0)
        except (OSError, AuthError, asyncio.TimeoutError, RuntimeError):
            return False
        self._warm = (index, reader, writer, session)
        return True

    async def _keep_warm(self, index: int, wait: float = 0.0) -> None:
        """An idle, authenticated connection to the standby at ``index``, as a relay keeps one
        (:mod:`unbroken.launch.node.relay`); dropped if it says anything or ends."""
        if not await self._dial_warm(index, wait):
            return
        assert self._warm is not None
        reader, writer = self._warm[1], self._warm[2]
        with contextlib.suppress(ConnectionError, OSError):
            await reader.read(1)  # nothing comes before it is used
        self._warm = None
        writer.close()

    def _hello_msg(self) -> dict[str, Any]:
        return {
            "op": "hello",
            "replica": self.replica,
            "rank": 0,
            "world_size": 1,
            "transfer_addr": f"127.0.0.1:{20000 + self.replica % 40000}",
            "node": f"sim{self.replica}",
            "step": self.step,
            **({"epoch": self.epoch} if self.epoch is not None else {}),  # a standby resumes it
        }

    def _send(self, msg: dict[str, Any]) -> None:
        if self._writer is not None and self._session is not None and not self._writer.is_closing():
            self._writer.write(protocol.encode(msg, self._session))
            self._last_sent = time.monotonic()

    async def _read(self, reader: asyncio.StreamReader, session: Session) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                self.bytes_in += len(line)
                self._handle(protocol.decode(line, session))
        except (ConnectionError, ValueError):
            pass
        if not self._connected.is_set():
            # Ended before its welcome: a standby that is not serving yet holds a hello and then
            # refuses it. The next address, as a client moves on (it came back to the standby
            # after one failed handshake with the active one, and never got a welcome).
            self._address += 1
        self._connected.clear()
        if not self.closed:
            asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        self._writer = self._session = None
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            await self.connect(time.monotonic() + 30.0)

    def _handle(self, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "welcome":
            self.heartbeat_s = msg.get("heartbeat_s") or self.plan.heartbeat_s  # the coordinator's pace
            self._connected.set()
        elif op == "quorum":
            msg = protocol.expand_answer(msg, self._last)  # a short answer on the fast path
            if "member_runs" in msg["decision"]:  # a full answer: its members listed, as a client does
                msg = {
                    **msg,
                    "decision": {**msg["decision"], "members": _listed(msg["decision"]["member_runs"])},
                }
            self._last = msg
            entry = self._pending.pop(msg["id"], None)
            if entry is None:
                return
            step, asked, failed, fut = entry
            d = msg["decision"]
            self.epoch = d["epoch"]
            self._answered(d["step"])
            self.answers.append(Answer(step, asked, time.monotonic(), d["epoch"], len(d["members"]), failed))
            if not fut.done():  # not given up on
                fut.set_result(msg)
        elif op == "epoch":  # the next epoch pushed with the abort: the answer to the re-ask, unasked
            now = time.monotonic()
            self.aborts.append((now, msg["abort"]))
            self._last = {
                **msg,
                "decision": {**msg["decision"], "members": _listed(msg["decision"]["member_runs"])},
            }
            self.epoch = epoch = msg["decision"]["epoch"]
            self.answers.append(Answer(self.step, now, now, epoch, len(self._last["decision"]["members"]), True))
            if self.lockstep is not None:
                self.lockstep.answered(self.replica, msg["decision"]["step"])
            for req_id, (step, _, _, fut) in list(self._pending.items()):  # sent before the push came: answered
                if step == msg["decision"]["step"] and not fut.done():
                    del self._pending[req_id]
                    fut.set_result(self._last)
        elif op == "abort":
            self.aborts.append((time.monotonic(), msg["epoch"]))
            # A replica blocked in the broken epoch's exchange fails it and asks again at once.
            asyncio.get_running_loop().create_task(self.ask(self.step, failed_epoch=msg["epoch"]))

    def _answered(self, step: int) -> None:
        """This group was answered for ``step``: the newest any group was answered for, and the hold."""
        if step > self.answered.value:
            with self.answered.get_lock():
                self.answered.value = max(self.answered.value, step)
        if self.lockstep is not None:
            self.lockstep.answered(self.replica, step)

    def _ask_msg(self, req_id: int, step: int, failed_epoch: int | None) -> dict[str, Any]:
        # The step time, as a replica reports it: the coordinator sizes its join window from it.
        return {
            "op": "quorum",
            "id": req_id,
            "step": step,
            "failed_epoch": failed_epoch,
            "step_time": self.plan.step_time,
        }

    async def ask(self, step: int, failed_epoch: int | None = None, patience_s: float | None = None) -> None:
        """Asks for ``step`` and waits for the answer, or gives up after ``patience_s`` (default:
        four steps, at least 5 s: an overloaded coordinator)."""
        if self.closed or any(s == step and f for (s, _, f, _) in self._pending.values()):
            return
        req_id = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = (step, time.monotonic(), failed_epoch is not None, fut)
        self._send(self._ask_msg(req_id, step, failed_epoch))
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
            await asyncio.wait_for(fut, patience_s or max(5.0, 4 * self.plan.step_time))

    async def heartbeats(self) -> None:
        """As a replica's client: a heartbeat line only when nothing else went out for a period.

        Each group at its own phase, as ranks started by different processes are: started
        together, a thousand groups heartbeat in one burst every period, and at the start of
        each step, among the first quorum requests (fast-path p99 10 ms instead of 2 to 4 ms
        at 1,000 groups).
        """
        await asyncio.sleep(random.Random(self.replica).uniform(0.0, self.heartbeat_s))
        while not self.closed:
            if heartbeat_due(time.monotonic(), self._last_sent, self.heartbeat_s):
                self._send({"op": "heartbeat", "step": self.step, "compute_s": None})
            await asyncio.sleep(self.heartbeat_s)

    def leave(self) -> None:
        """The process dies: its connection closes (the kernel's FIN, as on kill -9)."""
        if not self.closed:
            self.left.append(time.monotonic())
        self.closed = True
        if self.lockstep is not None:
            self.lockstep.leave(self.replica)
        if self._writer is not None:
            self._writer.close()
        if self._warming is not None:
            self._warming.cancel()
            self._warming = None
        if self._warm is not None:
            self._warm[2].close()
            self._warm = None
        self._pending.clear()

    async def come_back(self, deadline: float) -> None:
        self.closed = False
        self._connected.clear()
        await self.connect(deadline)

    # -- the schedule ----------------------------------------------------------------------

    def _start(self, k: int) -> float:
        """When step ``k`` starts: the plan's time, moved by every wait the job was held for."""
        return self.plan.step_start(k) + (self.held.value if self.held is not None else 0.0)

    def _held_back(self, k: int) -> None:
        """Step ``k``'s answer came after step ``k + 1`` was due (a standby taking over, a coordinator
        that fell behind): a real replica cannot start the step before its exchange ends, and its
        exchange holds every member back, so every group's schedule moves by the wait. Without
        this, the groups asked for the steps their clocks said once the answers came back: a
        mixture of steps that no job trains, whose catch-ups and evictions were then measured."""
        if self.held is None or self.replica == self.plan.victim:  # a newcomer's wait holds nobody back
            return
        wait = time.monotonic() - self.plan.step_start(k + 1)
        if wait > self.held.value:
            with self.held.get_lock():  # another group, in another process, may have moved it meanwhile
                self.held.value = max(self.held.value, wait)

    async def run(self) -> None:
        plan = self.plan
        beats = asyncio.create_task(self.heartbeats())
        k = -1
        while k + 1 < plan.steps:
            k += 1
            self.bytes_at.append(self.bytes_in)
            if self.replica == plan.victim and plan.disconnect_step is not None and plan.rejoin_step is not None:
                if k == plan.disconnect_step:
                    await _until(self._start(k) + plan.step_time / 2)
                    self.leave()
                    beats.cancel()
                    continue
                if plan.disconnect_step < k < plan.rejoin_step:
                    continue
                if k == plan.rejoin_step:
                    await _until(self._start(k) + plan.step_time / 2)
                    self.step = plan.disconnect_step  # behind: it resumes from an older state
                    try:
                        await self.come_back(time.monotonic() + 30.0)
                    except (TimeoutError, asyncio.TimeoutError):  # not admitted: no rejoin figure, the rest stands
                        continue
                    beats = asyncio.create_task(self.heartbeats())
                    # A newcomer waits out the steps granted to its peers (up to 10 s) before it is admitted.
                    await self.ask(self.step, patience_s=REJOIN_PATIENCE_S)
                    if self._last is not None:  # admitted: it caught up to the step its epoch trains, on from there
                        self.step = max(self.step, self._last["decision"]["step"])
                        k = max(k, self.step)
                        if self.lockstep is not None:
                            self.lockstep.join(self.replica, self.step)
                    continue
            await _until(self._start(k) + self.offset)
            # Late (its last answer came after its peers moved on): they, whom a real exchange
            # would have held back, train a newer step in this simulation; it asks for the newest
            # step the coordinator has answered any group, as a replica kept in step by its
            # exchange would. An older one would be a state that went back (evicted as one); the
            # step its schedule is at could be ahead of every peer, whose requests for the step
            # before would then be evicted in turn (a cascade seen at 5,000 groups).
            now = min(self.answered.value, plan.steps - 1)
            if now > k and self.replica != plan.victim:
                self.bytes_at.extend([self.bytes_in] * (now - k))
                k = now
            self.step = max(self.step, k)
            if self.lockstep is not None and self.step > 0:  # the exchange of the step before ended
                await self.lockstep.reached(self.step - 1, LOCKSTEP_PATIENCE_S)
            await self.ask(self.step)
            self._held_back(k)
        self.closed = True
        if self.lockstep is not None:
            self.lockstep.leave(self.replica)
        beats.cancel()

    def records(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "answers": [dataclasses.astuple(a) for a in self.answers],
            "aborts": self.aborts,
            "connects": self.connects,
            "left": self.left,
            "bytes_in": self.bytes_in,
            "bytes_at": self.bytes_at,
            "heartbeat_s": self.heartbeat_s,
        }


_LISTED: dict[str, tuple[int, ...]] = {}


def _listed(runs: list[list[int]]) -> tuple[int, ...]:
    """The members of ``runs``, listed as a client lists them, once per process for all its groups:
    a group's own list of 12,500 members per epoch was 12,500 lists in each client process
    (10 GB, and the kernel's OOM killer, at 12,500 nodes)."""
    key = json.dumps(runs)
    members = _LISTED.get(key)
    if members is None:
        if len(_LISTED) > 16:
            _LISTED.clear()
        members = _LISTED[key] = members_of_runs(runs)
    return members


async def _until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


async def _main(
    plan: Plan, ready: Any, go: Any, answered: Any, held: Any, floors: Any, index: int
) -> list[dict[str, Any]]:
    rng = random.Random(plan.seed)
    kind = SimReplica
    if plan.ranks_per_node:
        from unbroken.bench.control_plane.coordinator_sim_nodes import SimNode

        kind = SimNode
    lockstep = Lockstep(floors, index) if floors is not None else None
    sims = [
        kind(plan, r, rng.uniform(0.0, plan.jitter * plan.step_time), answered, held, lockstep) for r in plan.replicas
    ]
    sem = asyncio.Semaphore(64)  # handshakes in flight: not a SYN flood of the listener's backlog

    async def connect(s: SimReplica) -> None:
        async with sem:
            await s.connect(time.monotonic() + 120.0)

    await asyncio.gather(*(connect(s) for s in sims))
    # One process stands in for hundreds of replicas on their own machines: its garbage
    # collector's pauses (up to 700 ms at 2,500 groups) would be counted as the coordinator's
    # latency. Nothing is collected for the few seconds of the run.
    gc.collect()
    gc.freeze()
    gc.disable()
    ready.send(os.getpid())
    loop = asyncio.get_running_loop()
    t0 = await loop.run_in_executor(None, go.recv)
    plan = dataclasses.replace(plan, t0=t0)
    for s in sims:
        s.plan = plan
    await asyncio.gather(*(s.run() for s in sims))
    for s in sims:
        s.leave()
    return [s.records() for s in sims]


def client_process(
    plan: Plan, ready: Any, go: Any, out: Any, answered: Any, held: Any = None, floors: Any = None, index: int = 0
) -> None:
    """A client process's body: connects its groups, waits for the start time, runs, reports.
    ``floors``: the hold's shared array (:mod:`unbroken.bench.training.lockstep`), this process at ``index``."""
    records = event_loop.run(_main(plan, ready, go, answered, held, floors, index))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.send(json.dumps({"records": records, "cpu_s": usage.ru_utime + usage.ru_stime}))
