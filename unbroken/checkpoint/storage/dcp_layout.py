"""The on-disk layout of a DCP checkpoint written by :class:`~unbroken.checkpoint.DCPWriter`,
its checksums file and its commit: plain files and renames, no torch (tools can verify cheaply).

::

    ROOT/latest                        "step-00000042", moved only after a step is committed
    ROOT/step-00000042/.metadata       DCP's metadata (pickled), unchanged
    ROOT/step-00000042/__0_0.distcp    rank 0's tensors and objects, one file per rank (torch.save)
    ROOT/step-00000042/checksums.json  CRC-32C of .metadata and of every item in the data files
    ROOT/.step-00000042.tmp-<id>/      a save in progress; never read
    ROOT/step-00000042.prev/           the step a re-save is replacing, read while step-… is absent

Everything but ``checksums.json`` is what ``FileSystemWriter`` writes, so plain
``dcp.load(state, checkpoint_id=ROOT/step-00000042)`` reads it.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from unbroken.checkpoint.storage import checksum, disk
from unbroken.checkpoint.storage.manifest import LATEST_FILE, parse_step_dir, step_dir_name

METADATA_FILE = ".metadata"
CHECKSUMS_FILE = "checksums.json"
FORMAT = "unbroken-dcp-checksums/1"


def staging_name(name: str, save_id: str) -> str:
    """The directory a save of ``name`` is written into before its commit."""
    return f".{name}.tmp-{save_id}"


def fsync_file(path: str, blob: bytes) -> None:
    with open(path, "wb", opener=disk.private_opener) as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())


def write_checksums(staging: str, metadata: bytes, items: dict[str, list[list[int]]]) -> None:
    """Write ``.metadata`` and the checksums file into ``staging``, durably (files and directory).

    ``items`` maps each data file to ``[offset, length, crc]`` of every item in it.
    """
    fsync_file(os.path.join(staging, METADATA_FILE), metadata)
    sums = {
        "format": FORMAT,
        "algorithm": checksum.ALGORITHM,
        "metadata": [len(metadata), checksum.update(metadata)],
        "items": items,
    }
    fsync_file(os.path.join(staging, CHECKSUMS_FILE), json.dumps(sums).encode())
    disk.fsync_dir(staging)


def commit(root: str, name: str, staging: str) -> None:
    """Move a fully written staging directory to ``root/name``, then ``latest`` (disk.py's order).

    A directory saved again is first moved aside to ``name.prev``, so a crash between the two
    renames leaves the old checkpoint readable, not nothing.
    """
    final, prev = os.path.join(root, name), os.path.join(root, name + disk.PREV_SUFFIX)
    if os.path.exists(final):
        shutil.rmtree(prev, ignore_errors=True)
        os.rename(final, prev)
    os.rename(staging, final)
    disk.fsync_dir(root)
    shutil.rmtree(prev, ignore_errors=True)
    for debris in os.listdir(root):  # earlier saves of this name that died before their commit
        if debris.startswith(staging_name(name, "")):
            shutil.rmtree(os.path.join(root, debris), ignore_errors=True)
    step = parse_step_dir(name)
    if step is not None:
        disk.update_latest(root, step)


def resolve(path: str | os.PathLike[str]) -> str:
    """The checkpoint directory ``path`` names: itself if it holds ``.metadata``, else the step its
    ``latest`` names (or that step's ``.prev`` while a re-save is being committed)."""
    path = os.fspath(path)
    if os.path.exists(os.path.join(path, METADATA_FILE)):
        return path
    step = disk.read_latest(path)
    if step is not None:
        final = os.path.join(path, step_dir_name(step))
        return final if os.path.isdir(final) else final + disk.PREV_SUFFIX
    if os.path.isdir(path + disk.PREV_SUFFIX):
        return path + disk.PREV_SUFFIX
    raise FileNotFoundError(
        f"{path!r} is neither a DCP checkpoint (no {METADATA_FILE}) nor a root " f"with a {LATEST_FILE!r} file"
    )


def read_checksums(path: str) -> dict[str, Any] | None:
    """The checksums file of a checkpoint, None for one written by plain DCP (nothing to check)."""
    file = os.path.join(path, CHECKSUMS_FILE)
    try:
        with open(file, "rb") as f:
            raw = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise disk.CorruptCheckpoint(f"{file}: unreadable ({exc})") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("items"), dict):
        raise disk.CorruptCheckpoint(f"{file}: not an unbroken checksums file ({FORMAT})")
    try:
        checksum.check_algorithm(raw.get("algorithm", ""))
        raw["metadata"] = (int(raw["metadata"][0]), int(raw["metadata"][1]))
        raw["index"] = {
            (name, int(o)): (int(n), int(c)) for name, entries in raw["items"].items() for o, n, c in entries
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise disk.CorruptCheckpoint(f"{file}: damaged ({exc!r})") from exc
    return raw


def check(file: str, what: str, blob: bytes, expected: tuple[int, int] | None, algorithm: str) -> None:
    """Raise CorruptCheckpoint naming ``file`` unless ``blob`` has the ``(length, crc)`` expected."""
    if expected is None:
        raise disk.CorruptCheckpoint(f"{file}: {what} has no checksum (checksums file does not match)")
    if len(blob) != expected[0]:
        raise disk.CorruptCheckpoint(f"{file}: {what} is {len(blob)} bytes, expected {expected[0]} (truncated)")
    if checksum.update(blob, algorithm=algorithm) != expected[1]:
        raise disk.CorruptCheckpoint(f"{file}: checksum mismatch in {what} (file damaged)")


def verify(path: str | os.PathLike[str]) -> str:
    """Read a whole checkpoint written by :class:`~unbroken.checkpoint.DCPWriter` and check every checksum.

    Returns the checkpoint directory checked; raises CorruptCheckpoint naming the damaged file
    (or saying the checkpoint has no checksums to check).
    """
    path = resolve(path)
    sums = read_checksums(path)
    if sums is None:
        raise disk.CorruptCheckpoint(f"{path}: no {CHECKSUMS_FILE} (not written by DCPWriter): nothing to verify")
    with open(os.path.join(path, METADATA_FILE), "rb") as f:
        check(f.name, "the metadata", f.read(), sums["metadata"], sums["algorithm"])
    for (name, offset), expected in sorted(sums["index"].items()):
        with open(os.path.join(path, name), "rb") as f:
            f.seek(offset)
            check(f.name, f"the item at offset {offset}", f.read(expected[0]), expected, sums["algorithm"])
    return path
