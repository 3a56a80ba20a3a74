"""Exact, order-sensitive fingerprints of tensors, computed on the tensor's own device.

A fingerprint is two 64-bit integers over the tensor's bytes read as 32-bit words ``w[i]``
(bytes, when the size is not a multiple of 4), cut into blocks of :data:`BLOCK` words: the plain
sum ``S1 = sum w[i]`` and the block-positional sum ``S2 = sum (b + 1) * B[b]``, where ``B[b]`` is
the sum of block ``b``, both modulo 2**64. Integer sums are associative, so the value does not
depend on the order a kernel adds in: two tensors with the same bytes always get the same
fingerprint, on any device and at any thread count (no false alarm from a nondeterministic
reduction). A single flipped bit changes ``w[i]`` by a power of two, which ``S1`` always sees;
two blocks swapped, or data written at another block's place, change ``S2``. Two elements
swapped inside one 1 KiB block are not seen: no corruption we know of moves data that finely
(a collective's chunks are whole blocks), and seeing it took a second pass, the column sums of
the block matrix, which cost more than the rest (8 MB, one core: 0.58 ms with it, 0.27 without).

The work is one reduction of a ``(blocks, BLOCK)`` view (block sums accumulated in int32
modulo 2**32, then combined in int64), so nothing the size of the input is ever made and nothing
but the two integers leaves the device (:func:`fold` reads them all in one transfer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BLOCK = 256  # 32-bit words a block: 1 KiB
MASK = (1 << 64) - 1
_FNV_PRIME = 0x100000001B3
_FNV_OFFSET = 0xCBF29CE484222325
_positions: dict[torch.device, torch.Tensor] = {}  # one per device: 1..n, int64, grown as needed


def _block_positions(device: torch.device, n: int) -> torch.Tensor:
    """``1..n`` as int64 on ``device`` (a prefix of one tensor kept per device)."""
    p = _positions.get(device)
    if p is None or p.numel() < n:
        size = max(n, 2 * p.numel() if p is not None else 1024)
        p = _positions[device] = torch.arange(1, size + 1, dtype=torch.int64, device=device)
    return p[:n]


def words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as one flat tensor of 32-bit words (of bytes when they do not divide)."""
    flat = t.detach().reshape(-1).contiguous()
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    size = flat.element_size()
    if size >= 4 or ((flat.numel() * size) % 4 == 0 and (flat.storage_offset() * size) % 4 == 0):
        return flat.view(torch.int32)
    return flat.view(torch.uint8)


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """``(S1, S2)`` of ``t`` as a 2-element int64 tensor on ``t``'s device (see the module)."""
    w = words(t)
    n = w.numel()
    blocks, tail_n = divmod(n, BLOCK)
    if tail_n:  # the last, short block: its words summed in int64 (few, so cheap)
        tail = w[blocks * BLOCK :].to(torch.int64).sum().reshape(1)
    if blocks:
        # Accumulated in int32, wrapping modulo 2**32 (as exact and order-free as int64, and
        # four times faster on CPU than casting every word to int64); a flipped bit still moves
        # its block's sum by a nonzero amount, and S1 adds the block sums up in int64.
        sums = w[: blocks * BLOCK].view(blocks, BLOCK).sum(dim=1, dtype=torch.int32).to(torch.int64)
        if tail_n:
            sums = torch.cat([sums, tail])
    elif tail_n:
        sums = tail
    else:
        return torch.zeros(2, dtype=torch.int64, device=w.device)
    return torch.stack([sums.sum(), (sums * _block_positions(w.device, sums.numel())).sum()])


def mix(h: int, value: int) -> int:
    """One step of an FNV-1a-style fold of 64-bit ``value`` into ``h`` (order-sensitive)."""
    return (((h ^ (value & MASK)) * _FNV_PRIME) & MASK) or 1


def fold(prints: Sequence[torch.Tensor]) -> int:
    """One 64-bit value (never 0) for a sequence of :func:`fingerprint` results, in order: one
    transfer from the device for all of them. 0 stands for "nothing fingerprinted"."""
    if not prints:
        return 0
    h = _FNV_OFFSET
    if len({p.device for p in prints}) > 1:
        prints = [p.cpu() for p in prints]
    for s1, s2 in torch.stack(list(prints)).tolist():
        h = mix(mix(h, s1), s2)
    return h


SMALL = 1 << 16  # elements: tensors below this are fingerprinted together (see state_prints)


def state_prints(state: object) -> list[torch.Tensor]:
    """Fingerprints of every tensor in a nested dict/list ``state`` (a state_dict), dict keys in
    sorted order; other leaves (hyperparameters) are not fingerprinted.

    A tensor of :data:`SMALL` elements or more gets its own :func:`fingerprint`; the smaller ones
    (biases, norms, step counters: most of a model's tensors, few of its bytes) are copied, as
    bytes, into one buffer per device, fingerprinted once: a fingerprint is about ten kernel
    launches, which 116 small tensors of the example GPT turned into 32 ms.
    """
    prints: list[torch.Tensor] = []
    small: dict[torch.device, list[torch.Tensor]] = {}

    def walk(x: object) -> None:
        if isinstance(x, torch.Tensor):
            local = x.to_local() if hasattr(x, "to_local") else x
            if local.numel() >= SMALL:
                prints.append(fingerprint(local))
            elif local.numel():
                flat = local.detach().reshape(-1).contiguous()
                small.setdefault(flat.device, []).append(flat.view(torch.uint8))
        elif isinstance(x, dict):
            for k in sorted(x, key=repr):
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state)
    prints.extend(fingerprint(torch.cat(parts)) for parts in small.values())
    return prints
