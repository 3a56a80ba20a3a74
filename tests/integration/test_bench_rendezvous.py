"""``unbroken bench rendezvous`` end to end, small: each epoch's group meets on its leader's store.

Three member processes rebuild a real Gloo group every epoch on the store of the epoch's leader
(one store per simulated node): every member's requests of an epoch land on that store and no
other, and every epoch's all-reduce sums what it must (the worker fails otherwise). The one-store
rate is measured on a few connections. No timing is asserted (a busy machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import python_env
from unbroken.bench.control_plane.rendezvous import requests_per_rank

pytestmark = pytest.mark.integration


def test_each_epoch_s_group_meets_on_its_leader_s_store_and_the_one_store_rate_is_measured(tmp_path: Path) -> None:
    out = tmp_path / "rendezvous.json"
    args = ["--members", "3", "--ranks-per-node", "2", "--epochs", "2", "--period-s", "2"]
    args += ["--clients", "4", "--ranks", "40"]
    done = subprocess.run(
        [sys.executable, "-m", "unbroken", "bench", "rendezvous", *args, "--out", str(out)],
        env=python_env(),
        capture_output=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    result = json.loads(out.read_text())
    group, central = result["group"], result["central"]
    # Epochs 1 and 2 meet on the stores of members 1 % 3 and 2 % 3 (leader turned with the epoch):
    # theirs hold every member's rendezvous, the third none.
    assert group["requests_per_store"] == [0, 3 * requests_per_rank(3), 3 * requests_per_rank(3)]
    assert len(group["rebuild_s"]) == 2 and all(s > 0 for s in group["rebuild_s"])
    assert central["requests"] == 40 * requests_per_rank(3) and central["requests_per_s"] > 0
    # A leader node's store serves the members of the 2 groups it leads, at once.
    node = result["node"]
    assert node["groups"] == 2 and node["clients"] == node["ranks"] == 6
    assert node["requests"] == 6 * requests_per_rank(3)
    assert result["rebuild_at_scale_s"] == pytest.approx(group["rebuild_s_max"] + node["wall_s"], abs=1e-3)
