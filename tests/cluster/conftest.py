"""The cluster box for tests: skipped, with the reason, where network namespaces cannot be made."""

from __future__ import annotations

import pytest

from unbroken.cluster.box import unavailable


@pytest.fixture(scope="session")
def box_available() -> None:
    why = unavailable()
    if why is not None:
        pytest.skip(f"cluster box unavailable: {why} (run as root, as CI does)")
