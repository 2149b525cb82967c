"""The embedded PostgreSQL starts from a cluster that is whole, in a directory made for it.

These run the real binaries of the pgserver wheel. Where a test needs initdb to meet a
particular world (a directory locked down under it, a setting it refuses), it steps in
just before initdb runs, as another process on the machine would.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from reliable_consumer.dev.servers import process
from reliable_consumer.dev.servers.postgres_server import PostgresServer
from reliable_consumer.dev.servers.process import LOOPBACK, DevStackError

pytestmark = pytest.mark.integration

# A setting initdb passes to its bootstrap server (`-c`), which that server refuses.
REFUSED_SETTING = ["-c", "shared_buffers=lots"]
REFUSAL = 'invalid value for parameter "shared_buffers": "lots"'


def before_initdb(
    monkeypatch: pytest.MonkeyPatch, step: Callable[[list[str]], list[str]]
) -> list[list[str]]:
    """Run ``step`` on each initdb command line just before it runs; returns the calls."""
    calls: list[list[str]] = []
    real_run = subprocess.run

    def run(args: Any, *rest: Any, **kwargs: Any) -> Any:
        if isinstance(args, list) and any(Path(str(a)).name == "initdb" for a in args):
            calls.append(list(args))
            args = step(list(args))
        return real_run(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "run", run)
    return calls


def database_names(url: str) -> set[str]:
    with psycopg.connect(url, connect_timeout=5) as conn:
        return {row[0] for row in conn.execute("SELECT datname FROM pg_database")}


def test_initdb_is_not_broken_by_pytest_locking_down_its_base_temp_dir(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pytest resets ``pytest-of-<user>`` to 0700 whenever another xdist worker first asks
    for its base temp dir; a cluster below it (reached as root through the system user
    ``pgserver``) lost its way mid-initdb: ``PANIC: could not open file
    ".../global/pg_control": Permission denied``, then "database "postgres" does not exist".
    Here the pytest-like directory above the server's folder is locked as initdb starts."""
    pytest_like = tmp_path / "pytest-of-someone"
    server = PostgresServer(pytest_like / "pytest-7" / "test_x0" / "postgres")

    def lock_down(args: list[str]) -> list[str]:
        pytest_like.chmod(0o700)
        return args

    before_initdb(monkeypatch, lock_down)
    with server:
        assert "postgres" in database_names(server.url)
        for locked in (pytest_like, tmp_path_factory.getbasetemp().parent):
            assert not server.pgdata.is_relative_to(locked), server.pgdata
        cluster = server.pgdata.parent
        assert cluster.is_dir()
    assert not cluster.exists(), "the server's own directory outlived it"


def test_a_failed_initdb_raises_its_own_words_and_is_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = before_initdb(monkeypatch, lambda args: [*args, *REFUSED_SETTING])
    server = PostgresServer(tmp_path / "postgres")

    with pytest.raises(DevStackError, match="initdb") as failed:
        server.start()

    assert REFUSAL in str(failed.value)
    assert len(calls) == 1, f"initdb ran {len(calls)} times"
    assert not server.is_running()
    server.close()


def test_a_half_made_cluster_is_rebuilt_not_started_as_if_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """initdb that fails after writing PG_VERSION (``--no-clean`` keeps what it made, as a
    user without the right to remove it would) leaves a half-made cluster; the next start
    must build it again, not run the server on it as if it were whole."""
    failing = [True]

    def fail_once(args: list[str]) -> list[str]:
        if failing[0]:
            failing[0] = False
            return [*args, "--no-clean", *REFUSED_SETTING]
        return args

    calls = before_initdb(monkeypatch, fail_once)
    server = PostgresServer(tmp_path / "postgres")
    with pytest.raises(DevStackError, match="initdb"):
        server.start()
    assert (server.pgdata / "PG_VERSION").is_file(), "initdb left no half-made cluster"

    with server:
        assert "postgres" in database_names(server.url)
    assert len(calls) == 2, f"initdb ran {len(calls)} times"


def test_a_start_error_that_is_not_a_port_race_is_not_retried(tmp_path: Path) -> None:
    """The server refuses a setting: that is the error, said once, not three starts."""
    server = PostgresServer(tmp_path / "postgres", extra_config={"shared_buffers": "lots"})
    with pytest.raises(DevStackError, match="shared_buffers") as failed:
        server.start()
    server.close()
    assert REFUSAL in str(failed.value)
    starts = server.log_path.read_text().count(REFUSAL)
    assert starts == 1, f"started {starts} times"


def test_a_lost_port_race_is_retried_on_another_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process binds the port between our pick and the server's bind: try anew."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind((LOOPBACK, 0))  # bound, not listening: only the server's bind fails
        taken_port = taken.getsockname()[1]
        picks = iter([taken_port])
        real_free_port = process.free_port
        monkeypatch.setattr(process, "free_port", lambda: next(picks, None) or real_free_port())

        with PostgresServer(tmp_path / "postgres") as server:
            assert server.port != taken_port
            assert "postgres" in database_names(server.url)
        assert "Address already in use" in server.log_path.read_text()


def test_servers_made_from_one_cluster_run_no_initdb_and_share_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test kit's way (one initdb per session, a copy per test): each copy starts
    without initdb, and what one server writes the other never sees."""
    template = PostgresServer(tmp_path / "template")
    template.prepare_cluster()
    calls = before_initdb(monkeypatch, lambda args: args)
    try:
        with PostgresServer(tmp_path / "first", copy_of=template.cluster_dir) as first:
            with psycopg.connect(first.url, autocommit=True) as conn:
                conn.execute("CREATE DATABASE only_in_first")
            assert "only_in_first" in database_names(first.url)
        with PostgresServer(tmp_path / "second", copy_of=template.cluster_dir) as second:
            assert "only_in_first" not in database_names(second.url)
            assert "postgres" in database_names(second.url)
        assert calls == [], "a copied cluster ran initdb"
    finally:
        template.close()


def test_a_cluster_that_is_not_whole_is_not_copied(tmp_path: Path) -> None:
    """A template without its completion mark (initdb interrupted) is refused, naming it."""
    half_made = tmp_path / "half-made"
    (half_made / "pgdata").mkdir(parents=True)
    (half_made / "pgdata" / "PG_VERSION").write_text("16\n")
    server = PostgresServer(tmp_path / "postgres", copy_of=half_made)
    with pytest.raises(DevStackError, match="no complete cluster to copy"):
        server.start()
    server.close()
