"""``kombu-pgmq``: operator commands (dead letters, archive retention, Spark server).

Every command takes ``--url`` (default: ``$KOMBU_PGMQ_URL``, then ``$DATABASE_URL``,
then the embedded PostgreSQL of :mod:`kombu_pgmq.embedded`)::

    kombu-pgmq dlq list [--queue Q] [--reason R] [--task T] [--id N ...] [--limit 50] [--json]
    kombu-pgmq dlq replay (--all | --id N ... | --queue Q | --reason R | --task T)
    kombu-pgmq dlq purge  (--all | --id N ... | --queue Q | --reason R | --task T) [--yes]
    kombu-pgmq archive prune --older-than 7d [--queue Q ...] [--batch-size 5000]
    kombu-pgmq spark server start|stop|status [--port 15002]

Exit status: 0 on success, 1 on an error (printed, naming the fix), 2 on bad usage.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click
from rich.console import Console
from rich.table import Table

from . import errors
from .dlq import DEFAULT_DEAD_LETTER_QUEUE, DeadLetterInfo, DeadLetterQueue
from .retention import prune_archives

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


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
    from .embedded import default_broker_url

    return default_broker_url()


def _console() -> Console:
    """A console for tables: a terminal's width, or wide enough when piped (rich would
    assume 80 columns and fold task names)."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def _fail(exc: Exception) -> NoReturn:
    Console(stderr=True).print(f"[bold red]error:[/] {exc}", highlight=False)
    raise SystemExit(1)


@click.group()
@click.version_option(package_name="kombu-pgmq-transport")
def main() -> None:
    """kombu_pgmq operator commands (PostgreSQL as a Kombu/Celery broker)."""


url_option = click.option(
    "--url",
    envvar="KOMBU_PGMQ_URL",
    help="Broker URL (postgresql://...). Default: $KOMBU_PGMQ_URL, $DATABASE_URL, "
    "else the embedded PostgreSQL.",
)


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
                "--reason", type=click.Choice(["max_deliveries", "rejected"]), help="Reason."
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
    try:
        with DeadLetterQueue(_url(url), queue=dlq_name) as dead:
            return action(dead)
    except errors.KombuPgmqError as exc:
        _fail(exc)


@main.group()
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


@dlq.command("list")
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


@dlq.command("replay")
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


@dlq.command("purge")
@_filters
@click.option("--all", "everything", is_flag=True, help="Every dead letter.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def dlq_purge(url: str | None, dlq_name: str, everything: bool, yes: bool, **where: Any) -> None:
    """Delete dead letters for good."""
    if not yes:
        click.confirm(f"delete the matching dead letters of {dlq_name} for good?", abort=True)
    n = _with_dlq(url, dlq_name, lambda dead: dead.purge(**_where(where), all=everything))
    Console().print(f"purged {n} dead letter(s) from {dlq_name}")


@main.group()
def archive() -> None:
    """Archives (acked messages, pgmq.a_<queue>): retention."""


@archive.command("prune")
@url_option
@click.option("--older-than", required=True, help="Age: seconds, or with s/m/h/d/w (e.g. 7d).")
@click.option("--queue", "queues", multiple=True, help="Kombu queue (default: every queue).")
@click.option("--batch-size", default=5000, show_default=True, help="Rows per transaction.")
def archive_prune(
    url: str | None, older_than: str, queues: tuple[str, ...], batch_size: int
) -> None:
    """Delete archived messages older than --older-than, in short batches."""
    seconds = parse_duration(older_than)
    try:
        deleted = prune_archives(
            _url(url),
            older_than_seconds=seconds,
            queues=list(queues) or None,
            batch_size=batch_size,
        )
    except errors.KombuPgmqError as exc:
        _fail(exc)
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


@main.group()
def spark() -> None:
    """The local Spark Connect server of Spark tasks (kombu_pgmq.spark)."""


@spark.group("server")
def spark_server() -> None:
    """Start, stop or inspect the local Spark Connect server (one per host and port)."""


def _port_option(func: F) -> F:
    return click.option(
        "--port",
        type=int,
        default=None,
        help="Server port (default: $KOMBU_PGMQ_SPARK_CONNECT_PORT, else 15002).",
    )(func)


@spark_server.command("start")
@_port_option
def spark_server_start(port: int | None) -> None:
    """Start the server unless it is running (it keeps running after this command)."""
    from .spark import server

    conf = {"spark_connect_port": port} if port else None
    try:
        url = server.ensure_running(conf)
    except errors.KombuPgmqError as exc:
        _fail(exc)
    click.echo(f"running: {url} (log: {server.status(server.local_port(conf))['log']})")


@spark_server.command("stop")
@_port_option
def spark_server_stop(port: int | None) -> None:
    """Stop the server started by kombu_pgmq (running Spark jobs are cancelled)."""
    from .spark import server

    port = port or server.local_port()
    click.echo("stopped" if server.stop(port) else f"no kombu_pgmq Spark server on port {port}")


@spark_server.command("status")
@_port_option
def spark_server_status(port: int | None) -> None:
    """Whether the server answers, its pid and log file."""
    from .spark import server

    info = server.status(port or server.local_port())
    state = "running" if info["accepting"] else "not running"
    click.echo(f"{state}: port {info['port']}, pid {info['pid']}, log {info['log']}")


if __name__ == "__main__":  # pragma: no cover
    main()
