"""Files and processes of the Spark JVMs this package starts (the local Connect server of
:mod:`kombu_pgmq.spark.server`, the standalone cluster of :mod:`kombu_pgmq.spark.cluster`):
private state directories and files, pid files, the directory lock, Java properties files,
log tails, process-group termination, and where the installed ``pyspark`` (Spark's home)
is. Standard library only; POSIX (``fcntl``, process groups)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError

__all__ = [
    "ENV_DIR",
    "locked",
    "private_dir",
    "properties_text",
    "read_pid",
    "spark_home",
    "tail",
    "terminate",
    "write_private",
]

#: Environment variable of the local Connect server's state directory.
ENV_DIR = "KOMBU_PGMQ_SPARK_DIR"
_PROPERTY_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\f": "\\f"}


def private_dir(directory: Path, env: str = ENV_DIR) -> Path:
    """Create ``directory`` (mode 0700), or check an existing one is the user's and make it
    0700: it holds secrets (the Connect server's token, a cluster's shared secret).
    ``env``: the environment variable that chooses the directory (named in the error).

    Raises:
        ConfigurationError: it belongs to another user.
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = directory.stat()
    if st.st_uid != os.getuid():
        raise ConfigurationError(
            f"the Spark state directory {directory} belongs to uid {st.st_uid}, not to this "
            f"user (uid {os.getuid()}): it holds secrets; set ${env} to a directory of your "
            "own"
        )
    if st.st_mode & 0o077:
        os.chmod(directory, 0o700)
    return directory


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` by a file of mode 0600 holding ``text`` (readers never see half)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_pid(path: Path, marker: str) -> int | None:
    """The pid in ``path`` if that process is alive and (Linux) has ``marker`` in its
    command line (a JVM's main class): a pid file may outlive its process, and the pid be
    reused by another one."""
    try:
        pid = int(path.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return pid  # not Linux
    return pid if marker.encode() in cmdline else None


@contextlib.contextmanager
def locked(directory: Path, env: str = ENV_DIR) -> Iterator[None]:
    """Hold the exclusive lock of ``directory`` (``server.lock``, blocking; the directory
    is made private first, see :func:`private_dir`)."""
    private_dir(directory, env)
    with open(directory / "server.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def spark_home() -> Path:
    """Directory of the installed ``pyspark`` (Spark's home: ``bin/spark-submit``, jars).

    Raises:
        ConfigurationError: pyspark is not installed.
    """
    try:
        import pyspark
    except ImportError as exc:
        raise ConfigurationError(
            "pyspark is not installed: pip install 'kombu-pgmq-transport[spark]'"
        ) from exc
    return Path(pyspark.__file__).resolve().parent


def properties_text(conf: Mapping[str, Any]) -> str:
    """Java properties file text (UTF-8, as Spark reads it) of ``conf``."""

    def escape(text: str, key: bool) -> str:
        out = []
        for i, char in enumerate(text):
            if char in _PROPERTY_ESCAPES:
                out.append(_PROPERTY_ESCAPES[char])
            elif (key and char in "=: #!") or (not key and i == 0 and char == " "):
                out.append("\\" + char)
            else:
                out.append(char)
        return "".join(out)

    return "".join(f"{escape(str(k), True)}={escape(str(v), False)}\n" for k, v in conf.items())


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of the text file ``path`` (``"(no log)"`` if unreadable)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def terminate(
    pid: int, timeout: float = 15.0, children: Collection[subprocess.Popen[bytes]] = ()
) -> None:
    """SIGTERM the process group ``pid``, wait up to ``timeout`` seconds for ``pid`` to
    end, then SIGKILL the group. ``children``: processes this process started (one of them
    is reaped when it is ``pid``, or it stays a zombie "alive")."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        for child in children:
            if child.pid == pid:
                child.poll()  # reap our own child, or it stays a zombie "alive"
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
