"""What the diagnosis concludes: a culprit, a class, a confidence and the evidence.

The supervisor consumes verdicts as ``verdict`` events; their field names are an interface.
"""

from __future__ import annotations

import dataclasses
from typing import Any

NONCOMM_HANG = "noncomm_hang"
COMM_HANG = "comm_hang"
STRAGGLER = "straggler"
COMM_SLOW = "comm_slow"
METRIC_ANOMALY = "metric_anomaly"
# A NIC port whose ICCL connection keeps failing (failing, then flapping); its hop moved to the
# backup path, so the supervisor leaves the replica alone (an unknown class to it: ignored).
PORT_FAILURE = "port_failure"
# A replica named for silent data corruption again within a window of steps (one flip is
# healed by catch-up; a second one points at its hardware): reported, not acted on here.
SUSPECT_HARDWARE = "suspect_hardware"
CLASSES = (NONCOMM_HANG, COMM_HANG, STRAGGLER, COMM_SLOW, METRIC_ANOMALY, PORT_FAILURE, SUSPECT_HARDWARE)

UNKNOWN_REPLICA = -1  # a comm hang seen without per-connection evidence names no replica


@dataclasses.dataclass(frozen=True)
class Culprit:
    """Who is at fault: a replica (and its rank, node), or the link between two replicas."""

    replica: int
    rank: int | None = None
    node: str | None = None
    link: tuple[int, int] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "rank": self.rank,
            "node": self.node,
            "link": list(self.link) if self.link is not None else None,
        }


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One diagnosis. ``key`` identifies the finding so that it is reported once."""

    culprit: Culprit
    kind: str
    confidence: float
    evidence: dict[str, Any]
    detect_s: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in CLASSES:
            raise ValueError(f"verdict class must be one of {CLASSES}, got {self.kind!r}")
        if not 0.0 <= self.confidence <= 1.0:
            raise ValueError(f"confidence must be within [0, 1], got {self.confidence}")

    @property
    def key(self) -> tuple[Any, ...]:
        return (
            self.kind,
            self.culprit.replica,
            self.culprit.link,
            self.evidence.get("anomaly"),
            self.evidence.get("interface"),
            self.evidence.get("state"),
        )

    def fields(self) -> dict[str, Any]:
        """The ``verdict`` event's fields (the supervisor's interface)."""
        return {
            "culprit": self.culprit.to_json(),
            "class": self.kind,
            "confidence": round(self.confidence, 3),
            "evidence": self.evidence,
            "detect_s": self.detect_s,
        }
