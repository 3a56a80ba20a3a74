"""A stranger floods every listener of a real job while a replica is killed (-9) and recovers.

``unbroken bench abuse --quick``: a flooder process holds idle and dripping connections on the
coordinator, the store, the HTTP server, each donor's catch-up port and a peer store, reopens
what each sheds, and meanwhile connects to each as a key holder. What a user relies on: no
legitimate connect is refused, the killed replica comes back (it caught up from a donor whose
port is flooded), and the servers hold no thread per flooding connection.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import python_env
from unbroken.wire.admission import DEFAULT_POLICY

# A scenario (`make scenarios`): 40 s on 2 cores; `unbroken bench abuse` measures the same flood.
pytestmark = [pytest.mark.integration, pytest.mark.scenario]


def test_a_replica_recovers_and_key_holders_connect_while_every_listener_is_flooded(tmp_path: Path) -> None:
    out = tmp_path / "abuse.json"
    args = [sys.executable, "-m", "unbroken", "bench", "abuse", "--quick", "--run-dir", str(tmp_path / "run")]
    done = subprocess.run([*args, "--out", str(out)], env=python_env(), capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    result = json.loads(out.read_text())
    for run in ("unloaded", "flood"):
        assert "error" not in result[run], result[run]
        assert result[run]["recovery_s"] > 0
    targets = result["flood"]["flooder"]["targets"]
    assert {"coordinator", "store", "http", "peer_store"} <= set(targets)
    assert any(name.startswith("catchup_") for name in targets)  # the donors' ports
    for name, t in targets.items():
        assert t["legit_refused"] == 0, (name, t["errors"])
        assert t["legit_ok"] >= 3, name
        assert t["held_max"] >= DEFAULT_POLICY.max_pending_per_source, name  # the flood did hold its share
        assert t["closed_by_listener"] > 0, name  # and the listener shed the rest
    # No thread per flooding connection: the flood holds hundreds, the servers gain a few at most.
    before, during = result["flood"]["before"], result["flood"]["under_flood"]
    for server in before:
        assert during[server]["threads"] <= before[server]["threads"] + 4, server
    assert {"launcher", "peer_store"} <= set(during)
