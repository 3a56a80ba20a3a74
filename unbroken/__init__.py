"""unbroken: fault-tolerant data-parallel training for PyTorch.

A training loop needs a handful of lines::

    with unbroken.init() as manager:
        optimizer = unbroken.Optimizer(torch.optim.AdamW(model.parameters()), manager)
        state = unbroken.model_state(model, optimizer)  # what a recovering peer fetches
        manager.register_state_dict_fn("train", state.load_state_dict, state.state_dict)
        while manager.step < steps:
            optimizer.zero_grad(); model(batch).backward(); optimizer.step()
            if manager.last_step_committed: ...

and is launched with ``unbroken run --replicas N -- python train.py``. ``unbroken.Optimizer`` is
a ``torch.optim.Optimizer`` (schedulers, hooks and ``state_dict`` work on it) and
``unbroken.model_state`` handles FSDP2's DTensor state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

__all__ = [
    "Checkpointer",
    "DistributedDataParallel",
    "Manager",
    "ModelState",
    "Optimizer",
    "__version__",
    "average_gradients",
    "checkpointer_for",
    "gradient_numel",
    "init",
    "model_state",
    "resume",
    "save_if_due",
]

if TYPE_CHECKING:
    from unbroken.checkpoint import Checkpointer
    from unbroken.entry import init
    from unbroken.train.checkpointing import checkpointer_for, resume, save_if_due
    from unbroken.train.ddp import DistributedDataParallel
    from unbroken.train.manager import Manager
    from unbroken.train.optimizer import Optimizer, average_gradients, gradient_numel
    from unbroken.train.state import ModelState, model_state


def __getattr__(name: str) -> Any:
    # Importing torch only when the training API is used keeps the CLI quick to start.
    if name == "init":
        from unbroken.entry import init

        return init
    if name == "Manager":
        from unbroken.train.manager import Manager

        return Manager
    if name == "DistributedDataParallel":
        from unbroken.train.ddp import DistributedDataParallel

        return DistributedDataParallel
    if name in ("Optimizer", "average_gradients", "gradient_numel"):
        from unbroken.train import optimizer

        return getattr(optimizer, name)
    if name in ("ModelState", "model_state"):
        from unbroken.train import state

        return getattr(state, name)
    if name in ("checkpointer_for", "resume", "save_if_due"):
        from unbroken.train import checkpointing

        return getattr(checkpointing, name)
    if name == "Checkpointer":
        from unbroken.checkpoint import Checkpointer

        return Checkpointer
    raise AttributeError(f"module 'unbroken' has no attribute {name!r}")
