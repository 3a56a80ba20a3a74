"""Nothing a job started outlives its supervisor, not even a trainer behind a shell wrapper.

Every worker runs in its own session (its id is the worker's pid), and the kernel kills the
worker itself when its parent dies (``PR_SET_PDEATHSIG``, :mod:`unbroken.launch.workers`). That
signal reaches only the direct child: in ``unbroken run -- bash -c 'python train.py; ...'`` the
shell dies and the trainer, reparented to init, trains on unwatched, holding its GPU and ports.
Three pieces close that gap:

- The supervisor (``unbroken run``, ``unbroken agent``) is a child subreaper
  (``PR_SET_CHILD_SUBREAPER``): a descendant whose parent dies is reparented to it, not to init,
  so while it lives nothing of a worker's tree escapes it, and it reaps what it adopted.
- Stopping a worker ends its whole session: the process group, and any member that moved to a
  group of its own; the supervisor waits until the session is empty before it starts the
  replacement (which may need the same ports and memory).
- A guardian: one tiny process per supervisor, in a session of its own, started from this very
  file with nothing but the standard library. The supervisor tells it (over a pipe) each worker
  session it starts and ends. When the pipe reaches end-of-file, the supervisor is gone (a
  ``kill -9`` closes its end as surely as a clean exit), and the guardian kills every session it
  was told about, then exits. A worker that exited 0 is forgotten at once: what it left behind
  (a persist process finishing its last write) is not the guardian's to end.

Why a guardian and not a shim per worker (a process between the supervisor and each worker
that sets its own parent-death signal and kills the worker's group): a shim changes what every
pid the supervisor holds means. Fault injection (``kill -9``, ``SIGSTOP`` of a rank), stack
dumps and the events' ``pid`` fields must name the trainer, not a shim; one guardian per job
also costs one process, not one per rank.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper(on: bool = True) -> bool:
    """Makes this process the reaper of its orphaned descendants (Linux); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0)


def _stat(pid: str) -> tuple[str, int, int] | None:
    """(state, ppid, session) of a process, None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), int(fields[3])  # after the name: state ppid pgrp session
    except (OSError, IndexError, ValueError):
        return None


def session_members(sessions: Iterable[int]) -> list[int]:
    """Live (not zombie) processes in any of ``sessions``."""
    wanted = set(sessions)
    out: list[int] = []
    if not wanted:
        return out
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(entry)
            if st is not None and st[2] in wanted and st[0] != "Z":
                out.append(int(entry))
    return out


def kill_sessions(sessions: Iterable[int]) -> list[int]:
    """SIGKILLs each session's process group and every other live member; returns those found."""
    sessions = list(sessions)
    for sid in sessions:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(sid, signal.SIGKILL)
    members = session_members(sessions)
    for pid in members:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return members


def reap_orphans(sessions: Iterable[int]) -> int:
    """Reaps adopted zombies of ``sessions`` (never a session leader: asyncio waits for those)."""
    wanted, me, reaped = set(sessions), os.getpid(), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in wanted:
            continue
        st = _stat(entry)
        if st is not None and st[0] == "Z" and st[1] == me and st[2] in wanted:
            with contextlib.suppress(ChildProcessError):
                reaped += os.waitpid(int(entry), os.WNOHANG)[0] != 0
    return reaped


@contextlib.contextmanager
def supervising() -> Iterator[Guardian]:
    """For as long as the block runs, this process is a subreaper with a guardian (see the
    module docstring); both are undone however the block ends."""
    subreaper = become_subreaper()
    guardian = Guardian()
    try:
        yield guardian
    finally:
        guardian.close()
        if subreaper:
            become_subreaper(False)


class Guardian:
    """The supervisor's side of the guardian process (see the module docstring)."""

    def __init__(self) -> None:
        self.sessions: set[int] = set()
        self._proc: subprocess.Popen[bytes] | None = None
        self._start()

    def _start(self) -> None:
        # -I -S: no site, no PYTHONPATH, nothing imported but this file and the standard library.
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(Path(__file__).resolve()), "--guard", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        for sid in self.sessions:
            self._tell(f"+{sid}")

    def fileno(self) -> int:
        """The write end of the guardian's pipe: a worker's ``preexec_fn`` announces its own
        session on it (:func:`unbroken.launch.workers.die_with_parent`), a line like :meth:`add`'s."""
        assert self._proc is not None and self._proc.stdin is not None
        return self._proc.stdin.fileno()

    def add(self, sid: int) -> None:
        """A worker session started: the guardian kills it if this process dies."""
        self.sessions.add(sid)
        self._tell(f"+{sid}")

    def remove(self, sid: int) -> None:
        """A worker session is over: its id may be reused, so the guardian forgets it."""
        self.sessions.discard(sid)
        self._tell(f"-{sid}")

    def _tell(self, line: str) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(f"{line}\n".encode())
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            log.warning("the process guardian (pid %d) died; starting another", self._proc.pid)
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
            self._proc.wait()
            self._start()

    def close(self) -> None:
        """Ends the guardian (it kills whatever of the sessions it holds is still running)."""
        if self._proc is None:
            return
        with contextlib.suppress(OSError):
            assert self._proc.stdin is not None
            self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None


def _guard(stream: object) -> None:
    """The guardian's life: collect session ids until end-of-file, then kill them all."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the end of the pipe ends it
    sessions: set[int] = set()
    for raw in stream:  # type: ignore[attr-defined]
        line = raw.strip()
        with contextlib.suppress(ValueError):
            if line.startswith(b"+"):
                sessions.add(int(line[1:]))
            elif line.startswith(b"-"):
                sessions.discard(int(line[1:]))
    deadline = time.monotonic() + 10.0
    while sessions and time.monotonic() < deadline and kill_sessions(sessions):
        time.sleep(0.02)


if __name__ == "__main__" and sys.argv[1:2] == ["--guard"]:
    _guard(sys.stdin.buffer)
