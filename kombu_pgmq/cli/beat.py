"""``kombu-pgmq beat list|add|remove|enable|disable|run-now|history|leader``: the periodic
tasks of the beat scheduler (:mod:`kombu_pgmq.beat`, ``celery beat -S
kombu_pgmq.beat:Scheduler``) and which beat leads.

``list``, ``history`` and ``leader`` only read (:class:`kombu_pgmq.management.Management`,
no Celery needed); ``add``, ``remove``, ``enable``, ``disable`` and ``run-now`` go through
:class:`kombu_pgmq.beat.PeriodicTasks` (Celery needed) and reach the leading beat at once.
A ``producer`` role may run them all (``kombu-pgmq schema grant producer ROLE``).

Exit status: 0 on success, 1 on an error (one ``error: ...`` line naming the fix: bad
input as :class:`~kombu_pgmq.errors.ConfigurationError` words it, an unknown name, a
database without the beat tables), 2 on bad usage; ``leader`` exits 1 when no beat leads.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import click
from rich.table import Table

from .. import errors
from .._control import BUILTIN_PREFIX, registered_tasks
from ..management import Management
from ._base import _console, _examples, _fail, _Group, _run, _when, main, url_option

if TYPE_CHECKING:
    from ..beat import PeriodicTasks

T = TypeVar("T")

json_option = click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
_CRON_ORDER = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
_SETUP = "start one with: celery -A proj beat -S kombu_pgmq.beat:Scheduler (or worker -B)"


def schedule_text(kind: str, spec: Mapping[str, Any]) -> str:
    """A stored schedule for people: ``every 30 s``, ``cron */5 * * * * (Europe/Paris)``
    (the fields in crontab order: minute hour day-of-month month day-of-week; the zone
    only when the entry has its own), ``solar sunrise 48.85,2.35``."""
    if kind == "interval":
        text = f"every {float(spec.get('every', 0)):g} s"
        return text + (" (relative)" if spec.get("relative") else "")
    if kind == "crontab":
        fields = []
        for name in _CRON_ORDER:
            value = spec.get(name, "*")
            if isinstance(value, list):
                value = ",".join(str(v) for v in value)
            fields.append(str(value))
        tz = spec.get("tz")
        return "cron " + " ".join(fields) + (f" ({tz})" if tz else "")
    if kind == "solar":
        lat, lon = float(spec.get("lat", 0)), float(spec.get("lon", 0))
        return f"solar {spec.get('event')} {lat:g},{lon:g}"
    return f"{kind} {json.dumps(dict(spec))}"


def as_dict(row: NamedTuple) -> dict[str, Any]:
    """A stored row (entry, tick, leader) JSON-ready: its fields, times as ISO 8601; an
    entry also gets ``schedule_text`` (:func:`schedule_text`)."""
    data: dict[str, Any] = {
        key: value.isoformat() if isinstance(value, datetime) else value
        for key, value in row._asdict().items()
    }
    if "schedule_kind" in data:
        data["schedule_text"] = schedule_text(data["schedule_kind"], data["schedule"])
    return data


def _leader_line(leader: Any) -> str:
    if leader is None:
        return f"leader: none (no beat has led on this database; {_SETUP})"
    age = f"{leader.heartbeat_age:.1f} s ago"
    since = f"since {_when(leader.since)} UTC"
    if leader.alive:
        return f"leader: {leader.identity} (epoch {leader.epoch}) {since}, heartbeat {age}, alive"
    return (
        f"leader: none alive; {leader.identity} (epoch {leader.epoch}) led {since}, last "
        f"heartbeat {age}: a running beat takes over within beat_takeover_seconds, else "
        f"{_SETUP}"
    )


def _with_management(url: str | None, action: Callable[[Management], T]) -> T:
    def run(resolved: str) -> T:
        with Management(resolved) as management:
            return action(management)

    return _run(url, run)


def _with_tasks(
    url: str | None,
    action: Callable[[PeriodicTasks], T],
    *,
    check_queues: bool = False,
    install: bool = False,
    app: Any = None,
    check_tasks: bool = True,
    before: Callable[[str], None] | None = None,
) -> T:
    """Run ``action`` with :class:`~kombu_pgmq.beat.PeriodicTasks` on ``--url``'s
    database (``app``: checked against that Celery app). ``install``: install the schema
    if missing (``add``, as the API does); else a database without the beat tables is an
    error naming the fix. ``before``: called with the database's URL first."""

    def run(resolved: str) -> T:
        if not install:
            with Management(resolved) as management:
                management.beat_leader()  # ConfigurationError without the beat tables
        try:
            from ..beat import PeriodicTasks
        except ImportError as exc:
            raise errors.ConfigurationError(
                f"changing periodic tasks needs Celery ({exc}): pip install "
                "'kombu-pgmq-transport[celery]'"
            ) from None
        if before is not None:
            before(resolved)
        with PeriodicTasks(
            resolved, app=app, check_queues=check_queues, check_tasks=check_tasks
        ) as tasks:
            return action(tasks)

    return _run(url, run)


#: Longest wait for the running workers' answers to ``beat add``'s task check (seconds;
#: it ends as soon as every running worker answered).
REGISTERED_TIMEOUT_S = 3.0


def _load_app(name: str) -> Any:
    """The Celery app ``name`` names (:func:`kombu_pgmq.beat.api.load_app`).

    Raises:
        click.BadParameter: it cannot be loaded (the message says why and what to give).
    """
    try:
        from ..beat.api import load_app
    except ImportError as exc:
        raise click.BadParameter(
            f"needs Celery ({exc}): pip install 'kombu-pgmq-transport[celery]'",
            param_hint="'-A' / '--app'",
        ) from None
    try:
        return load_app(name)
    except errors.ConfigurationError as exc:
        raise click.BadParameter(str(exc), param_hint="'-A' / '--app'") from None


def _check_running_workers(resolved: str, task: str) -> str | None:
    """Refuse ``task`` when the workers running on ``resolved``'s broker answer and none
    registers it (exit status 1); the warning to print once it is added when no worker
    answers (not checked), else None."""
    registered = registered_tasks(resolved, timeout=REGISTERED_TIMEOUT_S)
    if not registered:
        return (
            f"no worker runs on this database: task {task!r} is not checked (-A APP "
            "checks it against your Celery app)"
        )
    if any(task in names for names in registered.values()):
        return None
    known = sorted(set().union(*registered.values()))
    close = difflib.get_close_matches(task, known, n=1)
    workers = ", ".join(sorted(registered))
    _fail(
        f"task {task!r} is not registered by any running worker ({workers})"
        f"{f': did you mean {close[0]!r}?' if close else ''}: check the name, or give "
        "--force to add it anyway (a task of workers not deployed yet); -A APP checks it "
        "against your Celery app instead"
    )


@main.group(
    "beat",
    cls=_Group,
    epilog=_examples(
        "kombu-pgmq beat list",
        "kombu-pgmq beat add cleanup app.tasks.cleanup --every 300",
        "kombu-pgmq beat leader",
    ),
)
def beat() -> None:
    """The beat scheduler's periodic tasks (celery beat -S kombu_pgmq.beat:Scheduler):
    list, add, change, run now, history, and which beat leads. Changes reach the leading
    beat at once, no restart."""


@beat.command(
    "list",
    epilog=_examples(
        "kombu-pgmq beat list",
        "kombu-pgmq beat list --json | jq 'select(.last_error != null)'",
    ),
)
@url_option
@json_option
def beat_list(url: str | None, as_json: bool) -> None:
    """Every periodic task: its schedule, enabled, catch-up policy, source (config:
    beat_schedule; api: added at run time), last run, next run (UTC), runs, missed ticks
    (caught up or skipped while no beat led), last error; then the leader. --json: one
    object per entry (the leader: 'kombu-pgmq beat leader --json')."""
    entries, leader = _with_management(url, lambda m: (m.beat_entries(), m.beat_leader()))
    if as_json:
        for entry in entries:
            click.echo(json.dumps(as_dict(entry)))
        return
    console = _console()
    if not entries:
        console.print("no periodic tasks (add one: kombu-pgmq beat add, or beat_schedule)")
    else:
        table = Table(title="periodic tasks", title_justify="left")
        for name, justify in (
            ("name", "left"),
            ("task", "left"),
            ("schedule", "left"),
            ("enabled", "left"),
            ("catch-up", "left"),
            ("source", "left"),
            ("last run (UTC)", "left"),
            ("next run (UTC)", "left"),
            ("runs", "right"),
            ("missed", "right"),
            ("last error", "left"),
        ):
            table.add_column(name, justify=justify)  # type: ignore[arg-type]
        for e in entries:
            table.add_row(
                e.name,
                e.task,
                schedule_text(e.schedule_kind, e.schedule),
                "yes" if e.enabled else "no",
                e.catch_up,
                e.source,
                _when(e.last_run_at),
                _when(e.next_run_at) if e.enabled else "- (disabled)",
                str(e.total_run_count),
                str(e.missed_ticks),
                e.last_error or "",
            )
        console.print(table)
    console.print(_leader_line(leader), highlight=False, soft_wrap=True)


def _json_value(option: str, text: str | None, kind: type, example: str) -> Any:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        _fail(f"{option} {text!r} is not JSON ({exc}): give e.g. {example}")
    if not isinstance(value, kind):
        _fail(f"{option} {text!r}: give a JSON {kind.__name__}, e.g. {example}")
    return value


def _schedule(
    name: str,
    every: float | None,
    cron: str | None,
    tz: str | None,
    solar: tuple[str, float, float] | None,
) -> Any:
    """The schedule ``PeriodicTasks.add`` takes, from exactly one of the options."""
    options = (("--every", every), ("--cron", cron), ("--solar", solar))
    given = [option for option, value in options if value is not None]
    if len(given) != 1:
        raise click.UsageError(
            "give one schedule: --every SECONDS, --cron 'm h dom mon dow' or --solar EVENT "
            f"LAT LON (given: {', '.join(given) or 'none'})"
        )
    if tz is not None and cron is None:
        raise click.UsageError("--tz goes with --cron (the zone its fields are read in)")
    if every is not None:
        return every
    if solar is not None:
        from ..beat.schedules import from_row

        event, lat, lon = solar
        return from_row("solar", {"event": event, "lat": lat, "lon": lon}, None, name)
    assert cron is not None
    if tz is None:
        return cron  # parsed (and its errors worded) by PeriodicTasks.add
    fields = cron.split()
    if len(fields) != 5:
        raise errors.ConfigurationError(
            f"periodic task {name!r}: invalid crontab {cron!r}: give five fields: minute "
            "hour day-of-month month day-of-week (e.g. '*/5 * * * *')"
        )
    from ..beat.schedules import from_row

    spec = {**dict(zip(_CRON_ORDER, fields, strict=True)), "tz": tz}
    return from_row("crontab", spec, None, name)


@beat.command(
    "add",
    epilog=_examples(
        "kombu-pgmq beat add cleanup app.tasks.cleanup --every 300",
        "kombu-pgmq beat add report app.tasks.report --cron '0 7 * * 1-5' --tz Europe/Paris \\",
        '    --kwargs \'{"format": "pdf"}\' --queue reports --expires 3600',
        "kombu-pgmq beat add blinds app.tasks.open_blinds --solar sunrise 48.85 2.35",
        "kombu-pgmq beat add -A proj cleanup app.tasks.cleanup --every 300",
    ),
)
@url_option
@click.argument("name")
@click.argument("task")
@click.option("--every", type=float, metavar="SECONDS", help="An interval schedule.")
@click.option("--cron", metavar="'m h dom mon dow'", help="A crontab schedule (five fields).")
@click.option(
    "--tz", metavar="ZONE", help="--cron's time zone (IANA; default: the beat app's timezone)."
)
@click.option(
    "--solar",
    type=(str, float, float),
    metavar="EVENT LAT LON",
    help="A solar schedule (sunrise, sunset, dawn_civil...; needs the ephem package).",
)
@click.option("--args", "args_json", metavar="JSON", help="Positional arguments (a JSON list).")
@click.option("--kwargs", "kwargs_json", metavar="JSON", help="Keyword arguments (a JSON object).")
@click.option("--queue", help="Queue to send to (it must exist: see --no-check-queue).")
@click.option("--priority", type=int, help="Message priority.")
@click.option("--expires", type=float, metavar="SECONDS", help="Each tick expires after this.")
@click.option("--options", "options_json", metavar="JSON", help="More apply_async options.")
@click.option("--disabled", is_flag=True, help="Add it disabled (beat enable NAME later).")
@click.option(
    "--catch-up",
    type=click.Choice(["once", "skip"]),
    default="once",
    show_default=True,
    help="After ticks were missed (no beat led): send one tick, or none.",
)
@click.option("--replace", is_flag=True, help="Replace the entry of that name (runs are kept).")
@click.option(
    "--no-check-queue",
    is_flag=True,
    help="Accept a --queue no worker has declared yet (the ticks wait in it).",
)
@click.option(
    "-A",
    "--app",
    "app_name",
    metavar="APP",
    help="Your Celery app, as for celery -A (proj, proj.celery:app): TASK must be one "
    "it registers, and its schedule database is the default --url. Without it, TASK "
    "must be registered by a worker running on the database, when one runs.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Add TASK even if the running workers (or --app) do not register it, e.g. a task "
    "of workers not deployed yet.",
)
def beat_add(
    url: str | None,
    name: str,
    task: str,
    every: float | None,
    cron: str | None,
    tz: str | None,
    solar: tuple[str, float, float] | None,
    args_json: str | None,
    kwargs_json: str | None,
    queue: str | None,
    priority: int | None,
    expires: float | None,
    options_json: str | None,
    disabled: bool,
    catch_up: str,
    replace: bool,
    no_check_queue: bool,
    app_name: str | None,
    force: bool,
) -> None:
    """Add periodic task NAME sending TASK (its registered name) on a schedule: exactly
    one of --every, --cron or --solar. It first runs one period after it is added (a
    crontab: at its next matching time); the leading beat sees it at once.

    TASK is checked first, as a worker would receive it: with --app, it must be a task
    that app registers; else, when workers run on the database, one of them must
    register it (asked as celery inspect registered does); with none running it is added
    with a warning. --force adds it unchecked."""
    app = _load_app(app_name) if app_name else None
    if app is not None and url is None:  # neither --url nor $KOMBU_PGMQ_URL
        from ..beat.settings import database_url

        url = database_url(app)
    args = _json_value("--args", args_json, list, "'[1, 2]'") or []
    kwargs = _json_value("--kwargs", kwargs_json, dict, "'{\"x\": 1}'") or {}
    options = _json_value("--options", options_json, dict, "'{\"countdown\": 5}'") or {}
    for key, value in (("queue", queue), ("priority", priority), ("expires", expires)):
        if value is not None:
            options[key] = value

    def add(tasks: PeriodicTasks) -> Any:
        from ..beat.entries import UnregisteredTask

        schedule = _schedule(name, every, cron, tz, solar)
        try:
            return tasks.add(
                name, task, schedule, args=args, kwargs=kwargs, options=options,
                enabled=not disabled, catch_up=catch_up, replace=replace,
            )  # fmt: skip
        except UnregisteredTask as exc:
            _fail(f"{exc}; or give --force to add it anyway")
        except errors.ConfigurationError as exc:
            if not replace and "exists already" in str(exc):
                _fail(f"periodic task {name!r} exists already: give --replace to replace it")
            raise

    warnings: list[str] = []  # printed once the entry is added

    def check(resolved: str) -> None:
        if force or task.startswith(BUILTIN_PREFIX):
            return
        if app is None:
            warning = _check_running_workers(resolved, task)
            warnings.extend([warning] if warning else [])
        elif not [t for t in app.tasks if not t.startswith(BUILTIN_PREFIX)]:
            warnings.append(
                f"app {app.main!r} registers no task (are its task modules imported? its "
                f"imports or include): task {task!r} is not checked"
            )

    entry = _with_tasks(
        url,
        add,
        check_queues=not no_check_queue,
        install=True,
        app=app,
        check_tasks=not force,
        before=check,
    )
    state = "" if entry.enabled else ", disabled"
    what = schedule_text(entry.schedule_kind, entry.schedule)
    click.echo(f"{'replaced' if replace else 'added'} {name!r}: {task} {what}{state}")
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)


def _unknown(name: str) -> str:
    return f"no periodic task named {name!r} (kombu-pgmq beat list shows them)"


@beat.command("remove", epilog=_examples("kombu-pgmq beat remove cleanup"))
@url_option
@click.argument("name")
def beat_remove(url: str | None, name: str) -> None:
    """Delete periodic task NAME (its history stays until pruned). An entry of
    beat_schedule comes back when a beat next starts to lead: remove it from the config."""
    if not _with_tasks(url, lambda tasks: tasks.remove(name)):
        _fail(_unknown(name))
    click.echo(f"removed {name!r}")


def _set_enabled(url: str | None, name: str, enabled: bool) -> None:
    def run(tasks: PeriodicTasks) -> None:
        (tasks.enable if enabled else tasks.disable)(name)

    _with_tasks(url, run)
    click.echo(f"{'enabled' if enabled else 'disabled'} {name!r}")


@beat.command("enable", epilog=_examples("kombu-pgmq beat enable cleanup"))
@url_option
@click.argument("name")
def beat_enable(url: str | None, name: str) -> None:
    """Send periodic task NAME on its schedule again (ticks missed meanwhile: its
    catch-up policy)."""
    _set_enabled(url, name, True)


@beat.command("disable", epilog=_examples("kombu-pgmq beat disable cleanup"))
@url_option
@click.argument("name")
def beat_disable(url: str | None, name: str) -> None:
    """Stop sending periodic task NAME (kept, with its history)."""
    _set_enabled(url, name, False)


@beat.command("run-now", epilog=_examples("kombu-pgmq beat run-now cleanup"))
@url_option
@click.argument("name")
def beat_run_now(url: str | None, name: str) -> None:
    """Ask the leading beat to send periodic task NAME once, now (history kind
    'manual'); its schedule does not move. A disabled task is not sent."""

    def run(tasks: PeriodicTasks) -> tuple[datetime, Any, bool]:
        requested = tasks.run_now(name)
        return requested, tasks.leader(), tasks.get(name).enabled

    requested, leader, enabled = _with_tasks(url, run)
    click.echo(f"run of {name!r} requested at {_when(requested)} UTC")
    if not enabled:
        click.echo(f"warning: {name!r} is disabled: it is sent once enabled", err=True)
    if leader is None or not leader.alive:
        click.echo(f"warning: no beat leads now: it is sent when one does ({_SETUP})", err=True)


@beat.command(
    "history",
    epilog=_examples("kombu-pgmq beat history", "kombu-pgmq beat history cleanup --limit 5"),
)
@url_option
@click.argument("name", required=False)
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=1))
@json_option
def beat_history(url: str | None, name: str | None, limit: int, as_json: bool) -> None:
    """Ticks sent, newest first, of NAME or of every periodic task: due time, kind
    (scheduled, catch-up, skipped, manual), due times missed and folded into it, task id,
    the leader that sent it and its epoch."""
    ticks = _with_management(url, lambda m: m.beat_history(name, limit))
    if as_json:
        for tick in ticks:
            click.echo(json.dumps(as_dict(tick)))
        return
    console = _console()
    if not ticks:
        console.print(f"no ticks sent{f' of {name!r}' if name else ''}")
        return
    table = Table(title="ticks", title_justify="left")
    for column in ("sent (UTC)", "entry", "due (UTC)", "kind", "missed", "task id", "leader"):
        table.add_column(column, justify="right" if column == "missed" else "left")
    for t in ticks:
        table.add_row(
            _when(t.sent_at),
            t.entry,
            _when(t.due_at),
            t.kind,
            str(t.missed),
            t.task_id or "-",
            f"{t.leader} (epoch {t.epoch})",
        )
    console.print(table)


@beat.command(
    "leader",
    epilog=_examples(
        "kombu-pgmq beat leader",
        "kombu-pgmq beat leader --json | jq -r .identity",
        "kombu-pgmq beat leader >/dev/null || echo 'no beat leads'",
    ),
)
@url_option
@json_option
def beat_leader(url: str | None, as_json: bool) -> None:
    """Which beat leads (host:pid), since when, its heartbeat's age (seconds) and whether
    it is alive (its session holds the lock). --json: one object (null: no beat ever
    led). Exit status 1 when no beat leads."""
    leader = _with_management(url, lambda m: m.beat_leader())
    if as_json:
        click.echo(json.dumps(None if leader is None else as_dict(leader)))
    else:
        click.echo(_leader_line(leader))
    if leader is None or not leader.alive:
        raise SystemExit(1)
