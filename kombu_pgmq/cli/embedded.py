"""``kombu-pgmq embedded start|status|url|stop``: the embedded PostgreSQL
(:mod:`kombu_pgmq.embedded`)."""

from __future__ import annotations

import logging

import click

from ._base import _examples, _fail, _Group, main

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
    """The embedded PostgreSQL (the 'embedded' extra; data in $KOMBU_PGMQ_EMBEDDED_DIR,
    else a per-user directory). Other commands use it with --embedded (starting it), or
    while it runs when no URL is configured; none of them starts it otherwise.
    """
    logging.basicConfig(level=logging.WARNING, format="%(message)s")


@embedded_group.command(
    "url",
    epilog=_examples('export KOMBU_PGMQ_URL="$(kombu-pgmq embedded url)"'),
)
def embedded_url() -> None:
    """Print the broker URL to use: $KOMBU_PGMQ_URL, else a PostgreSQL $DATABASE_URL,
    else the running embedded server's. Starts nothing ('kombu-pgmq embedded start' does,
    and prints the URL too): exit status 1 when there is no URL."""
    from ..embedded import configured_url, running_url

    url = configured_url() or running_url()
    if url is None:
        _fail(
            "no broker URL is configured and the embedded PostgreSQL is not running: "
            "start it with kombu-pgmq embedded start (it prints its URL)"
        )
    click.echo(url)


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
