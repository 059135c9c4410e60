"""``kombu-pgmq archive prune``: archive retention (:mod:`kombu_pgmq.retention`)."""

from __future__ import annotations

import click
from rich.table import Table

from ..retention import prune_archives
from ._base import _console, _examples, _Group, _run, main, parse_duration, url_option

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
@click.option(
    "--batch-size",
    default=5000,
    show_default=True,
    type=click.IntRange(min=1),
    help="Rows per transaction.",
)
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
