"""Moving shard bytes between memory and a file with ``O_DIRECT``, checksummed on the way.

Why direct I/O: a buffered write first copies every byte into the page cache (CPU time the
trainer wants) and then leaves the disk idle until ``fsync`` pushes a gigabyte at once, so its
time swings with whatever else dirties memory; a direct write hands the snapshot's own pages
to the device, so a durable checkpoint costs about what the disk takes and almost no CPU.
Reads come back the same way, several chunks in flight at once (measured here: ~4 GB/s from
the device against ~0.5 GB/s for a buffered read of a file not in the cache), into small
reused staging buffers from which each tensor's bytes are copied out and checksummed.

Direct I/O needs the file offset, the length and the memory address aligned to ``ALIGN``:
the data section starts on an ``ALIGN`` boundary (the safetensors header is padded with
spaces), the snapshot buffer is page-aligned, and only the last partial block of a file is
written through the page cache. Filesystems without ``O_DIRECT`` get plain buffered I/O.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from unbroken.checkpoint.storage import checksum

ALIGN = 4096
WRITE_CHUNK = 32 << 20
READ_CHUNK = 8 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class ShortRead(OSError):
    """The file ended before the bytes its manifest promises (it was truncated)."""


def open_file(path: str, flags: int, mode: int = 0o600) -> tuple[int, bool]:
    """Open with ``O_DIRECT`` where the filesystem allows it; returns ``(fd, direct)``."""
    if _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, mode), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode), False


def address(view: memoryview | bytes | bytearray | mmap.mmap) -> int:
    """The memory address of a contiguous buffer (read-only ones too)."""
    arr = np.frombuffer(view, dtype=np.uint8)
    return int(arr.__array_interface__["data"][0])


def _write_all(fd: int, view: memoryview, rate_bytes_s: float | None, started: float, done: int) -> int:
    pos = 0
    while pos < len(view):
        pos += os.write(fd, view[pos : pos + WRITE_CHUNK])
        if rate_bytes_s:
            ahead = (done + pos) / rate_bytes_s - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)
    return done + pos


def _buffered(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


def write_file(path: str, header: bytes, data: memoryview, rate_bytes_s: float | None = None) -> None:
    """Create ``path`` holding ``header + data`` and fsync it.

    The bulk goes straight from ``data``'s pages to the device when ``data`` starts on an
    ``ALIGN`` boundary (a snapshot buffer does) and the header's length is a multiple of it.
    """
    fd, direct = open_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        started, done = time.monotonic(), 0
        if direct and len(header) % ALIGN == 0 and (not len(data) or address(data) % ALIGN == 0):
            head = mmap.mmap(-1, max(len(header), ALIGN))  # the header, page-aligned
            try:
                head[: len(header)] = header
                done = _write_all(fd, memoryview(head)[: len(header)], rate_bytes_s, started, done)
            finally:
                head.close()
            bulk = len(data) - len(data) % ALIGN
            done = _write_all(fd, data[:bulk], rate_bytes_s, started, done)
            data = data[bulk:]
            _buffered(fd)  # the last partial block
        else:
            if direct:
                _buffered(fd)
            done = _write_all(fd, memoryview(header), rate_bytes_s, started, done)
        _write_all(fd, data, rate_bytes_s, started, done)
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Target:
    """A range ``[begin, end)`` of the data section and where its bytes go.

    ``dest`` is the address of ``end - begin`` writable bytes, or None to only checksum.
    """

    begin: int
    end: int
    dest: int | None


@dataclass(frozen=True)
class _Chunk:
    lo: int  # data-section range read in one request
    hi: int
    parts: tuple[tuple[int, int, int], ...]  # (target index, begin, end) inside [lo, hi)


def plan_chunks(targets: list[Target], size: int = READ_CHUNK) -> list[_Chunk]:
    """Group the targets' bytes into reads of about ``size``: neighbouring small tensors share
    one request, big ones are split. Empty targets need no read (their checksum is 0)."""
    chunks: list[_Chunk] = []
    parts: list[tuple[int, int, int]] = []
    lo = hi = 0
    for i, t in sorted(enumerate(targets), key=lambda it: it[1].begin):
        pos = t.begin
        while pos < t.end:
            if parts and (pos != hi or hi - lo >= size):
                chunks.append(_Chunk(lo, hi, tuple(parts)))
                parts = []
            if not parts:
                lo = hi = pos
            end = min(t.end, lo + size)
            parts.append((i, pos, end))
            hi = pos = end
    if parts:
        chunks.append(_Chunk(lo, hi, tuple(parts)))
    return chunks


class _Staging(threading.local):
    buf: mmap.mmap | None = None


def read_scatter(
    fd: int, direct: bool, base: int, targets: list[Target], pool: Executor, algorithm: str = checksum.ALGORITHM
) -> list[int]:
    """Read each target's bytes (the data section starts at file offset ``base``) into its
    destination, several chunks at once on ``pool``; returns each target's checksum.

    Raises:
        ShortRead: the file is shorter than the targets say.
    """
    staging = _Staging()
    update = checksum.update

    def run(chunk: _Chunk) -> list[tuple[int, int, int, int]]:
        start = base + chunk.lo
        first = start - start % ALIGN if direct else start
        stop = base + chunk.hi
        length = -(-(stop - first) // ALIGN) * ALIGN if direct else stop - first
        if staging.buf is None or len(staging.buf) < length:
            if staging.buf is not None:
                staging.buf.close()
            staging.buf = mmap.mmap(
                -1,
                max(length, READ_CHUNK + 2 * ALIGN),
                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0),
            )
        view = memoryview(staging.buf)
        got = os.preadv(fd, [view[:length]], first)
        if got < stop - first:
            raise ShortRead(errno.EIO, f"file ends {stop - first - got} bytes early")
        addr = ctypes.addressof(ctypes.c_char.from_buffer(staging.buf))
        out = []
        for index, b, e in chunk.parts:
            off = base + b - first
            dest = targets[index].dest
            if dest is not None and e > b:
                ctypes.memmove(dest + (b - targets[index].begin), addr + off, e - b)
            out.append((index, b, update(view[off : off + e - b], 0, algorithm), e - b))
        del view
        return out

    pieces: list[list[tuple[int, int, int]]] = [[] for _ in targets]
    for fut in [pool.submit(run, c) for c in plan_chunks(targets)]:
        for index, b, crc, n in fut.result():
            pieces[index].append((b, crc, n))
    return [checksum.join([(crc, n) for _, crc, n in sorted(p)], algorithm) for p in pieces]
