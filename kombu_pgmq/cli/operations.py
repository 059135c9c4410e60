"""``kombu-pgmq queues|messages|queue|task|metrics``: see and steer the broker
(:mod:`kombu_pgmq.management`, :mod:`kombu_pgmq.metrics`).

Every command takes ``--url`` (default ``$KOMBU_PGMQ_URL``, ``$DATABASE_URL``, then the
embedded PostgreSQL if it runs; ``--embedded`` starts it) and ``--json`` where it prints
rows (one JSON object per line, on stdout; the database line is on stderr).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import click
from rich.table import Table

from ..dlq import DEFAULT_DEAD_LETTER_QUEUE
from ..management import Management, QueueStats
from ._base import _console, _examples, _fail, _Group, _run, _when, main, url_option
from ._limit_text import summary as limit_summary

T = TypeVar("T")

#: A queue whose tables hold this many dead rows is named as held back by an old holder
#: of the xmin horizon (``kombu-pgmq queues``).
HELD_DEAD_ROWS = 1_000

dlq_option = click.option(
    "--dlq",
    "dlq_name",
    default=DEFAULT_DEAD_LETTER_QUEUE,
    show_default=True,
    help="Kombu name of the dead-letter queue (transport option dead_letter_queue).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")


def _with_management(
    url: str | None, action: Callable[[Management], T], dlq_name: str = DEFAULT_DEAD_LETTER_QUEUE
) -> T:
    def run(resolved: str) -> T:
        with Management(resolved, dead_letter_queue=dlq_name) as management:
            return action(management)

    return _run(url, run)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _table(title: str, columns: list[tuple[str, str]]) -> Table:
    table = Table(title=title, title_justify="left")
    for name, justify in columns:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    return table


# -- queues -----------------------------------------------------------------------------


@main.command(
    "queues",
    epilog=_examples(
        "kombu-pgmq queues",
        "kombu-pgmq queues --all          # also Celery's pidbox and reply queues",
        "kombu-pgmq queues --json | jq 'select(.ready > 1000)'",
    ),
)
@url_option
@dlq_option
@click.option("--all", "everything", is_flag=True, help="Include Celery's pidbox/reply queues.")
@json_option
def queues(url: str | None, dlq_name: str, everything: bool, as_json: bool) -> None:
    """Every queue: ready, in flight, delayed, oldest age, consumers, archive, DLQ,
    settled in a transaction, dead rows, limits.

    ready: visible now; in flight: delivered, held by a consumer's visibility timeout;
    delayed: countdown/ETA not due yet. Oldest: age since publish of the oldest ready or
    in-flight message. Archive: acked messages (an estimate above 100,000, marked ~).
    DLQ: dead letters that came from the queue. In tx (shown when a queue has some):
    messages archived by their task's own transaction (AtomicTask; JSON:
    settled_in_transaction, null when the database or role cannot count them). Dead
    rows (shown when a queue has 1,000 or more): row versions deliveries and acks left
    in its tables, not vacuumed yet; when an old transaction holds the database's xmin
    horizon (VACUUM can remove none of them), it is named below the table (JSON:
    dead_tuples, dead_tuples_held_by).
    Limits (shown when a queue has some):
    conc 3/5 = 3 in flight of a concurrency limit of 5, a rate (100/s), key 2 = 2 per key,
    fifo = a FIFO queue (see kombu-pgmq queue limit QUEUE).
    """
    stats, holder = _with_management(url, lambda m: (m.queues(), m.horizon()), dlq_name)
    if not everything:
        stats = [q for q in stats if not _is_celery_internal(q)]
    held = holder if holder is not None and holder.old is not False else None
    if as_json:
        for q in stats:
            by = held if held is not None and (q.dead_tuples or 0) >= HELD_DEAD_ROWS else None
            row = q.as_dict() | {"dead_tuples_held_by": None if by is None else by._asdict()}
            click.echo(json.dumps(row))
        return
    console = _console()
    if not stats:
        console.print("no queues (a worker or a publish declares them)")
        return
    limited = any(q.limits is not None for q in stats)
    dead = any((q.dead_tuples or 0) >= HELD_DEAD_ROWS for q in stats)
    atomic = any(q.settled_in_transaction for q in stats)
    table = _table(
        "queues",
        [
            ("queue", "left"),
            ("ready", "right"),
            ("in flight", "right"),
            ("delayed", "right"),
            ("oldest", "right"),
            ("consumers", "right"),
            ("archive", "right"),
            ("DLQ", "right"),
            *([("in tx", "right")] if atomic else []),
            *([("dead rows", "right")] if dead else []),
            ("state", "left"),
            *([("limits", "left")] if limited else []),
        ],
    )
    for q in stats:
        archive = (
            "?" if q.archived is None else f"{'~' if q.archived_estimated else ''}{q.archived:,}"
        )
        table.add_row(
            q.name,
            f"{q.ready:,}",
            f"{q.in_flight:,}",
            f"{q.delayed:,}",
            _age(q.oldest_age_seconds),
            str(q.consumers),
            archive,
            f"{q.dead_letters:,}",
            *([f"{q.settled_in_transaction or 0:,}"] if atomic else []),
            *([f"{q.dead_tuples or 0:,}"] if dead else []),
            "[yellow]paused[/yellow]" if q.paused else "",
            *([limit_summary(q.limits)] if limited else []),
        )
    console.print(table)
    if held is not None and dead:
        console.print(
            f"[yellow]dead rows stay[/yellow]: {held.describe()} holds the database's xmin "
            "horizon; VACUUM removes none of the dead rows until it ends (docs: Long "
            "transactions)",
            highlight=False,
        )


def _is_celery_internal(q: QueueStats) -> bool:
    """Celery's remote-control and reply queues (``*.pidbox``, ``*.reply.celery.pidbox``)."""
    return q.name.endswith(".pidbox") or ".reply." in q.name


# -- messages ---------------------------------------------------------------------------


@main.command(
    "messages",
    epilog=_examples(
        "kombu-pgmq messages celery",
        "kombu-pgmq messages celery --limit 100 --json",
    ),
)
@url_option
@click.argument("queue")
@click.option("--limit", default=20, show_default=True, help="Most messages shown.")
@json_option
def messages(url: str | None, queue: str, limit: int, as_json: bool) -> None:
    """Peek at QUEUE's messages without consuming them (nothing changes: no visibility
    timeout, no read_ct). Higher priorities first, then publish order."""
    if limit < 1:
        raise click.BadParameter("show at least 1 message", param_hint="--limit")
    found = _with_management(url, lambda m: m.messages(queue, limit))
    if as_json:
        for message in found:
            click.echo(json.dumps(message.as_dict()))
        return
    console = _console()
    if not found:
        console.print(f"queue {queue} is empty")
        return
    table = _table(
        f"messages in {queue}",
        [
            ("msg_id", "right"),
            ("state", "left"),
            ("task", "left"),
            ("task id", "left"),
            ("args", "left"),
            ("read_ct", "right"),
            ("enqueued (UTC)", "left"),
            ("visible at (UTC)", "left"),
        ],
    )
    for m in found:
        table.add_row(
            str(m.msg_id) if m.band == 0 else f"{m.msg_id} (p{m.band})",
            m.state,
            m.task or "-",
            m.task_id or "-",
            m.args,
            str(m.read_ct),
            _when(m.enqueued_at),
            _when(m.visible_at),
        )
    console.print(table)


# -- queue pause|resume (queue limit: cli/limits.py) ---------------------------------------


@main.group(
    "queue",
    cls=_Group,
    epilog=_examples("kombu-pgmq queue pause celery", "kombu-pgmq queue limit celery --rate 10/s"),
)
def queue_group() -> None:
    """Steer one queue: pause or resume its consumers, limit its deliveries."""


@queue_group.command(
    "pause",
    epilog=_examples("kombu-pgmq queue pause reports", "kombu-pgmq queue resume reports"),
)
@url_option
@click.argument("queue")
def queue_pause(url: str | None, queue: str) -> None:
    """Stop consumers receiving from QUEUE (within one polling interval); publishes still
    land, running tasks finish and ack. Survives restarts; resume undoes it."""
    _with_management(url, lambda m: m.pause(queue))
    click.echo(
        f"paused {queue}: consumers receive nothing from it until 'kombu-pgmq queue resume {queue}'"
    )


@queue_group.command("resume", epilog=_examples("kombu-pgmq queue resume reports"))
@url_option
@click.argument("queue")
def queue_resume(url: str | None, queue: str) -> None:
    """Let consumers receive from QUEUE again (waiting consumers are woken at once)."""
    bands = _with_management(url, lambda m: m.resume(queue))
    click.echo(f"resumed {queue}" if bands else f"{queue} was not paused")


# -- task find|cancel -------------------------------------------------------------------


@main.group(
    "task",
    cls=_Group,
    epilog=_examples("kombu-pgmq task find 5d0f7c1e-...", "kombu-pgmq task cancel 5d0f7c1e-..."),
)
def task_group() -> None:
    """Find or cancel one Celery task by its id."""


@task_group.command(
    "find",
    epilog=_examples(
        "kombu-pgmq task find 0b5c4a9e-8f7f-4a55-9d4c-0a3f1c0e2b11",
        "kombu-pgmq task find 0b5c4a9e-8f7f-4a55-9d4c-0a3f1c0e2b11 --no-archive --json",
    ),
)
@url_option
@click.argument("task_id")
@click.option("--no-archive", is_flag=True, help="Search the queues only (archives can be big).")
@json_option
def task_find(url: str | None, task_id: str, no_archive: bool, as_json: bool) -> None:
    """Where TASK_ID's messages are: queued (ready, in flight, delayed), archived (done,
    or cancelled) or dead-lettered. Exit status 1 if it is nowhere."""
    found = _with_management(url, lambda m: m.find_task(task_id, archives=not no_archive))
    if as_json:
        for loc in found:
            click.echo(json.dumps(loc.as_dict()))
    elif found:
        table = _table(
            f"task {task_id}",
            [
                ("queue", "left"),
                ("state", "left"),
                ("reason", "left"),
                ("task", "left"),
                ("msg_id", "right"),
                ("read_ct", "right"),
                ("enqueued (UTC)", "left"),
                ("visible at / archived (UTC)", "left"),
            ],
        )
        for loc in found:
            table.add_row(
                loc.queue,
                loc.state,
                loc.reason or "-",
                loc.task or "-",
                str(loc.msg_id),
                str(loc.read_ct),
                _when(loc.enqueued_at),
                _when(loc.archived_at or loc.visible_at),
            )
        _console().print(table)
    if not found:
        _fail(
            f"task {task_id} is in no queue{'' if no_archive else ' and no archive'} of this "
            "database (a task published to another broker, or its archive rows were pruned)"
        )


@task_group.command(
    "cancel",
    epilog=_examples(
        "kombu-pgmq task cancel 0b5c4a9e-8f7f-4a55-9d4c-0a3f1c0e2b11",
        "kombu-pgmq task cancel 0b5c4a9e-8f7f-4a55-9d4c-0a3f1c0e2b11 --terminate",
    ),
)
@url_option
@click.argument("task_id")
@click.option(
    "--no-revoke",
    is_flag=True,
    help="Do not ask the running workers (Celery's revoke) to skip or stop the task.",
)
@click.option(
    "--terminate",
    is_flag=True,
    help="Also terminate the task if it runs (Celery's revoke --terminate, SIGTERM).",
)
@json_option
def task_cancel(
    url: str | None, task_id: str, no_revoke: bool, terminate: bool, as_json: bool
) -> None:
    """Cancel TASK_ID, queued, delayed or running: a queued or delayed message is removed
    and archived with reason 'cancelled', and the task is revoked on every worker as
    'celery control revoke' does (--terminate: a running task is killed too). The
    revocation is recorded in the database: workers started later refuse the task too."""

    def run(resolved: str) -> Any:
        with Management(resolved) as management:
            return management.cancel_task(task_id, revoke=not no_revoke, terminate=terminate)

    result = _run(url, run)
    if as_json:
        click.echo(json.dumps(result.as_dict()))
        return
    for queue, msg_id in result.cancelled:
        click.echo(f"cancelled {task_id}: message {msg_id} of {queue} archived (reason cancelled)")
    for loc in result.in_flight:
        click.echo(f"{task_id} is delivered to a worker from {loc.queue} (message {loc.msg_id})")
    if not result.cancelled and not result.in_flight:
        click.echo(
            f"{task_id} is in no queue of this database: running (its message acked when it "
            f"started), finished, or unknown (see 'kombu-pgmq task find {task_id}')"
        )
    if result.revoked:
        what = "revoked and terminated if it runs" if result.terminated else "revoked"
        click.echo(
            f"{task_id} {what}: sent to every worker (Celery's remote control) and recorded "
            "(workers started later refuse it too)"
        )
    else:
        click.echo(
            f"{task_id} recorded as revoked (workers started later refuse it); running "
            "workers were not told (--no-revoke)"
        )


# -- metrics ----------------------------------------------------------------------------


@main.group("metrics", cls=_Group, epilog=_examples("kombu-pgmq metrics serve --port 9808"))
def metrics_group() -> None:
    """Prometheus metrics of every queue."""


#: The basic auth password of ``metrics serve`` when no --basic-auth-password-file.
PASSWORD_ENV = "KOMBU_PGMQ_METRICS_PASSWORD"


@metrics_group.command(
    "serve",
    epilog=_examples(
        "kombu-pgmq metrics serve --url postgresql://monitor@db/app --port 9808",
        "curl -s localhost:9808/metrics | grep kombu_pgmq_queue_messages",
        "kombu-pgmq metrics serve --host 0.0.0.0 --tls-cert exporter.crt \\",
        "    --tls-key exporter.key --basic-auth-user prometheus \\",
        "    --basic-auth-password-file /run/secrets/metrics_password",
        "curl -s --cacert exporter.crt -u prometheus https://db-host:9808/metrics",
    ),
)
@url_option
@dlq_option
@click.option(
    "--port",
    default=9808,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="TCP port of /metrics (0: a free one).",
)
@click.option(
    "--host",
    metavar="ADDRESS",
    default=None,
    help="Address to listen on. Default: 127.0.0.1 (this machine only); 0.0.0.0 or :: "
    "for every interface (then add TLS and basic auth: a warning says what is missing).",
)
@click.option("--addr", default=None, hidden=True, help="Old name of --host.")
@click.option(
    "--tls-cert",
    metavar="FILE",
    help="PEM certificate (chain): serve HTTPS (TLS 1.2+). Needs --tls-key.",
)
@click.option("--tls-key", metavar="FILE", help="Unencrypted PEM private key of --tls-cert.")
@click.option(
    "--tls-client-ca",
    metavar="FILE",
    help="PEM CA certificate(s): scrapers must present a certificate it signed (mutual TLS).",
)
@click.option(
    "--basic-auth-user",
    metavar="USER",
    help=f"Require HTTP basic auth as USER (else 401); the password from "
    f"--basic-auth-password-file, else ${PASSWORD_ENV}.",
)
@click.option(
    "--basic-auth-password-file",
    metavar="FILE",
    help="File holding the basic auth password (surrounding whitespace, such as the "
    "final newline, is ignored). Never give a password on the command line.",
)
@click.option(
    "--cache-seconds",
    metavar="SECONDS",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    help="Scrapes within this many seconds of the last read of the statistics get that "
    "snapshot again (0: read on every scrape; concurrent scrapes always share one read).",
)
def metrics_serve(
    url: str | None,
    dlq_name: str,
    port: int,
    host: str | None,
    addr: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    tls_client_ca: str | None,
    basic_auth_user: str | None,
    basic_auth_password_file: str | None,
    cache_seconds: float,
) -> None:
    """Serve Prometheus metrics on http://127.0.0.1:PORT/metrics until stopped (Ctrl-C,
    SIGTERM): per queue ready/in-flight/delayed messages, oldest age, consumers,
    archive and dead letters, from one statement per snapshot (at most one per
    --cache-seconds, whatever the number of scrapers; kombu_pgmq_scrape_age_seconds
    says how old). --host widens it; then use HTTPS (--tls-cert, --tls-key,
    --tls-client-ca) and basic auth (--basic-auth-user)."""
    from .. import _metrics_server
    from ..metrics import DEFAULT_HOST, serve

    if host is not None and addr is not None and host != addr:
        raise click.UsageError("--addr is the old name of --host: give one of them")
    host = host or addr or DEFAULT_HOST
    if (tls_cert is None) != (tls_key is None):
        given, needed = (
            ("--tls-key", "--tls-cert") if tls_cert is None else ("--tls-cert", "--tls-key")
        )
        _fail(f"{given} needs {needed}: give the certificate and its key (or neither: HTTP)")
    if tls_client_ca is not None and tls_cert is None:
        _fail("--tls-client-ca needs --tls-cert and --tls-key (the exporter's own certificate)")
    for option, path in (
        ("--tls-cert", tls_cert),
        ("--tls-key", tls_key),
        ("--tls-client-ca", tls_client_ca),
    ):
        if path is not None:
            _readable(option, path)
    basic_auth = _basic_auth(basic_auth_user, basic_auth_password_file)

    def check(resolved: str) -> str:
        with Management(resolved, dead_letter_queue=dlq_name) as management:
            management.queues()  # fail now, with one line, not at the first scrape
        return resolved

    resolved = _run(url, check)
    # a server's log: the warning of a wide host, failed reads, with the time
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    try:
        server, _thread, _registry = serve(
            resolved,
            host=host,
            port=port,
            certfile=tls_cert,
            keyfile=tls_key,
            client_cafile=tls_client_ca,
            basic_auth=basic_auth,
            cache_seconds=cache_seconds,
            dead_letter_queue=dlq_name,
        )
    except OSError as exc:
        fix = (
            "choose another --port"
            if exc.errno == errno.EADDRINUSE
            else "give --host an address of this machine (127.0.0.1, 0.0.0.0, ::)"
        )
        _fail(f"cannot listen on {host}:{port} ({exc.strerror or exc}): {fix}")
    bound, bound_port = _metrics_server.bound(server)
    shown = f"[{bound}]" if ":" in bound else bound
    scheme = "https" if tls_cert else "http"
    details = ", ".join(
        [
            *(["mutual TLS" if tls_client_ca else "TLS"] if tls_cert else []),
            *([f"basic auth as {basic_auth_user}"] if basic_auth else []),
            f"snapshot cached {cache_seconds:g}s",
        ]
    )
    click.echo(
        f"serving kombu_pgmq metrics on {scheme}://{shown}:{bound_port}/metrics "
        f"({details}; Ctrl-C stops)"
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    server.shutdown()
    server.server_close()


def _readable(option: str, path: str) -> None:
    """Exit with one error line naming ``option`` if ``path`` cannot be read."""
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        _fail(f"{option} {path}: {exc.strerror or exc}: give a readable file")


def _basic_auth(user: str | None, password_file: str | None) -> tuple[str, str] | None:
    """``(user, password)`` from --basic-auth-user and --basic-auth-password-file (else
    ``$KOMBU_PGMQ_METRICS_PASSWORD``), ``None`` without a user; exits with one error line
    naming the option on anything missing, unreadable or empty. The password is never
    printed."""
    from_env = os.environ.get(PASSWORD_ENV)
    if user is None:
        if password_file is not None:
            _fail("--basic-auth-password-file needs --basic-auth-user USER")
        if from_env is not None:
            _fail(f"${PASSWORD_ENV} is set but --basic-auth-user is not: give the user")
        return None
    if not user or ":" in user:
        _fail(f"--basic-auth-user {user!r}: give a non-empty user name without ':'")
    if password_file is not None:
        try:
            with open(password_file, encoding="utf-8") as f:
                password = f.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            _fail(
                f"--basic-auth-password-file {password_file}: {reason}: give a readable "
                "file holding the password"
            )
        if not password:
            _fail(f"--basic-auth-password-file {password_file} is empty: write the password in it")
        return user, password
    if not from_env:
        _fail(
            f"--basic-auth-user needs a password: --basic-auth-password-file FILE or "
            f"${PASSWORD_ENV} (never on the command line)"
        )
    return user, from_env
