"""``KOMBU_PGMQ_TEST_PG_VERSION`` (``tox -e pg14`` ... ``pg18``) for a major with no
binaries here: the suite against a PostgreSQL container with PGMQ; without a Docker engine
it says so and skips. Here ``DOCKER_HOST`` names a socket that does not exist: no engine,
whatever the machine has."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import containers, pginstalls

ROOT = Path(__file__).resolve().parents[2]
NO_DOCKER = "unix:///nonexistent/kombu-pgmq-test/docker.sock"


@pytest.fixture
def no_docker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", NO_DOCKER)


def test_the_version_is_checked():
    assert containers.requested_version({}) is None
    assert containers.requested_version({containers.ENV_PG_VERSION: " 16 "}) == "16"
    with pytest.raises(ValueError, match="expected one of 14, 15, 16, 17, 18"):
        containers.requested_version({containers.ENV_PG_VERSION: "12"})
    assert containers.image_for("18", {}) == "ghcr.io/pgmq/pg18-pgmq:latest"
    assert containers.image_for("18", {containers.ENV_PG_IMAGE: "me/pg:18"}) == "me/pg:18"


def test_without_docker_the_reason_names_where_it_looked(no_docker):
    reason = containers.docker_unavailable_reason()
    assert reason is not None and reason.startswith(f"no Docker engine is reachable at {NO_DOCKER}")


def test_without_docker_no_container_is_started_and_the_error_says_why(no_docker):
    with pytest.raises(containers.DockerUnavailable) as info:
        containers.start_pgmq_container("16", {"fsync": "off"})
    message = str(info.value)
    assert "KOMBU_PGMQ_TEST_PG_VERSION=16" in message
    assert "no binaries of it here" in message
    assert "no container with PGMQ (ghcr.io/pgmq/pg16-pgmq:latest)" in message
    assert "no Docker engine is reachable" in message


def test_without_docker_the_tests_that_need_postgresql_skip_saying_so(tmp_path):
    """What ``tox -e pg14`` does on a machine without Docker and without PostgreSQL 14
    binaries: pytest exits 0, the test that needs the server is skipped with the reason, a
    unit test still runs."""
    if pginstalls.find_install("14") is not None:
        pytest.skip("this machine has PostgreSQL 14 binaries: tox -e pg14 starts no container")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KOMBU_PGMQ_TEST_")}
    env.update({"DOCKER_HOST": NO_DOCKER, containers.ENV_PG_VERSION: "14"})
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-rs",
            "tests/integration/test_schema.py::test_sql_only_install_on_empty_database",
            "tests/unit/test_containers.py::test_the_version_is_checked",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "1 passed, 1 skipped" in out, out
    assert "SKIPPED" in out and "no Docker engine is reachable" in out, out
    assert "no container with PGMQ (ghcr.io/pgmq/pg14-pgmq:latest)" in out, out
