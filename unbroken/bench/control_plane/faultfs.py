"""A passthrough filesystem (FUSE) that stalls or fails its calls on demand: the metadata latency,
stalls and errors (``EIO``, ``ESTALE``, ``EMFILE``) of shared filesystems, made real for the lease's
tests and ``unbroken bench lease``.

Every call the kernel sends for files under the mount point goes through :meth:`FaultFS._gate`,
which reads the current :class:`Faults` (a JSON file the test rewrites, re-read every 20 ms):

- ``delay_s``: every call waits this long (a slow metadata server);
- ``stall_until``: every call waits until this wall-clock time (a stall);
- ``errno`` with ``match`` and ``pids``: calls on paths containing ``match`` fail with that error,
  for the processes in ``pids`` only when it is given (one coordinator's store fails, not its
  standby's), until ``fail_until`` when it is set.

The kernel keeps FUSE's default caches (attributes and names for 1 s, no data cache across
opens): what a FUSE filesystem gives a program, not a filesystem made kinder for the test.

Run: ``python -m unbroken.bench.control_plane.faultfs ROOT MOUNTPOINT CONTROL`` (in the foreground, as root;
``fusermount3 -u MOUNTPOINT`` or SIGTERM ends it). Needs ``mfusepy`` and libfuse3 (``make lease-fs``).
"""

from __future__ import annotations

import dataclasses
import errno as errnos
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

CONTROL_POLL_S = 0.02


@dataclasses.dataclass(frozen=True)
class Faults:
    """What the filesystem does to its calls now."""

    delay_s: float = 0.0
    stall_until: float = 0.0
    errno: str | None = None
    match: str = ""
    pids: tuple[int, ...] = ()
    fail_until: float | None = None

    @classmethod
    def from_json(cls, text: str) -> Faults:
        d: dict[str, Any] = json.loads(text) if text.strip() else {}
        name = d.get("errno")
        if name is not None and not isinstance(getattr(errnos, str(name), None), int):
            raise ValueError(f"not an errno name: {name!r}")
        return cls(
            delay_s=float(d.get("delay_s", 0.0)),
            stall_until=float(d.get("stall_until", 0.0)),
            errno=None if name is None else str(name),
            match=str(d.get("match", "")),
            pids=tuple(int(p) for p in d.get("pids", ())),
            fail_until=None if d.get("fail_until") is None else float(d["fail_until"]),
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    def error_for(self, path: str, pid: int, now: float) -> int | None:
        """The errno a call on ``path`` by process ``pid`` fails with now (None: it goes through)."""
        if self.errno is None or (self.fail_until is not None and now >= self.fail_until):
            return None
        if self.match not in path or (self.pids and pid not in self.pids):
            return None
        return int(getattr(errnos, self.errno))


def write_faults(control: str | Path, faults: Faults) -> None:
    """Sets what the filesystem does from now on (atomically: a reader never sees half)."""
    tmp = Path(f"{control}.tmp")
    tmp.write_text(faults.to_json())
    os.replace(tmp, control)


def process_of(tid: int) -> int:
    """The process a thread belongs to: FUSE says which thread called."""
    try:
        with open(f"/proc/{tid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return tid


def _make_ops(root: str, control: str) -> Any:
    import mfusepy as fuse

    class FaultFS(fuse.Operations):
        """Passthrough to ``root``, every call through :meth:`_gate`."""

        use_ns = True

        def __init__(self) -> None:
            self.root = root
            self.faults = Faults()
            self._stamp = -1
            threading.Thread(target=self._watch, daemon=True).start()

        def _watch(self) -> None:
            while True:
                try:
                    st = os.stat(control)
                    if st.st_mtime_ns != self._stamp:
                        self._stamp = st.st_mtime_ns
                        self.faults = Faults.from_json(Path(control).read_text())
                except (OSError, ValueError):
                    pass
                time.sleep(CONTROL_POLL_S)

        def _gate(self, path: str) -> str:
            f = self.faults
            if f.stall_until > time.time():
                time.sleep(f.stall_until - time.time())
            if f.delay_s > 0:
                time.sleep(f.delay_s)
            code = f.error_for(path, process_of(fuse.fuse_get_context()[2]), time.time()) if f.errno else None
            if code is not None:
                raise fuse.FuseOSError(code)
            return os.path.join(self.root, path.lstrip("/"))

        def access(self, path: str, amode: int) -> int:
            if not os.access(self._gate(path), amode):
                raise fuse.FuseOSError(errnos.EACCES)
            return 0

        def chmod(self, path: str, mode: int) -> int:
            os.chmod(self._gate(path), mode)
            return 0

        def chown(self, path: str, uid: int, gid: int) -> int:
            os.chown(self._gate(path), uid, gid)
            return 0

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            st = os.lstat(self._gate(path))
            keys = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_atime_ns", "st_mtime_ns", "st_ctime_ns")
            out = {k.replace("_ns", ""): getattr(st, k) for k in keys}
            return out

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(self._gate(path))]

        def mkdir(self, path: str, mode: int) -> int:
            os.mkdir(self._gate(path), mode)
            return 0

        def rmdir(self, path: str) -> int:
            os.rmdir(self._gate(path))
            return 0

        def unlink(self, path: str) -> int:
            os.unlink(self._gate(path))
            return 0

        def rename(self, old: str, new: str) -> int:
            os.rename(self._gate(old), self._gate(new))
            return 0

        def link(self, target: str, source: str) -> int:
            os.link(self._gate(source), self._gate(target))
            return 0

        def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
            if times is None:
                os.utime(self._gate(path))
            else:
                os.utime(self._gate(path), ns=times)
            return 0

        def statfs(self, path: str) -> dict[str, int]:
            sv = os.statvfs(self._gate(path))
            keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag")
            return {k: getattr(sv, k) for k in (*keys, "f_frsize", "f_namemax")}

        def open(self, path: str, flags: int) -> int:
            return os.open(self._gate(path), flags)

        def create(self, path: str, mode: int, fi: Any = None) -> int:
            return os.open(self._gate(path), os.O_RDWR | os.O_CREAT, mode)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            self._gate(path)
            return os.pread(fh, size, offset)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            self._gate(path)
            return os.pwrite(fh, data, offset)

        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            os.truncate(self._gate(path), length)
            return 0

        def flush(self, path: str, fh: int) -> int:
            self._gate(path)
            return 0

        def fsync(self, path: str, datasync: int, fh: int) -> int:
            self._gate(path)
            os.fsync(fh)
            return 0

        def release(self, path: str, fh: int) -> int:
            os.close(fh)
            return 0

    return FaultFS()


def main(argv: list[str]) -> None:
    import mfusepy as fuse

    root, mountpoint, control = argv
    if not Path(control).exists():
        write_faults(control, Faults())
    fuse.FUSE(_make_ops(os.path.realpath(root), control), mountpoint, foreground=True, nothreads=False)


if __name__ == "__main__":
    main(sys.argv[1:])
