"""A connection attempt the server turns down is a :class:`ConnectionRejected` naming the
database or the role and the fix, from the one translation point (the connector), so the
worker, the CLI and the library say the same: a missing database (``createdb``), a missing
role (``createuser``), a role that may not log in or connect, and, on a throwaway server
that asks for passwords, a wrong or missing password and no ``pg_hba.conf`` entry.
Anything else (no server listening) stays a plain :class:`BrokerConnectionError`."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from kombu_pgmq._db.connector import Connector
from kombu_pgmq.errors import BrokerConnectionError, ConnectionRejected
from tests.support import pgserver


def refusal(url: str) -> BrokerConnectionError:
    """The error of the connector's first statement on ``url``."""
    db = Connector(url)
    try:
        with pytest.raises(BrokerConnectionError) as caught:
            db.scalar(b"SELECT 1")
    finally:
        db.close()
    return caught.value


def test_a_missing_database_names_createdb(pg_server: str) -> None:
    name = f"kpt_missing_{uuid.uuid4().hex[:12]}"  # never created
    err = refusal(pgserver.database_url(pg_server, name))
    assert type(err) is ConnectionRejected
    text = str(err)
    assert text.startswith(f'PostgreSQL refused the connection: database "{name}" does not exist')
    assert "createdb " in text and text.split("createdb ", 1)[1].split(")")[0].endswith(name)
    assert isinstance(err.__cause__, psycopg.OperationalError)


def test_a_missing_role_names_createuser_and_the_grant(pg_server: str, db_dsn: str) -> None:
    role = f"kpt_norole_{uuid.uuid4().hex[:12]}"  # never created
    name = psycopg.conninfo.conninfo_to_dict(db_dsn)["dbname"]
    err = refusal(pgserver.database_url(pg_server, str(name), user=role))
    assert type(err) is ConnectionRejected
    text = str(err)
    assert f'role "{role}" does not exist' in text
    assert f"--pwprompt {role})" in text and f"schema grant worker {role}" in text
    assert "-U" not in text  # createuser runs as an admin, not as the missing role


@pytest.fixture
def role(pg_server: str) -> Iterator[str]:
    name, _password = pgserver.create_role(pg_server, "refused")
    yield name
    pgserver.drop_role(pg_server, name)


def test_a_role_that_may_not_log_in(pg_server: str, db_dsn: str, role: str) -> None:
    with psycopg.connect(pg_server, autocommit=True) as admin:
        admin.execute(sql.SQL("ALTER ROLE {} NOLOGIN").format(sql.Identifier(role)))
    name = str(psycopg.conninfo.conninfo_to_dict(db_dsn)["dbname"])
    err = refusal(pgserver.database_url(pg_server, name, user=role))
    assert type(err) is ConnectionRejected
    assert f'role "{role}" may not log in: ALTER ROLE "{role}" LOGIN' in str(err)


def test_a_role_without_connect_on_the_database(pg_server: str, db_dsn: str, role: str) -> None:
    name = str(psycopg.conninfo.conninfo_to_dict(db_dsn)["dbname"])
    with psycopg.connect(pg_server, autocommit=True) as admin:
        admin.execute(
            sql.SQL("REVOKE CONNECT ON DATABASE {} FROM PUBLIC").format(sql.Identifier(name))
        )
    err = refusal(pgserver.database_url(pg_server, name, user=role))
    assert type(err) is ConnectionRejected
    assert f'GRANT CONNECT ON DATABASE "{name}" TO "{role}"' in str(err)


def test_no_server_listening_stays_a_connection_error() -> None:
    url = f"postgresql://postgres@127.0.0.1:{pgserver.free_port()}/postgres?connect_timeout=5"
    err = refusal(url)
    assert type(err) is BrokerConnectionError
    assert "Connection refused" in str(err)


# -- a server that asks for passwords ---------------------------------------------------

PASSWORD_ROLE = "kpt_pw"
PASSWORD = "right-password"
UNLISTED_ROLE = "kpt_unlisted"  # no pg_hba.conf line names it


@pytest.fixture(scope="module")
def password_server() -> Iterator[pgserver.LocalServer]:
    """A throwaway server (unix socket) whose pg_hba.conf trusts the superuser, asks
    ``kpt_pw`` for its password and has no entry for any other role."""
    fd, hba = tempfile.mkstemp(prefix="kpt_hba_", suffix=".conf")
    with os.fdopen(fd, "w") as f:
        f.write(f"local all {pgserver.SUPERUSER} trust\nlocal all {PASSWORD_ROLE} scram-sha-256\n")
    os.chmod(hba, 0o644)  # read by the server's system user
    try:
        with pgserver.throwaway_server(
            {**pgserver.TEST_SETTINGS, "hba_file": hba}, "broker"
        ) as server:
            with psycopg.connect(server.dsn, autocommit=True) as admin:
                for name, password in ((PASSWORD_ROLE, PASSWORD), (UNLISTED_ROLE, PASSWORD)):
                    admin.execute(
                        sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                            sql.Identifier(name), sql.Literal(password)
                        )
                    )
            yield server
    finally:
        Path(hba).unlink()


def _as(server: pgserver.LocalServer, user: str, password: str | None) -> str:
    return pgserver.database_url(server.dsn, "broker", user=user, password=password)


@pytest.fixture(autouse=True)
def _no_password_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PGPASSWORD", raising=False)
    monkeypatch.setenv("PGPASSFILE", str(tmp_path / "none"))


def test_a_wrong_password_names_the_role_and_where_passwords_go(
    password_server: pgserver.LocalServer,
) -> None:
    err = refusal(_as(password_server, PASSWORD_ROLE, "wrong"))
    assert type(err) is ConnectionRejected
    text = str(err)
    assert f'refused the password of role "{PASSWORD_ROLE}"' in text
    assert "$PGPASSWORD or ~/.pgpass" in text and f'ALTER ROLE "{PASSWORD_ROLE}" PASSWORD' in text
    db = Connector(_as(password_server, PASSWORD_ROLE, PASSWORD))  # the fix works
    try:
        assert db.scalar(b"SELECT current_user") == PASSWORD_ROLE
    finally:
        db.close()


def test_a_missing_password(password_server: pgserver.LocalServer) -> None:
    err = refusal(_as(password_server, PASSWORD_ROLE, None))
    assert type(err) is ConnectionRejected
    assert f"asks {PASSWORD_ROLE} for a password and none was given" in str(err)


def test_no_pg_hba_entry(password_server: pgserver.LocalServer) -> None:
    err = refusal(_as(password_server, UNLISTED_ROLE, PASSWORD))
    assert type(err) is ConnectionRejected
    text = str(err)
    assert (
        f'no pg_hba.conf entry letting role "{UNLISTED_ROLE}" connect to database "broker"' in text
    )
    assert f'"local broker {UNLISTED_ROLE} scram-sha-256"' in text
