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

Allowed values can still cost time: pickle's memo lets 137 bytes describe a tuple of a tuple of
... thirty levels deep in which each level refers to the one below twice, and hashing it (as a
set or a dict key must) walks 2**30 items; so does walking the loaded skeleton. Before the
bytes are unpickled, :func:`check_shape` counts the items of the value they describe with
every shared reference counted again, and the depth of its containers (linear in the bytes),
and a value far larger than its bytes, or nested deeper than any state, is refused.
"""

from __future__ import annotations

import io
import pickle
import pickletools
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
# A skeleton's items counted with their shared references expanded may exceed its distinct items
# by this factor (a tuple of betas shared by every parameter group), plus MIN_EXPANDED. Every
# distinct item costs at least a byte, so what the bytes make a load or a walk do is linear in
# their length: 381 bytes once bought a million items (1.4 s to walk) under a flat allowance.
EXPANSION = 16
MIN_EXPANDED = 16_384
# Containers nested deeper than this are refused: a state nests a few levels (a module's
# parameters in an optimizer's groups), and the walks of a skeleton recurse once a level.
MAX_DEPTH = 100


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


_MARK = -1
_IN_PLACE = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"})
_SKIP, _STOP, _PUSH_MARK, _PUT, _MEMOIZE, _GET, _DUP, _POP, _POP_MARK, _IN_PLACE_OP, _BUILD, _CONSUME = range(12)


def _opcode_table() -> dict[str, tuple[int, int, bool]]:
    """name -> (what it does to the stack, items it takes below a mark or in all, takes a mark)."""
    fixed_kinds = {
        "PROTO": _SKIP,
        "FRAME": _SKIP,
        "STOP": _STOP,
        "MARK": _PUSH_MARK,
        "PUT": _PUT,
        "BINPUT": _PUT,
        "LONG_BINPUT": _PUT,
        "MEMOIZE": _MEMOIZE,
        "GET": _GET,
        "BINGET": _GET,
        "LONG_BINGET": _GET,
        "DUP": _DUP,
        "POP": _POP,
        "POP_MARK": _POP_MARK,
    }
    table = {}
    for op in pickletools.opcodes:
        before = op.stack_before
        marked = pickletools.markobject in before
        fixed = before.index(pickletools.markobject) if marked else len(before)
        kind = fixed_kinds.get(
            op.name, _IN_PLACE_OP if op.name in _IN_PLACE else _BUILD if op.stack_after else _CONSUME
        )
        table[op.name] = (kind, fixed, marked)
    return table


_OPS = _opcode_table()


_ATOM = _CONSUME + 1  # pushes a value with no parts (a string, a number, a class): no item kept
_LEAF = -2  # an atom on the replayed stack: counts 1, has no children
_CONTAINERS = frozenset({"EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"})


def _code_table() -> dict[int, tuple[str, int, int, bool, int, int]]:
    """opcode byte -> (name, stack kind, items taken, takes a mark, argument bytes (negative:
    lines), length-prefix bytes)."""
    prefix = {
        pickletools.TAKEN_FROM_ARGUMENT1: 1,
        pickletools.TAKEN_FROM_ARGUMENT4: 4,
        pickletools.TAKEN_FROM_ARGUMENT4U: 4,
        pickletools.TAKEN_FROM_ARGUMENT8U: 8,
    }
    table = {}
    for op in pickletools.opcodes:
        kind, fixed, marked = _OPS[op.name]
        if kind == _BUILD and not fixed and not marked and op.name not in _CONTAINERS:
            kind = _ATOM
        n = op.arg.n if op.arg is not None else 0
        if n == pickletools.UP_TO_NEWLINE:
            args, pre = (-2 if op.arg.name.endswith("_pair") else -1), 0  # type: ignore[union-attr]
        elif n < 0:
            args, pre = 0, prefix[n]
        else:
            args, pre = n, 0
        table[ord(op.code)] = (op.name, kind, fixed, marked, args, pre)
    return table


_CODES = _code_table()


def expanded_size(data: bytes | bytearray | memoryview) -> tuple[int, int]:
    """(items of the pickled value with every shared reference expanded, distinct items);
    see :func:`measure`."""
    expanded, distinct, _ = measure(data)
    return expanded, distinct


def measure(data: bytes | bytearray | memoryview) -> tuple[int, int, int]:
    """(items of the pickled value with every shared reference expanded, distinct items,
    nesting depth of its containers).

    Replays the pickle's stack and memo on item numbers only (nothing is built, no global is
    looked up, arguments are skipped by their length), then sums each item's parts once per
    reference, each item computed once.

    Raises:
        UnsafeObjectError: malformed, or a value that contains itself.
    """
    data = bytes(data)
    children: list[list[int]] = []
    stack: list[int] = []
    marks: list[int] = []  # stack heights at each open mark
    memo: dict[int, int] = {}
    root = None
    codes = _CODES
    i, n, atoms = 0, len(data), 0
    try:
        while True:
            name, kind, fixed, marked, args, pre = codes[data[i]]
            i += 1
            arg = 0
            if args > 0:
                if kind == _GET or kind == _PUT:
                    arg = int.from_bytes(data[i : i + args], "little")
                i += args
            elif pre:
                i += pre + int.from_bytes(data[i : i + pre], "little")
            elif args < 0:
                for _ in range(-args):
                    end = data.index(b"\n", i)
                    if kind == _GET or kind == _PUT:
                        arg = int(data[i:end])
                    i = end + 1
            if i > n:
                raise ValueError(f"{name} runs past the end of the data")
            if kind == _ATOM:
                stack.append(_LEAF)
                atoms += 1
            elif kind == _MEMOIZE:
                memo[len(memo)] = stack[-1]
            elif kind == _GET:
                stack.append(memo[arg])
            elif kind == _PUT:
                memo[arg] = stack[-1]
            elif kind == _PUSH_MARK:
                marks.append(len(stack))
            elif kind == _SKIP:
                continue
            elif kind == _STOP:
                root = stack[-1]
                break
            elif kind == _DUP:
                stack.append(stack[-1])
            elif kind == _POP:
                if marks and marks[-1] == len(stack):
                    marks.pop()  # POP of a mark itself
                else:
                    stack.pop()
            else:
                items: list[int] = []
                if marked or kind == _POP_MARK:
                    at = marks.pop()
                    items = stack[at:]
                    del stack[at:]
                if fixed:
                    if len(stack) - fixed < (marks[-1] if marks else 0):
                        raise ValueError(f"{name} reaches past a mark")
                    items = stack[-fixed:] + items
                    del stack[-fixed:]
                if kind == _IN_PLACE_OP:
                    if items[0] < 0:
                        raise ValueError(f"{name} on a value with no parts")
                    children[items[0]].extend(items[1:])
                    stack.append(items[0])
                elif kind == _BUILD:
                    children.append(items)
                    stack.append(len(children) - 1)
    except (IndexError, KeyError, ValueError, TypeError) as e:
        raise UnsafeObjectError(f"the state's objects are not a valid pickle: {e!r}") from None
    if root is None:
        raise UnsafeObjectError("the state's objects are not a valid pickle: no value before STOP")
    if root == _LEAF:
        return 1, 1, 0
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    open_: set[int] = set()
    work = [root]
    while work:
        node = work[-1]
        if node in size:
            work.pop()
            continue
        pending = [c for c in children[node] if c >= 0 and c not in size]
        if not pending:
            open_.discard(node)
            size[node] = 1 + sum(size[c] if c >= 0 else 1 for c in children[node])
            depth[node] = 1 + max((depth[c] for c in children[node] if c >= 0), default=0)
            work.pop()
        elif node in open_ or any(c in open_ for c in pending):
            raise UnsafeObjectError("the state's objects contain themselves")
        else:
            open_.add(node)
            work.extend(pending)
    return size[root], len(children) + atoms, depth[root]


def check_shape(
    data: bytes | bytearray | memoryview, what: str = "the state's objects", max_bytes: int = MAX_BYTES
) -> None:
    """Refuses, in one linear pass and before anything is built, pickled bytes whose load or
    walk would cost more than linear time: over ``max_bytes``, containers nested deeper than
    :data:`MAX_DEPTH`, or more items through shared references than
    ``MIN_EXPANDED + EXPANSION`` times their distinct items (see the module doc).

    Raises:
        UnsafeObjectError: one of the bounds is exceeded (the message names which), or the
            bytes are not a valid pickle.
    """
    if len(data) > max_bytes:
        raise UnsafeObjectError(f"{what} take {len(data)} bytes; at most {max_bytes} are accepted")
    expanded, distinct, deepest = measure(data)
    if deepest > MAX_DEPTH:
        raise UnsafeObjectError(
            f"{what} nest containers {deepest} deep; at most {MAX_DEPTH} are accepted (a state nests a few levels)"
        )
    if expanded > MIN_EXPANDED + EXPANSION * distinct:
        raise UnsafeObjectError(
            f"{what} describe {expanded} items through shared references ({distinct} distinct; at most "
            f"{MIN_EXPANDED} + {EXPANSION} x distinct are accepted): a value built to take exponential time "
            "to load or walk, not a state"
        )


def dumps(obj: Any) -> bytes:
    """Pickles a skeleton (no check here: :func:`loads` is the gate, on whichever side loads)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes | bytearray | memoryview, max_bytes: int = MAX_BYTES, own: bool = False) -> Any:
    """Loads a skeleton written by :func:`dumps` (or an older checkpoint's ``objects.pkl``).

    ``own``: the bytes were pickled by this process from its own objects a moment ago (the
    check at save time, a snapshot in this process's memory): the size check is skipped, as
    it costs a linear pass in Python (~0.3 us a byte) and guards against bytes someone else wrote.

    Raises:
        UnsafeObjectError: the bytes name a global outside the allow-list, exceed
            ``max_bytes``, nest deeper than :data:`MAX_DEPTH`, describe a value far larger than
            themselves (see the module doc and :func:`check_shape`), or are not a valid pickle.
    """
    if len(data) > max_bytes:
        raise UnsafeObjectError(f"a state's objects take {len(data)} bytes; at most {max_bytes} are accepted")
    if not own:
        check_shape(data, max_bytes=max_bytes)
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except UnsafeObjectError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a malformed pickle raises
        raise UnsafeObjectError(f"the state's objects are not a valid pickle: {type(e).__name__}: {e}") from e
