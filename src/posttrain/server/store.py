"""The server's durable state in SQLite: sessions, models, futures, checkpoints, samplers.

Every row carries its owner (a hash of the caller's API key); reads take the owner and treat
another owner's rows as absent. One connection, serialised by a lock, in WAL mode: writes are
short transactions, so a failed request never leaves a half-written row behind.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

FutureStatus = Literal["pending", "completed", "failed"]
CheckpointKind = Literal["weights", "sampler", "external"]
SessionState = Literal["live", "finished"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, tags TEXT NOT NULL,
    user_metadata TEXT NOT NULL, sdk_version TEXT, created REAL NOT NULL,
    last_heartbeat REAL NOT NULL, finished TEXT);
CREATE TABLE IF NOT EXISTS models (
    model_id TEXT PRIMARY KEY, owner TEXT NOT NULL, session_id TEXT NOT NULL,
    base_model TEXT NOT NULL, lora TEXT NOT NULL, user_metadata TEXT NOT NULL,
    created REAL NOT NULL, last_request REAL NOT NULL);
CREATE TABLE IF NOT EXISTS futures (
    request_id TEXT PRIMARY KEY, owner TEXT NOT NULL, dedup_key TEXT UNIQUE,
    model_id TEXT, seq_id INTEGER, request_type TEXT NOT NULL, payload_hash TEXT NOT NULL,
    status TEXT NOT NULL, result_json BLOB, result_proto BLOB, error TEXT, category TEXT,
    created REAL NOT NULL, completed REAL);
CREATE TABLE IF NOT EXISTS checkpoints (
    tinker_path TEXT PRIMARY KEY, owner TEXT NOT NULL, model_id TEXT NOT NULL,
    kind TEXT NOT NULL, name TEXT NOT NULL, dir TEXT NOT NULL, user_metadata TEXT NOT NULL,
    size_bytes INTEGER, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS sampling_sessions (
    sampling_session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, session_id TEXT,
    base_model TEXT NOT NULL, model_path TEXT, weights_dir TEXT, lora TEXT,
    created REAL NOT NULL);
"""


@dataclass(frozen=True)
class ModelRow:
    model_id: str
    owner: str
    session_id: str
    base_model: str
    lora: dict[str, int | bool]
    user_metadata: dict[str, str]
    created: float
    last_request: float


@dataclass(frozen=True)
class FutureRow:
    request_id: str
    owner: str
    model_id: str | None
    seq_id: int | None
    request_type: str
    payload_hash: str
    status: FutureStatus
    result_json: bytes | None
    result_proto: bytes | None
    error: str | None
    category: str | None


@dataclass(frozen=True)
class CheckpointRow:
    tinker_path: str
    owner: str
    model_id: str
    kind: CheckpointKind
    name: str
    dir: str
    user_metadata: dict[str, str]
    size_bytes: int | None
    created: float


@dataclass(frozen=True)
class SamplerRow:
    sampling_session_id: str
    owner: str
    session_id: str | None
    base_model: str
    model_path: str | None
    weights_dir: str | None
    lora: dict[str, int | bool] | None  # None: the base model's own weights


class DuplicateRequest(Exception):
    """A submission reuses a dedup key; `.existing` is the future that holds it."""

    def __init__(self, existing: FutureRow) -> None:
        super().__init__(existing.request_id)
        self.existing = existing


class Store:
    def __init__(self, path: str | Path) -> None:
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA busy_timeout=30000")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _one(self, sql: str, *args: object) -> sqlite3.Row | None:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def _all(self, sql: str, *args: object) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # sessions
    def add_session(
        self, session_id: str, owner: str, tags: list[str], metadata: dict[str, object], sdk: str
    ) -> None:
        now = time.time()
        with self.transaction() as db:
            db.execute(
                "INSERT INTO sessions VALUES (?,?,?,?,?,?,?,NULL)",
                (session_id, owner, json.dumps(tags), json.dumps(metadata), sdk, now, now),
            )

    def session_state(self, session_id: str, owner: str) -> SessionState | None:
        row = self._one(
            "SELECT finished FROM sessions WHERE session_id=? AND owner=?", session_id, owner
        )
        if row is None:
            return None
        return "live" if row["finished"] is None else "finished"

    def touch_session(self, session_id: str, owner: str, finished: str | None = None) -> bool:
        with self.transaction() as db:
            cursor = db.execute(
                "UPDATE sessions SET last_heartbeat=?, finished=COALESCE(?, finished) "
                "WHERE session_id=? AND owner=?",
                (time.time(), finished, session_id, owner),
            )
            return cursor.rowcount == 1

    def expire_sessions(self, cutoff: float) -> list[str]:
        """Mark live sessions without a heartbeat since `cutoff` finished; their ids."""
        with self.transaction() as db:
            rows = db.execute(
                "SELECT session_id FROM sessions WHERE finished IS NULL AND last_heartbeat < ?",
                (cutoff,),
            ).fetchall()
            ids = [r["session_id"] for r in rows]
            db.executemany(
                "UPDATE sessions SET finished='expired' WHERE session_id=?", [(i,) for i in ids]
            )
            return ids

    # models
    def add_model(self, row: ModelRow) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT INTO models VALUES (?,?,?,?,?,?,?,?)",
                (
                    *(row.model_id, row.owner, row.session_id, row.base_model),
                    *(json.dumps(row.lora), json.dumps(row.user_metadata)),
                    *(row.created, row.last_request),
                ),
            )

    def model(self, model_id: str, owner: str) -> ModelRow | None:
        row = self._one("SELECT * FROM models WHERE model_id=? AND owner=?", model_id, owner)
        return _model_row(row) if row else None

    def models(self, owner: str) -> list[ModelRow]:
        rows = self._all("SELECT * FROM models WHERE owner=? ORDER BY created DESC", owner)
        return [_model_row(r) for r in rows]

    def touch_model(self, model_id: str) -> None:
        with self.transaction() as db:
            db.execute("UPDATE models SET last_request=? WHERE model_id=?", (time.time(), model_id))

    # futures
    def add_future(
        self,
        request_id: str,
        owner: str,
        request_type: str,
        payload_hash: str,
        *,
        dedup_key: str | None = None,
        model_id: str | None = None,
        seq_id: int | None = None,
    ) -> None:
        """Insert a pending future; DuplicateRequest if `dedup_key` is taken (by any owner)."""
        with self.transaction() as db:
            if dedup_key is not None:
                row = db.execute("SELECT * FROM futures WHERE dedup_key=?", (dedup_key,)).fetchone()
                if row is not None:
                    raise DuplicateRequest(_future_row(row))
            db.execute(
                "INSERT INTO futures (request_id, owner, dedup_key, model_id, seq_id, "
                "request_type, payload_hash, status, created) VALUES (?,?,?,?,?,?,?,?,?)",
                (
                    *(request_id, owner, dedup_key, model_id, seq_id, request_type),
                    *(payload_hash, "pending", time.time()),
                ),
            )

    def complete_future(
        self, request_id: str, result_json: bytes | None, result_proto: bytes | None = None
    ) -> None:
        with self.transaction() as db:
            db.execute(
                "UPDATE futures SET status='completed', result_json=?, result_proto=?, "
                "completed=? WHERE request_id=? AND status='pending'",
                (result_json, result_proto, time.time(), request_id),
            )

    def fail_future(self, request_id: str, error: str, category: str) -> None:
        with self.transaction() as db:
            db.execute(
                "UPDATE futures SET status='failed', error=?, category=?, completed=? "
                "WHERE request_id=? AND status='pending'",
                (error, category, time.time(), request_id),
            )

    def future(self, request_id: str, owner: str) -> FutureRow | None:
        row = self._one("SELECT * FROM futures WHERE request_id=? AND owner=?", request_id, owner)
        return _future_row(row) if row else None

    def tenant(self, request_id: str) -> str | None:
        """Whose compute a request uses: the session of its model or sampling session, else
        "owner:" and its owner's key hash (None: no such request). `Runtime.tenant_of`."""
        row = self._one(
            "SELECT f.owner, COALESCE(m.session_id, s.session_id) AS session FROM futures f "
            "LEFT JOIN models m ON m.model_id = f.model_id "
            "LEFT JOIN sampling_sessions s ON s.sampling_session_id = f.model_id "
            "WHERE f.request_id=?",
            request_id,
        )
        if row is None:
            return None
        return row["session"] or f"owner:{row['owner']}"

    def fail_pending(self, error: str) -> int:
        """Mark every pending future failed (on start: their work died with the old process)."""
        with self.transaction() as db:
            cursor = db.execute(
                "UPDATE futures SET status='failed', error=?, category='server', completed=? "
                "WHERE status='pending'",
                (error, time.time()),
            )
            return cursor.rowcount

    # checkpoints
    def add_checkpoint(self, row: CheckpointRow) -> None:
        """Insert or replace (a save under an existing name overwrites it)."""
        with self.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO checkpoints VALUES (?,?,?,?,?,?,?,?,?)",
                (
                    *(row.tinker_path, row.owner, row.model_id, row.kind, row.name, row.dir),
                    *(json.dumps(row.user_metadata), row.size_bytes, row.created),
                ),
            )

    def checkpoint(self, tinker_path: str, owner: str) -> CheckpointRow | None:
        row = self._one(
            "SELECT * FROM checkpoints WHERE tinker_path=? AND owner=?", tinker_path, owner
        )
        return _checkpoint_row(row) if row else None

    def checkpoints(self, owner: str, model_id: str | None = None) -> list[CheckpointRow]:
        if model_id is None:
            rows = self._all("SELECT * FROM checkpoints WHERE owner=? ORDER BY created", owner)
        else:
            rows = self._all(
                "SELECT * FROM checkpoints WHERE owner=? AND model_id=? ORDER BY created",
                owner,
                model_id,
            )
        return [_checkpoint_row(r) for r in rows]

    def delete_checkpoint(self, tinker_path: str, owner: str) -> bool:
        with self.transaction() as db:
            cursor = db.execute(
                "DELETE FROM checkpoints WHERE tinker_path=? AND owner=?", (tinker_path, owner)
            )
            return cursor.rowcount == 1

    # sampling sessions
    def add_sampler(self, row: SamplerRow) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT INTO sampling_sessions VALUES (?,?,?,?,?,?,?,?)",
                (
                    *(row.sampling_session_id, row.owner, row.session_id, row.base_model),
                    *(row.model_path, row.weights_dir),
                    *(None if row.lora is None else json.dumps(row.lora), time.time()),
                ),
            )

    def sampler(self, sampling_session_id: str, owner: str) -> SamplerRow | None:
        row = self._one(
            "SELECT * FROM sampling_sessions WHERE sampling_session_id=? AND owner=?",
            sampling_session_id,
            owner,
        )
        return None if row is None else _sampler_row(row)

    def ephemeral_samplers(self, session_id: str) -> list[SamplerRow]:
        """The session's snapshot samplers: weights of their own, no checkpoint path."""
        rows = self._all(
            "SELECT * FROM sampling_sessions WHERE session_id=? AND model_path IS NULL "
            "AND weights_dir IS NOT NULL",
            session_id,
        )
        return [_sampler_row(r) for r in rows]


def _sampler_row(row: sqlite3.Row) -> SamplerRow:
    return SamplerRow(
        sampling_session_id=row["sampling_session_id"],
        owner=row["owner"],
        session_id=row["session_id"],
        base_model=row["base_model"],
        model_path=row["model_path"],
        weights_dir=row["weights_dir"],
        lora=None if row["lora"] is None else json.loads(row["lora"]),
    )


def _model_row(row: sqlite3.Row) -> ModelRow:
    return ModelRow(
        model_id=row["model_id"],
        owner=row["owner"],
        session_id=row["session_id"],
        base_model=row["base_model"],
        lora=json.loads(row["lora"]),
        user_metadata=json.loads(row["user_metadata"]),
        created=row["created"],
        last_request=row["last_request"],
    )


def _future_row(row: sqlite3.Row) -> FutureRow:
    return FutureRow(
        request_id=row["request_id"],
        owner=row["owner"],
        model_id=row["model_id"],
        seq_id=row["seq_id"],
        request_type=row["request_type"],
        payload_hash=row["payload_hash"],
        status=row["status"],
        result_json=row["result_json"],
        result_proto=row["result_proto"],
        error=row["error"],
        category=row["category"],
    )


def _checkpoint_row(row: sqlite3.Row) -> CheckpointRow:
    return CheckpointRow(
        tinker_path=row["tinker_path"],
        owner=row["owner"],
        model_id=row["model_id"],
        kind=row["kind"],
        name=row["name"],
        dir=row["dir"],
        user_metadata=json.loads(row["user_metadata"]),
        size_bytes=row["size_bytes"],
        created=row["created"],
    )
