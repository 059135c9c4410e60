"""``kombu-pgmq results [expire]``: the Celery results stored by kombu_pgmq's result
backend (``result_backend = "postgresql://..."``; :meth:`kombu_pgmq.management.Management.results`).
"""

from __future__ import annotations

import json
from typing import Any

import click
from rich.table import Table

from ..management import Management, ResultStats
from ._base import _console, _examples, _Group, _run, _when, main, url_option

json_option = click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")


def _size(n: int) -> str:
    """``512 -> "512 B"``, ``1536 -> "1.5 kB"`` (powers of 1024), up to GB."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("kB", "MB", "GB"):
        value /= 1024
        if value < 1024 or unit == "GB":
            break
    return f"{value:.1f} {unit}"


def as_dict(row: ResultStats) -> dict[str, Any]:
    """JSON-ready (``oldest`` as ISO 8601)."""
    return {
        "state": row.state,
        "results": row.results,
        "oldest": row.oldest.isoformat() if row.oldest else None,
        "bytes": row.bytes,
        "expired": row.expired,
    }


@main.group(
    "results",
    cls=_Group,
    invoke_without_command=True,
    epilog=_examples(
        "kombu-pgmq results",
        "kombu-pgmq results --json | jq 'select(.state == \"FAILURE\")'",
        "kombu-pgmq results expire",
    ),
)
@url_option
@json_option
@click.pass_context
def results(ctx: click.Context, url: str | None, as_json: bool) -> None:
    """Celery results by state: how many, the oldest, their size, and how many are past
    their expiry (result_expires) but not deleted yet (a worker deletes them every
    expire_interval_seconds; 'kombu-pgmq results expire' now)."""
    if ctx.invoked_subcommand is not None:
        return

    def read(resolved: str) -> list[ResultStats]:
        with Management(resolved) as management:
            return management.results()

    rows = _run(url, read)
    if as_json:
        for row in rows:
            click.echo(json.dumps(as_dict(row)))
        return
    console = _console()
    if not rows:
        console.print("no results stored")
        return
    table = Table(title="results", title_justify="left")
    for name, justify in (
        ("state", "left"),
        ("results", "right"),
        ("oldest (UTC)", "left"),
        ("size", "right"),
        ("expired", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        table.add_row(
            row.state, str(row.results), _when(row.oldest), _size(row.bytes), str(row.expired)
        )
    oldest = min((r.oldest for r in rows if r.oldest), default=None)
    table.add_row(
        "total",
        str(sum(r.results for r in rows)),
        _when(oldest),
        _size(sum(r.bytes for r in rows)),
        str(sum(r.expired for r in rows)),
        style="bold",
    )
    console.print(table)


@results.command("expire", epilog=_examples("kombu-pgmq results expire --batch-size 1000"))
@url_option
@click.option(
    "--batch-size",
    default=5000,
    show_default=True,
    type=click.IntRange(min=1),
    help="Rows per statement.",
)
def results_expire(url: str | None, batch_size: int) -> None:
    """Delete every expired result now (what the workers' sweep does on its own)."""

    def expire(resolved: str) -> int:
        with Management(resolved) as management:
            return management.expire_results(batch_size)

    deleted = _run(url, expire)
    click.echo(f"{deleted} expired results deleted")
