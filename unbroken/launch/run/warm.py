"""A warm worker: a Python process that has already imported torch, waiting to become a replica.

Restarting a replica on a busy machine is dominated by the interpreter start and ``import
torch`` (seconds on a loaded CPU). The supervisor keeps one of these ready; a restart hands it
the replica's environment, log file and script on stdin, and it runs the script as ``__main__``
at once. Used for ``python script.py ...`` and ``python -m module ...`` commands; anything else
is started cold.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

from unbroken.config import python_path


def main() -> None:
    import torch  # noqa: F401  - the point: paid before the replica needs it
    import torch.distributed  # noqa: F401

    import unbroken.train.optimizer  # noqa: F401

    # The first optimizer a process builds imports torch's compiler stack lazily: seconds on
    # a busy machine, measured as most of a warm restart before this line was added.
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).step()

    line = sys.stdin.readline()
    if not line:
        return  # the supervisor ended without needing us
    order = json.loads(line)
    fd = os.open(order["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(order["env"])
    # A fresh interpreter would have put the replica's PYTHONPATH on sys.path (the torchft
    # shim of --torchft-compat is there): entries this process did not start with go first.
    for entry in reversed((python_path(order["env"]) or "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    argv = list(order["argv"])
    if argv[0] == "-m":  # python -m module args...
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
