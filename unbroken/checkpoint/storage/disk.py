"""The disk tier: committing a shard durably and atomically, and reading it back verified.

Layout of a checkpoint directory::

    DIR/latest                          "step-00000042", replaced atomically, moved last
    DIR/step-00000042/r0-w0/data.safetensors   tensor bytes (a valid safetensors file)
    DIR/step-00000042/r0-w0/objects.pkl        the pickled non-tensor skeleton
    DIR/step-00000042/r0-w0/manifest.json      layout, global offsets, CRC32 per tensor
    DIR/step-00000042/r0-w0/verified           present once every checksum was read back
    DIR/step-00000042/.r0-w0.tmp-...           a shard being written; never read
    DIR/step-00000042/r0-w0.prev/              the shard a re-save is replacing (see below)

A shard directory appears only by ``rename`` after its files and the directory are fsynced, so a
reader sees a shard either whole or not at all; a crash leaves only ``.tmp`` debris. A shard saved
again (the same step after a restart) cannot be renamed over the old directory, so the old one
is first renamed to ``r0-w0.prev``, which readers take as the shard while ``r0-w0`` is absent: a
crash between the two renames leaves the old shard readable, never no shard. This module does
not import torch: the persist process uses it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

from unbroken.checkpoint.storage import checksum, directio, history
from unbroken.checkpoint.storage.manifest import (
    DATA_FILE,
    LATEST_FILE,
    MANIFEST_FILE,
    OBJECTS_FILE,
    VERIFIED_FILE,
    ShardManifest,
    TensorEntry,
    is_complete,
    parse_shard_dir,
    parse_step_dir,
    safetensors_header,
    step_dir_name,
    with_checksums,
)

READERS = 4  # reads in flight at once: enough to keep a device (or the page cache) busy


class CorruptCheckpoint(Exception):
    """A shard failed its checks: the message says which file and what is wrong."""


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_writable(root: str) -> None:
    """Fail early, with what to fix, if checkpoints cannot be written under ``root``.

    Creates the directory if its parent exists, then really creates and removes a file: that is
    the only honest test (permission bits say nothing for root or on read-only mounts).
    """
    if os.path.exists(root) and not os.path.isdir(root):
        raise ValueError(f"checkpoint path {root!r} exists and is not a directory")
    try:
        os.makedirs(root, mode=DIR_MODE, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"checkpoint directory {root!r} cannot be created: {exc.strerror}; "
            "choose a path on a writable filesystem"
        ) from exc
    probe = os.path.join(root, f".probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(probe, "wb", opener=private_opener) as f:  # no fsync: a refused write fails here already
            f.write(b"x")
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(
            f"checkpoint directory {root!r} is not writable: {exc.strerror}; "
            "fix its permissions or choose another directory"
        ) from exc


# A checkpoint is the job's own (weights, data positions, whatever the state holds): its files
# 0600 and its directories 0700, whatever the umask. The checkpoint root a user made stays as made.
FILE_MODE = 0o600
DIR_MODE = 0o700


def private_opener(path: str, flags: int) -> int:
    """``open(..., opener=private_opener)``: a file created 0600."""
    return os.open(path, flags, FILE_MODE)


def _write_file(path: str, blob: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        view = memoryview(blob)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


_pool: ThreadPoolExecutor | None = None


def _checksum_pool() -> ThreadPoolExecutor:
    """One pool for the life of the process: the persist process writes a shard per snapshot,
    and starting two threads for each one was CPU taken from training."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(2, thread_name_prefix="unbroken-checksum")
    return _pool


def write_shard(
    root: str, manifest: ShardManifest, objects: bytes, data: memoryview, rate_bytes_s: float | None = None
) -> ShardManifest:
    """Write one shard durably and commit it with a rename; returns the manifest with CRCs.

    The checksums are computed by helper threads over the same memory while it is being
    written (the checksum and ``write`` both release the GIL), so they cost no extra pass.
    """
    step_dir = os.path.join(root, step_dir_name(manifest.step))
    # The step directory's own entry in ``root`` becomes durable with the fsync of ``root``
    # that follows the move of ``latest``; until then a crash can only lose this newest step.
    os.makedirs(step_dir, mode=DIR_MODE, exist_ok=True)
    final = os.path.join(step_dir, manifest.shard_name)
    tmp = os.path.join(step_dir, f".{manifest.shard_name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp, DIR_MODE)
    algorithm = manifest.checksum
    try:
        pending = checksum.start(data, [(t.begin, t.end) for t in manifest.tensors], _checksum_pool(), algorithm)
        try:
            header = safetensors_header(manifest.tensors, {"format": "pt"}, align=directio.ALIGN)
            directio.write_file(
                os.path.join(tmp, DATA_FILE), header, data[: manifest.data_len], rate_bytes_s=rate_bytes_s
            )
        finally:
            crcs = dict(zip((t.name for t in manifest.tensors), checksum.finish(pending, algorithm), strict=False))
        _write_file(os.path.join(tmp, OBJECTS_FILE), objects)
        done = ShardManifest(
            **{
                **manifest.__dict__,
                "tensors": with_checksums(manifest.tensors, crcs),
                "objects_len": len(objects),
                "objects_crc32": checksum.update(objects, algorithm=algorithm),
            }
        )
        _write_file(os.path.join(tmp, MANIFEST_FILE), done.to_json().encode())
        fsync_dir(tmp)
        prev = final + PREV_SUFFIX
        if os.path.exists(final):  # the same step saved again (e.g. after a restart)
            shutil.rmtree(prev, ignore_errors=True)  # a finished re-save's leftover: ``final`` wins
            os.rename(final, prev)  # still read as the shard until the next rename commits
        os.rename(tmp, final)
        fsync_dir(step_dir)
        shutil.rmtree(prev, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return done


PREV_SUFFIX = ".prev"


def committed_shards(root: str, step: int) -> dict[tuple[int, int], str]:
    """(replica, rank) -> directory of every committed shard of a step.

    A ``.prev`` directory stands in for its shard while the shard itself is absent: a re-save
    crashed between moving the old shard aside and committing the new one.
    """
    step_dir = os.path.join(root, step_dir_name(step))
    try:
        names = os.listdir(step_dir)
    except OSError:
        return {}
    found, prev = {}, {}
    for name in names:
        key = parse_shard_dir(name)
        if key is not None:
            found[key] = os.path.join(step_dir, name)
        elif name.endswith(PREV_SUFFIX) and (key := parse_shard_dir(name[: -len(PREV_SUFFIX)])) is not None:
            prev[key] = os.path.join(step_dir, name)
    return {**prev, **found}


def fences(root: str) -> history.Fences:
    """The rollbacks recorded in ``root`` (:mod:`unbroken.checkpoint.storage.history`).

    Raises:
        CorruptCheckpoint: the record is unreadable: nothing may load until it is repaired.
    """
    try:
        return history.read(root)
    except ValueError as e:
        raise CorruptCheckpoint(f"{root}: {e}") from e


def step_readers(root: str, step: int, known: history.Fences | None = None) -> dict[int, str]:
    """rank -> the shard directory a restore reads for it (the lowest replica that saved it).

    After a rollback, only shards of a history the rollback did not undo count: a step of the
    undone history whose delete failed, or another replica's stale shard beside a step saved
    again, is never read.

    Raises:
        CorruptCheckpoint: the step is entirely of an undone history (the reason), or the
            rollbacks' record is unreadable.
    """
    known = fences(root) if known is None else known
    dirs: dict[int, str] = {}
    undone = ""
    for (_, rank), path in sorted(committed_shards(root, step).items()):
        if rank in dirs:
            continue
        if known.fences:
            try:
                why = known.undone(step, history.history_of(read_manifest(path).extra))
            except (CorruptCheckpoint, OSError, ValueError):
                why = None  # damage: the reader's own checks name it
            if why:
                undone = why
                continue
        dirs[rank] = path
    if not dirs and undone:
        raise CorruptCheckpoint(undone)
    return dirs


def step_world_size(root: str, step: int) -> int | None:
    """The world size a step was saved with, from any one of its manifests (None if none)."""
    for path in committed_shards(root, step).values():
        try:
            return read_manifest(path).world_size
        except (OSError, ValueError, CorruptCheckpoint):
            continue
    return None


def list_steps(root: str) -> list[int]:
    """Every step directory name found, newest first (complete or not)."""
    steps = [parse_step_dir(n) for n in os.listdir(root)] if os.path.isdir(root) else []
    return sorted((s for s in steps if s is not None), reverse=True)


def complete_steps(root: str) -> list[int]:
    """Steps whose every rank has a committed shard, newest first."""
    out = []
    for step in list_steps(root):
        world = step_world_size(root, step)
        if world is not None and is_complete(committed_shards(root, step), world):
            out.append(step)
    return out


def update_latest(root: str, step: int, backwards: bool = False) -> None:
    """Point ``latest`` at ``step`` atomically; never backwards unless asked (a rollback)."""
    current = read_latest(root)
    if current is not None and (current > step and not backwards or current == step):
        return
    tmp = os.path.join(root, f".{LATEST_FILE}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    _write_file(tmp, step_dir_name(step).encode())
    os.replace(tmp, os.path.join(root, LATEST_FILE))
    fsync_dir(root)


def read_latest(root: str) -> int | None:
    try:
        with open(os.path.join(root, LATEST_FILE)) as f:
            return parse_step_dir(f.read().strip())
    except OSError:
        return None


def read_manifest(shard_dir: str) -> ShardManifest:
    try:
        with open(os.path.join(shard_dir, MANIFEST_FILE)) as f:
            text = f.read()
    except OSError as exc:
        raise CorruptCheckpoint(f"{shard_dir}: manifest unreadable ({exc.strerror})") from exc
    try:
        return ShardManifest.from_json(text)
    except ValueError as exc:
        raise CorruptCheckpoint(f"{shard_dir}: {exc}") from exc


def read_objects(shard_dir: str, manifest: ShardManifest) -> bytes:
    path = os.path.join(shard_dir, OBJECTS_FILE)
    with open(path, "rb") as f:
        blob = f.read()
    if (
        len(blob) != manifest.objects_len
        or checksum.update(blob, algorithm=manifest.checksum) != manifest.objects_crc32
    ):
        raise CorruptCheckpoint(f"{path}: checksum mismatch (file damaged)")
    return blob


@dataclass
class DataFile:
    """An open shard data file whose size has been checked against its manifest."""

    path: str
    fd: int  # direct I/O where the filesystem has it, for the bulk reads
    direct: bool
    data_start: int
    algorithm: str

    @classmethod
    def open(cls, shard_dir: str, manifest: ShardManifest) -> DataFile:
        path = os.path.join(shard_dir, DATA_FILE)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CorruptCheckpoint(f"{path}: truncated (no header)")
            start = 8 + int.from_bytes(head, "little")
            size = os.fstat(f.fileno()).st_size
        if size != start + manifest.data_len:
            raise CorruptCheckpoint(
                f"{path}: {size} bytes, expected {start + manifest.data_len} " "(truncated or overwritten)"
            )
        fd, direct = directio.open_file(path, os.O_RDONLY)
        return cls(path, fd, direct, start, manifest.checksum)

    def read_many(self, requests: list[tuple[TensorEntry, int | None]], pool: Executor, verify: bool = True) -> None:
        """Read tensors into memory at the given addresses (None: only check them), several
        chunks in flight; raises CorruptCheckpoint naming the first tensor that fails its CRC."""
        targets = [directio.Target(e.begin, e.end, dest) for e, dest in requests]
        try:
            crcs = directio.read_scatter(self.fd, self.direct, self.data_start, targets, pool, self.algorithm)
        except directio.ShortRead as exc:
            raise CorruptCheckpoint(f"{self.path}: truncated ({exc.strerror})") from exc
        for (e, _), crc in zip(requests, crcs, strict=False):
            if verify and crc != e.crc32:
                raise CorruptCheckpoint(f"{self.path}: checksum mismatch in tensor {e.name!r}")

    def close(self) -> None:
        os.close(self.fd)


def verify_shard(shard_dir: str) -> ShardManifest:
    """Read a whole shard and check every checksum; raises CorruptCheckpoint on damage."""
    manifest = read_manifest(shard_dir)
    read_objects(shard_dir, manifest)
    data = DataFile.open(shard_dir, manifest)
    try:
        with ThreadPoolExecutor(READERS, thread_name_prefix="unbroken-read") as pool:
            data.read_many([(t, None) for t in manifest.tensors], pool)
    finally:
        data.close()
    return manifest


def verify_step(root: str, step: int) -> None:
    """Check that ``step`` loads: complete, every manifest valid, every checksum right.

    Each shard read back in full once gets a ``verified`` marker, so a step is read once, not
    at every call; a re-saved shard is a new directory without one. Raises CorruptCheckpoint.
    """
    readers = step_readers(root, step)
    if not readers:
        raise CorruptCheckpoint(f"step {step} has no committed shard in {root}")
    world = None
    for rank, path in readers.items():
        manifest = read_manifest(path)
        if world is None:
            world = manifest.world_size
        if manifest.world_size != world or manifest.rank != rank or manifest.step != step:
            raise CorruptCheckpoint(
                f"{path}: manifest says step {manifest.step} rank {manifest.rank} of "
                f"{manifest.world_size}, which does not belong here"
            )
        if os.path.exists(os.path.join(path, VERIFIED_FILE)):
            continue
        verify_shard(path)
        with contextlib.suppress(OSError):  # no marker only means reading it again next time
            os.close(os.open(os.path.join(path, VERIFIED_FILE), os.O_WRONLY | os.O_CREAT, FILE_MODE))
    if world is None or not is_complete({(0, r) for r in readers}, world):
        raise CorruptCheckpoint(f"step {step} in {root} lacks the shards of some ranks")


def newest_verified_step(root: str, at_most: int | None = None) -> tuple[int | None, list[str]]:
    """The newest complete step (up to ``at_most``) that passes :func:`verify_step`, and why
    each newer one was passed over."""
    skipped: list[str] = []
    for step in complete_steps(root):
        if at_most is not None and step > at_most:
            continue
        try:
            verify_step(root, step)
            return step, skipped
        except (CorruptCheckpoint, OSError, ValueError) as exc:
            skipped.append(f"step {step}: {exc}")
    return None, skipped
