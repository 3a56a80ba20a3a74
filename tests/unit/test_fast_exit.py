"""The fast exit keeps what an ordinary exit keeps for the processes that install it: garbage with
finalizers is finalized and files held by modules' globals are flushed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HOLDER = """
import sys

class Holder:
    pass

log = open(sys.argv[2], "w")
log.write("in a module global")
"""

MAIN = """
import sys
from unbroken import fast_exit
fast_exit.install()
fast_exit.install()

def main():
    class Marker:
        def __del__(self):
            with open(sys.argv[1], "w") as out:
                out.write("finalized")

    m = Marker()
    m.me = m

import holder
main()
"""


def test_garbage_is_finalized_and_module_files_are_flushed(tmp_path: Path) -> None:
    (tmp_path / "holder.py").write_text(HOLDER)
    (tmp_path / "main.py").write_text(MAIN)
    a, b = tmp_path / "a", tmp_path / "b"
    env = {"PYTHONPATH": f"{Path(__file__).parents[2]}:{tmp_path}"}
    done = subprocess.run(
        [sys.executable, str(tmp_path / "main.py"), str(a), str(b)], env=env, timeout=60, capture_output=True
    )
    assert done.returncode == 0, done.stderr
    assert a.read_text() == "finalized"
    assert b.read_text() == "in a module global"
