"""torchft's ``LocalSGD`` and ``DiLoCo``: replicas train alone and agree every few steps.

Each sync is one step of unbroken's protocol (a quorum, the fault-tolerant exchange, the
replica vote, commit), so ``manager.current_step()`` counts syncs. What is exchanged is the
pseudo-gradient, the distance each replica moved from the last agreed parameters (the
"backup", torchft's ``original_parameters``), never the parameters themselves: a replica that
catches up in a sync contributes zeros, loads its donor's state (the donor's backup and outer
optimizer state) and then applies the same average as everyone, so after every sync that commits
all replicas hold the same backup. A sync that does not commit puts the parameters back to the
backup, as torchft's.

- ``LocalSGD``: the new parameters are ``backup + average(params - backup)``.
- ``DiLoCo``: the gradient ``average(backup - params)`` is stepped by the outer optimizer from
  ``backup``. With several fragments, as torchft's streaming DiLoCo, one fragment syncs every
  ``sync_every / len(fragments)`` inner steps, the one the synced step's number picks; its
  exchange starts ``fragment_sync_delay`` inner steps before it is applied, and
  ``fragment_update_alpha`` keeps that share of each replica's own progress
  (``params.lerp_(local, alpha)``). Quantization and bucketization are not supported (ignored).
"""

from __future__ import annotations

import dataclasses
from types import TracebackType
from typing import Any

import torch
from torch import nn, optim
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from unbroken.torchft.init_sync import as_like
from unbroken.torchft.manager import Manager


@dataclasses.dataclass
class _Fragment:
    """Parameters synced together, their backup, and the outer optimizer that steps them."""

    names: list[str]
    params: list[nn.Parameter]
    backup: list[torch.Tensor]
    outer: optim.Optimizer | None = None


class _SyncEvery:
    """Counts the inner optimizer's steps (a step post-hook) and syncs a fragment every
    ``every`` of them: its exchange starts ``delay`` steps before the sync applies it.

    The backups are registered with the Manager, so a recovering replica receives the agreed
    parameters with the rest of its donor's state.
    """

    def __init__(
        self,
        manager: Manager,
        fragments: list[_Fragment],
        inner: optim.Optimizer,
        every: int,
        delay: int = 0,
        alpha: float = 0.0,
    ) -> None:
        if every < 1:
            raise ValueError(f"sync_every must be >= 1, got {every}")
        if not 0 <= delay < every:
            raise ValueError(f"fragment_sync_delay must be in [0, {every}), got {delay}")
        self._manager = manager
        self._fragments = fragments
        self._inner = inner
        self._every, self._delay, self._alpha = every, delay, alpha
        self._local_step = 0
        self._hooks: list[RemovableHandle] = []
        self._pending: tuple[_Fragment, list[torch.Tensor]] | None = None
        self._register_state()

    def _register_state(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        self._hooks.append(self._inner.register_step_post_hook(self._step_post_hook))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _step_post_hook(self, _optim: optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._local_step += 1
        if self._local_step == self._every - self._delay:
            self._prepare()
        if self._local_step >= self._every:
            self._local_step = 0
            self._perform()

    def sync(self) -> bool:
        """Syncs now (torchft's ``LocalSGD.sync``); True when the sync committed."""
        self._local_step = 0
        if self._pending is None:
            self._prepare()
        return self._perform()

    def _prepare(self) -> None:
        """Starts a sync: its quorum, and the exchange of the pseudo-gradients of the fragment
        the synced step picks (the quorum's step, the same on every member, a newcomer too)."""
        m = self._manager
        m.start_quorum()
        d = m._decision()
        step = d.step if d is not None else m.current_step()
        fragment = self._fragments[step % len(self._fragments)]
        with torch.no_grad():
            moved = [
                (_local(p.detach()) - _local(b)).float() for p, b in zip(fragment.params, fragment.backup, strict=True)
            ]
        for t in moved:
            m.allreduce(t)
        self._pending = (fragment, moved)

    def _perform(self) -> bool:
        """Ends the sync: commits it (a catching-up replica loads its donor's state here), then
        applies the averaged move from the backup, or goes back to the backup."""
        assert self._pending is not None
        fragment, moved = self._pending
        self._pending = None
        ok = self._manager._commit(moved)
        with torch.no_grad():
            local = [p.detach().clone() for p in fragment.params] if self._alpha else []
            for p, b in zip(fragment.params, fragment.backup, strict=True):
                p.copy_(b)
            if ok:
                self._apply(fragment, moved)
                for p, lo in zip(fragment.params, local, strict=False):
                    p.lerp_(lo, self._alpha)
        return ok

    def _apply(self, fragment: _Fragment, moved: list[torch.Tensor]) -> None:
        for p, b, d in zip(fragment.params, fragment.backup, moved, strict=True):
            _local(b).add_(d.to(b.dtype))
            p.copy_(b)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters under torchtitan), the part this rank
    exchanges with the same rank of the other replicas; a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _like(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t``, a local shard, as a DTensor laid out as ``p`` where ``p`` is one."""
    return as_like(t, p)


def _state_like_params(opt: optim.Optimizer) -> None:
    """Makes the per-parameter state an optimizer loaded (a donor's local shards: its momentum)
    DTensors again where the parameters are: the step would mix the two kinds and fail."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p)
            if not state or not isinstance(p, DTensor):
                continue
            local = p.to_local()
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == local.shape:
                    state[k] = _like(p, v)


def _fragment(module: nn.Module, outer: optim.Optimizer | None = None) -> _Fragment:
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    with torch.no_grad():
        backup = [p.detach().clone() for _, p in named]
    return _Fragment([n for n, _ in named], [p for _, p in named], backup, outer)


class LocalSGD(_SyncEvery):
    """torchft's ``LocalSGD(manager, model, optimizer, sync_every)``, a context manager."""

    def __init__(self, manager: Manager, model: nn.Module, optimizer: optim.Optimizer, sync_every: int) -> None:
        self._model = model
        super().__init__(manager, [_fragment(model)], optimizer, sync_every)

    def _register_state(self) -> None:
        (f,) = self._fragments

        def load(state: dict[str, Any]) -> None:
            with torch.no_grad():
                for b, v in zip(f.backup, state["backup"], strict=True):
                    b.copy_(v)

        self._manager.register_state_dict_fn("local_sgd", load, lambda: {"backup": f.backup})


class DiLoCo(_SyncEvery):
    """torchft's ``DiLoCo(manager, model_fragments, inner_optimizer, outer_optimizer, sync_every)``.

    ``outer_optimizer``: one, or one per fragment, over the fragments' parameters (torchtitan
    builds ``SGD(lr=0.7, momentum=0.9, nesterov=True)``). Its state travels to a recovering
    replica with the backup.
    """

    def __init__(
        self,
        manager: Manager,
        model_fragments: list[nn.Module] | nn.Module,
        inner_optimizer: optim.Optimizer,
        outer_optimizer: optim.Optimizer | list[optim.Optimizer],
        sync_every: int,
        backup_device: torch.device | None = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: int | None = None,
        should_quantize: bool = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        modules = model_fragments if isinstance(model_fragments, list) else [model_fragments]
        outer = outer_optimizer if isinstance(outer_optimizer, list) else [outer_optimizer] * len(modules)
        if len(outer) != len(modules):
            raise ValueError(f"one outer optimizer per fragment: {len(outer)} for {len(modules)} fragments")
        if sync_every < len(modules) or sync_every % len(modules):
            raise ValueError(f"sync_every ({sync_every}) must be a multiple of the fragments ({len(modules)})")
        if not 0.0 <= fragment_update_alpha <= 1.0:
            raise ValueError(f"fragment_update_alpha must be in [0, 1], got {fragment_update_alpha}")
        fragments = [_fragment(f, o) for f, o in zip(modules, outer, strict=True)]
        super().__init__(
            manager,
            fragments,
            inner_optimizer,
            sync_every // len(modules),
            fragment_sync_delay,
            fragment_update_alpha,
        )

    def _register_state(self) -> None:
        """Each fragment's state under torchft's key and layout (``StreamingDiLoCoFragment_I``:
        ``original_parameters`` by name, ``outer_optimizer``), which torchft's tests read."""
        for i, f in enumerate(self._fragments):
            assert f.outer is not None

            def save(f: _Fragment = f) -> dict[str, Any]:
                assert f.outer is not None
                return {
                    "outer_optimizer": f.outer.state_dict(),
                    "original_parameters": dict(zip(f.names, f.backup, strict=False)),
                }

            def load(state: dict[str, Any], f: _Fragment = f) -> None:
                assert f.outer is not None
                with torch.no_grad():
                    for n, b in zip(f.names, f.backup, strict=True):
                        b.copy_(state["original_parameters"][n])
                f.outer.load_state_dict(state["outer_optimizer"])
                _state_like_params(f.outer)

            self._manager.register_state_dict_fn(f"StreamingDiLoCoFragment_{i}", load, save)

    def _apply(self, fragment: _Fragment, moved: list[torch.Tensor]) -> None:
        assert fragment.outer is not None
        saved = [p.grad for p in fragment.params]
        for p, d in zip(fragment.params, moved, strict=True):
            p.grad = _like(p, (-d).to(p.dtype))  # the outer gradient: backup - params, averaged
        fragment.outer.step()
        for p, b, g in zip(fragment.params, fragment.backup, saved, strict=True):
            b.copy_(p)
            p.grad = g
