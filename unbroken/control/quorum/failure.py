"""Telling a configuration that can never work from a fault that a new epoch may heal.

A cross-replica exchange fails for two kinds of reasons. A fault (a peer crashed, hung, or its
link broke: timeouts, resets, refused connections) is healed by forming a new epoch without
the culprit, which the coordinator does. A configuration error (NCCL refusing two ranks on one
GPU, an interface or address that this host does not have, a backend this torch build lacks)
fails every epoch the same way, and retrying only loops: the job must stop and say why. The
error text is all a rank and the coordinator share, so the classification reads the text,
here, in one place: the rank reports the text and the coordinator classifies it (a peer's
word that something is "fatal" is not taken on trust).
"""

from __future__ import annotations

import dataclasses
import re

from unbroken.control.protocol.messages import MAX_FAILURE_CHARS  # a wire bound: the messages own it


@dataclasses.dataclass(frozen=True)
class FailureClass:
    """What an exchange's error means.

    Attributes:
        fatal: no retry can mend it (a configuration error); False: a fault.
        cause: a short name of the cause (``nccl_duplicate_gpu``, ``fault``...).
        hint: what the user should change, for a fatal one.
    """

    fatal: bool
    cause: str
    hint: str = ""


FAULT = FailureClass(fatal=False, cause="fault")

# (pattern, cause, hint): the first match wins. Patterns are searched case-insensitively.
_FATAL: tuple[tuple[str, str, str], ...] = (
    (
        r"duplicate gpu detected|ncclInvalidUsage|invalid usage",
        "nccl_invalid_usage",
        "NCCL refuses two ranks on one GPU: use --cross-replica-backend gloo (or auto, which picks Gloo "
        "when members share a GPU)",
    ),
    (
        r"unable to find address for",
        "no_such_interface",
        "GLOO_SOCKET_IFNAME (or NCCL_SOCKET_IFNAME) names an interface this host does not have: "
        "set it to one that `ip addr` lists, or unset it",
    ),
    (
        r"cannot resolve \S+ to a \(local\) address",
        "no_such_address",
        "the address the exchange binds is not one of this host's: check --advertise-addr, "
        "GLOO_SOCKET_IFNAME and the host name's resolution",
    ),
    (
        r"has no attribute 'ProcessGroupNCCL'|nccl is not available|doesn't have nccl built in|"
        r"torch not compiled with cuda",
        "backend_missing",
        "this torch build has no NCCL (a CPU build?): use --cross-replica-backend gloo, or install a "
        "CUDA build of torch",
    ),
    (
        r"ProcessGroupGloo.*not available|doesn't have gloo built in",
        "backend_missing",
        "this torch build has no Gloo: use --cross-replica-backend nccl",
    ),
)
_COMPILED = tuple((re.compile(p, re.IGNORECASE), cause, hint) for p, cause, hint in _FATAL)


def classify(error: str) -> FailureClass:
    """The class of an exchange's error text (see the module's docstring)."""
    text = error[:MAX_FAILURE_CHARS]
    for pattern, cause, hint in _COMPILED:
        if pattern.search(text):
            return FailureClass(fatal=True, cause=cause, hint=hint)
    return FAULT
