"""The live dashboard in a real browser: a 3-replica job, a kill -9, and the page shows the
replica go failed -> catching_up -> training as it happens. A screenshot is kept. The same job's
``/metrics`` then counts its checkpoints and the catch-up's bytes."""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from tests.integration.browser import CHROMIUM, Browser
from tests.integration.harness import Job

pytestmark = pytest.mark.integration


def _dashboard_url(job: Job, timeout: float = 30.0) -> str:
    log = job.run_dir.parent / f"{job.run_dir.name}-launcher.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"dashboard (http://\S+)", log.read_text(errors="replace"))
        if found:
            return found.group(1)
        assert job.proc.poll() is None, f"the job ended early with code {job.proc.returncode}"
        time.sleep(0.1)
    raise AssertionError("unbroken run printed no dashboard URL")


def _wait(browser: Browser, expression: str, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if browser.evaluate(expression):
            return
        time.sleep(0.2)
    raise AssertionError(f"the page did not show {what} in {timeout}s")


def _scrape(url: str, timeout: float, ready: Callable[[dict[str, float]], bool]) -> dict[str, float]:
    """``/metrics`` of the dashboard at ``url`` (its ``?token=``), polled until ``ready``."""
    base, token = url.split("?")[0], parse_qs(urlparse(url).query)["token"][0]
    deadline = time.monotonic() + timeout
    while True:
        req = urllib.request.Request(base + "metrics", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            text = resp.read().decode()
        samples = {x.rsplit(" ", 1)[0]: float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x[:1] != "#"}
        if ready(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.5)


def _in_order(seen: list[str], wanted: list[str]) -> bool:
    it = iter(seen)
    return all(any(s == w for s in it) for w in wanted)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (make test installs it when run as root)")
def test_the_dashboard_shows_a_killed_replica_fail_catch_up_and_train_again(tmp_path: Path) -> None:
    extra = ["--http-port", "0", "--checkpoint-dir", str(tmp_path / "ckpt")]
    with Job(tmp_path / "run", replicas=3, steps=400, extra=extra) as job:
        url = _dashboard_url(job)
        base = url.split("?")[0]
        with pytest.raises(urllib.error.HTTPError) as refused:  # the data needs the job's token
            urllib.request.urlopen(base + "api/state", timeout=5)
        assert refused.value.code == 401
        browser = Browser(url, tmp_path / "chromium-profile")
        try:
            row = "document.querySelector('#replica-1')"
            _wait(browser, f"{row} && {row}.dataset.state === 'training'", 60, "replica 1 training")
            os.kill(job.pid(1), signal.SIGKILL)

            def shown() -> list[str]:
                return str(browser.evaluate(f"{row}.querySelector('.history').textContent")).split(" \u2192 ")

            # The page updates by itself (it polls once a second): its history of the replica goes
            # through the whole recovery. Not its current state at some poll: the recovery can be
            # over within a second (0.86 s from the kill to caught up, seen), between two polls.
            recovery = ["failed", "catching_up", "training"]
            deadline = time.monotonic() + 60
            history = shown()
            while time.monotonic() < deadline and not _in_order(history[history.index("training") + 1 :], recovery):
                time.sleep(0.1)
                history = shown()
            state = browser.evaluate(f"{row}.dataset.state")
            shot = browser.screenshot(tmp_path / "dashboard.png")
            print(f"dashboard screenshot: {shot}")
        finally:
            browser.close()
        # Its history, as the page lists it, went through the whole recovery in order, and it
        # shows the replica training again.
        assert _in_order(history[history.index("training") + 1 :], recovery), history
        assert state == "training", (state, history)
        assert shot.stat().st_size > 10_000
        # What the checkpoints and the catch-up cost, as Prometheus sees it (the writes to disk
        # run behind training: wait for one).
        m = _scrape(url, 30, lambda m: m.get('unbroken_checkpoint_persists_total{outcome="ok"}', 0) >= 1)
        assert m["unbroken_checkpoint_stall_seconds_count"] >= 1 and m["unbroken_checkpoint_snapshot_bytes_total"] > 0
        assert m['unbroken_checkpoint_persists_total{outcome="ok"}'] >= 1
        assert m["unbroken_checkpoint_persisted_bytes_total"] > 0
        assert m["unbroken_catch_up_transfer_seconds_count"] >= 1 and m["unbroken_catch_up_bytes_total"] > 0
