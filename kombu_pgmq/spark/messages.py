"""Rows as Kombu messages and as Celery task messages (what the ``pgmq`` writer sends).

Both give ``(message_json, headers_json)`` in the transport's storage layout
(:mod:`kombu_pgmq._encoding`), so Kombu consumers and Celery workers receive them exactly
as if a Kombu producer had published them to the queue (exchange ``""``, routing key =
queue name).
"""

from __future__ import annotations

import uuid
from functools import lru_cache
from typing import Any

from ..errors import ConfigurationError

__all__ = ["WRITE_HEADER", "row_message", "task_message"]

#: Header marking a staged (not yet committed) message: ``"<write>/<partition>/<attempt>"``.
WRITE_HEADER = "x-kombu-pgmq-write"


def _properties(queue: str, **extra: Any) -> dict[str, Any]:
    return {
        "delivery_mode": 2,
        "delivery_info": {"exchange": "", "routing_key": queue},
        "priority": 0,
        **extra,
    }


def row_message(row: dict[str, Any], queue: str, marker: str) -> tuple[str, str]:
    """A row as a JSON Kombu message: body ``{"column": value, ...}``.

    Values that are not JSON (dates, timestamps, decimals) follow Kombu's JSON encoder
    (ISO 8601 text, numbers).
    """
    serialize, encoding = _codec()
    content_type, content_encoding, body = serialize(row, serializer="json")
    return encoding.encode(
        {
            "body": body,
            "content-type": content_type,
            "content-encoding": content_encoding,
            "headers": {WRITE_HEADER: marker},
            "properties": _properties(queue),
        }
    )


@lru_cache(maxsize=1)
def _codec() -> tuple[Any, Any]:
    """kombu's serializer and the transport's storage layout (:mod:`kombu_pgmq._encoding`,
    which uses kombu's JSON), imported on the first message: importing this module (as
    executors do through :mod:`kombu_pgmq.spark.datasource`) needs no kombu."""
    from kombu.serialization import dumps

    from .. import _encoding

    return dumps, _encoding


@lru_cache(maxsize=1)
def _celery_app() -> Any:
    """A Celery app that only builds task messages.

    Raises:
        ConfigurationError: Celery is not installed (here: on a Spark executor).
    """
    try:
        from celery import Celery
    except ImportError as exc:
        raise ConfigurationError(
            "the pgmq writer's task option makes Celery task messages, which needs celery "
            "where the Spark tasks run (on every executor): pip install "
            "'kombu-pgmq-transport[spark]' there, or write rows without task"
        ) from exc

    # Only builds messages (protocol 2); never connects anywhere.
    return Celery("kombu_pgmq.spark", set_as_current=False)


def task_message(
    task: str, args: list[Any], kwargs: dict[str, Any], queue: str, marker: str
) -> tuple[str, str]:
    """A Celery task message (protocol 2, JSON) for ``task(*args, **kwargs)``.

    Shapes: task id is a fresh uuid4; no result callbacks, no ETA, priority 0.
    """
    serialize, encoding = _codec()
    task_id = str(uuid.uuid4())
    message = _celery_app().amqp.as_task_v2(task_id, task, args, kwargs)
    content_type, content_encoding, body = serialize(message.body, serializer="json")
    return encoding.encode(
        {
            "body": body,
            "content-type": content_type,
            "content-encoding": content_encoding,
            "headers": {**message.headers, WRITE_HEADER: marker},
            "properties": _properties(queue, **message.properties),
        }
    )
