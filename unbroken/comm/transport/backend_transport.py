"""``UNBROKEN_EXCHANGE=backend`` (the default): the all-reduce of a torch NCCL or Gloo group.

Each epoch gets a fresh group, its backend chosen by :mod:`unbroken.comm.backend` (``auto``:
NCCL when every member holds a distinct GPU, else Gloo carrying the CUDA tensors). Gloo's pair
connections, which carry the all-reduce, cannot be authenticated by us (nor are NCCL's): on a
single-machine job (a loopback store) they bind loopback only; across machines the address on
the route to the store (``GLOO_SOCKET_IFNAME`` picks an interface instead), and the network
between the nodes must be trusted, as for any torch.distributed job.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist

from unbroken.comm import retire
from unbroken.comm.backend import choose_backend, gpu_identity
from unbroken.comm.recorder import FlightRecorder
from unbroken.comm.retire import GroupReaper
from unbroken.comm.transport.base import EpochLink, Running, Transport, allreduce
from unbroken.config import gloo_socket_ifname, is_loopback, local_address_towards, parse_host_port

# Retired NCCL communicators that may wait for their abort while a new one is built: each holds
# GPU memory, and an abort takes about a second (H200, torch 2.11).
NCCL_RETIRED_MOST = 1


class BackendTransport(Transport):
    """The backend's own all-reduce; several sums (a bucket each) may be in flight."""

    name = "backend"
    gathers = True

    def build(self, link: EpochLink) -> tuple[str, Any]:
        backend = epoch_backend(link.backend_setting, link.store, link.rank, link.size, link.device)
        group = make_group(
            backend, link.store, link.rank, link.size, link.store_address, link.device, link.timeout, link.reaper
        )
        return backend, group

    def start(
        self,
        pg: Any,
        tensor: torch.Tensor,
        rank: int,
        size: int,
        wake: threading.Event,
        op: Any,
        recorder: FlightRecorder | None,
    ) -> Running:
        held = allreduce(pg, tensor, op)
        held.future.add_done_callback(lambda _: wake.set())
        return held


def epoch_backend(setting: str, store: Any, rank: int, size: int, device: torch.device) -> str:
    """This epoch's backend; with ``auto`` on CUDA the members first tell each other their GPU."""
    if setting != "auto" or device.type != "cuda":
        return choose_backend(setting, device.type)
    store.set(f"gpu/{rank}", gpu_identity(device))
    identities = [store.get(f"gpu/{r}").decode() for r in range(size)]
    return choose_backend("auto", "cuda", identities)


def make_group(
    backend: str,
    store: Any,
    rank: int,
    size: int,
    store_address: str,
    device: torch.device,
    timeout: datetime.timedelta,
    reaper: GroupReaper,
) -> Any:
    """A torch process group of ``backend`` on ``store`` (what each epoch builds on its thread)."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        bound = reaper.abort_timeout_s
        reaper.settle("nccl", NCCL_RETIRED_MOST, bound)  # GPU memory: a bounded backlog
        with retire.NCCL_LIFECYCLE.hold(bound):  # never beside an abort
            pg = dist.ProcessGroupNCCL(store, rank, size, options)
            if device.type == "cuda" and hasattr(pg, "eager_connect_single_device"):
                # The communicator is made here, on the build thread, not lazily inside the
                # first all-reduce on the training thread; NCCL's refusals surface here.
                index = device.index if device.index is not None else torch.cuda.current_device()
                try:
                    pg.eager_connect_single_device(torch.device("cuda", index))
                except BaseException:
                    reaper.retire(pg, "nccl", None, ())  # aborted and released off this thread
                    raise
        return pg
    return dist.ProcessGroupGloo(store, rank, size, gloo_options(store_address, timeout))


def gloo_options(store_address: str, timeout: datetime.timedelta) -> Any:
    """Gloo's options: its pairs listen on loopback when the job is on one machine (the store,
    hosted by the coordinator, is on loopback), never on every interface of the host."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stub lacks _Options
    options._timeout = timeout
    host = parse_host_port(store_address, "store address")[0]
    ifname = gloo_socket_ifname()
    if ifname:
        options._devices = [dist.ProcessGroupGloo.create_device(interface=ifname.split(",")[0])]
    elif is_loopback(host):
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    else:
        # Not the default device: it binds what the host name resolves to, often loopback,
        # which the other nodes cannot dial; the address on the route to the store they can.
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(host))]
    return options
