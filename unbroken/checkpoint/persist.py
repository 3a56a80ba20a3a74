"""The persist process: writes snapshots to disk (and to a peer) so the trainer never does.

A process rather than a thread because a Python thread that copies, checksums and writes
gigabytes fights the training thread for the GIL (thread-based savers are known to halve
throughput). The trainer and this process share the snapshot pages: each buffer's memfd is
passed once over a Unix socket, and a job is then a small JSON message naming a buffer. The
process exits when the socket closes, so a dead trainer never leaves it behind. It does not
import torch, so it starts in a fraction of a second and costs little memory.
"""

from __future__ import annotations

import base64
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from unbroken.checkpoint.storage import disk, retention
from unbroken.checkpoint.storage.manifest import ShardManifest, is_complete
from unbroken.wire.framing import FrameError, recv_exact

_MAX_FDS = 4


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    """Send one length-prefixed JSON message, with file descriptors attached if given."""
    payload = json.dumps(message).encode()
    head = len(payload).to_bytes(8, "little")
    if fds:
        socket.send_fds(sock, [head], fds)
    else:
        sock.sendall(head)
    sock.sendall(payload)


def recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """Receive one message and any descriptors; None when the other side has gone."""
    data, fds, _, _ = socket.recv_fds(sock, 8, _MAX_FDS)
    if not data:
        return None
    try:
        head = bytes(data) + bytes(recv_exact(sock, 8 - len(data)))
        body = recv_exact(sock, int.from_bytes(head, "little"))
    except FrameError:
        return None
    return json.loads(body), list(fds)


def _persist(job: dict[str, Any], buffers: dict[int, mmap.mmap]) -> dict[str, Any]:
    manifest = ShardManifest.from_json(job["manifest"])
    objects = base64.b64decode(job["objects"])
    root = job["root"]
    started = time.monotonic()
    reply: dict[str, Any] = {"op": "done", "slot": job["slot"], "step": manifest.step}
    try:
        done = disk.write_shard(
            root, manifest, objects, memoryview(buffers[job["slot"]]), rate_bytes_s=job.get("rate_bytes_s")
        )
        reply["durable_s"] = time.monotonic() - started
        if is_complete(disk.committed_shards(root, manifest.step), manifest.world_size):
            disk.update_latest(root, manifest.step)
            reply["deleted"] = retention.apply(root, job["keep_last"])
        reply.update(ok=True, crcs={t.name: t.crc32 for t in done.tensors})
    except OSError as exc:
        reply.update(
            ok=False,
            error=f"writing step {manifest.step} to {root} failed: "
            f"{exc.strerror or exc} (errno {exc.errno}); "
            "the previous checkpoint is intact",
        )
        return reply
    if job.get("peer"):
        from unbroken.checkpoint.peer import PeerClient
        from unbroken.wire.auth import JobSecret

        try:
            host, port = job["peer"]
            secret = JobSecret(bytes.fromhex(job["peer_key"]))
            PeerClient(host, port, secret).put(
                job["owner"], done, objects, memoryview(buffers[job["slot"]])[: done.data_len]
            )
            reply["peer_s"] = time.monotonic() - started - reply["durable_s"]
        except (OSError, ValueError, TypeError) as exc:
            reply["peer_error"] = f"peer copy failed: {exc}"
    return reply


def serve(sock: socket.socket) -> None:
    """The persist process's loop: attach buffers, persist jobs one at a time, reply."""
    buffers: dict[int, mmap.mmap] = {}
    while True:
        try:
            got = recv(sock)
        except ConnectionResetError:  # the trainer died with a reply unread
            return
        if got is None or got[0]["op"] == "exit":
            return
        message, fds = got
        if message["op"] == "attach":
            old = buffers.pop(message["slot"], None)
            if old is not None:
                old.close()
            buffers[message["slot"]] = mmap.mmap(fds[0], message["size"], prot=mmap.PROT_READ)
            os.close(fds[0])
        elif message["op"] == "persist":
            reply = _persist(message, buffers)
            try:
                send(sock, reply)
            except (BrokenPipeError, ConnectionResetError):
                return  # the trainer is gone (killed, or cut off by a time limit): what was written stays


class PersistProcess:
    """The trainer's handle on the persist process: start, attach buffers, submit, stop."""

    def __init__(self, on_message: Callable[[dict[str, Any]], None]) -> None:
        self._on_message = on_message
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        # Started with SIGTERM blocked (a signal mask survives fork and exec), so that a SIGTERM
        # to the trainer's process group while this interpreter starts up, before it can ignore
        # the signal, does not kill the writer of the trainer's last flush.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "unbroken.checkpoint.persist", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="unbroken-persist-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None and self._reader.is_alive()

    def attach(self, slot: int, fd: int, size: int) -> None:
        with self._lock:
            send(self._sock, {"op": "attach", "slot": slot, "size": size}, [fd])

    def submit(self, job: dict[str, Any]) -> None:
        with self._lock:
            send(self._sock, {"op": "persist", **job})

    def _read(self) -> None:
        while True:
            try:
                got = recv(self._sock)
            except OSError:
                got = None
            if got is None:
                self._on_message({"op": "died", "returncode": self.proc.poll()})
                return
            self._on_message(got[0])

    def close(self, timeout: float = 30.0) -> None:
        try:
            with self._lock:
                send(self._sock, {"op": "exit"})
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._sock.close()
        self._reader.join(timeout=5)


if __name__ == "__main__":
    # Yield the CPU to training: when both want a core the trainer's threads win, so persisting
    # slows training little; when the trainer is idle the disk still gets full speed.
    os.nice(10)
    # SIGTERM to the trainer's process group (a preemption) must not cut the flush short: this
    # process ends when the trainer closes the socket, after the last write.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # blocked by the trainer at the start
    serve(socket.socket(fileno=int(sys.argv[1])))
