"""The lease on real filesystems that lie: coarse timestamps, slow metadata, stalls, errors.

Real processes (an active ``unbroken coordinator`` and a ``--standby``) on a FAT image mounted
by fusefat (2 s timestamps, no hard links) and a loop-mounted ext4 made with ``-I 128`` (whole
seconds), under a FUSE layer that adds latency, stalls every call or fails them with EIO
(:mod:`unbroken.bench.control_plane.faultfs`). The harness is ``unbroken bench lease``'s own. Needs root and
``make lease-fs``; skipped, saying what is missing, elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.bench.control_plane import lease_filesystems as bench
from unbroken.control.coordinator_cli import STEPPED_DOWN
from unbroken.control.state.lease import EXIT_LEASE_STORE

pytestmark = pytest.mark.integration
TARGET_S = bench.TAKEOVER_TARGET_S + 1.0  # a loaded 2-core machine


def need(fs: str, fuse: bool) -> None:
    why = bench.missing_tools(fs, fuse)
    if why is not None:
        pytest.skip(f"{fs}: {why}")


@pytest.mark.scenario  # 10 s: `make test` keeps the ext4 and etcd ones
def test_a_live_holder_on_fat_with_slow_metadata_is_never_deposed_and_a_stopped_one_is(tmp_path: Path) -> None:
    need("vfat", fuse=True)
    row = bench.live("vfat", tmp_path, renewals=24, delay_s=0.005)
    assert row["takeovers_of_a_live_holder"] == 0, row
    assert row["holder_renewals_seen"] >= 12, row  # renewals the standby saw, 2 s timestamps or not
    assert row["sigstop_to_standby_answer_s"] is not None and row["sigstop_to_standby_answer_s"] < TARGET_S, row
    assert row["woken_holder_exit"] == STEPPED_DOWN, row


def test_a_failing_store_ends_the_holder_with_its_code_and_the_standby_answers(tmp_path: Path) -> None:
    need("ext4-128", fuse=True)
    row = bench.store_fails("ext4-128", tmp_path)
    assert row["exit_code"] == EXIT_LEASE_STORE, row
    assert row["failure_to_exit_s"] < 2 * bench.DEFAULT_LEASE_S + 0.5, row  # two lease periods, and a poll
    assert row["failure_to_standby_answer_s"] is not None and row["failure_to_standby_answer_s"] < TARGET_S, row


@pytest.mark.scenario
@pytest.mark.parametrize("fs", ["ext4-128", "vfat"])
def test_a_stall_shorter_than_the_lease_drops_and_evicts_no_one(tmp_path: Path, fs: str) -> None:
    need(fs, fuse=True)
    row = bench.stall(fs, tmp_path, stall_s=0.5)
    assert row["connections_dropped"] == 0 and row["replicas_evicted"] == 0 and not row["took_over"], row


@pytest.mark.scenario
def test_a_live_holder_on_whole_second_ext4_is_never_deposed(tmp_path: Path) -> None:
    need("ext4-128", fuse=False)
    row = bench.live("ext4-128", tmp_path, renewals=60, delay_s=0.0)
    assert row["takeovers_of_a_live_holder"] == 0 and row["holder_renewals_seen"] >= 40, row


def test_etcd_killed_ends_the_holder_and_the_standby_takes_over_once_it_is_back(tmp_path: Path) -> None:
    need("etcd", fuse=False)
    row = bench.store_fails("etcd", tmp_path, etcd_down_s=3.0)
    assert row["exit_code"] == EXIT_LEASE_STORE, row
    assert row["failure_to_exit_s"] < 2 * bench.DEFAULT_LEASE_S + 0.5, row
    back = row["failure_to_standby_answer_s"]
    assert back is not None and back - row["etcd_down_s"] < TARGET_S, row  # taken over once etcd answers


@pytest.mark.scenario
def test_etcd_holds_a_live_holder_survives_a_stalled_etcd_and_fails_a_stopped_holder_over(tmp_path: Path) -> None:
    need("etcd", fuse=False)
    (tmp_path / "live").mkdir()
    row = bench.live("etcd", tmp_path / "live", renewals=40, delay_s=0.0)
    assert row["takeovers_of_a_live_holder"] == 0 and row["holder_renewals_seen"] >= 30, row
    assert row["sigstop_to_standby_answer_s"] is not None and row["sigstop_to_standby_answer_s"] < TARGET_S, row
    (tmp_path / "stall").mkdir()
    row = bench.stall("etcd", tmp_path / "stall", stall_s=0.5)
    assert row["connections_dropped"] == 0 and row["replicas_evicted"] == 0 and not row["took_over"], row


@pytest.mark.scenario
@pytest.mark.parametrize("store", ["tmp", "etcd"])
def test_forced_takeovers_never_let_two_coordinators_answer(tmp_path: Path, store: str) -> None:
    need(store, fuse=False)
    row = bench.forced_takeovers(store, tmp_path, takeovers=5)
    assert row["answers_of_an_older_term"] == 0 and row["clients_terms_in_order"], row
    assert row["stepped_down"] == 5 and row["missed_takeovers"] == 0 and not row["client_errors"], row
    assert len(row["terms_answered_in"]) >= 5, row  # answered in each term: the clients followed


def test_answers_out_of_term_order_are_counted() -> None:
    assert bench.terms_out_of_order([(0.0, 1), (1.0, 2), (2.0, 2), (3.0, 3)]) == 0
    assert bench.terms_out_of_order([(0.0, 1), (2.0, 1), (1.0, 2), (3.0, 3)]) == 1  # term 1 answered after 2
