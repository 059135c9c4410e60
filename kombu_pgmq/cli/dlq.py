"""``kombu-pgmq dlq list|replay|purge``: the dead-letter queue (:mod:`kombu_pgmq.dlq`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from ..dlq import DEFAULT_DEAD_LETTER_QUEUE, DeadLetterInfo, DeadLetterQueue
from ._base import F, T, _console, _examples, _Group, _run, main, url_option

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


def _require_filter(action: str, everything: bool, where: dict[str, Any]) -> None:
    """Refuse an unfiltered replay or purge without ``--all`` (a usage error, before
    asking for confirmation or connecting)."""
    if not everything and not any(_where(where).values()):
        raise click.UsageError(
            f"say which dead letters to {action}: --id N, --queue Q, --reason R or --task T, "
            "or --all for every one"
        )


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
@click.option(
    "--limit", default=50, show_default=True, type=click.IntRange(min=1), help="Most rows shown."
)
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
    """Send dead letters back to their original queues (atomically, per batch): those
    the filters match, or every one with --all."""
    _require_filter("replay", everything, where)
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
    """Delete dead letters for good: those the filters match, or every one with --all."""
    _require_filter("purge", everything, where)
    if not yes:
        click.confirm(f"delete the matching dead letters of {dlq_name} for good?", abort=True)
    n = _with_dlq(url, dlq_name, lambda dead: dead.purge(**_where(where), all=everything))
    Console().print(f"purged {n} dead letter(s) from {dlq_name}")
