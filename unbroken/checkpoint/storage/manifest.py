"""What a checkpoint shard contains, as plain data: tensor layout, global offsets, checksums.

A shard is the state one (replica, rank) saved at one step. Its tensors are packed back to back
in one buffer that is, byte for byte, the data section of a safetensors file: the snapshot
buffer in memory, the file on disk and the copy in a peer all share this layout, so moving a
shard between tiers is a single copy and the file opens with any safetensors reader.

Everything here is pure (no files, no processes) so it can be tested alone.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from unbroken.checkpoint.storage import checksum

FORMAT = "unbroken-checkpoint/1"
DATA_FILE = "data.safetensors"
OBJECTS_FILE = "objects.pkl"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
VERIFIED_FILE = "verified"  # in a shard directory: its checksums were read back and matched

# torch dtype name -> (safetensors dtype code, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
    "uint16": ("U16", 2),
    "uint32": ("U32", 4),
    "uint64": ("U64", 8),
    "bool": ("BOOL", 1),
}

_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_SHARD_DIR = re.compile(r"^r(\d+)-w(\d+)$")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor before layout: its name, dtype and where it sits in the global tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class TensorEntry:
    """A laid-out tensor: ``[begin, end)`` bytes in the data section, and its checksum.

    ``crc32`` is a 32-bit CRC of the tensor's bytes with the manifest's ``checksum`` polynomial.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    begin: int
    end: int
    crc32: int | None = None


@dataclass
class ShardManifest:
    """Everything needed to find, check and re-cut one shard without opening its data."""

    step: int
    replica: int
    replicas: int
    rank: int
    world_size: int
    tensors: list[TensorEntry]
    objects_len: int = 0
    objects_crc32: int | None = None
    format: str = FORMAT
    extra: dict[str, Any] = field(default_factory=dict)
    checksum: str = checksum.ALGORITHM

    @property
    def data_len(self) -> int:
        return max((t.end for t in self.tensors), default=0)

    @property
    def shard_name(self) -> str:
        return shard_dir_name(self.replica, self.rank)

    def to_json(self) -> str:
        """The manifest as JSON text.

        Built by hand and encoded without indentation so that json's C encoder does it: the
        trainer sends a manifest to the persist process with every snapshot, and ``asdict`` plus
        the pure-Python indenting encoder held the GIL for ~14 ms per save of a 117-tensor state.
        """
        raw = {k: v for k, v in self.__dict__.items() if k != "tensors"}
        raw["tensors"] = entries_to_json(self.tensors)
        return json.dumps(raw, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ShardManifest:
        """Parse and validate a manifest; a damaged one is a ValueError naming the problem."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"manifest is not valid JSON ({exc})") from exc
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"manifest format is not {FORMAT!r}")
        try:
            tensors = entries_from_json(raw["tensors"])
            manifest = cls(
                step=int(raw["step"]),
                replica=int(raw["replica"]),
                replicas=int(raw["replicas"]),
                rank=int(raw["rank"]),
                world_size=int(raw["world_size"]),
                tensors=tensors,
                objects_len=int(raw.get("objects_len", 0)),
                objects_crc32=raw.get("objects_crc32"),
                extra=dict(raw.get("extra", {})),
                checksum=checksum.check_algorithm(str(raw.get("checksum", checksum.LEGACY))),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"manifest is missing or mistypes a field ({exc!r})") from exc
        validate(manifest)
        return manifest


def _ints(values: Any) -> tuple[int, ...]:
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"a shape or offset is not a list of integers: {values!r}")
    return tuple(values)


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name, with a clear error for dtypes we cannot store."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} cannot be checkpointed; supported: {sorted(DTYPES)}")
    return DTYPES[dtype][1]


def layout(specs: Iterable[TensorSpec]) -> list[TensorEntry]:
    """Pack tensors back to back, widest dtype first.

    Widest first means every tensor starts at a multiple of its own element size without any
    padding, which safetensors requires (no holes) and which lets a byte buffer be viewed as
    the tensor's dtype in place.
    """
    ordered = sorted(specs, key=lambda s: (-itemsize(s.dtype), s.name))
    names = [s.name for s in ordered]
    if len(set(names)) != len(names):
        raise ValueError("tensor names in one shard must be unique")
    entries, offset = [], 0
    for s in ordered:
        if len(s.shape) != len(s.global_shape) or len(s.global_offset) != len(s.shape):
            raise ValueError(f"{s.name}: shape, global_shape and global_offset differ in rank")
        for lo, n, g in zip(s.global_offset, s.shape, s.global_shape, strict=False):
            if lo < 0 or lo + n > g:
                raise ValueError(
                    f"{s.name}: shard {s.shape} at {s.global_offset} " f"falls outside global shape {s.global_shape}"
                )
        entries.append(
            TensorEntry(s.name, s.dtype, s.shape, s.global_shape, s.global_offset, offset, offset + s.nbytes)
        )
        offset += s.nbytes
    return entries


MAX_TENSORS = 1_000_000  # far beyond any real shard; a larger count is a damaged manifest
MAX_DIMS = 64
MAX_BYTES = 1 << 50  # 1 PiB per shard: bounds every offset so that nothing overflows


def validate(manifest: ShardManifest) -> None:
    """Check a manifest's internal consistency (contiguous, in bounds, known dtypes).

    Everything a reader later computes from a manifest (tensor shapes, byte ranges, the boxes a
    re-cut reads) is checked here, so a damaged or hostile manifest is a ValueError that the
    loader turns into "try the older checkpoint", never a crash deeper down (a negative
    dimension once passed because ``prod((-1, -4))`` is positive).
    """
    if manifest.step < 0:
        raise ValueError("manifest step is negative")
    if not (0 <= manifest.replica < manifest.replicas and 0 <= manifest.rank < manifest.world_size):
        raise ValueError("manifest replica/rank outside replicas/world_size")
    if not 0 <= manifest.objects_len <= MAX_BYTES:
        raise ValueError(f"manifest objects_len {manifest.objects_len} is out of range")
    check_entries(manifest.tensors)


def check_entries(entries: list[TensorEntry]) -> int:
    """Checks that ``entries`` tile their data section exactly; returns its length in bytes.

    Each entry names a unique tensor of a known dtype and a plausible shape, at an offset that
    is a multiple of its element size (so the bytes view as the dtype in place), and the
    entries lie back to back from 0 with no hole and no overlap: every byte a reader writes or
    views then lies inside the data section. A checkpoint's manifest and a catch-up donor's
    header (:mod:`unbroken.comm.catchup`) are both checked here.

    Raises:
        ValueError: naming the first entry that breaks a rule.
    """
    if len(entries) > MAX_TENSORS:
        raise ValueError(f"{len(entries)} tensors listed (at most {MAX_TENSORS})")
    names = set()
    for t in entries:
        _check_entry(t)
        if t.name in names:
            raise ValueError(f"{t.name}: listed twice")
        names.add(t.name)
    offset = 0
    for t in sorted(entries, key=lambda t: t.begin):
        if t.begin != offset:
            raise ValueError(f"{t.name}: data starts at {t.begin}, expected {offset} (hole or overlap)")
        if t.end - t.begin != math.prod(t.shape) * itemsize(t.dtype):
            raise ValueError(f"{t.name}: byte range does not match shape and dtype")
        if t.begin % itemsize(t.dtype):
            raise ValueError(f"{t.name}: data at byte {t.begin} is not aligned to its {t.dtype} elements")
        offset = t.end
    return offset


def entries_to_json(entries: list[TensorEntry]) -> list[dict[str, Any]]:
    """The entries as JSON-ready dicts (a manifest's ``tensors``, a catch-up header's entries)."""
    return [_entry_dict(e) for e in entries]


def entries_from_json(raw: Any) -> list[TensorEntry]:
    """Parses :func:`entries_to_json`'s output; unchecked (see :func:`check_entries`).

    Raises:
        ValueError: a field is missing or of the wrong type.
    """
    if not isinstance(raw, list):
        raise ValueError(f"the tensor entries are not a list: {type(raw).__name__}")
    try:
        return [
            TensorEntry(
                name=t["name"],
                dtype=t["dtype"],
                shape=_ints(t["shape"]),
                global_shape=_ints(t["global_shape"]),
                global_offset=_ints(t["global_offset"]),
                begin=int(t["begin"]),
                end=int(t["end"]),
                crc32=t.get("crc32"),
            )
            for t in raw
        ]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"a tensor entry is missing or mistypes a field ({exc!r})") from exc


def _check_entry(t: TensorEntry) -> None:
    if not isinstance(t.name, str) or not t.name:
        raise ValueError(f"tensor name {t.name!r} is not a non-empty string")
    if not isinstance(t.dtype, str):
        raise ValueError(f"{t.name}: dtype {t.dtype!r} is not a name")
    itemsize(t.dtype)
    dims = (t.shape, t.global_shape, t.global_offset)
    if not all(isinstance(d, int) and not isinstance(d, bool) for ds in dims for d in ds):
        raise ValueError(f"{t.name}: shape, global_shape and global_offset must be integers")
    if not len(t.shape) == len(t.global_shape) == len(t.global_offset) or len(t.shape) > MAX_DIMS:
        raise ValueError(
            f"{t.name}: shape, global_shape and global_offset differ in rank " f"(or exceed {MAX_DIMS} dimensions)"
        )
    for lo, n, g in zip(t.global_offset, t.shape, t.global_shape, strict=False):
        if n < 0 or g < 0 or lo < 0 or lo + n > g:
            raise ValueError(
                f"{t.name}: shard {t.shape} at {t.global_offset} does not fit in "
                f"global shape {t.global_shape} (negative or out of bounds)"
            )
    if math.prod(t.global_shape) * itemsize(t.dtype) > MAX_BYTES:
        raise ValueError(f"{t.name}: global shape {t.global_shape} is implausibly large")
    if not 0 <= t.begin <= t.end <= MAX_BYTES:
        raise ValueError(f"{t.name}: byte range [{t.begin}, {t.end}) is out of range")
    if t.crc32 is not None and not (isinstance(t.crc32, int) and 0 <= t.crc32 < 1 << 32):
        raise ValueError(f"{t.name}: checksum {t.crc32!r} is not a 32-bit integer")


def _entry_dict(e: TensorEntry) -> dict[str, Any]:
    return {
        "name": e.name,
        "dtype": e.dtype,
        "shape": e.shape,
        "global_shape": e.global_shape,
        "global_offset": e.global_offset,
        "begin": e.begin,
        "end": e.end,
        "crc32": e.crc32,
    }


def with_checksums(entries: list[TensorEntry], crcs: dict[str, int]) -> list[TensorEntry]:
    """Entries with their checksums filled in (computed later, by the persist process)."""
    return [
        TensorEntry(e.name, e.dtype, e.shape, e.global_shape, e.global_offset, e.begin, e.end, crcs[e.name])
        for e in entries
    ]


def safetensors_header(entries: list[TensorEntry], metadata: dict[str, str] | None = None, align: int = 8) -> bytes:
    """The length prefix and JSON header that precede the data section in a safetensors file.

    Padded with spaces (which safetensors allows) to a multiple of ``align``, so the data
    section starts aligned: 8 keeps every dtype aligned, 4096 also permits direct I/O.
    """
    header: dict[str, Any] = {
        e.name: {"dtype": DTYPES[e.dtype][0], "shape": list(e.shape), "data_offsets": [e.begin, e.end]} for e in entries
    }
    if metadata:
        header["__metadata__"] = metadata
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % align)
    return len(body).to_bytes(8, "little") + body


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def shard_dir_name(replica: int, rank: int) -> str:
    return f"r{replica}-w{rank}"


def parse_step_dir(name: str) -> int | None:
    """The step of a committed step directory name, or None for anything else (temp dirs)."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def parse_shard_dir(name: str) -> tuple[int, int] | None:
    m = _SHARD_DIR.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def is_complete(shards: Iterable[tuple[int, int]], world_size: int) -> bool:
    """A step is complete when every rank's shard is committed by at least one replica."""
    return {w for _, w in shards} >= set(range(world_size))
