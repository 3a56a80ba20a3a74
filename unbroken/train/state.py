"""What a replica registers as its state, and how sharded (DTensor) state travels.

A recovering replica fetches the registered state from a peer, and a checkpoint holds the same
state. Both move plain tensors: a :class:`~torch.distributed.tensor.DTensor` (FSDP2's
parameters and optimizer state) goes as this rank's local shard, to the same rank of the peer
or into the checkpoint as a :class:`~unbroken.checkpoint.Shard` that records where the piece
sits in the global tensor (so it can be re-cut for another world size). Loading wraps the local
shards back into DTensors laid out like this rank's own. All of it runs on the training thread,
between steps: FSDP2's state must not be read while a backward pass runs.

For a model and its optimizer, :func:`model_state` does this with PyTorch's
``torch.distributed.checkpoint.state_dict`` (plain, DDP and FSDP2 models alike)::

    state = unbroken.model_state(model, optimizer)
    manager.register_state_dict_fn("train", state.load_state_dict, state.state_dict)
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from unbroken.checkpoint.snapshot import Shard

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)

StateDictFn = Callable[[], Any]
LoadStateDictFn = Callable[[Any], None]


def _map(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """Rebuilds nested dicts, lists and tuples, passing every other value through ``leaf``."""
    if isinstance(obj, dict):
        return {k: _map(v, leaf) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_map(v, leaf) for v in obj)
    return leaf(obj)


def _dtensor() -> type | None:
    """DTensor's class if anything imported it (no state holds a DTensor otherwise).

    Looked up rather than imported: importing torch.distributed.tensor takes seconds on a busy
    machine, which a job without DTensors should not pay at every (re)start.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _is_dtensor(v: Any) -> bool:
    cls = _dtensor()
    return cls is not None and isinstance(v, cls)


def _global_offset(t: DTensor) -> tuple[int, ...]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[1])


def as_shards(state: Any) -> Any:
    """``state`` with every DTensor replaced by a :class:`Shard` of its local tensor (what a
    checkpoint stores: the local bytes and where they sit in the global tensor)."""

    def leaf(v: Any) -> Any:
        if _is_dtensor(v):
            return Shard(v.to_local(), tuple(v.shape), _global_offset(v))
        return v

    return _map(state, leaf)


def as_local(state: Any) -> Any:
    """``state`` with every DTensor or :class:`Shard` replaced by its local tensor (what a peer
    is sent: the same rank of the receiver holds the same piece)."""

    def leaf(v: Any) -> Any:
        if _is_dtensor(v):
            return v.to_local()
        if isinstance(v, Shard):
            return v.tensor
        return v

    return _map(state, leaf)


def like(loaded: Any, template: Any, strict: bool = True) -> Any:
    """``loaded`` with each local tensor or :class:`Shard` at a place where ``template`` holds a
    DTensor wrapped into a DTensor with the template's mesh, placements and global shape.

    Args:
        strict: a local piece whose shape is not that of this rank's shard is an error; when
            False it stays as it is (an optimizer's scalar step count beside its DTensor moments).

    Raises:
        ValueError: with ``strict``, a local piece does not have the shape of this rank's shard
            (the state was saved by a differently sharded job).
    """
    if _is_dtensor(template):
        from torch.distributed.tensor import DTensor

        local = loaded.tensor if isinstance(loaded, Shard) else loaded
        if isinstance(local, DTensor) or not isinstance(local, torch.Tensor):
            return local
        mine = template.to_local()
        if tuple(local.shape) != tuple(mine.shape):
            if not strict:
                return loaded
            raise ValueError(
                f"a loaded shard has shape {tuple(local.shape)} but this rank's shard of the "
                f"{tuple(template.shape)} tensor has {tuple(mine.shape)}: the state comes from a "
                "job sharded differently"
            )
        return DTensor.from_local(
            local.to(device=mine.device),
            template.device_mesh,
            template.placements,
            run_check=False,
            shape=template.shape,
            stride=template.stride(),
        )
    if isinstance(loaded, dict) and isinstance(template, dict):
        return {k: like(v, template[k], strict) if k in template else v for k, v in loaded.items()}
    if isinstance(loaded, (list, tuple)) and isinstance(template, (list, tuple)) and len(loaded) == len(template):
        return type(loaded)(like(a, b, strict) for a, b in zip(loaded, template, strict=False))
    return loaded


class ModelState:
    """A model and its optimizer as one registrable state (torch's ``Stateful`` protocol).

    Built on :func:`torch.distributed.checkpoint.state_dict.get_state_dict` and
    :func:`~torch.distributed.checkpoint.state_dict.set_state_dict`, so the same code serves a
    plain model, DDP and FSDP2: keys are fully qualified parameter names and sharded tensors
    are DTensors, which the manager turns into local shards on the way out and
    :meth:`load_state_dict` wraps back. Pass the torch optimizer or the
    :class:`unbroken.Optimizer` around it (its inner optimizer is used: reading the state must
    never run a fault-tolerant step).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        # Imported now, at setup, not on first use: that is a restarted replica's first step,
        # which its peers wait for (the import takes seconds on a busy machine).
        import torch.distributed.checkpoint.state_dict  # noqa: F401

        self.model = model
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # unwraps unbroken.Optimizer

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optim": ...}``; ``optim`` is None before the optimizer's first step.

        Before its first step an optimizer has no state, and get_state_dict would create it by
        running a step with zero gradients, which advances Adam's step count: a job that read
        its state early would then train differently from plain torch.
        """
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None or not self.optimizer.state:
            return {"model": get_model_state_dict(self.model), "optim": None}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads what :meth:`state_dict` returned, from a peer or a checkpoint (local shards
        or :class:`Shard` markers where this rank holds DTensors)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict, set_state_dict

        if not isinstance(state, dict) or "model" not in state or "optim" not in state:
            raise ValueError(
                "model_state() loads what its state_dict() returned: a dict with 'model' and "
                f"'optim', got {type(state).__name__} with {sorted(state) if isinstance(state, dict) else ''}"
            )
        params = get_model_state_dict(self.model)
        model_sd = like(state["model"], params)
        if state["optim"] is None or self.optimizer is None:
            set_model_state_dict(self.model, model_sd)
            return
        # An optimizer's per-parameter state is laid out like its parameter (keyed by the same
        # name): the parameters are the template, not this optimizer's own state, which a
        # replica catching up does not have yet.
        optim = state["optim"]
        per_param = {
            name: {k: params[name] for k in st}
            for name, st in optim.get("state", {}).items()
            if name in params and isinstance(st, dict)
        }
        optim_sd = like(optim, {"state": per_param}, strict=False)
        set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> ModelState:
    """The state of ``model`` and ``optimizer`` to register with
    :meth:`~unbroken.train.manager.Manager.register_state_dict_fn` (see :class:`ModelState`)."""
    return ModelState(model, optimizer)


def check_state_pair(state_dict: StateDictFn | None, load_state_dict: LoadStateDictFn | None) -> None:
    """Refuses one of the two state functions of ``unbroken.init()`` without the other."""
    if (state_dict is None) != (load_state_dict is None):
        raise ValueError(
            "pass both state_dict and load_state_dict, or neither (and register states "
            "with manager.register_state_dict_fn)"
        )


class StateRegistry:
    """The states registered with :meth:`~unbroken.train.manager.Manager.register_state_dict_fn`.

    A replica's whole state is ``{"user": {key: state_dict()}, "unbroken": {"step": step}}``:
    what a recovering peer is sent and what a checkpoint holds.
    """

    def __init__(self) -> None:
        self._fns: dict[str, tuple[LoadStateDictFn, StateDictFn]] = {}
        self._warned_stateless = False

    def register(self, key: str, load_state_dict: LoadStateDictFn, state_dict: StateDictFn) -> None:
        """Adds ``key``; see :meth:`~unbroken.train.manager.Manager.register_state_dict_fn`."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"a state key must be a non-empty string, got {key!r}")
        if key in self._fns:
            raise ValueError(f"a state is already registered under {key!r}: pick another key")
        if not callable(load_state_dict) or not callable(state_dict):
            raise TypeError(f"register_state_dict_fn({key!r}, load_state_dict, state_dict) takes two callables")
        self._fns[key] = (load_state_dict, state_dict)

    def full(self, step: int) -> dict[str, Any]:
        """Every registered state and ``step``, tensors as the state functions return them."""
        if not self._fns and not self._warned_stateless:
            self._warned_stateless = True
            log.warning(
                "no state is registered (manager.register_state_dict_fn): a replica that catches "
                "up or resumes gets only the step number, not the model"
            )
        user = {key: save() for key, (_, save) in self._fns.items()}
        return {"user": user, "unbroken": {"step": step}}

    def load(self, state: dict[str, Any]) -> int:
        """Loads a whole state (as :meth:`full` returns it) into the registered states; returns its step."""
        user = state["user"]
        missing = [k for k in self._fns if k not in user]
        unknown = [k for k in user if k not in self._fns]
        if missing or unknown:
            raise ValueError(
                f"the loaded state holds {sorted(user)} but this replica registered "
                f"{sorted(self._fns)}: register the same keys as the replica that saved it"
                + (f" (missing: {missing})" if missing else "")
                + (f" (unknown: {unknown})" if unknown else "")
            )
        for key, (load, _) in self._fns.items():
            load(user[key])
        return int(state["unbroken"]["step"])
