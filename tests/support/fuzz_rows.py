"""Random PGMQ rows for the fault suite: what anyone able to insert a row could
write into a queue table, from valid Kombu messages with awkward content to envelopes of
every wrong shape. Seeded: the same seed gives the same rows.

Each row is ``(message_json, headers_json, expected)``: ``expected`` is the Kombu message
a consumer must get (``{"body": bytes, "headers": dict, "json": bool}``; ``json``: compare
the bodies as JSON, which jsonb keeps equal but not byte-identical) for rows written by
kombu_pgmq's own encoder, or None for rows that may be delivered or dead-lettered
(either is fine, as long as each row is accounted for exactly once and the consumer never
stops).
"""

from __future__ import annotations

import json
import random
import string
from typing import Any

from kombu import compression

from kombu_pgmq import _encoding

#: Values of random headers and envelope fields: every JSON type, text that looks like
#: what jsonb refuses, and (for the valid rows) values jsonb cannot hold at all.
_AWKWARD_TEXT = ["NaN", "Infinity", "-Infinity", "\\u0000", "BANaNa", "", "é", "😀", '"', "\\"]
_UNSTORABLE = ["a\x00b", "\ud800", float("nan"), float("inf")]
_ENCODINGS = [None, "base64", "BASE64", "rot13", "", "utf-8", 5, ["base64"], {"x": 1}]
_CONTENT_TYPES = ["application/json", "text/plain", "application/x-python-serialize", None, 7]


def _text(rng: random.Random, size: int = 12) -> str:
    pieces = [rng.choice(_AWKWARD_TEXT) for _ in range(rng.randint(0, 2))]
    pieces.append("".join(rng.choice(string.printable) for _ in range(rng.randint(0, size))))
    rng.shuffle(pieces)
    return "".join(pieces)


def _json_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 2 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.randint(-(2**40), 2**40)
    if kind == 3:
        return rng.uniform(-1e6, 1e6)
    if kind == 4:
        return _text(rng)
    if kind == 5:
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {_text(rng, 6): _json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _valid(rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    """A message kombu_pgmq's encoder wrote: awkward bodies, headers and compression."""
    kind = rng.randrange(4)
    if kind == 0:
        body: Any = json.dumps(_json_value(rng))
        content_type, content_encoding = "application/json", "utf-8"
    elif kind == 1:
        body = _text(rng, 40)
        content_type, content_encoding = "text/plain", "utf-8"
    else:
        body = rng.randbytes(rng.randint(0, 64))
        content_type, content_encoding = "application/x-python-serialize", "binary"
    headers: dict[str, Any] = {
        f"h{i}": rng.choice([_json_value(rng), *_UNSTORABLE]) for i in range(rng.randint(0, 3))
    }
    headers["task"] = f"fuzz.{rng.choice(['NaN', 'Infinity', 'ok'])}"
    raw = body.encode("utf-8") if isinstance(body, str) else body
    if rng.random() < 0.25:
        body, headers["compression"] = compression.compress(raw, rng.choice(["zlib", "bzip2"]))
    message = {
        "body": body,
        "content-type": content_type,
        "content-encoding": content_encoding,
        "headers": headers,
        "properties": {"delivery_info": {"exchange": "", "routing_key": "fuzz"}, "priority": 0},
    }
    stored, header_json = _encoding.encode(message)
    # JSON bodies stored as JSON come back as equal JSON, not the same text (jsonb)
    as_json = not stored.startswith('"') or (kind == 0 and json.loads(stored) == json.loads(raw))
    return stored, header_json, {"body": raw, "headers": headers, "json": as_json}


def _garbage(rng: random.Random) -> tuple[str, str, None]:
    """A row of anyone's: random JSON, often with an envelope of a wrong shape."""
    envelope: dict[str, Any] = {}
    for key, choices in (
        ("content-type", _CONTENT_TYPES),
        ("content-encoding", ["utf-8", "binary", None, 3]),
        ("body-encoding", _ENCODINGS),
        ("properties", [{}, [], None, "x", {"delivery_info": rng.choice([{}, [], 1])}]),
        ("exact", [None, "", "!!", "e30=", "W10=", 1]),
    ):
        if rng.random() < 0.7:
            envelope[key] = rng.choice(choices)
    headers: Any = {_text(rng, 6): _json_value(rng) for _ in range(rng.randint(0, 3))}
    if rng.random() < 0.8:
        headers["x-kombu"] = envelope if rng.random() < 0.9 else _json_value(rng)
    if rng.random() < 0.1:
        headers["compression"] = rng.choice(["application/x-gzip", "zlib", "nope"])
    if rng.random() < 0.05:
        headers = _json_value(rng)  # not even an object
    if rng.random() < 0.5:
        message: Any = rng.choice([_text(rng, 30), "%%%", "cm90MTM=", ""])
    else:
        message = _json_value(rng)
    return json.dumps(message), json.dumps(headers), None


def rows(count: int, seed: int = 25) -> list[tuple[str, str, dict[str, Any] | None]]:
    """``count`` random rows, about one in three written by kombu_pgmq's encoder."""
    rng = random.Random(seed)
    return [_valid(rng) if rng.random() < 0.35 else _garbage(rng) for _ in range(count)]
