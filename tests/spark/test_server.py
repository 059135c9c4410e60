"""The local Spark Connect server: one per port under concurrent callers, started again
after it died or when its Python is gone, stopped by the CLI; settings validation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kombu_pgmq.errors import ConfigurationError
from kombu_pgmq.spark import server
from tests.support import pgserver


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


def test_one_server_for_concurrent_callers_and_restarted_after_it_died(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = pgserver.free_port()
    monkeypatch.setenv(server.ENV_PORT, str(port))
    monkeypatch.setenv(server.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(server.ENV_MASTER, "local[1]")
    monkeypatch.delenv(server.ENV_REMOTE, raising=False)
    try:
        with ThreadPoolExecutor(4) as pool:  # as pool processes asking at once
            urls = set(pool.map(lambda _: server.ensure_running(), range(4)))
        assert urls == {f"sc://127.0.0.1:{port}"}
        first = server.status(port)
        assert first["accepting"] and _servers_on(port) == [first["pid"]]

        os.kill(first["pid"], signal.SIGKILL)  # the JVM dies (OOM killer, a crash)
        deadline = time.monotonic() + 10
        while server.accepting(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.ensure_running() == f"sc://127.0.0.1:{port}"  # supervision on demand
        second = server.status(port)
        assert second["accepting"] and second["pid"] != first["pid"]
        assert _servers_on(port) == [second["pid"]]

        # The virtualenv that started it was deleted: its Python workers would fail.
        (tmp_path / "server.python").write_text(str(tmp_path / "deleted-venv/bin/python"))
        assert server.ensure_running() == f"sc://127.0.0.1:{port}"
        third = server.status(port)
        assert third["accepting"] and third["pid"] != second["pid"]
        assert _servers_on(port) == [third["pid"]]
        assert (tmp_path / "server.python").read_text() == sys.executable
        second = third

        cli = [sys.executable, "-m", "kombu_pgmq.cli", "spark", "server"]
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
