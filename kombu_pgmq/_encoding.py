"""Kombu message <-> PGMQ row (``message`` and ``headers`` jsonb columns).

Storage layout, chosen so ``SELECT message, headers->>'task' FROM pgmq.q_celery``
shows the task a person would expect:

* ``message``: the body itself when it is JSON text (content type ``application/json``
  or ``*+json``, uncompressed, storable by jsonb); otherwise a JSON string holding the
  base64 of the body bytes (binary, pickle, compressed, text with ``\\u0000``...).
* ``headers``: the Kombu application headers (e.g. Celery's ``task``, ``id``,
  ``retries``) at the top level, plus one reserved key ``"x-kombu"`` holding the rest
  of the envelope: ``content-type``, ``content-encoding``, ``body-encoding`` and the
  message properties (``delivery_info``, ``priority``, ``correlation_id``,
  ``reply_to``, ...). PGMQ's own header conventions (``x-pgmq-group``) therefore work.
  Only the properties Kombu and AMQP define are stored (:data:`STORED_PROPERTIES`); any
  other is ignored with a debug log, as AMQP transports ignore properties they do not
  know (Celery hands Kombu the ``apply_async`` options it does not know as properties,
  and they need not be JSON).

JSON bodies come back as equal JSON values, not byte-identical text (jsonb normalises
whitespace and key order); every other body comes back byte for byte.
"""

from __future__ import annotations

import base64
import json
import logging
import re
from typing import Any

from kombu.utils.json import JSONEncoder as KombuJSONEncoder
from kombu.utils.json import dumps as _kombu_dumps
from kombu.utils.json import loads

from .errors import ConfigurationError

logger = logging.getLogger(__name__)

# The C encoder of the standard library with kombu's conventions for non-JSON types
# (datetime, UUID, Decimal, bytes: kombu's ``JSONEncoder.default``, called only for
# those): ~3x faster than kombu's dumps on the hot path (headers of every publish).
# allow_nan=False: NaN and Infinity raise ValueError instead of producing text jsonb
# refuses.
_strict_encode = KombuJSONEncoder(
    ensure_ascii=False, check_circular=False, separators=(",", ":"), allow_nan=False
).encode


def dumps(value: Any) -> str:
    """JSON text of ``value`` (kombu's JSON conventions for non-JSON types; NaN and
    Infinity as Python's json writes them)."""
    try:
        return _strict_encode(value)
    except ValueError:
        return str(_kombu_dumps(value))


#: Header key holding the Kombu envelope.
ENVELOPE_KEY = "x-kombu"
#: Envelope key of the exact headers and properties (base64 of kombu's JSON), when some
#: header jsonb cannot hold.
EXACT_KEY = "exact"
#: ``body-encoding`` value for bodies stored as base64 JSON strings.
BASE64 = "base64"
#: Header counting the deliveries of a message that were restored (returned unprocessed:
#: a channel closed with it prefetched, a callback that failed): they do not count
#: toward ``max_deliveries`` (``read_ct``, which only grows, minus this count). Written by
#: the server, taken out of the
#: headers the application sees (:func:`decode` puts it in ``delivery_info``).
RESTORED_KEY = "x-kombu-restored"
#: Headers kombu_pgmq's SQL reads (deduplication, FIFO groups, dead-letter filters, task
#: lookup and cancel, PGMQ's own grouped reads): stored readable at the top level of the
#: headers column whatever the other headers hold, or refused (:func:`encode`).
SERVER_HEADERS = {
    "x-deduplication-id": "deduplication",
    "x-group-id": "FIFO groups",
    "x-pgmq-group": "PGMQ's grouped reads",
    "task": "dead-letter filters and kombu-pgmq task find/cancel",
    "id": "task id deduplication and kombu-pgmq task find/cancel",
}
#: Message property recording the delay a message was sent with (seconds): its
#: x-message-ttl / expiration count from when it became visible, not from the publish.
DELAY_PROPERTY = "pgmq_delay_seconds"
#: Message properties stored: AMQP's basic properties (headers aside), Kombu's virtual
#: transport's ``delivery_info``, and :data:`DELAY_PROPERTY`. Any other is ignored.
STORED_PROPERTIES = frozenset(
    {
        "content_type",
        "content_encoding",
        "delivery_mode",
        "priority",
        "correlation_id",
        "reply_to",
        "expiration",
        "message_id",
        "timestamp",
        "type",
        "user_id",
        "app_id",
        "cluster_id",
        "delivery_info",
        DELAY_PROPERTY,
    }
)
# Kombu's, not stored as properties: a new tag per delivery; the body encoding goes into
# the envelope's "body-encoding".
_DROP_PROPERTIES = ("delivery_tag", "body_encoding")
# A NUL character in JSON text: the escape \u0000 after an even number of backslashes (an
# odd number escapes the backslash itself: the text "\\u0000" holds no NUL).
_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def is_json_content(content_type: str | None) -> bool:
    """True for ``application/json`` and ``application/<x>+json`` (parameters ignored)."""
    if not content_type:
        return False
    base = content_type.split(";", 1)[0].strip().lower()
    if base == "application/json":
        return True
    return base.startswith("application/") and base.endswith("+json")


def encode(message: dict[str, Any]) -> tuple[str, str]:
    """Return ``(message_json, headers_json)`` for a Kombu virtual-transport message.

    Shapes: ``{"body": str | bytes, "content-type": str, "content-encoding": str,
    "headers": dict, "properties": dict} -> (str, str)``.

    Raises:
        ConfigurationError: the application headers use the reserved key ``x-kombu``.
    """
    app_headers = message.get("headers") or {}
    if ENVELOPE_KEY in app_headers:
        raise ConfigurationError(
            f"message header {ENVELOPE_KEY!r} is reserved by kombu_pgmq: rename that header"
        )
    body = message.get("body")
    content_type = message.get("content-type")
    properties = message.get("properties") or {}
    preset_encoding = properties.get("body_encoding")
    if (
        isinstance(body, str)
        and not preset_encoding
        and is_json_content(content_type)
        and "compression" not in app_headers
        and body.strip()
        and _jsonb_can_store(body)
    ):
        stored, body_encoding = body, None
    else:
        stored, body_encoding = encode_opaque(body, preset_encoding)
    return stored, _headers_json(message, app_headers, properties, body_encoding)


def encode_opaque(body: Any, preset_encoding: str | None = None) -> tuple[str, str]:
    """Store any body as a JSON string: base64 of its bytes (``body-encoding`` returned).

    A body already encoded by Kombu (``properties.body_encoding`` set, e.g. base64
    chosen by the ``body_encoding`` transport option) is kept as is under that encoding.
    """
    if preset_encoding and isinstance(body, str):
        return dumps(body), preset_encoding
    if body is None:
        raw = b""
    elif isinstance(body, str):
        raw = body.encode("utf-8")
    else:
        raw = bytes(body)
    return '"' + base64.b64encode(raw).decode("ascii") + '"', BASE64


def _headers_json(
    message: dict[str, Any],
    app_headers: dict[str, Any],
    properties: dict[str, Any],
    body_encoding: str | None,
) -> str:
    props = {k: v for k, v in properties.items() if k in STORED_PROPERTIES}
    known = len(props) + ("delivery_tag" in properties) + ("body_encoding" in properties)
    if known < len(properties):  # a cheap test: the hot path builds no set
        _log_ignored(properties)
    envelope: dict[str, Any] = {
        "content-type": message.get("content-type"),
        "content-encoding": message.get("content-encoding"),
        "body-encoding": body_encoding,
        "properties": props,
    }
    text = _jsonb_text({**app_headers, ENVELOPE_KEY: envelope})
    if text is not None:
        return text
    # A header or property jsonb cannot hold (NUL, NaN/Infinity, a lone surrogate): the
    # exact headers and properties go into the envelope as the base64 of kombu's JSON
    # (lossless); the storable headers stay readable at the top, and the headers the
    # server reads must be among them.
    readable = {}
    for key, value in app_headers.items():
        if _jsonb_text({key: value}) is not None:
            readable[key] = value
        elif key in SERVER_HEADERS:
            raise ConfigurationError(
                f"message header {key!r}={value!r} cannot be stored so that PostgreSQL can "
                "read it (jsonb holds no NUL character, lone surrogate, NaN or Infinity), "
                f"and kombu_pgmq reads it in SQL ({SERVER_HEADERS[key]}): nothing was sent; "
                "use a value without them"
            )
    exact = _kombu_dumps({"headers": app_headers, "properties": props})
    envelope["properties"] = {}
    envelope[EXACT_KEY] = base64.b64encode(str(exact).encode("ascii")).decode("ascii")
    text = _jsonb_text({**readable, ENVELOPE_KEY: envelope})
    if text is None:
        raise ConfigurationError(
            f"message content-type {envelope['content-type']!r} or content-encoding "
            f"{envelope['content-encoding']!r} cannot be stored (jsonb holds no NUL "
            "character or lone surrogate): nothing was sent"
        )
    return text


def _log_ignored(properties: dict[str, Any]) -> None:
    ignored = sorted(
        str(k) for k in properties if k not in STORED_PROPERTIES and k not in _DROP_PROPERTIES
    )
    logger.debug(
        "message properties %s ignored: not Kombu message properties (AMQP transports "
        "ignore them too)",
        ", ".join(ignored),
    )


def _jsonb_text(value: Any) -> str | None:
    """JSON text of ``value`` if jsonb stores it exactly, else None (it holds NaN or
    Infinity, a NUL character, or a lone surrogate, in a key or a value). Exact: text
    that merely looks like those (``"BANaNa"``, an escaped backslash before ``u0000``)
    is storable."""
    try:
        text = _strict_encode(value)
    except ValueError:  # NaN, Infinity
        return None
    if not _jsonb_can_store(text, finite=True):
        return None
    return text


def _jsonb_can_store(text: str, *, finite: bool = False) -> bool:
    """True if jsonb can store JSON ``text`` as is: no NUL escape, no lone surrogate and
    (unless ``finite``: made without NaN) no bare NaN/Infinity token. Cheap substring
    tests first; the exact scans run only when those match."""
    if "\\u0000" in text and _NUL.search(text):
        return False
    if not finite and ("NaN" in text or "Infinity" in text) and _has_non_finite(text):
        return False
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate
            return False
    return True


class _NonFinite(Exception):
    """A NaN, Infinity or -Infinity token (stops the parse at the first)."""


def _refuse_constant(token: str) -> None:
    raise _NonFinite(token)


def _has_non_finite(text: str) -> bool:
    """True if JSON ``text`` holds a bare NaN, Infinity or -Infinity token (outside
    strings). The standard library's C parser finds them: about 1 ms per MB of a long
    string (a large task argument), where a regular expression matching each string
    character by character takes over 100. Text that is not JSON, or nested deeper than
    Python parses: True (jsonb cannot be trusted with it; base64 always stores it)."""
    try:
        json.loads(text, parse_constant=_refuse_constant)
    except (_NonFinite, ValueError, RecursionError):
        return True
    return False


def reencode_opaque(message_json: str, headers_json: str) -> tuple[str, str]:
    """Turn an encoded JSON body into the base64 form (PostgreSQL refused the JSON)."""
    headers = loads(headers_json)
    headers[ENVELOPE_KEY]["body-encoding"] = BASE64
    return encode_opaque(message_json)[0], dumps(headers)


def decode(message_json: str, headers_json: str | None) -> dict[str, Any]:
    """Return the Kombu payload dict for a PGMQ row (inverse of :func:`encode`).

    Raises:
        ValueError, KeyError, TypeError: the row cannot be a Kombu message (an envelope
            of the wrong shape, a base64 body that is not base64); the transport
            dead-letters such a row with reason ``undecodable``.

    Messages not written by kombu_pgmq (e.g. ``SELECT pgmq.send('q', '{"a": 1}')`` from
    SQL) have no envelope: they are delivered as ``application/json`` with their
    headers column as Kombu headers. ``delivery_info["pgmq_restored"]``: the restores
    counted in the ``x-kombu-restored`` header (taken out of the headers).
    """
    headers = loads(headers_json) if headers_json else {}
    if not isinstance(headers, dict):
        headers = {"pgmq_headers": headers}
    restored = headers.pop(RESTORED_KEY, 0)
    if not isinstance(restored, int) or isinstance(restored, bool) or restored < 0:
        restored = 0
    envelope = headers.pop(ENVELOPE_KEY, None)
    if envelope is None:
        return {
            "body": message_json,
            "content-type": "application/json",
            "content-encoding": "utf-8",
            "headers": headers,
            "properties": {"delivery_info": {"pgmq_restored": restored}, "priority": 0},
        }
    properties = envelope.get("properties") or {}
    exact = envelope.get(EXACT_KEY)
    if exact:  # headers jsonb could not hold: the exact ones, as sent
        original = loads(base64.b64decode(exact).decode("ascii"))
        headers, properties = original["headers"], original["properties"]
    body_encoding = envelope.get("body-encoding")
    body: Any = message_json
    if body_encoding:
        body = loads(message_json)
        if body_encoding == BASE64:
            if not isinstance(body, str):
                raise ValueError(f"a base64 body must be a JSON string, not {type(body).__name__}")
            body = base64.b64decode(body, validate=True)
        else:
            properties["body_encoding"] = body_encoding
    if not isinstance(headers, dict) or not isinstance(properties, dict):
        raise ValueError("the envelope's headers and properties must be JSON objects")
    info = properties.setdefault("delivery_info", {})
    if not isinstance(info, dict):
        raise ValueError("the envelope's delivery_info must be a JSON object")
    info["pgmq_restored"] = restored
    return {
        "body": body,
        "content-type": envelope.get("content-type"),
        "content-encoding": envelope.get("content-encoding"),
        "headers": headers,
        "properties": properties,
    }
