"""torchft's ``LocalSGD`` and ``DiLoCo``: replicas train alone and agree every ``sync_every`` steps.

Each sync is one step of unbroken's protocol (a quorum, the fault-tolerant exchange, the
replica vote, commit), so ``manager.current_step()`` counts syncs. What is exchanged is the
pseudo-gradient, the distance each replica moved from the last agreed parameters (the
"backup"), never the parameters themselves: a replica that catches up in a sync contributes
zeros, loads its donor's state (the donor's backup, the outer optimizer's state) and then applies
the same average as everyone, so after every sync that commits all replicas hold the same
parameters. A sync that does not commit puts the parameters back to the backup, as torchft's.

- ``LocalSGD``: the new parameters are ``backup + average(params - backup)``.
- ``DiLoCo``: the gradient ``average(backup - params)`` is stepped by the outer optimizer from
  ``backup``. Every fragment syncs at once every ``sync_every`` inner steps: torchft's staggered
  fragments (``fragment_sync_delay``, ``fragment_update_alpha``) and quantization are not
  supported.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch
from torch import nn, optim
from torch.utils.hooks import RemovableHandle

from unbroken.torchft.manager import Manager


class _SyncEvery:
    """Counts the inner optimizer's steps (a step post-hook) and syncs every ``sync_every``.

    Holds the backup of the parameters it syncs, registered with the Manager under ``key`` so a
    recovering replica receives the agreed parameters with the rest of its donor's state.
    """

    key = "local_sgd"

    def __init__(self, manager: Manager, params: list[nn.Parameter], inner: optim.Optimizer, sync_every: int) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self._manager = manager
        self._params = params
        self._inner = inner
        self._sync_every = sync_every
        self._local_step = 0
        self._hooks: list[RemovableHandle] = []
        with torch.no_grad():
            self._backup = [p.detach().clone() for p in params]
        self._register_state()

    def _register_state(self) -> None:
        self._manager.register_state_dict_fn(self.key, self._load_state, self._state)

    def _state(self) -> dict[str, Any]:
        return {"backup": self._backup}

    def _load_state(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for b, v in zip(self._backup, state["backup"], strict=True):
                b.copy_(v)

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
        if self._local_step >= self._sync_every:
            self.sync()

    def sync(self) -> bool:
        """Agrees on the parameters with the other replicas; True when the sync committed."""
        self._local_step = 0
        m = self._manager
        m.start_quorum()
        with torch.no_grad():
            moved = [(p.detach() - b).float() for p, b in zip(self._params, self._backup, strict=True)]
        for t in moved:
            m.allreduce(t)
        ok = m._commit(moved)  # a catching-up replica loads its donor's backup here
        with torch.no_grad():
            if ok:
                self._apply(moved)
            else:
                for p, b in zip(self._params, self._backup, strict=True):
                    p.copy_(b)
        return ok

    def _apply(self, moved: list[torch.Tensor]) -> None:
        for p, b, d in zip(self._params, self._backup, moved, strict=True):
            b.add_(d.to(b.dtype))
            p.copy_(b)


class LocalSGD(_SyncEvery):
    """torchft's ``LocalSGD(manager, model, optimizer, sync_every)``, a context manager."""

    def __init__(self, manager: Manager, model: nn.Module, optimizer: optim.Optimizer, sync_every: int) -> None:
        self._model = model
        super().__init__(manager, [p for p in model.parameters() if p.requires_grad], optimizer, sync_every)


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
        if fragment_sync_delay != 0 or fragment_update_alpha != 0.0:
            raise NotImplementedError("unbroken's DiLoCo syncs every fragment at once: no fragment_sync_delay/alpha")
        fragments = model_fragments if isinstance(model_fragments, list) else [model_fragments]
        outer = outer_optimizer if isinstance(outer_optimizer, list) else [outer_optimizer] * len(fragments)
        if len(outer) != len(fragments):
            raise ValueError(f"one outer optimizer per fragment: {len(outer)} for {len(fragments)} fragments")
        self._outer = list(dict.fromkeys(outer))  # each stepped once
        # Per fragment: its outer optimizer and (name, index into the synced parameters).
        self._fragments: list[tuple[optim.Optimizer, list[tuple[str, int]]]] = []
        params: list[nn.Parameter] = []
        for f, o in zip(fragments, outer, strict=True):
            named = [(n, p) for n, p in f.named_parameters() if p.requires_grad]
            self._fragments.append((o, [(n, len(params) + i) for i, (n, _) in enumerate(named)]))
            params += [p for _, p in named]
        super().__init__(manager, params, inner_optimizer, sync_every)

    def _register_state(self) -> None:
        """Each fragment's state under torchft's key and layout (``StreamingDiLoCoFragment_I``:
        ``original_parameters`` by name, ``outer_optimizer``), which torchft's tests read."""
        for i, (o, names) in enumerate(self._fragments):

            def save(o: optim.Optimizer = o, names: list[tuple[str, int]] = names) -> dict[str, Any]:
                return {
                    "outer_optimizer": o.state_dict(),
                    "original_parameters": {n: self._backup[j] for n, j in names},
                }

            def load(state: dict[str, Any], o: optim.Optimizer = o, names: list[tuple[str, int]] = names) -> None:
                with torch.no_grad():
                    for n, j in names:
                        self._backup[j].copy_(state["original_parameters"][n])
                o.load_state_dict(state["outer_optimizer"])

            self._manager.register_state_dict_fn(f"StreamingDiLoCoFragment_{i}", load, save)

    def _apply(self, moved: list[torch.Tensor]) -> None:
        saved = []
        for p, b, d in zip(self._params, self._backup, moved, strict=True):
            saved.append(p.grad)
            p.copy_(b)
            p.grad = (-d).to(p.dtype)  # the outer gradient: backup - params, averaged
        for o in self._outer:
            o.step()
        for p, b, g in zip(self._params, self._backup, saved, strict=True):
            b.copy_(p)
            p.grad = g
