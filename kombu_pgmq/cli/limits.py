"""``kombu-pgmq queue limit``: see and change a queue's fleet-wide concurrency and rate
limits (:mod:`kombu_pgmq.limits`, :meth:`kombu_pgmq.management.Management.set_limits`).

Changes are persisted in the database and in force at the consumers' next read (within
one polling interval; waiting consumers are woken): no worker restarts. A worker whose
transport option ``queue_limits`` names the queue sets its limits again each time it
declares the queue (its configuration wins).
"""

from __future__ import annotations

import json
from typing import Any

import click

from ..errors import ConfigurationError, StatementError
from ..limits import validate_limits
from ..management import LimitInfo, Management
from ._base import _examples, _fail, url_option
from ._limit_text import FIFO_KEY, describe, limits_json
from .operations import _with_management, json_option, queue_group

#: ``--option`` of each limit (the names of ``kombu_pgmq.limits.LIMIT_NAMES``).
OPTIONS = {
    "concurrency": "--concurrency",
    "rate": "--rate",
    "burst": "--burst",
    "key_concurrency": "--key-concurrency",
    "key_rate": "--key-rate",
    "key_burst": "--key-burst",
    "limit_key": "--limit-key",
}


def _tokens(_ctx: click.Context, _param: click.Parameter, value: float | None) -> float | None:
    """A burst option's value: 0 (the default burst) or at least 1 token."""
    if value is not None and value != 0 and value < 1:
        raise click.BadParameter(f"{value:g}: give 1 token or more (0: the default burst)")
    return value


def _header(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """``--limit-key``: a header name, or ``task``."""
    if value is not None and not value.strip():
        raise click.BadParameter(
            "give a header name (x-limit-key, the default) or 'task' (Celery's task name)"
        )
    return value


def checked_limits(queue: str, given: dict[str, Any], *, clear: bool) -> dict[str, Any]:
    """``given`` (limit name -> option value, None: option not given) checked by
    :func:`kombu_pgmq.limits.validate_limits`, without the options not given.

    Raises:
        click.BadParameter: a bad value (names its option).
        click.UsageError: a burst without its rate (with ``clear``, or a rate of 0).
    """
    limits = {name: value for name, value in given.items() if value is not None}
    for name, value in limits.items():
        try:
            validate_limits(queue, {name: value}, complete=False)
        except ConfigurationError as exc:
            raise click.BadParameter(str(exc), param_hint=OPTIONS[name]) from None
    try:
        return validate_limits(queue, limits, complete=clear)
    except ConfigurationError:
        burst = "--key-burst" if limits.get("key_burst") and not limits.get("burst") else "--burst"
        rate = "--key-rate" if burst == "--key-burst" else "--rate"
        why = "--clear removes the rate" if clear else f"{rate} 0 removes the rate"
        raise click.UsageError(
            f"{burst} needs {rate} (a burst is the size of a rate's token bucket; {why}): "
            f"give {rate} with {burst}"
        ) from None


@queue_group.command(
    "limit",
    epilog=_examples(
        "kombu-pgmq queue limit emails                        # the limits and their use",
        "kombu-pgmq queue limit emails --concurrency 20 --rate 100/s",
        "kombu-pgmq queue limit emails --rate 6000/m --burst 50",
        "kombu-pgmq queue limit api --key-concurrency 2       # per x-limit-key header",
        "kombu-pgmq queue limit api --limit-key task --key-rate 10/s   # per task name",
        "kombu-pgmq queue limit emails --rate 0               # remove the rate limit",
        "kombu-pgmq queue limit emails --clear                # remove every limit",
    ),
)
@url_option
@click.argument("queue")
@click.option(
    "--concurrency",
    type=click.IntRange(min=0),
    metavar="N",
    help="Messages of QUEUE delivered and not yet settled, across every worker (prefetched "
    "ones count). 0 removes it.",
)
@click.option(
    "--rate",
    metavar="RATE",
    help="Deliveries of QUEUE across every worker: 100/s, 6000/m, 50/h (a number: per "
    "second). 0 removes it.",
)
@click.option(
    "--burst",
    type=float,
    callback=_tokens,
    metavar="TOKENS",
    help="Most deliveries at once after a pause (the token bucket's size; default the "
    "tokens of 0.1 s, at least 1). 0: the default.",
)
@click.option(
    "--key-concurrency",
    type=click.IntRange(min=0),
    metavar="N",
    help="Messages in flight per key (the header named by --limit-key). 0 removes it.",
)
@click.option("--key-rate", metavar="RATE", help="Deliveries per key (as --rate). 0 removes it.")
@click.option(
    "--key-burst",
    type=float,
    callback=_tokens,
    metavar="TOKENS",
    help="Burst per key (as --burst).",
)
@click.option(
    "--limit-key",
    metavar="HEADER",
    callback=_header,
    help="The message header that holds the key (default x-limit-key, set with "
    "apply_async(headers={'x-limit-key': ...})); 'task': Celery's task name.",
)
@click.option(
    "--clear",
    is_flag=True,
    help="Remove every limit not given with it (a FIFO queue keeps its group limit).",
)
@json_option
def queue_limit(
    url: str | None,
    queue: str,
    concurrency: int | None,
    rate: str | None,
    burst: float | None,
    key_concurrency: int | None,
    key_rate: str | None,
    key_burst: float | None,
    limit_key: str | None,
    clear: bool,
    as_json: bool,
) -> None:
    """Show or change QUEUE's limits, enforced across every worker where messages are
    delivered. Without options: the limits in force and their use now (messages in
    flight, tokens left, keys at their limit, reads held back). With options: those
    limits change, the others are kept. In force at the workers' next read (no
    restart). A worker whose transport option queue_limits names QUEUE sets them again
    when it declares it."""
    given = {
        "concurrency": concurrency,
        "rate": rate,
        "burst": burst,
        "key_concurrency": key_concurrency,
        "key_rate": key_rate,
        "key_burst": key_burst,
        "limit_key": limit_key,
    }
    limits = checked_limits(queue, given, clear=clear)
    if not limits and not clear:
        info = _one(_with_management(url, lambda m: m.limits(queue)))
        _print(queue, info, as_json)
        return

    def change(management: Management) -> LimitInfo | None:
        try:
            return management.set_limits(queue, limits, replace=clear)
        except StatementError as exc:
            if "needs its rate" not in str(exc):
                raise
            key = limits.get("key_burst") is not None and limits.get("burst") is None
            burst, rate = ("--key-burst", "--key-rate") if key else ("--burst", "--rate")
            _fail(  # the stored limits have no rate for the burst given
                f"queue {queue} has no {'per-key ' if key else ''}rate limit for {burst} to "
                f"size: give {rate} with {burst}"
            )

    info = _with_management(url, change)
    if as_json:
        _print(queue, info, as_json)
        return
    what = "cleared the limits" if clear and not limits else "changed the limits"
    click.echo(f"{what} of queue {queue}: in force at the workers' next read (no restart needed)")
    if clear and info is not None and info.ordered_keys:
        click.echo(
            f"queue {queue} is a FIFO queue (x-fifo-groups): it keeps its group limit, one "
            f"message per {FIFO_KEY} at a time"
        )
    _print(queue, info, as_json)


def _one(found: list[LimitInfo]) -> LimitInfo | None:
    return found[0] if found else None


def _print(queue: str, info: LimitInfo | None, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(limits_json(queue, info)))
    else:
        for line in describe(queue, info):
            click.echo(line)
