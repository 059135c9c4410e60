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

JSON bodies come back as equal JSON values, not byte-identical text (jsonb normalises
whitespace and key order); every other body comes back byte for byte.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
from typing import Any

from kombu.utils.json import dumps as _kombu_dumps
from kombu.utils.json import loads

from .errors import ConfigurationError

# The C encoder of the standard library: ~3x faster than kombu's dumps on the hot path
# (headers of every publish). Values it cannot encode (datetime, UUID, Decimal, ...)
# fall back to kombu's encoder, which knows them.
_fast_encode = json.JSONEncoder(
    ensure_ascii=False, check_circular=False, separators=(",", ":"), allow_nan=False
).encode


def dumps(value: Any) -> str:
    """JSON text of ``value`` (kombu's JSON conventions for non-JSON types)."""
    try:
        return _fast_encode(value)
    except (TypeError, ValueError):
        return str(_kombu_dumps(value))


#: Header key holding the Kombu envelope.
ENVELOPE_KEY = "x-kombu"
#: Envelope key of the exact headers and properties (base64 of kombu's JSON), when some
#: header jsonb cannot hold.
EXACT_KEY = "exact"
#: ``body-encoding`` value for bodies stored as base64 JSON strings.
BASE64 = "base64"
# Tokens Python's json emits that jsonb refuses (NaN/Infinity), and the NUL escape that
# jsonb text cannot hold. A false positive only means the body is stored as base64.
_JSONB_UNSAFE = ("\\u0000", "NaN", "Infinity")
_DROP_PROPERTIES = ("delivery_tag", "body_encoding")


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
        and not any(token in body for token in _JSONB_UNSAFE)
        and body.strip()
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
    props = {k: v for k, v in properties.items() if k not in _DROP_PROPERTIES}
    envelope: dict[str, Any] = {
        "content-type": message.get("content-type"),
        "content-encoding": message.get("content-encoding"),
        "body-encoding": body_encoding,
        "properties": props,
    }
    text = dumps({**app_headers, ENVELOPE_KEY: envelope})
    if _storable(text):
        return text
    # A header or property jsonb cannot hold (NUL, NaN/Infinity, a lone surrogate) or
    # JSON cannot (bytes): the exact headers and properties go into the envelope as the
    # base64 of kombu's JSON (lossless); the storable headers stay readable at the top.
    exact = _kombu_dumps({"headers": app_headers, "properties": props})
    envelope["properties"] = {}
    envelope[EXACT_KEY] = base64.b64encode(str(exact).encode("ascii")).decode("ascii")
    readable = {k: v for k, v in app_headers.items() if _storable(dumps({k: v}))}
    return dumps({**readable, ENVELOPE_KEY: envelope})


def _storable(text: str) -> bool:
    """True if jsonb can store this JSON text as is."""
    if "\\u0000" in text or "NaN" in text or "Infinity" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def reencode_opaque(message_json: str, headers_json: str) -> tuple[str, str]:
    """Turn an encoded JSON body into the base64 form (PostgreSQL refused the JSON)."""
    headers = loads(headers_json)
    headers[ENVELOPE_KEY]["body-encoding"] = BASE64
    return encode_opaque(message_json)[0], dumps(headers)


def decode(message_json: str, headers_json: str | None) -> dict[str, Any]:
    """Return the Kombu payload dict for a PGMQ row (inverse of :func:`encode`).

    Messages not written by kombu_pgmq (e.g. ``SELECT pgmq.send('q', '{"a": 1}')`` from
    SQL) have no envelope: they are delivered as ``application/json`` with their
    headers column as Kombu headers.
    """
    headers = loads(headers_json) if headers_json else {}
    if not isinstance(headers, dict):
        headers = {"pgmq_headers": headers}
    envelope = headers.pop(ENVELOPE_KEY, None)
    if envelope is None:
        return {
            "body": message_json,
            "content-type": "application/json",
            "content-encoding": "utf-8",
            "headers": headers,
            "properties": {"delivery_info": {}, "priority": 0},
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
            with contextlib.suppress(binascii.Error, TypeError):
                body = base64.b64decode(body)
        else:
            properties["body_encoding"] = body_encoding
    properties.setdefault("delivery_info", {})
    return {
        "body": body,
        "content-type": envelope.get("content-type"),
        "content-encoding": envelope.get("content-encoding"),
        "headers": headers,
        "properties": properties,
    }
