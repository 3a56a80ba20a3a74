"""Trains a small ``transformers`` Llama, FSDP2 inside each replica, as a fault-tolerant job.

    pip install 'unbroken[examples]'
    unbroken run --replicas 3 --ranks-per-replica 2 -- python examples/llama/train.py --steps 200

The loop is :mod:`unbroken.examples.llama.train` (its docstring says what each part does, and
how to run the same training without unbroken: ``--plain`` under ``torchrun``).
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import unbroken  # noqa: F401
except ImportError:  # a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from unbroken.examples.llama.train import main  # noqa: E402

if __name__ == "__main__":
    main()
