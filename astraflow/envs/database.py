"""Database environment: questions over a small SQLite database built for each rollout.

The task's reference carries the database (`{"db": {"tables": [...]}, "query": "SELECT ..."}`);
the agent sees the table layout in its prompt and runs SQL through the `sql` tool against its
own in-memory copy; the reward (`sql_result`) rebuilds the database, runs the ground-truth
query and compares its result with the agent's final answer, value by value.

SQL comes from the model (and the reference from a record), so each statement runs under a
guard: one statement per call; an authorizer that refuses ATTACH / DETACH (which is also how
`VACUUM INTO` writes a file), pragmas other than a few read-only ones, extension loading and
virtual tables, and any database but the rollout's own (`main`, `temp`); SQLite limits on
attached databases (0), string length and statement length; a deadline on the virtual machine
(`progress handler`); and at most `max_rows` rows read back. What it refuses or stops comes back
as a `SqlError` whose message the model sees.
"""

from __future__ import annotations

import math
import re
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Any

from astraflow.errors import AstraflowError

MAX_TABLES, MAX_COLUMNS, MAX_ROWS, MAX_VALUE_CHARS = 8, 16, 2000, 200
TYPES = ("INTEGER", "REAL", "TEXT")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_READ_PRAGMAS = {"table_info", "table_list", "index_list", "index_info", "table_xinfo"}
_OTHER_DB_OK = {None, "main", "temp"}
_DENIED = {sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH, sqlite3.SQLITE_CREATE_VTABLE, sqlite3.SQLITE_DROP_VTABLE}
_DENIED_FUNCTIONS = {"load_extension", "readfile", "writefile", "edit", "fts3_tokenizer"}


class SqlError(AstraflowError):
    """Raised when a statement is refused (outside the rollout's database, a denied pragma,
    several statements), fails, or runs past its deadline; the message is for the model."""


class DbSpecError(AstraflowError):
    """Raised when a task's database description is malformed or over its limits (the task's
    author fixes the reference)."""


@dataclass(frozen=True, slots=True)
class Table:
    """One table of a task's database."""

    name: str
    columns: list[tuple[str, str]]  # (name, INTEGER | REAL | TEXT)
    rows: list[list[Any]]


def parse_spec(spec: Any) -> list[Table]:
    """The tables of `{"tables": [{"name", "columns": [[name, type]], "rows": [[...]]}]}`, checked."""
    tables = spec.get("tables") if isinstance(spec, dict) else None
    if not isinstance(tables, list) or not 0 < len(tables) <= MAX_TABLES:
        raise DbSpecError(f"db must be {{\"tables\": [...]}} with 1..{MAX_TABLES} tables")
    out = []
    for t in tables:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not _IDENT.match(t["name"]):
            raise DbSpecError("every table needs a name made of letters, digits and _ (at most 64)")
        cols = t.get("columns")
        if not isinstance(cols, list) or not 0 < len(cols) <= MAX_COLUMNS:
            raise DbSpecError(f"table {t['name']}: columns must be 1..{MAX_COLUMNS} [name, type] pairs")
        columns = []
        for c in cols:
            if not (isinstance(c, list) and len(c) == 2 and isinstance(c[0], str) and _IDENT.match(c[0])
                    and c[1] in TYPES):
                raise DbSpecError(f"table {t['name']}: column {str(c)[:60]} must be [identifier, one of {TYPES}]")
            columns.append((c[0], c[1]))
        rows = t.get("rows", [])
        if not isinstance(rows, list) or len(rows) > MAX_ROWS:
            raise DbSpecError(f"table {t['name']}: rows must be a list of at most {MAX_ROWS}")
        for r in rows:
            if not isinstance(r, list) or len(r) != len(columns) or not all(_value_ok(v) for v in r):
                raise DbSpecError(f"table {t['name']}: row {str(r)[:80]} must hold {len(columns)} numbers, "
                                  f"strings (at most {MAX_VALUE_CHARS} characters) or nulls")
        out.append(Table(t["name"], columns, rows))
    return out


def _value_ok(v: Any) -> bool:
    if v is None or isinstance(v, bool):
        return v is None
    if isinstance(v, int):
        return abs(v) < 2**63
    if isinstance(v, float):
        return math.isfinite(v)
    return isinstance(v, str) and len(v) <= MAX_VALUE_CHARS


def schema_text(tables: list[Table]) -> str:
    """The layout shown to the agent: `employees(id INTEGER, name TEXT, ...)`, one table a line."""
    return "\n".join(f"{t.name}({', '.join(f'{n} {ty}' for n, ty in t.columns)})" for t in tables)


def _authorize(action: int, arg1: str | None, arg2: str | None, db: str | None, _trigger: str | None) -> int:
    if action in _DENIED or db not in _OTHER_DB_OK:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_PRAGMA:
        return sqlite3.SQLITE_OK if arg1 in _READ_PRAGMAS else sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


class GuardedDb:
    """An in-memory SQLite database of one rollout, behind the guard of the module doc."""

    def __init__(self, tables: list[Table], *, timeout_s: float = 2.0, max_rows: int = 50,
                 max_length: int = 1_000_000) -> None:
        self.timeout_s = timeout_s
        self.max_rows = max_rows
        self._lock = threading.Lock()
        self._deadline = math.inf
        self.conn = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
        for t in tables:
            cols = ", ".join(f'"{n}" {ty}' for n, ty in t.columns)
            self.conn.execute(f'CREATE TABLE "{t.name}" ({cols})')
            marks = ", ".join("?" for _ in t.columns)
            self.conn.executemany(f'INSERT INTO "{t.name}" VALUES ({marks})', t.rows)
        self.conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        self.conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, max_length)
        self.conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, 100_000)
        self.conn.set_authorizer(_authorize)
        self.conn.set_progress_handler(self._progress, 1000)

    def _progress(self) -> int:
        return 1 if time.monotonic() > self._deadline else 0

    def query(self, sql: str) -> list[tuple]:
        """Runs one statement; its rows (at most `max_rows`). `SqlError` with the reason otherwise."""
        if not isinstance(sql, str) or not sql.strip():
            raise SqlError("empty statement: send one SQL statement")
        with self._lock:
            self._deadline = time.monotonic() + self.timeout_s
            try:
                cur = self.conn.execute(sql)
                rows = cur.fetchmany(self.max_rows)
            except sqlite3.DatabaseError as exc:
                msg = str(exc)
                if "interrupted" in msg:
                    msg = f"the statement ran past its {self.timeout_s:g} s limit and was stopped"
                elif "authoriz" in msg or "prohibited" in msg:
                    msg = ("not authorized: only this task's own database may be used (no ATTACH, DETACH, "
                           "VACUUM INTO, writing pragmas or extensions)")
                raise SqlError(msg) from None
            except (sqlite3.Warning, sqlite3.ProgrammingError, OverflowError, ValueError, MemoryError) as exc:
                raise SqlError(str(exc)[:300]) from None
            finally:
                self._deadline = math.inf
            return rows

    def run_text(self, sql: str) -> str:
        """`query` rendered for the model: one row a line, values separated by ' | '."""
        rows = self.query(sql)
        if not rows:
            return "(no rows)"
        lines = [" | ".join("NULL" if v is None else str(v) for v in r) for r in rows]
        more = "\n..." if len(rows) == self.max_rows else ""
        return "\n".join(lines)[:4000] + more

    def close(self) -> None:
        self.conn.close()


# ---- comparing answers ----------------------------------------------------------------------------


def _norm(v: Any) -> str:
    s = str(v).strip().strip("'\"`").strip().lower()
    try:
        f = float(s)
    except ValueError:
        return s
    if not math.isfinite(f):
        return s
    return str(round(f, 4)).removesuffix(".0")


def answer_values(answer: str) -> list[str]:
    """The values of an answer such as `42`, `Alice, Bob` or `[3, 4]`, normalised."""
    s = answer.strip().strip("[]()").strip()
    if not s:
        return []
    parts = re.split(r"\s*(?:,|;|\n|\|)\s*", s)
    return sorted(_norm(p) for p in parts if p.strip())


def rows_values(rows: list[tuple]) -> list[str]:
    """Every value of a query result, normalised like `answer_values`."""
    return sorted(_norm(v) for r in rows for v in r)


__all__ = ["DbSpecError", "GuardedDb", "SqlError", "Table", "answer_values", "parse_spec", "rows_values",
           "schema_text"]
