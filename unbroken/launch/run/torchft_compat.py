"""``unbroken run --torchft-compat``: ``import torchft`` in the workers is unbroken's facade.

A torchft or torchtitan script imports ``torchft`` and its submodules (``torchft.manager``,
``torchft.process_group``, ``torchft.local_sgd``...). The launcher writes a one-file ``torchft``
package into the run directory and puts it first on the workers' ``PYTHONPATH``: its
``__init__`` is :mod:`unbroken.torchft`, and each submodule is registered under its torchft
name, so the scripts run with no edit, and a real torchft installed beside is not used. Writing
it here, rather than shipping a top-level ``torchft`` package in the wheel, keeps the name free
for the real one in every process not launched with the switch. Nothing here imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path

from unbroken import config as env

# The submodules torchtitan 0.3.0 and torchft's examples import, each the facade's module.
SUBMODULES = ("checkpointing", "data", "ddp", "local_sgd", "manager", "optim", "process_group")
# torchft's modules inside those, each the facade's module that holds what they define.
ALIASES = {
    "checkpointing.http_transport": "checkpointing",
    "checkpointing.pg_transport": "checkpointing",
    "checkpointing.transport": "checkpointing",
}

SHIM = '''"""torchft, as unbroken's facade (written by `unbroken run --torchft-compat`)."""

import sys as _sys

import unbroken.torchft as _facade
from unbroken.torchft import *  # noqa: F403

for _name in {submodules!r}:
    _sys.modules[__name__ + "." + _name] = getattr(_facade, _name)
for _name, _module in {aliases!r}.items():
    _sys.modules[__name__ + "." + _name] = getattr(_facade, _module)
__path__.extend({upstream!r})  # torchft's own files (its tests) behind the facade's modules
'''

# torchft's Rust extension, as far as its integration tests use it: the lighthouse.
EXTENSION = '''"""torchft._torchft as unbroken's stand-in (written by unbroken's torchft shim)."""

from unbroken.torchft.lighthouse import LighthouseServer  # noqa: F401
'''


def shim_source(upstream: Path | None = None) -> str:
    """The text of the shim's ``torchft/__init__.py``; ``upstream``: see :func:`write_shim`."""
    return SHIM.format(submodules=SUBMODULES, aliases=ALIASES, upstream=[str(upstream)] if upstream is not None else [])


def write_shim(run_dir: Path, upstream: Path | None = None) -> Path:
    """Writes the ``torchft`` shim under ``run_dir``; returns the directory to put on the path.

    ``upstream``: the ``torchft`` directory of an unpacked torchft wheel, whose other modules
    (its tests, ``torchft._test``) then import from there, with the facade's modules and a
    lighthouse stand-in for its Rust extension in front: how torchft's own integration tests
    run on unbroken with only the import redirected (``make torchft-upstream``).
    """
    root = Path(run_dir).resolve() / "torchft-compat"
    (root / "torchft").mkdir(parents=True, exist_ok=True)
    (root / "torchft" / "__init__.py").write_text(shim_source(upstream))
    if upstream is not None:
        (root / "torchft" / "_torchft.py").write_text(EXTENSION)
    return root


def python_path_with(shim_dir: Path) -> str:
    """The workers' ``PYTHONPATH``: the shim first, then what was set around us."""
    return os.pathsep.join(filter(None, [str(shim_dir), env.python_path()]))
