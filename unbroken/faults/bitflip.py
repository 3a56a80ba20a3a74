"""One flipped bit, where silent data corruption lands: a tensor's bytes, changed in place.

``--fault bitflip:replica=R,step=S,where=W,bit=B[,index=I]`` flips bit ``B`` of element ``I``
of one tensor of replica ``R``'s rank at step ``S`` (:class:`~unbroken.faults.worker_chaos.WorkerChaos`
applies it), where ``W`` is one of :data:`WHERE`:

- ``grad``: this rank's gradient, before the exchange sends it (every member then sums the same
  wrong value: no comparison across replicas can see it; ``docs/diagnosis.md``);
- ``result``: the exchange's sum as this member received it, before it is checked (a corrupted
  sum or receive buffer at one member);
- ``weight``: a parameter, at the step's start;
- ``moment``: an optimizer moment (Adam's ``exp_avg``, or the first tensor of its state).

Bit numbers count from the least significant bit of the element's own width (0-31 for float32:
31 is the sign, 23-30 the exponent); for a narrower element they wrap around its width.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

WHERE = ("grad", "result", "weight", "moment")
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    """Flips bit ``bit`` of element ``index`` (modulo its element count) of ``t``, in place."""
    local = t.to_local() if hasattr(t, "to_local") else t
    flat = local.detach().view(-1)
    if flat.numel() == 0:
        raise ValueError("cannot flip a bit of an empty tensor")
    size = flat.element_size()
    words = flat.view(_INT_OF_SIZE[size])
    i = index % flat.numel()
    mask = 1 << (bit % (8 * size))
    if mask >= 1 << (8 * size - 1) and size > 1:
        mask -= 1 << (8 * size)  # the sign bit, as the signed integer of that width
    words[i] ^= torch.tensor(mask, dtype=words.dtype, device=words.device)


def _tensors(x: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
    if isinstance(x, torch.Tensor):
        yield path, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _tensors(v, (*path, str(k)))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _tensors(v, (*path, str(i)))


def pick(state: Any, where: str) -> torch.Tensor:
    """The tensor of a state dict that a ``weight`` or ``moment`` flip lands in.

    ``weight``: the first floating tensor outside an optimizer's ``state``; ``moment``: the first
    ``exp_avg`` in it, else its first floating tensor of more than one element.

    Raises:
        ValueError: the state holds no such tensor (no model or no optimizer registered).
    """
    floats = [(p, t) for p, t in _tensors(state) if t.is_floating_point() and t.numel() > 0]
    if where == "weight":
        found = [t for p, t in floats if "state" not in p]
    elif where == "moment":
        moments = [(p, t) for p, t in floats if "state" in p and t.numel() > 1]
        found = [t for p, t in moments if p[-1] == "exp_avg"] or [t for _, t in moments]
    else:
        raise ValueError(f"a bit flip in the state lands in a weight or a moment, not {where!r}")
    if not found:
        raise ValueError(
            f"no {where} to flip a bit of: register the model and optimizer state "
            "(manager.register_state_dict_fn, or unbroken.model_state)"
        )
    return found[0]
