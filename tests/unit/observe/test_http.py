"""/metrics and /api/state from a run directory's events and rows: the figures, the names, the
token. The server is real (loopback); the job is a written event log."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from unbroken.observe import schema as ev
from unbroken.observe.events import EventLog
from unbroken.observe.http import ObserveServer, read_token
from unbroken.observe.live import JobView

KEY = b"k" * 32


def _write_job(run_dir: Path) -> None:
    log = EventLog(run_dir / "events.jsonl", "launcher")
    t = 1000.0
    log.emit(ev.JobStarted(t=t, replicas=2, spares=0, schedule=[], coordinator="127.0.0.1:1"))
    log.emit(ev.Quorum(t=t + 1, epoch=1, step=0, members=[0, 1]))
    for r in (0, 1):
        log.emit(ev.ReplicaState(t=t + 1, replica=r, old="warming_up", new="training", reason="member"))
    log.emit(ev.FaultInjected(t=t + 5, fault=0, fault_kind="crash", replica=1, pid=42))
    log.emit(ev.ProcessExited(t=t + 5.5, replica=1, rank=0, pid=42, exitcode=-9, action="restart"))
    log.emit(ev.ReplicaState(t=t + 5.5, replica=1, old="training", new="failed", reason="exit"))
    log.emit(
        ev.RestartDecision(
            t=t + 5.5,
            replica=1,
            action="restart",
            delay_s=0.1,
            reason="backoff",
            cause="rank 0 exited",
            decision_ms=1.0,
            failure=ev.FailureCause.PROCESS_EXIT,
        )
    )
    log.emit(ev.ReplicaState(t=t + 6, replica=1, old="failed", new="recovering", reason="restart"))
    log.emit(ev.ReplicaState(t=t + 8, replica=1, old="recovering", new="catching_up", reason="behind"))
    log.emit(ev.ReplicaState(t=t + 9, replica=1, old="catching_up", new="training", reason="caught up"))
    log.emit("verdict", culprit={"replica": 0}, confidence=0.9, **{"class": "straggler"})
    port = {"host": "h1", "interface": "eth0", "peer": 2, "failures": 1, "state": "failing"}
    log.emit("verdict", culprit={"replica": 1}, confidence=0.7, evidence=port, **{"class": "port_failure"})
    port = {**port, "failures": 3, "state": "flapping"}
    log.emit("verdict", culprit={"replica": 1}, confidence=0.9, evidence=port, **{"class": "port_failure"})
    for step in (10, 20):
        log.emit(ev.CheckpointSaved(t=t + step, replica=0, rank=0, step=step, stall_s=0.003, nbytes=1000))
    log.emit(ev.CheckpointPersisted(t=t + 11, replica=0, rank=0, step=10, ok=True, persist_s=0.4, nbytes=1000))
    log.emit(ev.CheckpointPersisted(t=t + 21, replica=0, rank=0, step=20, ok=False, persist_s=0.0, nbytes=1000))
    log.emit(ev.CaughtUp(t=t + 8.5, replica=1, rank=0, step=6, seconds=0.7, nbytes=5000))
    log.close()
    for r in (0, 1):
        rows = [{"t": t + 1 + s, "step": s, "loss": 4.0 - s / 10, "committed": True, "step_s": 0.5} for s in range(10)]
        (run_dir / f"metrics-r{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))


def _get(url: str, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture
def server(tmp_path: Path) -> Any:
    _write_job(tmp_path)
    status = {"epoch": 4, "members": [0, 1], "replicas": {"0": {"step": 9, "compute_s": 0.4}, "1": {"step": 9}}}
    srv = ObserveServer("127.0.0.1", 0, JobView(tmp_path), lambda: status, read_token(KEY)).start()
    yield srv
    srv.close()


def test_metrics_follow_prometheus_names_and_count_what_the_events_say(server: ObserveServer) -> None:
    code, body = _get(f"http://{server.address}/metrics", server.token)
    assert code == 200
    text = body.decode()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}
    assert samples["unbroken_job_step"] == 9 and samples["unbroken_quorum_epoch"] == 4
    assert samples["unbroken_replicas"] == 2 and samples["unbroken_replicas_healthy"] == 2
    assert samples['unbroken_replica_step_seconds{replica="0"}'] == 0.4
    assert samples['unbroken_replica_state{replica="1",state="training"}'] == 1
    assert samples['unbroken_restarts_total{cause="process_exit"}'] == 1
    assert samples['unbroken_verdicts_total{class="straggler"}'] == 1
    assert samples['unbroken_port_failures{host="h1",interface="eth0",peer="2",state="flapping"}'] == 3
    assert not any("failing" in k for k in samples if k.startswith("unbroken_port_failures"))  # the latest state only
    assert samples["unbroken_detection_seconds_count"] == 1 and samples["unbroken_detection_seconds_sum"] == 0.5
    assert samples["unbroken_recovery_seconds_sum"] == pytest.approx(3.5)  # failed at +5.5, training at +9
    assert samples['unbroken_recovery_seconds_bucket{le="5"}'] == 1
    assert 0 < samples["unbroken_goodput_ratio"] <= 1
    assert samples['unbroken_lost_replica_seconds{category="catch_up"}'] == pytest.approx(1.0)
    assert samples["unbroken_checkpoint_stall_seconds_count"] == 2
    assert samples['unbroken_checkpoint_stall_seconds_bucket{le="0.005"}'] == 2
    assert samples["unbroken_checkpoint_snapshot_bytes_total"] == 2000
    assert samples['unbroken_checkpoint_persists_total{outcome="ok"}'] == 1
    assert samples['unbroken_checkpoint_persists_total{outcome="failed"}'] == 1
    assert samples["unbroken_checkpoint_persisted_bytes_total"] == 1000  # the failed write's are not on disk
    assert samples["unbroken_checkpoint_persist_seconds_sum"] == pytest.approx(0.4)
    assert samples["unbroken_catch_up_transfer_seconds_sum"] == pytest.approx(0.7)
    assert samples["unbroken_catch_up_bytes_total"] == 5000


def test_the_state_shows_the_replicas_history_and_the_timeline(server: ObserveServer) -> None:
    code, body = _get(f"http://{server.address}/api/state", server.token)
    state = json.loads(body)
    assert code == 200
    (r1,) = [r for r in state["replicas"] if r["replica"] == 1]
    assert r1["history"] == ["training", "failed", "recovering", "catching_up", "training"]
    assert [e["kind"] for e in state["timeline"]] == ["quorum", "fault_injected", "process_exited"] + ["verdict"] * 3
    assert state["ports"] == [{"host": "h1", "interface": "eth0", "peer": 2, "state": "flapping", "failures": 3}]
    assert [p[0] for p in state["series"]["0"]] == list(range(10))


def test_data_needs_the_token_and_the_page_does_not(server: ObserveServer) -> None:
    for path in ("/metrics", "/api/state"):
        assert _get(f"http://{server.address}{path}")[0] == 401
        assert _get(f"http://{server.address}{path}", "0" * 32)[0] == 401
    assert _get(f"http://{server.address}/api/state?token={server.token}")[0] == 200
    code, page = _get(f"http://{server.address}/")
    assert code == 200 and b"dashboard.js" in page
    assert _get(f"http://{server.address}/dashboard.js")[0] == 200
    assert server.token == read_token(KEY) != read_token(b"x" * 32)
    assert server.url.endswith(f"/?token={server.token}") and server.address.startswith("127.0.0.1:")


def test_a_restarted_replica_redoing_steps_does_not_draw_backwards(tmp_path: Path) -> None:
    view = JobView(tmp_path, replicas=1)
    rows = [(0, 1.0), (1, 0.9), (2, 0.8), (1, 0.95), (2, 0.85)]  # a restart redid steps 1 and 2
    (tmp_path / "metrics-r0.jsonl").write_text(
        "".join(json.dumps({"t": 1.0, "step": s, "loss": x, "committed": True, "step_s": 0.1}) + "\n" for s, x in rows)
        + '{"t": 2.0, "step": 3'  # a torn line: read once complete
    )
    view.refresh()
    assert [(s, x) for s, x, _ in view.points[0]] == [(0, 1.0), (1, 0.95), (2, 0.85)]
    with open(tmp_path / "metrics-r0.jsonl", "a") as f:
        f.write(', "loss": 0.7, "committed": true, "step_s": 0.1}\n')
    view.refresh()
    assert view.points[0][-1][:2] == (3, 0.7)


def test_every_metric_the_sample_grafana_dashboard_plots_is_served(server: ObserveServer) -> None:
    dashboard = Path(__file__).parents[3] / "docs" / "grafana-dashboard.json"
    exprs = [t["expr"] for p in json.loads(dashboard.read_text())["panels"] for t in p.get("targets", [])]
    plotted = {m for e in exprs for m in re.findall(r"unbroken_\w+", e)}
    _, body = _get(f"http://{server.address}/metrics", server.token)
    served = {line.split("{")[0].split(" ")[0] for line in body.decode().splitlines() if line[:1] != "#"}
    assert plotted and plotted <= served, sorted(plotted - served)
