"""The non-tensor part of a state (its "skeleton"), as bytes that are safe to load.

A training state is tensors plus small plain objects: hyperparameters, step counts, parameter
ids, ``torch.Size``, dtypes, the ``OrderedDict`` of a module's ``state_dict`` and the markers
that stand for the tensors. Those objects travel between processes (catch-up from a donor, a
peer's copy of a checkpoint) and sit on disk (``objects.pkl``), and ``pickle.loads`` of bytes
that someone else wrote runs whatever code they chose (a ``__reduce__`` naming ``os.system``).

So the format stays pickle (checkpoints already on disk still load, and pickling a skeleton on
every save is cheap), but loading goes through an allow-list unpickler, in the spirit of
``torch.load(weights_only=True)``: the containers and scalars pickle builds itself, plus the
few classes named in :data:`ALLOWED`; any other global (a function, a module, a class not on
the list) is refused with :class:`UnsafeObjectError` before anything is called. Callables
reachable through the list only build values (``torch.Size((2, 3))``, ``OrderedDict()``).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

# (module, name) of every global a skeleton may name. The tensor marker is referred to by name
# so that this bottom layer imports nothing above it; it is a plain frozen dataclass.
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "complex"),
        ("builtins", "slice"),
        ("_codecs", "encode"),  # how pickle protocols 0-2 spell bytes (a pure function, as in torch's list)
        ("collections", "OrderedDict"),
        ("torch", "Size"),
        ("torch", "device"),
        ("unbroken.checkpoint.snapshot", "TensorRef"),
    }
)

MAX_BYTES = 256 << 20  # a skeleton this large is no skeleton: refuse before unpickling


class UnsafeObjectError(pickle.UnpicklingError):
    """The bytes name a global that a state skeleton has no business naming, or are malformed."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "__builtin__":  # protocols 0-2 name builtins as Python 2 did
            module = "builtins"
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise UnsafeObjectError(
            f"refusing to load the global {module}.{name}: a state's non-tensor objects may only hold "
            "dicts, lists, tuples, sets, numbers, strings, bytes, None, OrderedDict, torch.Size, "
            "torch dtypes and devices (anything else could run code when loaded)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeObjectError("refusing a persistent id in a state's objects")


def dumps(obj: Any) -> bytes:
    """Pickles a skeleton (no check here: :func:`loads` is the gate, on whichever side loads)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes | bytearray | memoryview, max_bytes: int = MAX_BYTES) -> Any:
    """Loads a skeleton written by :func:`dumps` (or an older checkpoint's ``objects.pkl``).

    Raises:
        UnsafeObjectError: the bytes name a global outside the allow-list, exceed
            ``max_bytes``, or are not a valid pickle.
    """
    if len(data) > max_bytes:
        raise UnsafeObjectError(f"a state's objects take {len(data)} bytes; at most {max_bytes} are accepted")
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except UnsafeObjectError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a malformed pickle raises
        raise UnsafeObjectError(f"the state's objects are not a valid pickle: {type(e).__name__}: {e}") from e
