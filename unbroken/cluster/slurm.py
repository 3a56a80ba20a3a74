"""A real Slurm in the cluster box: ``slurmctld`` on ``ctl``, one ``slurmd`` per host, one ``munged``.

The README's Slurm example is only true if it runs under a real ``slurmd``: ``srun`` lines that
look right can still be killed with the job when a node dies. So this runs Debian's
``slurm-wlm`` (22.05) as a cluster would, without touching anything under ``/etc``:

* one ``munged`` (not in any namespace) with its own key, socket, pid, seed and log files in a
  temporary directory; the namespaces share the filesystem, so every daemon and client reaches
  its socket (``AuthInfo=socket=...``);
* a ``slurm.conf`` and a ``cgroup.conf`` in that directory, found through ``SLURM_CONF``;
  ``cgroup.conf`` names ``cgroup/v1`` because ``ip netns exec`` remounts ``/sys`` and hides the
  machine's cgroup mounts, which makes 22.05's autodetection (it has no "disabled") refuse to
  start ``slurmd``; with ``proctrack/linuxproc`` and ``task/none`` no cgroup is ever used;
* each daemon in a UTS namespace of its own named after its node (``ctl``, ``h0``...): Debian's
  ``slurmd`` is not built for several daemons per machine, and a node's ``slurmd`` finds its
  ``NodeName`` from its host name, as ``unbroken agent`` finds its ``--node``;
* a hosts file naming every node, bind-mounted on ``/etc/hosts`` in the daemons' own mount
  namespace (the one ``ip netns exec`` made): a job's ``$head:$port`` resolves as a cluster's
  DNS would resolve it, and the machine's ``/etc/hosts`` is untouched.

A power cut of a host (:meth:`Box.power_cut`) kills its ``slurmd`` and every ``slurmstepd`` with
the job's processes, as a real one does. :meth:`Slurm.close` ends the daemons it started (by
pid) and removes the temporary directory after copying the logs next to the job's.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from unbroken.cluster.box import Box

DAEMONS = ("munged", "slurmctld", "slurmd", "slurmstepd")
CLIENTS = ("sbatch", "scontrol", "sinfo", "srun")
INSTALL_HINT = "run `make slurm` as root (it runs `apt-get install -y slurm-wlm munge`)"
PARTITION = "box"


class SlurmUnavailable(RuntimeError):
    """Slurm or munge is not installed here."""


def missing() -> str | None:
    """Why a real Slurm cannot run here (what is missing, and what to run), or None."""
    absent = [t for t in (*DAEMONS, *CLIENTS) if shutil.which(t, path=_search_path()) is None]
    if absent:
        return f"{', '.join(absent)} not found; {INSTALL_HINT}"
    return None


def _search_path() -> str:
    # Daemons live in sbin, which a non-login PATH may lack.
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def slurm_conf(box: Box, state: Path, munge_socket: Path) -> str:
    """The cluster's ``slurm.conf``: ``ctl`` runs the controller, every host is a node of one
    partition; no cgroups, no accounting, every file under ``state``."""
    lines = [
        "ClusterName=unbroken-box",
        f"SlurmctldHost=ctl({box.coordinator.addr})",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={state}/ctld",
        f"SlurmdSpoolDir={state}/spool-%n",
        f"SlurmctldPidFile={state}/slurmctld.pid",
        f"SlurmdPidFile={state}/slurmd-%n.pid",
        f"SlurmctldLogFile={state}/slurmctld.log",
        f"SlurmdLogFile={state}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SelectType=select/linear",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmdTimeout=10",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    lines += [f"NodeName={h.name} NodeAddr={h.addr} CPUs=1 State=UNKNOWN" for h in box.hosts.values()]
    lines.append(f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def hosts_file(box: Box) -> str:
    """``/etc/hosts`` as the box's DNS: every node's name and address."""
    rows = ["127.0.0.1 localhost", f"{box.coordinator.addr} ctl"]
    return "\n".join(rows + [f"{h.addr} {h.name}" for h in box.hosts.values()]) + "\n"


def batch_script(run_dir: Path, worker: Sequence[str], replicas: int = 4, min_replicas: int = 3) -> str:
    """The README's sbatch script (docs/operations.md, "Slurm") for the box: the same lines but
    for 1 rank per replica, no GPUs, ``worker`` instead of ``python train.py`` and a run
    directory the harness reads. ``unbroken`` is on the job's ``PATH`` (see :meth:`Slurm.submit`)."""
    nodes = replicas + 1
    return f"""#!/bin/bash
#SBATCH --job-name=unbroken-box
#SBATCH --nodes={nodes}                 # {replicas} replicas + 1 spare node
#SBATCH --ntasks-per-node=1
#SBATCH --no-kill                 # a node's loss does not end the job: unbroken moves its replica
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=29510
run_dir={shlex.quote(str(run_dir))}
unbroken secret new "$run_dir/secret"

srun --nodes=1 --ntasks=1 --nodelist="$head" --overlap \\
  unbroken coordinator --replicas {replicas} --min-replicas {min_replicas} --host 0.0.0.0 --port $port \\
  --state-dir "$run_dir" --secret-file "$run_dir/secret" &
coordinator=$!

srun --ntasks-per-node=1 --overlap --no-kill \\
  unbroken agent --coordinator "$head:$port" --secret-file "$run_dir/secret" --slots 1 \\
  --ranks-per-replica 1 --run-dir "$run_dir" -- {shlex.join(worker)}
status=$?
kill $coordinator
exit $status
"""


def parse_job(text: str) -> dict[str, str]:
    """``scontrol show job -o`` as a dict (``JobState``, ``ExitCode``, ``NodeList``...)."""
    return {m.group(1): m.group(2) for m in re.finditer(r"(\w+)=(\S*)", text)}


class Slurm:
    """``slurmctld``, ``slurmd``s and ``munged`` in ``box``; their logs end in ``logs``. Use as a
    context manager inside the box's (it closes before the box does)."""

    def __init__(self, box: Box, logs: Path) -> None:
        why = missing()
        if why is not None:
            raise SlurmUnavailable(why)
        self.box, self.logs = box, logs
        self.dir = Path(tempfile.mkdtemp(prefix="unbroken-slurm-"))  # short: a unix socket lives here
        self.dir.chmod(0o755)  # munged refuses a socket in a directory that not everyone may enter
        self.conf = self.dir / "slurm.conf"
        # ``unbroken`` on every job's PATH, as ``pip install unbroken`` puts it on a cluster's.
        bin_dir = self.dir / "bin"
        bin_dir.mkdir()
        (bin_dir / "unbroken").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m unbroken "$@"\n')
        (bin_dir / "unbroken").chmod(0o755)
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), "PATH": f"{bin_dir}{os.pathsep}{_search_path()}"}
        self._munged: subprocess.Popen[bytes] | None = None
        self._daemons: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Slurm:
        with contextlib.ExitStack() as undo:
            undo.callback(self.close)  # a start that fails halfway ends what it started
            self.start()
            undo.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, timeout: float = 60.0) -> None:
        d = self.dir
        key, socket = d / "munge.key", d / "munge.socket"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        munge_argv = ["munged", "--foreground", f"--socket={socket}", f"--key-file={key}"]
        munge_argv += [f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"]
        with open(d / "munged.out", "ab") as out:
            self._munged = subprocess.Popen(munge_argv, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        _wait(
            f"munged's socket {socket} (its output: {self.logs}/slurm-daemon-munged.out)",
            socket.exists,
            10,
            self._munged,
        )
        (d / "ctld").mkdir()
        for h in self.box.hosts:
            (d / f"spool-{h}").mkdir()
        self.conf.write_text(slurm_conf(self.box, d, socket))
        (d / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        (d / "hosts").write_text(hosts_file(self.box))
        self._daemons.append(self._daemon("ctl", ["slurmctld", "-D", "-i"]))
        for h in self.box.hosts:
            self._daemons.append(self._daemon(h, ["slurmd", "-D"]))
        _wait("every slurmd to register idle", self._all_idle, timeout)

    def _daemon(self, host: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        """``argv`` on ``host``, in a UTS namespace named ``host`` with the box's hosts file."""
        hosts = shlex.quote(str(self.dir / "hosts"))
        line = f"mount --bind {hosts} /etc/hosts && hostname {host} && exec {shlex.join(argv)}"
        return self.box.spawn(
            host, ["unshare", "--uts", "sh", "-c", line], self.dir / f"{argv[0]}-{host}.out", self.env
        )

    def client(self, host: str, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """A Slurm client command run on ``host`` (bounded)."""
        netns = self.box.host(host).netns
        return subprocess.run(
            ["ip", "netns", "exec", netns, *argv],
            env={**(env or os.environ), **{k: self.env[k] for k in ("SLURM_CONF", "PATH")}},
            capture_output=True,
            text=True,
            timeout=30,
        )

    def _all_idle(self) -> bool:
        for d in self._daemons:
            if d.poll() is not None:
                raise RuntimeError(f"a Slurm daemon exited ({d.args!r}): see {self.logs}/slurm-daemon-*")
        done = self.client("ctl", "sinfo", "-h", "-N", "-o", "%N %t")
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return done.returncode == 0 and set(states) == set(self.box.hosts) and set(states.values()) == {"idle"}

    def submit(self, script: str, host: str, workdir: Path, env: dict[str, str]) -> int:
        """``sbatch`` ``script`` from ``host``; its output in ``workdir/slurm-JOBID.out``."""
        path = workdir / "job.sbatch"
        path.write_text(script)
        argv = ["sbatch", "--parsable", f"--chdir={workdir}", f"--output={workdir}/slurm-%j.out", str(path)]
        done = self.client(host, *argv, env=env)
        if done.returncode:
            raise RuntimeError(f"sbatch failed ({done.returncode}): {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        done = self.client("ctl", "scontrol", "show", "job", "-o", str(job_id))
        return parse_job(done.stdout) if done.returncode == 0 else {}

    def node_state(self, node: str) -> str:
        done = self.client("ctl", "sinfo", "-h", "-n", node, "-o", "%t")
        return done.stdout.strip()

    def wait_node_down(self, node: str, timeout: float) -> bool:
        """Whether Slurm declares ``node`` down within ``timeout`` (polled each second: ``sinfo``
        is a process, and the box has few cores)."""
        deadline = time.monotonic() + timeout
        while not self.node_state(node).startswith("down"):
            if time.monotonic() > deadline:
                return False
            time.sleep(1.0)
        return True

    def wait_job(self, job_id: int, timeout: float) -> dict[str, str]:
        """The job once it left the running states (or as it is when ``timeout`` runs out)."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", None):
                return job
            if time.monotonic() > deadline:
                return job
            time.sleep(0.5)

    def close(self) -> None:
        """Ends the daemons it started (by pid), then copies the logs and removes its directory."""
        for p in self._daemons:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in self._daemons:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        if self._munged is not None:
            self._munged.terminate()
            try:
                self._munged.wait(10)
            except subprocess.TimeoutExpired:
                self._munged.kill()
                self._munged.wait(10)
        self._daemons.clear()
        self._munged = None
        if self.dir.exists():
            self.logs.mkdir(parents=True, exist_ok=True)
            for f in [*self.dir.glob("*.log"), *self.dir.glob("*.out"), self.conf]:
                with contextlib.suppress(OSError):
                    shutil.copy(f, self.logs / f"slurm-daemon-{f.name}")
            shutil.rmtree(self.dir, ignore_errors=True)


def _wait(what: str, ready: Callable[[], bool], timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited ({proc.returncode})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.2)
