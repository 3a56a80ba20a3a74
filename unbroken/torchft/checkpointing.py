"""torchft's checkpoint transports, accepted so that scripts naming one run unchanged.

In torchft a recovering replica fetches its state over a transport the script picks
(``HTTPTransport``, ``PGTransport``). In unbroken the donor serves a snapshot taken at its step
boundary over its own CRC-checked transfer (:mod:`unbroken.comm.catchup`), so these classes only
keep their arguments; a Manager given one (``checkpoint_transport=``) ignores it.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

T = TypeVar("T")


class CheckpointTransport(Generic[T]):
    """Keeps its arguments; unbroken's catch-up moves the state."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def metadata(self) -> str:
        return ""

    def disallow_checkpoint(self) -> None:
        """Nothing to disallow: unbroken serves a snapshot, never the live state."""

    def shutdown(self, wait: bool = True) -> None:
        """Nothing to stop: the Manager's catch-up server stops with it."""


class HTTPTransport(CheckpointTransport[T]):
    """torchft's default transport; see the module."""


class PGTransport(CheckpointTransport[T]):
    """torchft's process-group transport; see the module."""
