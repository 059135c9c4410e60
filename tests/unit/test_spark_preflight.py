"""The executor checks' pure parts: socket paths of URLs, the sentences of problems, the
explanation of a missing ``kombu_pgmq``, the data source's Unix-socket refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

from kombu_pgmq.errors import ConfigurationError, SparkError
from kombu_pgmq.spark import preflight
from kombu_pgmq.spark.preflight import ExecutorReport


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://u@/db?host=/run/pg", "/run/pg/.s.PGSQL.5432"),
        ("postgresql://u@/db?host=/run/pg&port=6543", "/run/pg/.s.PGSQL.6543"),
        ("postgresql://u:p@db.example.com:5432/db", None),
        ("postgresql://u@127.0.0.1/db", None),
        ("host=/tmp/s port=5999 dbname=x", "/tmp/s/.s.PGSQL.5999"),
    ],
)
def test_unix_socket_of_a_url(url: str, expected: str | None) -> None:
    assert preflight.unix_socket(url) == expected


def test_local_paths_are_checked_and_remote_file_systems_are_not() -> None:
    assert preflight._local_path("/data/x.parquet") == "/data/x.parquet"
    assert preflight._local_path("file:///data/x") == "/data/x"
    assert preflight._local_path("s3a://bucket/key") is None
    assert preflight._local_path("hdfs://nn/x") is None


def _report(**kw: object) -> ExecutorReport:
    return ExecutorReport(host="h1", pid=7, python="/opt/py/bin/python", **kw)  # type: ignore[arg-type]


def test_problems_name_the_path_the_package_the_socket_and_the_fix() -> None:
    reports = [
        _report(
            missing_paths=["/data/in"],
            module_error="ModuleNotFoundError: No module named 'kombu_pgmq'",
            broker_error="FileNotFoundError: [Errno 2]",
        ),
        ExecutorReport(host="h2", pid=9, python="/opt/py/bin/python"),
    ]
    found = preflight.problems(reports, broker_url="postgresql://u:secret@/db?host=/run/pg")
    assert len(found) == 3
    assert found[0].startswith("path /data/in is not visible to the Spark executor(s) on h1")
    assert "h2" not in found[0]
    assert "pip install kombu-pgmq-transport into that Python" in found[1]
    assert "/opt/py/bin/python" in found[1]
    assert "Unix socket (/run/pg/.s.PGSQL.5432)" in found[2] and "TCP URL" in found[2]
    assert "secret" not in " ".join(found)  # passwords are redacted


def test_problems_of_an_unreachable_tcp_broker_and_of_healthy_executors() -> None:
    bad = [_report(broker_error="TimeoutError: timed out")]
    (text,) = preflight.problems(bad, broker_url="postgresql://u@localhost:5432/db")
    assert "cannot connect to the broker at localhost:5432" in text and "not localhost" in text
    assert preflight.problems([_report()], broker_url="postgresql://u@db:5432/x") == []


def test_explain_turns_a_missing_module_into_the_fix() -> None:
    error = RuntimeError("PythonException: ModuleNotFoundError: No module named 'kombu_pgmq'\n...")
    explained = preflight.explain(error)
    assert isinstance(explained, SparkError)
    assert "pip install kombu-pgmq-transport" in str(explained)
    assert preflight.explain(RuntimeError("No module named 'pandas'")) is None


def test_data_source_refuses_a_unix_socket_missing_on_this_host(tmp_path: Path) -> None:
    from kombu_pgmq.spark.datasource import _reachable_socket

    with pytest.raises(ConfigurationError, match=r"Unix socket .* TCP URL"):
        _reachable_socket(f"host={tmp_path} port=5432 dbname=x")
    (tmp_path / ".s.PGSQL.5432").touch()
    _reachable_socket(f"host={tmp_path} port=5432 dbname=x")  # present: libpq's turn
    _reachable_socket("host=db.example.com port=5432 dbname=x")  # TCP: not checked
