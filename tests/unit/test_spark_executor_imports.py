"""What a Spark executor imports: ``kombu_pgmq.spark.datasource`` in a
virtualenv that has pyspark and psycopg but neither Celery nor kombu.

The virtualenv is made here (``python -m venv --without-pip``, no network): its
site-packages gets a ``.pth`` file naming a directory of symlinks to the installed
packages an executor needs and to this checkout's ``kombu_pgmq``; nothing else of the
test environment is visible to it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import kombu_pgmq

#: What an executor has: pyspark (and py4j), psycopg (with its C or binary part).
_EXECUTOR_PACKAGES = (
    "pyspark",
    "py4j",
    "psycopg",
    "psycopg_binary",
    "psycopg_c",
    "psycopg_pool",
    "typing_extensions",
)
_REQUIRED = ("pyspark", "py4j", "psycopg", "typing_extensions")


def _location(name: str) -> Path | None:
    """The package directory (or single-file module) of installed ``name``; None if it
    is not installed."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin)
    return origin.parent if spec.submodule_search_locations is not None else origin


@pytest.fixture(scope="module")
def executor_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Interpreter of a virtualenv with only the executor packages and ``kombu_pgmq``."""
    base = tmp_path_factory.mktemp("executor")
    venv = base / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    links = base / "packages"
    links.mkdir()
    for name in _EXECUTOR_PACKAGES:
        found = _location(name)
        if found is None:
            assert name not in _REQUIRED, f"{name} is not installed (a dev dependency)"
            continue
        (links / found.name).symlink_to(found)
    (links / "kombu_pgmq").symlink_to(Path(kombu_pgmq.__file__).parent)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    (Path(purelib) / "executor_packages.pth").write_text(f"{links}\n")
    assert sysconfig.get_path("purelib") != purelib  # not this test run's site-packages
    return python


def _run(python: Path, code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


def test_the_executor_virtualenv_has_neither_celery_nor_kombu(executor_python: Path) -> None:
    for module in ("celery", "kombu"):
        done = _run(executor_python, f"import {module}")
        assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr, (module, done)


def test_the_data_source_imports_without_celery_or_kombu(executor_python: Path) -> None:
    done = _run(
        executor_python,
        "import sys, kombu_pgmq.spark.datasource as ds; "
        "assert ds.PgmqDataSource.name() == 'pgmq'; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('celery', 'kombu')))",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
