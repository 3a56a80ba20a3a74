"""NIC port verdicts from the ICCL rings' path events (pure).

Each rank's flight-recorder batch carries its rings' port events (``down``, ``up``,
``failover``, ``failback``, ``flagged``) as ages; the master keeps the job's newest ones in its
own clock and, on every evaluation, names the ports that failed within the last 30 s:
``failing`` once, ``flapping`` again and again (:func:`~unbroken.diagnosis.rules.links.port_findings`),
by host, interface and peer. The hop already moved to its backup path, so the verdict is
evidence (and a metric), not a remedy: the supervisor does not act on its class.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from unbroken.diagnosis.rules.links import port_findings
from unbroken.diagnosis.telemetry import PathEvent
from unbroken.diagnosis.verdict import PORT_FAILURE, Culprit, Verdict


def port_event(now: float, replica: int, p: PathEvent) -> dict[str, Any]:
    """One shipped event in the coordinator's clock, with the replica whose port it is."""
    return {
        "t": now - p.age_s,
        "replica": replica,
        "host": p.host,
        "interface": p.interface,
        "peer": p.peer,
        "what": p.what,
        "why": p.why,
    }


def port_verdicts(events: Iterable[Mapping[str, Any]], now: float) -> list[Verdict]:
    """A ``port_failure`` verdict per port that failed in the window (see the module)."""
    events = list(events)
    if not events:
        return []
    replica_of = {(e["host"], e["interface"], e["peer"]): e["replica"] for e in events}
    out = []
    for f in port_findings(events, now):
        replica = replica_of.get((f.host, f.interface, f.peer), -1)
        evidence = {k: v for k, v in f.to_json().items() if k != "class"}
        culprit = Culprit(replica, None, f.host, (replica, f.peer) if replica >= 0 else None)
        out.append(Verdict(culprit, PORT_FAILURE, 0.9 if f.state == "flapping" else 0.7, evidence))
    return out
