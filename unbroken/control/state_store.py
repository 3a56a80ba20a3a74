"""The coordinator's durable state: the highest epoch issued and the event history.

SQLite in the state directory, so a restarted coordinator continues with higher epochs (a
replica can never see an epoch number reused) and the history survives.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any


class StateStore:
    """Epochs and events of one job, in ``state_dir/coordinator.sqlite``."""

    def __init__(self, state_dir: str | Path) -> None:
        path = Path(state_dir)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create the coordinator state directory {path}: {e}") from e
        self.path = path / "coordinator.sqlite"
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS epochs (epoch INTEGER PRIMARY KEY, step INTEGER, "
            "members TEXT, behind TEXT, t REAL)"
        )
        self._db.execute("CREATE TABLE IF NOT EXISTS events (t REAL, kind TEXT, data TEXT)")

    def max_epoch(self) -> int:
        row = self._db.execute("SELECT MAX(epoch) FROM epochs").fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def record_epoch(self, epoch: int, step: int, members: list[int], behind: list[int]) -> None:
        self._db.execute(
            "INSERT INTO epochs VALUES (?, ?, ?, ?, ?)",
            (epoch, step, json.dumps(members), json.dumps(behind), time.time()),
        )

    def record_event(self, event: dict[str, Any]) -> None:
        self._db.execute(
            "INSERT INTO events VALUES (?, ?, ?)",
            (event.get("t", time.time()), event.get("kind", ""), json.dumps(event, default=str)),
        )

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(r[0]) for r in self._db.execute("SELECT data FROM events ORDER BY t")]

    def close(self) -> None:
        self._db.close()
