"""torchft's ``train_ddp.py`` example on this machine, unedited: every stand-in in this one file.

The example (torchft's repository root, not in its wheel) trains a small CNN on CIFAR-10 with a
1 GB ``nn.Embedding`` added "so we spend more time in dist communication", through torchft's
``Manager``, ``DistributedDataParallel``, ``Optimizer``, ``DistributedSampler`` and
``ProcessGroupGloo``. This wrapper changes only what this machine cannot provide, each stand-in
listed in ``STANDINS`` with why, then runs the script as ``__main__`` with its own arguments:

    unbroken run --torchft-compat --replicas 2 -- python ddp_example_standins.py \
        [--digest-steps 10,20] train_ddp.py

Observation, not a stand-in: as each step begins (``zero_grad`` asks for its quorum) the
wrapper logs ``unbroken-observe step=<committed steps> t=<wall time>``: the example itself prints
only every 100th step. At each step given to ``--digest-steps`` it writes
``digest-r<replica>-s<step>.json`` into ``UNBROKEN_RUN_DIR`` first: the SHA-256 of the state
the script's own ``state_dict`` function returns (model and optimizer) after that many
committed steps, so replicas can be compared.
"""

from __future__ import annotations

import hashlib
import json
import runpy
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch

STANDINS = {
    "torchvision": "the example imports torchvision for CIFAR10, Compose, ToTensor and Normalize; "
    "torchvision's wheels in reach are built for torch 2.14 and fail to import beside torch 2.13 "
    "('operator torchvision::nms does not exist'): those four, in plain torch",
    "cifar10": "CIFAR10(download=True) downloads 170 MB and nothing here reaches the network: "
    "50,000 seeded random 32x32 RGB images (uint8, HWC, as CIFAR-10's arrays) with labels 0-9",
}
IMAGES, CLASSES = 50_000, 10


class _ToTensor:
    """HWC uint8 to CHW float in [0, 1], as torchvision's ``ToTensor`` does for an array."""

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        return img.permute(2, 0, 1).float().div(255)


class _Normalize:
    def __init__(self, mean: Any, std: Any) -> None:
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return (t - self.mean) / self.std


class _Compose:
    def __init__(self, transforms: list[Any]) -> None:
        self.transforms = transforms

    def __call__(self, x: Any) -> Any:
        for t in self.transforms:
            x = t(x)
        return x


class _CIFAR10(torch.utils.data.Dataset):
    """CIFAR-10's shape and labels, seeded data (STANDINS["cifar10"]); made per item, so the
    two data loader workers of each replica hold no 150 MB copy."""

    def __init__(self, root: str, train: bool = True, download: bool = False, transform: Any = None) -> None:
        self.transform = transform
        self.seed = 0 if train else 1

    def __len__(self) -> int:
        return IMAGES

    def __getitem__(self, i: int) -> tuple[Any, int]:
        g = torch.Generator().manual_seed(self.seed * IMAGES + i)
        img = torch.randint(0, 256, (32, 32, 3), dtype=torch.uint8, generator=g)
        label = int(torch.randint(0, CLASSES, (), generator=g))
        return (self.transform(img) if self.transform else img), label


def install() -> None:
    """The torchvision stand-in (STANDINS["torchvision"], STANDINS["cifar10"])."""
    tv = types.ModuleType("torchvision")
    datasets = types.ModuleType("torchvision.datasets")
    transforms = types.ModuleType("torchvision.transforms")
    datasets.CIFAR10 = _CIFAR10  # type: ignore[attr-defined]
    transforms.Compose, transforms.ToTensor, transforms.Normalize = _Compose, _ToTensor, _Normalize  # type: ignore[attr-defined]
    tv.datasets, tv.transforms = datasets, transforms  # type: ignore[attr-defined]
    sys.modules.update({"torchvision": tv, "torchvision.datasets": datasets, "torchvision.transforms": transforms})


def digest(state: Any) -> str:
    """SHA-256 of every tensor's bytes in ``state`` (nested dicts and lists, keys sorted), and of
    the other leaves' text."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(memoryview(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]  # no copy
        elif isinstance(x, dict):
            for k in sorted(x, key=repr):
                h.update(repr(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    walk(state)
    return h.hexdigest()


def observe(steps: set[int]) -> None:
    """Writes the digests (see the module) through the facade's Manager: it keeps the
    ``state_dict`` function the script gave it, and calls it before a listed step's successor
    asks for its quorum."""
    from unbroken.config import observation_dir, replica_group
    from unbroken.torchft.manager import Manager

    run_dir, replica = observation_dir(), replica_group()
    made, quorum = Manager.__init__, Manager.start_quorum

    def init(self: Any, *args: Any, **kw: Any) -> None:
        made(self, *args, **kw)
        self._observed_state = kw.get("state_dict")

    def start_quorum(self: Any, *args: Any, **kw: Any) -> Any:
        step = self.current_step()
        print(f"unbroken-observe step={step} t={time.time():.3f}", flush=True)
        if step in steps and run_dir and self._observed_state is not None:
            record = {"replica": replica, "step": step, "sha256": digest(self._observed_state())}
            (Path(run_dir) / f"digest-r{replica}-s{step}.json").write_text(json.dumps(record))
        return quorum(self, *args, **kw)

    Manager.__init__, Manager.start_quorum = init, start_quorum  # type: ignore[method-assign]


def main() -> None:
    # Run as a script, this file's folder comes first on sys.path: its modules must not stand
    # in for top-level ones of the same name.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if not p or str(Path(p).resolve()) != here]
    args = sys.argv[1:]
    steps: set[int] = set()
    if args[:1] == ["--digest-steps"] and len(args) > 1:
        steps = {int(s) for s in args[1].split(",") if s.strip()}
        args = args[2:]
    if not args:
        raise SystemExit("usage: ddp_example_standins.py [--digest-steps N,M] train_ddp.py [args...]")
    install()
    observe(steps)
    script = args[0]
    sys.argv = args
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
