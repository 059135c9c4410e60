"""``kombu-pgmq schema install|status|grant``: PGMQ and kombu_pgmq's migrations, least privilege."""

from __future__ import annotations

import click

from .. import schema
from .._conninfo import redact, to_dsn
from ._base import _EXAMPLE_URL, _examples, _fail, _Group, _run, main, url_option

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
    """The database schema: PGMQ and kombu_pgmq's tables (migrations)."""


@schema_group.command(
    "install",
    epilog=_examples(
        "kombu-pgmq schema install --url " + _EXAMPLE_URL,
        "KOMBU_PGMQ_URL=" + _EXAMPLE_URL + " kombu-pgmq schema install",
    ),
)
@url_option
def schema_install(url: str | None) -> None:
    """Install PGMQ (if missing) and kombu_pgmq's schema, or the migrations it lacks.

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
