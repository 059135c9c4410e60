"""The local Spark Connect server without a JVM: a port held by
another process is refused before anything is sent to it; the token and settings files are
private; no secret on the command lines the package starts."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kombu_pgmq.errors import ConfigurationError, SparkServerError
from kombu_pgmq.spark import _sockets, _state, server
from kombu_pgmq.spark import task as spark_task
from kombu_pgmq.spark.task import SparkRequest

SECRET = "hunter2-not-for-ps"

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="psutil lists other processes' sockets without privileges on Linux only",
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _FakePopen:
    """Records what the server would be started with; the 'server' exits at once."""

    calls: list[dict[str, Any]] = []

    def __init__(self, args: list[str], **kwargs: Any) -> None:
        self.args = args
        self.pid = 2**22 + 1  # beyond pid_max by default: names no process
        _FakePopen.calls.append({"args": args, **kwargs})

    def poll(self) -> int:
        return 1

    def wait(self, timeout: float | None = None) -> int:
        return 1


def _fake_subprocess() -> SimpleNamespace:
    """The ``subprocess`` module for the module under test, with :class:`_FakePopen`."""
    _FakePopen.calls = []
    return SimpleNamespace(**{**vars(subprocess), "Popen": _FakePopen})


@pytest.fixture
def local(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """(port, state directory) of a local server that never starts a JVM here (see
    :class:`_FakePopen`)."""
    port = _free_port()
    directory = tmp_path / "spark"
    monkeypatch.setenv(server.ENV_PORT, str(port))
    monkeypatch.setenv(server.ENV_DIR, str(directory))
    monkeypatch.delenv(server.ENV_REMOTE, raising=False)
    monkeypatch.setattr(server, "_children", {})
    monkeypatch.setattr(server, "_verified", {}, raising=False)  # the cache of servers checked
    monkeypatch.setattr(server, "subprocess", _fake_subprocess())
    yield port, directory


@pytest.fixture
def elsewhere() -> Iterator[int]:
    """Pid of a live process that is not a Spark server (what a stale pid file names)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


@linux_only
@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_a_port_held_by_another_process_is_refused(
    local: tuple[int, Path], elsewhere: int, host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another local user's listener on the port (first, or on ::1 where clients of
    localhost may go first) must get neither jobs nor the token: a listener on 127.0.0.1
    is not taken for the server, nor its URL returned, unless it is checked to be ours."""
    port, directory = local
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.bind((host, port))
    except OSError as exc:
        pytest.skip(f"cannot listen on {host}: {exc}")
    listener.listen()
    directory.mkdir(mode=0o700)
    (directory / "server.pid").write_text(str(elsewhere))  # a stale pid file
    (directory / "server.token").write_text("stale-token")

    def no_start(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a server was started although the port is taken")

    monkeypatch.setattr(server, "_start", no_start)
    try:
        with pytest.raises(SparkServerError) as info:
            server.ensure_running()  # before: "sc://127.0.0.1:<port>" for the IPv4 listener
        message = str(info.value)
        assert f"port {port} " in message
        assert f"uid {os.getuid()}, pid {os.getpid()}" in message  # who listens
        assert f"pid {elsewhere} in {directory}" in message  # what we expected
        assert "spark_connect_port" in message and server.ENV_PORT in message
        assert "stale-token" not in message
        with pytest.raises(SparkServerError, match=f"port {port} "):
            server.running_url()  # what the interrupt subprocess uses
        problem = server.status(port)["problem"]
        assert problem is not None and f"port {port} " in problem
    finally:
        listener.close()
    os.kill(elsewhere, 0)  # the process the pid file names was left alone


def test_without_permission_to_list_sockets_the_servers_own_are_checked(
    local: tuple[int, Path], elsewhere: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """psutil.AccessDenied (macOS without root): the process in server.pid must hold the
    listening socket itself; a listener that is not it is refused, with no token sent."""
    import psutil

    def denied(*args: Any, **kwargs: Any) -> None:
        raise psutil.AccessDenied()

    monkeypatch.setattr(psutil, "net_connections", denied)
    port, directory = local
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", port))
    listener.listen()
    directory.mkdir(mode=0o700)
    (directory / "server.pid").write_text(str(elsewhere))  # alive, ours, not listening
    (directory / "server.token").write_text("stale-token")
    try:
        with pytest.raises(SparkServerError, match=f"port {port} .*pid {elsewhere}"):
            server.running_url()
        (directory / "server.pid").write_text(str(os.getpid()))  # the listener's process
        assert server.running_url() == f"sc://localhost:{port}/;token=stale-token"
    finally:
        listener.close()


def test_server_files_are_private_and_no_secret_goes_on_its_command_line(
    local: tuple[int, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    port, directory = local
    directory.mkdir(mode=0o755)
    os.chmod(directory, 0o755)  # as an older version (or the umask) left it
    monkeypatch.setattr(_state, "spark_home", lambda: tmp_path / "pyspark")
    conf = {"spark_local_conf": {"spark.kombu_pgmq.test.password": SECRET, "spark.a b": " x\n"}}
    with pytest.raises(SparkServerError, match=f"did not start on port {port}"):
        server.ensure_running(conf)

    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    token_file, properties = directory / "server.token", directory / "server.properties"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(properties.stat().st_mode) == 0o600
    token = token_file.read_text()
    assert len(token) >= 32
    text = properties.read_text()
    assert f"spark.kombu_pgmq.test.password={SECRET}\n" in text
    assert "spark.a\\ b=\\ x\\n\n" in text  # Java properties escapes
    assert "spark.connect.grpc.binding.address=127.0.0.1\n" in text

    (call,) = _FakePopen.calls
    args = " ".join(call["args"])
    assert token not in args and SECRET not in args
    assert call["args"][-3:] == ["--properties-file", str(properties), "--load-spark-defaults"]
    assert f"spark.connect.grpc.binding.port={port}" in call["args"]
    assert call["env"][server.ENV_TOKEN] == token  # the JVM gets it from its environment


def test_spark_local_conf_cannot_set_the_address_port_or_token(local: tuple[int, Path]) -> None:
    for key in (
        "spark.connect.grpc.binding.address",
        "spark.connect.grpc.binding.port",
        "spark.connect.authenticate.token",
    ):
        with pytest.raises(ConfigurationError, match=key):
            server.ensure_running({"spark_local_conf": {key: "x"}})


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the directory away")
def test_a_state_directory_of_another_user_is_refused(local: tuple[int, Path]) -> None:
    _port, directory = local
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)  # nobody
    with pytest.raises(ConfigurationError, match="belongs to uid 65534"):
        server.ensure_running()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the directory away")
def test_a_cluster_directory_of_another_user_names_the_cluster_variable(tmp_path: Path) -> None:
    from kombu_pgmq.spark import cluster

    directory = tmp_path / "cluster"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)  # nobody
    with pytest.raises(ConfigurationError, match=rf"uid 65534.*\${cluster.ENV_DIR} "):
        _state.private_dir(directory, cluster.ENV_DIR)


def test_redact_url() -> None:
    assert server.redact_url("sc://localhost:15002/;token=abc") == "sc://localhost:15002/;token=***"
    assert (
        server.redact_url("sc://h:1/;user_id=u;token=abc;session_id=s")
        == "sc://h:1/;user_id=u;token=***;session_id=s"
    )
    assert server.redact_url("sc://h:1") == "sc://h:1"


@pytest.mark.parametrize(
    ("address", "reaches"),
    [
        ("127.0.0.1", True),
        ("127.0.1.1", True),
        ("0.0.0.0", True),
        ("10.0.0.1", False),
        ("::1", True),
        ("::", True),
        ("::ffff:127.0.0.1", True),  # a JVM's bind
        ("::ffff:10.0.0.1", False),
        ("fe80::1%eth0", False),
    ],
)
def test_listening_addresses_that_clients_of_localhost_reach(address: str, reaches: bool) -> None:
    assert _sockets.reaches_localhost(address) is reaches


@pytest.mark.parametrize("remote", [None, "sc://spark.example.com:15002/;token=cluster-" + SECRET])
def test_the_interrupt_subprocess_gets_no_url_on_its_command_line(
    monkeypatch: pytest.MonkeyPatch, remote: str | None
) -> None:
    """A killed task's Spark work is interrupted from a subprocess: where it connects (a
    URL that may carry a token) goes through its environment, not its arguments."""
    monkeypatch.setattr(spark_task, "subprocess", _fake_subprocess())
    monkeypatch.delenv(server.ENV_REMOTE, raising=False)
    conf = {"spark_remote": remote, "spark_connect_port": 15999}
    request = SimpleNamespace(
        task=SimpleNamespace(app=SimpleNamespace(conf=conf)),
        id="task-1",
        request_dict={"retries": 2},
    )
    SparkRequest._interrupt_spark(request, "killed")  # type: ignore[arg-type]
    (call,) = _FakePopen.calls
    assert call["args"][1:] == ["-m", "kombu_pgmq.spark.interrupt", "task-1", "2"]
    assert not any("sc://" in arg or SECRET in arg for arg in call["args"])
    env = call["env"]
    if remote is None:
        assert server.ENV_REMOTE not in env and env[server.ENV_PORT] == "15999"
    else:
        assert env[server.ENV_REMOTE] == remote
