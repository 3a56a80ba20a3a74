"""A one-node replica group's Gloo pairs listen on loopback, whatever the host name resolves to.

Each rank is a real process in its own UTS namespace whose host name is this machine's
non-loopback address: what Gloo binds by default (it resolves the host name), and what a
machine whose name resolves to its network address gives every job. The ranks build the
default group as ``Manager`` does (:func:`init_gloo_group` over the authenticated store), then
report their listening sockets.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


CHILD = r"""
import json, os, sys, socket
from unbroken.train.replica_group import init_gloo_group, rendezvous_store
from unbroken.wire.auth import JobSecret
import torch, torch.distributed as dist
rank, port, key = int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3])
store, server = rendezvous_store(f"127.0.0.1:{port}", JobSecret(key), rank == 0, timeout_s=30)
init_gloo_group("gloo", store, rank, 2, "127.0.0.1")
t = torch.ones(4)
dist.all_reduce(t)
inodes = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue  # the directory listing's own descriptor
    if link.startswith("socket:["):
        inodes.add(int(link[8:-1]))
listening = []
for line in open("/proc/net/tcp").readlines()[1:]:
    f = line.split()
    if f[3] == "0A" and int(f[9]) in inodes:  # LISTEN, one of ours
        ip = socket.inet_ntoa(bytes.fromhex(f[1].split(":")[0])[::-1])
        listening.append(ip)
print(json.dumps({"sum": float(t[0]), "listening": listening, "hostname": socket.gethostname()}))
dist.barrier()
dist.destroy_process_group()
if server is not None:
    server.close()
"""


def external_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.254", 9))  # no packet is sent: the kernel picks the route
            addr = str(s.getsockname()[0])
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or external_address() is None,
    reason="needs root, unshare(1) and a non-loopback address",
)
def test_gloo_pairs_listen_on_loopback_even_when_the_host_name_resolves_elsewhere(tmp_path: Path) -> None:
    addr = external_address()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = os.urandom(32).hex()
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3])
    procs = [
        subprocess.Popen(
            [
                "unshare",
                "--uts",
                "sh",
                "-c",
                f'hostname {addr} && exec "$0" -c "$1" {r} {port} {key}',
                sys.executable,
                CHILD,
            ],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outs
    for out in outs:
        got = json.loads(out.strip().splitlines()[-1])
        assert got["hostname"] == addr and got["sum"] == 2.0
        assert got["listening"] and all(ip.startswith("127.") for ip in got["listening"]), got
