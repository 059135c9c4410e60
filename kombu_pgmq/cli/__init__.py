"""``kombu-pgmq``: operator commands (schema, dead letters, archive retention, queues,
results, the beat scheduler, metrics, embedded PostgreSQL, Spark server).

The commands that talk to the database take ``--url`` (default: ``$KOMBU_PGMQ_URL``, then
``$DATABASE_URL``, then the embedded PostgreSQL of :mod:`kombu_pgmq.embedded` if it is
running) and ``--embedded`` (the embedded PostgreSQL, started if needed: nothing else
starts it); each names the database it reads on stderr (``database: ...``, no password).
``--url``, ``--embedded`` and ``--json`` go before the command or after it
(``kombu-pgmq --url URL queues`` is ``kombu-pgmq queues --url URL``)::

    kombu-pgmq schema install [--url URL]     # PGMQ + kombu_pgmq's schema (idempotent)
    kombu-pgmq schema status  [--url URL]     # what is installed; installs nothing
    kombu-pgmq schema grant worker|producer ROLE [--url URL]   # least privilege
    kombu-pgmq dlq list [--queue Q] [--reason R] [--task T] [--id N ...] [--limit 50] [--json]
    kombu-pgmq dlq replay (--all | --id N ... | --queue Q | --reason R | --task T)
    kombu-pgmq dlq purge  (--all | --id N ... | --queue Q | --reason R | --task T) [--yes]
    kombu-pgmq archive prune --older-than 7d [--queue Q ...] [--batch-size 5000]
    kombu-pgmq queues [--all] [--json]        # ready, in flight, delayed, oldest, limits
    kombu-pgmq messages QUEUE [--limit 20] [--json]   # peek, nothing consumed
    kombu-pgmq queue pause|resume QUEUE       # consumers stop/start receiving from QUEUE
    kombu-pgmq queue limit QUEUE [--concurrency N] [--rate R] [--burst B]
        [--key-concurrency N] [--key-rate R] [--key-burst B] [--limit-key H] [--clear]
        [--json]                              # fleet-wide limits; no option: show them
    kombu-pgmq task find|cancel TASK_ID       # where a task is; durable revoke
    kombu-pgmq results [--json]               # Celery results by state, size, expired
    kombu-pgmq results expire [--batch-size 5000]   # delete expired results now
    kombu-pgmq beat list [--json]             # periodic tasks: schedule, last/next run, leader
    kombu-pgmq beat add NAME TASK (--every S | --cron 'm h dom mon dow' [--tz Z] |
        --solar EVENT LAT LON) [--args JSON] [--kwargs JSON] [--queue Q] [--replace]
        [-A APP | --force] ...                # TASK checked: the app's or running workers'
    kombu-pgmq beat remove|enable|disable|run-now NAME
    kombu-pgmq beat history [NAME] [--limit 50] [--json]   # ticks sent, newest first
    kombu-pgmq beat leader [--json]           # which beat leads; exit 1 when none does
    kombu-pgmq metrics serve [--port 9808] [--host 127.0.0.1] [--tls-cert F --tls-key F]
        [--basic-auth-user U] [--cache-seconds 5]   # Prometheus /metrics
    kombu-pgmq embedded start|status|url|stop  # the embedded PostgreSQL (no --url)
    kombu-pgmq spark server start|stop|status [--port 15002]

``python -m kombu_pgmq ARGS`` is ``kombu-pgmq ARGS`` (without the console script on ``PATH``).
Library modules never import this package (tests/unit/test_import_graph.py).

Exit status: 0 on success, 1 on an error (one line on stderr, ``error: ...``, naming the
fix; a server's error without its PL/pgSQL context), 2 on bad usage. ``schema status``
exits 1 when something is missing or too old, ``embedded status`` when the server is not
running, ``embedded url`` when there is no URL, ``beat leader`` when no beat leads.
"""

from __future__ import annotations

# Each command group is a module of its own; importing it registers it on ``main``.
from . import (  # noqa: F401
    archive,
    beat,
    dlq,
    embedded,
    limits,
    operations,
    results,
    schema,
    spark,
)
from ._base import main, parse_duration, url_option

__all__ = ["main", "parse_duration", "url_option"]
