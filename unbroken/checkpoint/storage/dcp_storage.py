"""``torch.distributed.checkpoint`` storage with unbroken's disk guarantees: checksums, atomic commit.

A user of ``dcp.save``/``dcp.load``/``dcp.async_save`` passes :class:`DCPWriter` or
:class:`DCPReader` and keeps everything else (planners, ``get_state_dict``, resharding). What
lands on disk is plain DCP plus a checksums file (layout in :mod:`~unbroken.checkpoint.storage.dcp_layout`),
so ``dcp.load(state, checkpoint_id=path)`` reads it with no unbroken code.

Why not FileSystemWriter: it writes into the final directory, so a job killed mid-save leaves a
directory that looks like a checkpoint (or replaces a good one with a broken one), and nothing
notices a flipped byte until ``torch.load`` fails somewhere, or does not. Here every rank writes
into a staging directory the coordinator names in the global plan, each file is fsynced before
its rank reports it written, and the coordinator renames the directory into place after
``.metadata`` and the checksums are durable, then moves ``latest``. The async-save staging copy
(``dcp.async_save``) is torch's ``BlockingAsyncStager``, the role unbroken's memory snapshot plays
for its own Checkpointer.
"""

from __future__ import annotations

import io
import os
import pickle
import uuid
import zipfile
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from unbroken.checkpoint.storage import checksum, disk, retention
from unbroken.checkpoint.storage.dcp_layout import (
    METADATA_FILE,
    check,
    commit,
    read_checksums,
    resolve,
    staging_name,
    verify,
    write_checksums,
)
from unbroken.checkpoint.storage.manifest import parse_step_dir, step_dir_name
from unbroken.wire.objects import UnsafeObjectError, check_shape


@dataclass(frozen=True)
class _Target:
    """The coordinator's choice for one rank: its file prefix and the shared staging directory."""

    prefix: str
    staging: str


@dataclass(frozen=True)
class _Written:
    """What a rank reports for one item: DCP's storage info and the CRC of its bytes.

    Only ``info`` goes into ``.metadata``, so plain DCP can unpickle it without unbroken.
    """

    info: _StorageInfo
    crc32: int


class _CrcFile:
    """A file that keeps a running CRC of what is written to it (``torch.save`` writes through it)."""

    def __init__(self, f: io.BufferedWriter) -> None:
        self.f, self.crc = f, 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = checksum.update(view, self.crc)
        return self.f.write(view)

    def flush(self) -> None:
        self.f.flush()


class DCPWriter(StorageWriter, BlockingAsyncStager):
    """A DCP ``StorageWriter`` that commits a checkpoint atomically and checksums every byte.

    Args:
        path: the checkpoint directory (as ``checkpoint_id`` of ``dcp.save``, which overrides it),
            or, with ``step``, the root that holds ``step-NNNNNNNN`` directories and ``latest``.
        step: save into ``path/step-{step:08d}`` and point ``path/latest`` at it once committed.
            A ``path`` named ``step-N`` moves its parent's ``latest`` too.
        cache_staged_state_dict: for ``dcp.async_save``, keep the host copy between saves (see
            ``BlockingAsyncStager``): no allocation per save, at the cost of holding the memory.
        keep_last: after each committed save into a root (``step`` given), delete older step
            directories so that ``keep_last`` checkpoints that verify remain, by the rule of
            :mod:`unbroken.checkpoint.storage.retention` (only verified checkpoints count; nothing newer
            than them and nothing at all while fewer exist). None keeps everything.

    Give DCP checkpoints a root of their own: unbroken's ``Checkpointer`` keeps its retention
    and ``latest`` in its directory and would treat these step directories as its own.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        step: int | None = None,
        cache_staged_state_dict: bool = False,
        keep_last: int | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be at least 1 (or None to keep every checkpoint), got {keep_last}")
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        self.keep_last = keep_last
        self.deleted: list[int] = []  # steps the last save's retention removed
        self._verified: set[str] = set()  # directories read back whole once: not read again
        self.path = os.fspath(path) if step is None else os.path.join(os.fspath(path), step_dir_name(step))
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self._staging_name = ""  # chosen by the coordinator in prepare_global_plan

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ValueError(
                "DCPWriter commits a checkpoint from one coordinator: save with " "use_collectives=True (the default)"
            )
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Runs on the coordinator: checks the root, names the staging directory for every rank."""
        root, name = os.path.split(os.path.abspath(self.path))
        disk.check_writable(root)
        latest = disk.read_latest(root)
        if (
            latest is not None
            and os.path.isdir(os.path.join(root, step_dir_name(latest)))
            and not os.path.exists(os.path.join(root, step_dir_name(latest), METADATA_FILE))
        ):
            raise ValueError(
                f"{root!r} holds checkpoints of unbroken's Checkpointer: give DCP checkpoints "
                "a directory of their own"
            )
        self._staging_name = staging_name(name, self.save_id)
        return [replace(p, storage_data=_Target(f"__{i}_", self._staging_name)) for i, p in enumerate(plans)]

    def _staging(self, name: str) -> str:
        return os.path.join(os.path.dirname(os.path.abspath(self.path)), name)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Writes this rank's items into one file of the staging directory, fsynced, with CRCs."""
        target: _Target = plan.storage_data
        staging = self._staging(target.staging)
        os.makedirs(staging, mode=disk.DIR_MODE, exist_ok=True)
        name = f"{target.prefix}0.distcp"
        results: list[WriteResult] = []
        # Objects first, then tensors, as FileSystemWriter orders them.
        items = sorted(plan.items, key=lambda i: i.type != WriteItemType.BYTE_IO)
        with open(os.path.join(staging, name), "wb", opener=disk.private_opener) as f:
            for item in items:
                results.append(self._write_item(f, item, planner, name))
            f.flush()
            os.fsync(f.fileno())
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    @staticmethod
    def _write_item(f: io.BufferedWriter, item: WriteItem, planner: SavePlanner, name: str) -> WriteResult:
        offset = f.tell()
        out = _CrcFile(f)
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO and isinstance(data, io.BytesIO):
            out.write(data.getbuffer())
        elif item.type != WriteItemType.BYTE_IO and isinstance(data, torch.Tensor):
            tensor = data.detach().cpu()
            if tensor.untyped_storage().size() != tensor.numel() * tensor.element_size():
                tensor = tensor.clone()  # a view: torch.save would write its whole storage
            torch.save(tensor, out)  # type: ignore[arg-type]  # torch.save needs only write and flush
        else:
            raise TypeError(f"the save planner resolved a {item.type.name} item to a {type(data).__name__}")
        length = f.tell() - offset
        return WriteResult(
            index=item.index, size_in_bytes=length, storage_data=_Written(_StorageInfo(name, offset, length), out.crc)
        )

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: writes ``.metadata`` and the checksums, then commits by rename."""
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {}
        items: dict[str, list[list[int]]] = {}
        for rank_results in results:
            for wr in rank_results:
                written: _Written = wr.storage_data
                metadata.storage_data[wr.index] = written.info
                items.setdefault(written.info.relative_path, []).append(
                    [written.info.offset, written.info.length, written.crc32]
                )
        metadata.storage_meta = self.storage_meta()
        root, name = os.path.split(os.path.abspath(self.path))
        staging = self._staging(self._staging_name)
        os.makedirs(staging, mode=disk.DIR_MODE, exist_ok=True)
        write_checksums(staging, pickle.dumps(metadata), items)
        commit(root, name, staging)
        if self.keep_last is not None and parse_step_dir(name) is not None:
            self.deleted = apply_retention(root, self.keep_last, self._verified)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return FileSystem.validate_checkpoint_id(checkpoint_id)


# (module, name) of every global a DCP ``.metadata`` names (torch's own dataclasses and value
# types); the dtypes are checked by type. Anything else is refused before it is called.
_METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a lookup of torch.strided and its kind by name
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("pathlib", "PosixPath"),  # a checkpoint_id given as a Path
        ("pathlib", "PurePosixPath"),
    }
)


# A ``.metadata`` holds a few hundred bytes per tensor shard: a million shards fit.
MAX_METADATA_BYTES = 1 << 30


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeObjectError(
            f"refusing to load the global {module}.{name} from a checkpoint's {METADATA_FILE}: it may "
            "only name DCP's metadata classes, torch.Size and dtypes (anything else could run code)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeObjectError(f"refusing a persistent id in a checkpoint's {METADATA_FILE}")


def load_metadata(blob: bytes, file: str = METADATA_FILE) -> Metadata:
    """DCP's ``.metadata`` (a pickle, as plain DCP writes it) through an allow-list unpickler:
    whoever can write the checkpoint directory must not get to run code in the job.

    Nor to spend the job's time: its shape is bounded first, as a skeleton's is
    (:func:`~unbroken.wire.objects.check_shape`: depth, items through shared references, size).

    Raises:
        UnsafeObjectError: a global outside the allow-list, a shape past the bounds, or not a
            valid pickle of a Metadata.
    """
    check_shape(blob, f"the checkpoint's {file}", MAX_METADATA_BYTES)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(blob)).load()
    except UnsafeObjectError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a malformed pickle raises
        raise UnsafeObjectError(f"{file} is not a valid pickle: {type(e).__name__}: {e}") from e
    if not isinstance(metadata, Metadata):
        raise UnsafeObjectError(f"{file} holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def check_saved(blob: bytes, what: str) -> None:
    """Bounds the shape of ``torch.save`` bytes' pickle (its ``data.pkl``) as a ``.metadata``'s
    (:func:`~unbroken.wire.objects.check_shape`) before anything loads them: a few hundred bytes
    of shared references could otherwise make loading them (a dict key hashed) take minutes.

    Raises:
        UnsafeObjectError: not ``torch.save``'s zip format (DCP writes nothing else), or a shape
            past the bounds.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            pickles = [i for i in z.infolist() if i.filename.count("/") == 1 and i.filename.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise UnsafeObjectError(f"{what} holds {len(pickles)} data.pkl, not one as torch.save writes")
            if pickles[0].file_size > MAX_METADATA_BYTES:
                raise UnsafeObjectError(f"{what} holds a {pickles[0].file_size}-byte pickle: too large for an object")
            data = z.read(pickles[0])
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError) as e:
        raise UnsafeObjectError(f"{what} is not torch.save's format, as DCP writes objects: {e}") from None
    check_shape(data, what, MAX_METADATA_BYTES)


def apply_retention(root: str, keep_last: int, verified: set[str] | None = None) -> list[int]:
    """Delete old DCP step directories of ``root`` by :func:`unbroken.checkpoint.storage.retention.apply`,
    keeping ``keep_last`` whose checksums all read back; ``verified`` caches directories already
    read whole (each is read once per writer)."""
    cache = set() if verified is None else verified

    def check(root: str, step: int) -> None:
        path = os.path.join(root, step_dir_name(step))
        if path not in cache:
            verify(path)
            cache.add(path)

    deleted = retention.apply(root, keep_last, verify=check)
    cache.difference_update(os.path.join(root, step_dir_name(s)) for s in deleted)
    return deleted


class DCPReader(StorageReader):
    """A DCP ``StorageReader`` that verifies every byte it reads against ``checksums.json``.

    Reads what :class:`DCPWriter` wrote and checkpoints written by plain ``FileSystemWriter``
    (torch.save format; these have no checksums and are read unverified). ``path`` is a checkpoint
    directory or a root with ``latest`` (its newest committed step). A damaged file raises
    :class:`~unbroken.checkpoint.storage.disk.CorruptCheckpoint` naming the file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.load_id = uuid.uuid4().hex
        self.storage_data: dict[Any, _StorageInfo] = {}
        self.checksums: dict[str, Any] | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.storage_data, self.checksums = {}, None
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self.path = path = resolve(self.path)  # pinned: ``latest`` may move while we load
        file = os.path.join(path, METADATA_FILE)
        with open(file, "rb") as f:
            blob = f.read()
        sums = read_checksums(path)
        if sums is not None:  # checked before unpickling: a damaged pickle can do anything
            check(file, "the metadata", blob, sums["metadata"], sums["algorithm"])
        metadata = load_metadata(blob, file)
        meta: StorageMeta | None = getattr(metadata, "storage_meta", None)
        if meta is None:
            meta = metadata.storage_meta = StorageMeta()
        meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # Every rank reads the checksums itself: only the coordinator ran read_metadata.
        self.path = resolve(self.path)
        self.storage_data = metadata.storage_data
        self.checksums = read_checksums(self.path)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return replace(plan, storage_data=self.path)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: every rank resolved a root to the same step (a save can move ``latest``
        between two ranks' reads, and mixing two steps' metadata and data is silent damage)."""
        paths = sorted({str(p.storage_data) for p in plans})
        if len(paths) > 1:
            raise RuntimeError(
                f"ranks are loading different checkpoints {paths} (latest moved during the "
                "load): load again, or name the step directory"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads each stored item once, checks its CRC, then serves every request cut from it."""
        by_item: dict[tuple[str, int, int], list[ReadItem]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if info.transform_descriptors:
                raise ValueError(
                    f"{info.relative_path} was written with stream transforms "
                    f"{info.transform_descriptors}: load it with FileSystemReader"
                )
            by_item.setdefault((info.relative_path, info.offset, info.length), []).append(req)
        for (name, offset, length), reqs in sorted(by_item.items()):
            file = os.path.join(self.path, name)
            with open(file, "rb") as f:
                f.seek(offset)
                blob = f.read(length)
            if self.checksums is not None:
                check(
                    file,
                    f"the item at offset {offset}",
                    blob,
                    self.checksums["index"].get((name, offset)),
                    self.checksums["algorithm"],
                )
            elif len(blob) != length:
                raise disk.CorruptCheckpoint(f"{file}: truncated at offset {offset}")
            if reqs[0].type == LoadItemType.BYTE_IO:
                # DCP's planner loads these with torch.load(weights_only=False): only bytes whose
                # shape is bounded and that torch's allow-list loads first get that far.
                check_saved(blob, f"{file}: the object {reqs[0].storage_index.fqn!r} at offset {offset}")
                try:
                    torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
                except Exception as e:  # noqa: BLE001 - whatever the restricted load refused
                    raise UnsafeObjectError(
                        f"{file}: refusing the object {reqs[0].storage_index.fqn!r} at offset {offset}: "
                        f"it does not load with torch.load(weights_only=True) ({type(e).__name__}: {e})"
                    ) from None
                for req in reqs:
                    planner.load_bytes(req, io.BytesIO(blob))
                continue
            stored = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
            for req in reqs:
                piece = narrow_tensor_by_index(stored, req.storage_offsets, req.lengths)
                dest = planner.resolve_tensor(req).detach()
                if dest.size() != piece.size():
                    raise ValueError(
                        f"{file}: stored piece {tuple(piece.size())} does not fit the requested "
                        f"{tuple(dest.size())} of {req.storage_index.fqn!r}"
                    )
                dest.copy_(piece)
                planner.commit_tensor(req, dest)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.path.isdir(os.fspath(checkpoint_id))
