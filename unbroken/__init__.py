"""unbroken: fault-tolerant data-parallel training for PyTorch.

The public API is deliberately small; everything a training loop touches is importable from
here.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
