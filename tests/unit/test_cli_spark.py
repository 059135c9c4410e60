"""``kombu-pgmq spark cluster|server`` messages without Spark: the library's functions
(:mod:`kombu_pgmq.spark.server`, :mod:`kombu_pgmq.spark.cluster`) are replaced by stubs
that record their calls. The commands against real servers: tests/spark."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from kombu_pgmq import cli
from kombu_pgmq.spark import cluster, server

CONNECT_PORT = 15099
LOCAL_MASTER = "local[*]"


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli.main, ["spark", *args])


class FakeSpark:
    """Stubs of the server and cluster functions the commands call; ``calls`` in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, running: str | None) -> None:
        self.running = running
        self.calls: list[tuple[str, Any]] = []
        monkeypatch.setattr(server, "local_port", lambda conf=None: CONNECT_PORT)
        monkeypatch.setattr(server, "running_master", self.running_master)
        monkeypatch.setattr(server, "stop", self.stop)
        monkeypatch.setattr(server, "ensure_running", self.ensure_running)
        monkeypatch.setattr(cluster, "start", self.start)
        monkeypatch.setattr(cluster, "application_conf", lambda port: {})

    def running_master(self, port: int) -> str | None:
        return self.running

    def stop(self, port: int) -> bool:
        self.calls.append(("server.stop", port))
        self.running = None
        return True

    def ensure_running(self, conf: dict[str, Any]) -> str:
        self.calls.append(("server.ensure_running", conf["spark_local_master"]))
        self.running = conf["spark_local_master"]
        return f"sc://localhost:{conf['spark_connect_port']}/;token=secret"

    def start(self, **kwargs: Any) -> dict[str, Any]:
        self.calls.append(("cluster.start", kwargs["port"]))
        return {
            "master": cluster.master_url(kwargs["port"]),
            "webui": "http://127.0.0.1:8080",
            "dir": Path("/tmp/cluster"),
            "workers": [],
        }


def test_cluster_start_while_the_connect_server_runs_elsewhere_names_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spark = FakeSpark(monkeypatch, running=LOCAL_MASTER)
    result = invoke("cluster", "start")
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert f"port {CONNECT_PORT} runs on --master {LOCAL_MASTER}" in lines[0]
    assert "add --replace" in lines[0] and "kombu-pgmq spark server stop" in lines[0]
    assert spark.calls == []  # nothing stopped, nothing started


def test_cluster_start_replace_stops_the_connect_server_then_starts_it_on_the_cluster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spark = FakeSpark(monkeypatch, running=LOCAL_MASTER)
    result = invoke("cluster", "start", "--replace")
    assert result.exit_code == 0, result.output
    master = cluster.master_url(cluster.DEFAULT_MASTER_PORT)
    assert spark.calls == [
        ("server.stop", CONNECT_PORT),
        ("cluster.start", cluster.DEFAULT_MASTER_PORT),
        ("server.ensure_running", master),
    ]
    assert result.stdout.splitlines()[0] == (
        f"stopped the Connect server on port {CONNECT_PORT} (it ran on --master {LOCAL_MASTER})"
    )
    assert "token=***" in result.stdout and "secret" not in result.stdout


@pytest.mark.parametrize("running", [None, "cluster"])
def test_cluster_start_without_a_conflict_stops_nothing(
    monkeypatch: pytest.MonkeyPatch, running: str | None
) -> None:
    master = cluster.master_url(cluster.DEFAULT_MASTER_PORT)
    spark = FakeSpark(monkeypatch, running=master if running else None)
    result = invoke("cluster", "start", "--replace")
    assert result.exit_code == 0, result.output
    assert [name for name, _ in spark.calls] == ["cluster.start", "server.ensure_running"]


@pytest.mark.parametrize("pid", [None, 4242])
def test_cluster_status_prints_no_unknown_pid(
    monkeypatch: pytest.MonkeyPatch, pid: int | None
) -> None:
    master = cluster.master_url(cluster.DEFAULT_MASTER_PORT)
    info = {
        "master": master,
        "running": True,
        "pid": pid,
        "webui": "http://127.0.0.1:8080",
        "workers": [],
        "apps": [],
        "dir": Path("/tmp/cluster"),
    }
    monkeypatch.setattr(cluster, "status", lambda port, webui_port: info)
    monkeypatch.setattr(cluster, "executors_by_worker", lambda webui_port: {})
    monkeypatch.setattr(server, "running_master", lambda port: None)
    result = invoke("cluster", "status")
    assert result.exit_code == 0, result.output
    first = result.stdout.splitlines()[0]
    assert "None" not in result.stdout
    assert first == (
        f"running: {master}{'' if pid is None else f', pid {pid}'}, web UI http://127.0.0.1:8080"
    )


@pytest.mark.parametrize("pid", [None, 4242])
def test_server_status_prints_no_unknown_pid(
    monkeypatch: pytest.MonkeyPatch, pid: int | None
) -> None:
    info = {
        "port": CONNECT_PORT,
        "accepting": pid is not None,
        "pid": pid,
        "log": Path("/tmp/server.log"),
        "problem": None,
    }
    monkeypatch.setattr(server, "status", lambda port: info)
    result = invoke("server", "status", "--port", str(CONNECT_PORT))
    assert result.exit_code == 0, result.output
    assert "None" not in result.stdout
    expected = "running" if pid else "not running"
    pid_part = f", pid {pid}" if pid else ""
    assert (
        result.stdout.strip() == f"{expected}: port {CONNECT_PORT}{pid_part}, log /tmp/server.log"
    )
