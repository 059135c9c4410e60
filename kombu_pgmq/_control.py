"""What the running Celery workers of a kombu_pgmq broker register, asked through Celery's
remote control, as ``celery inspect registered`` asks (kombu's pidbox: a broadcast on the
``<control_exchange>.pidbox`` fanout exchange, replies on ``reply.<control_exchange>.pidbox``).

The workers running are those consuming their remote-control queue now
(``<node>.<control_exchange>.pidbox`` with a live consumer in the broker's registry): the
broadcast waits for that many replies, up to ``timeout`` seconds, instead of always the
whole timeout; with no worker running nothing is sent.
"""

from __future__ import annotations

from .errors import ConfigurationError
from .management import Management

__all__ = ["BUILTIN_PREFIX", "registered_tasks", "running_workers"]

#: Celery's own tasks (``celery.backend_cleanup``, ``celery.chord_unlock``...): every
#: worker has them, and its ``registered`` reply leaves them out.
BUILTIN_PREFIX = "celery."
#: Celery's defaults for its remote-control queues (``control_queue_ttl``,
#: ``control_queue_expires``, seconds): the reply queue goes away once unused.
_REPLY_TTL_S = 300.0
_REPLY_EXPIRES_S = 10.0


def running_workers(url: str, control_exchange: str = "celery") -> list[str]:
    """Node names (``celery@host``) of the workers consuming their remote-control queue
    in ``url``'s broker now, sorted; none in a database without kombu_pgmq's schema (a
    worker installs it).

    Raises:
        KombuPgmqError: the database cannot be reached.
    """
    suffix = f".{control_exchange}.pidbox"
    with Management(url) as management:
        try:
            stats = management.queues()
        except ConfigurationError:  # no schema (or an older one): no worker of ours ran
            return []
    return sorted(
        q.name[: -len(suffix)]
        for q in stats
        if q.name.endswith(suffix) and ".reply." not in q.name and q.consumers
    )


def registered_tasks(
    url: str, *, timeout: float = 1.0, control_exchange: str = "celery"
) -> dict[str, set[str]]:
    """The task names each running worker registers (Celery's built-in tasks left out,
    as ``celery inspect registered`` does): ``{node: {task name, ...}}``; ``{}`` when no
    worker runs. Waits for the replies of the workers running, at most ``timeout``
    seconds (one that does not answer in time is left out).

    Raises:
        KombuPgmqError: the database cannot be reached.
    """
    nodes = running_workers(url, control_exchange)
    if not nodes:
        return {}
    from kombu import Connection
    from kombu.pidbox import Mailbox

    mailbox = Mailbox(
        control_exchange,
        type="fanout",
        accept=["json"],
        serializer="json",
        reply_queue_ttl=_REPLY_TTL_S,
        reply_queue_expires=_REPLY_EXPIRES_S,
    )
    with Connection(url) as connection:
        replies = mailbox(connection)._broadcast(
            "registered", {}, reply=True, timeout=timeout, limit=len(nodes)
        )
    found: dict[str, set[str]] = {}
    for reply in replies or ():
        for node, names in reply.items():
            # "name" or, with taskinfoitems, "name [rate_limit=...]"
            found[node] = {str(name).split(" [", 1)[0] for name in names or ()}
    return found
