"""The local Spark Connect server: one per port under concurrent callers, started again
after it died or when its Python is gone, stopped by the CLI; settings validation; only
clients with its token get in, and no secret is on its command lines."""

from __future__ import annotations

import errno
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kombu_pgmq.errors import ConfigurationError
from kombu_pgmq.spark import server
from tests.support import pgserver


class _Module:
    """A module with some attributes replaced (for the module under test only)."""

    def __init__(self, module: Any, **replaced: Any) -> None:
        self.__dict__.update(vars(module), **replaced)


def _servers_on(port: int) -> list[int]:
    """Pids of Spark Connect server JVMs bound to *port* (from their command lines)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            server.SERVER_CLASS.encode() in cmdline
            and (f"spark.connect.grpc.binding.port={port}".encode() in cmdline)
            and b"bash" not in cmdline[0]
        ):
            found.append(int(proc.name))
    return found


def _url(port: int, directory: Path) -> str:
    return f"sc://localhost:{port}/;token={(directory / 'server.token').read_text()}"


@pytest.mark.slow
def test_one_server_for_concurrent_callers_and_restarted_after_it_died(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = pgserver.free_port()
    monkeypatch.setenv(server.ENV_PORT, str(port))
    monkeypatch.setenv(server.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(server.ENV_MASTER, "local[1]")
    monkeypatch.delenv(server.ENV_REMOTE, raising=False)
    secret = "s3cret-of-spark_local_conf"
    conf = {"spark_local_conf": {"spark.kombu_pgmq.test.password": secret}}
    started: list[list[str]] = []
    popen = subprocess.Popen

    def spy(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        started.append(list(args))  # spark-submit's command line, before it execs the JVM
        return popen(args, **kwargs)

    monkeypatch.setattr(server, "subprocess", _Module(subprocess, Popen=spy))
    try:
        with ThreadPoolExecutor(4) as pool:  # as pool processes asking at once
            urls = set(pool.map(lambda _: server.ensure_running(conf), range(4)))
        assert urls == {_url(port, tmp_path)}
        first = server.status(port)
        assert first["accepting"] and _servers_on(port) == [first["pid"]]
        # No secret where every local user can read it (ps): neither spark-submit's
        # command line nor the JVM's (spark-submit execs it: same pid).
        token = (tmp_path / "server.token").read_text()
        jvm = Path(f"/proc/{first['pid']}/cmdline").read_bytes().decode()
        assert len(started) == 1 and "java" in jvm
        for cmdline in (" ".join(started[0]), jvm):
            assert token not in cmdline and secret not in cmdline
        assert f"={secret}" in (tmp_path / "server.properties").read_text()

        os.kill(first["pid"], signal.SIGKILL)  # the JVM dies (OOM killer, a crash)
        deadline = time.monotonic() + 10
        while server.accepting(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.ensure_running() == _url(port, tmp_path)  # supervision on demand
        assert _url(port, tmp_path) != f"sc://localhost:{port}/;token={token}"  # a new one
        second = server.status(port)
        assert second["accepting"] and second["pid"] != first["pid"]
        assert _servers_on(port) == [second["pid"]]

        # The virtualenv that started it was deleted: its Python workers would fail.
        (tmp_path / "server.python").write_text(str(tmp_path / "deleted-venv/bin/python"))
        assert server.ensure_running() == _url(port, tmp_path)
        third = server.status(port)
        assert third["accepting"] and third["pid"] != second["pid"]
        assert _servers_on(port) == [third["pid"]]
        assert (tmp_path / "server.python").read_text() == sys.executable
        second = third

        cli = [sys.executable, "-m", "kombu_pgmq", "spark", "server"]
        status = subprocess.run([*cli, "status"], capture_output=True, text=True, check=True)
        assert f"running: port {port}, pid {second['pid']}" in status.stdout
        stop = subprocess.run([*cli, "stop"], capture_output=True, text=True, check=True)
        assert stop.stdout.strip() == "stopped"
        assert not server.accepting(port) and _servers_on(port) == []
    finally:
        server.stop(port)


def test_settings_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(server.ENV_REMOTE, raising=False)
    assert server.remote_url({}) is None
    assert server.remote_url({"spark_remote": "sc://spark:15002"}) == "sc://spark:15002"
    monkeypatch.setenv(server.ENV_REMOTE, "sc://env:15002")
    assert server.remote_url({}) == "sc://env:15002"
    assert server.remote_url({"spark_remote": "sc://conf:1"}) == "sc://conf:1"  # setting wins
    with pytest.raises(ConfigurationError, match="spark_remote / \\$SPARK_REMOTE must be"):
        server.remote_url({"spark_remote": "spark://master:7077"})
    with pytest.raises(ConfigurationError, match="TCP port number"):
        server.local_port({"spark_connect_port": "http"})


def test_only_clients_with_the_token_get_in(spark_server: dict[str, Any]) -> None:
    """Without the token any local user could connect (and run Python UDFs as us)."""
    from pyspark.sql import SparkSession

    port, url = spark_server["port"], spark_server["url"]
    directory = server.state_dir(port)
    token = (directory / "server.token").read_text()
    assert url == f"sc://localhost:{port}/;token={token}"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((directory / "server.token").stat().st_mode) == 0o600
    pid = server.status(port)["pid"]
    assert token not in Path(f"/proc/{pid}/cmdline").read_bytes().decode()

    for stranger in (f"sc://127.0.0.1:{port}", f"sc://localhost:{port}/;token=guess"):
        spark = SparkSession.builder.remote(stranger).create()
        try:
            with pytest.raises(Exception, match="UNAUTHENTICATED"):
                spark.range(3).count()
        finally:
            spark.stop()
    spark = SparkSession.builder.remote(url).create()
    try:
        assert spark.range(3).count() == 3
    finally:
        spark.stop()

    # Clients of localhost may try [::1] first: the server holds that address too, so no
    # other process can listen there and take their token.
    try:
        probe = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError:
        return  # no IPv6: nobody can listen on [::1]
    with probe, pytest.raises(OSError) as info:
        probe.bind(("::1", port))
    assert info.value.errno == errno.EADDRINUSE
