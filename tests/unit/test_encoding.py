import json
import pickle
import random
import string

import pytest

from kombu_pgmq._encoding import ENVELOPE_KEY, decode, encode, is_json_content, reencode_opaque
from kombu_pgmq.errors import ConfigurationError


def kombu_message(body, content_type="application/json", encoding="utf-8", headers=None):
    return {
        "body": body,
        "content-type": content_type,
        "content-encoding": encoding,
        "headers": headers or {},
        "properties": {
            "delivery_info": {"exchange": "", "routing_key": "q"},
            "priority": 3,
            "correlation_id": "cid",
            "reply_to": "r",
            "delivery_tag": "publish-time-uuid",
            "body_encoding": None,
        },
    }


def roundtrip(message):
    stored, headers = encode(message)
    json.loads(stored)  # both columns are valid JSON for jsonb
    json.loads(headers)
    return stored, decode(stored, headers)


def test_json_body_is_stored_as_json():
    body = json.dumps([[2, 3], {"k": "v"}, {"callbacks": None}])
    stored, back = roundtrip(kombu_message(body, headers={"task": "add", "id": "x"}))
    assert json.loads(stored) == [[2, 3], {"k": "v"}, {"callbacks": None}]
    assert json.loads(back["body"]) == json.loads(body)
    assert back["headers"] == {"task": "add", "id": "x"}
    assert back["content-type"] == "application/json"
    props = back["properties"]
    assert props["priority"] == 3 and props["correlation_id"] == "cid"
    assert "delivery_tag" not in props  # a new tag is given per delivery


def test_task_name_is_queryable_at_top_level_of_headers():
    _, headers = encode(kombu_message("{}", headers={"task": "tasks.add"}))
    assert json.loads(headers)["task"] == "tasks.add"


@pytest.mark.parametrize(
    "body",
    [
        pickle.dumps({"a": 1}),
        b"\x00\xff\x10binary",
        b"",
    ],
)
def test_binary_bodies_roundtrip_exactly(body):
    stored, back = roundtrip(kombu_message(body, "application/x-python-serialize", "binary"))
    assert back["body"] == body
    assert isinstance(stored, str)


@pytest.mark.parametrize(
    "body",
    [
        '{"x": "a\\u0000b"}',
        '{"x": NaN}',
        "[Infinity]",
        '{"a": ["NaN", -Infinity]}',
        '["\\\\", NaN]',
        '["x\\"", {"Infinity": NaN}]',
        '{"x": NaN',
    ],
)
def test_json_jsonb_cannot_hold_falls_back_to_base64(body):
    stored, back = roundtrip(kombu_message(body))
    assert back["body"] == body.encode("utf-8")
    assert stored.startswith('"')


def test_compressed_body_is_opaque():
    message = kombu_message(b"zlib-bytes", headers={"compression": "application/x-gzip"})
    _, back = roundtrip(message)
    assert back["body"] == b"zlib-bytes"
    assert back["headers"]["compression"] == "application/x-gzip"


def test_text_body_roundtrips():
    _, back = roundtrip(kombu_message("plain text ü", "text/plain"))
    assert back["body"] == "plain text ü".encode()


def test_reserved_header_is_refused():
    with pytest.raises(ConfigurationError, match=ENVELOPE_KEY):
        encode(kombu_message("{}", headers={ENVELOPE_KEY: 1}))


def test_foreign_rows_decode_as_json():
    back = decode('{"a": 1}', '{"x-pgmq-group": "g"}')
    assert back["content-type"] == "application/json"
    assert back["headers"] == {"x-pgmq-group": "g"}
    assert decode('{"a": 1}', None)["headers"] == {}


@pytest.mark.parametrize(
    ("ctype", "expected"),
    [
        ("application/json", True),
        ("application/vnd.x+json; charset=utf-8", True),
        ("application/x-yaml", False),
        (None, False),
        ("text/json", False),
    ],
)
def test_is_json_content(ctype, expected):
    assert is_json_content(ctype) is expected


def test_reencode_opaque_keeps_the_exact_body():
    stored, headers = encode(kombu_message("not json at all"))
    assert stored == "not json at all"  # PostgreSQL will refuse it: the transport re-encodes
    stored, headers = reencode_opaque(stored, headers)
    assert decode(stored, headers)["body"] == b"not json at all"


@pytest.mark.parametrize(
    "value",
    ["a\x00b", float("nan"), float("inf"), "\ud800 lone surrogate", b"\xff\x00 bytes"],
    ids=["nul", "nan", "inf", "surrogate", "bytes"],
)
def test_headers_jsonb_cannot_hold_round_trip_exactly(value):
    """Celery puts argsrepr in headers: a task argument with a NUL must not fail the
    publish; every header comes back as sent, the storable ones stay readable in SQL."""
    import json
    import math

    message = {
        "body": '{"x": 1}',
        "content-type": "application/json",
        "content-encoding": "utf-8",
        "headers": {"task": "tasks.add", "argsrepr": value},
        "properties": {"delivery_info": {}, "correlation_id": "c-1"},
    }
    body, headers = encode(message)
    headers.encode("utf-8")  # storable: no lone surrogate
    assert "\\u0000" not in headers and "NaN" not in headers and "Infinity" not in headers
    assert json.loads(headers)["task"] == "tasks.add"  # readable at the top level
    back = decode(body, headers)
    got = back["headers"]["argsrepr"]
    if isinstance(value, float) and math.isnan(value):
        assert math.isnan(got)
    else:
        assert got == value
    assert back["properties"]["correlation_id"] == "c-1"


@pytest.mark.parametrize(
    "body",
    [
        '["BANaNa", "Infinity and beyond"]',
        '{"path": "C:\\\\u0000dir"}',
        '{"x": "\\"NaN\\""}',
        '{"NaN": "\\\\\\"NaN", "-Infinity": [1e308]}',
    ],
    ids=["nan-in-strings", "escaped-backslash", "escaped-quote", "keys-and-escapes"],
)
def test_json_that_only_looks_unsafe_is_stored_as_json(body):
    """The text NaN/Infinity inside a string, or an escaped backslash before u0000, is
    JSON jsonb stores as is (not base64, which SQL cannot read)."""
    stored, back = roundtrip(kombu_message(body))
    assert stored == body
    assert json.loads(back["body"]) == json.loads(body)


def test_a_large_body_whose_strings_hold_nan_is_stored_as_json():
    """A task argument of random text (base64 of a file, identifiers) holds "NaN" and
    "Infinity" inside its strings many times over: still JSON, stored as the text sent."""
    rng = random.Random(42)
    text = "".join(rng.choices(string.ascii_letters + string.digits, k=3_000_000))
    text += "NaN Infinity"
    body = json.dumps([[text, {"blob": text[::-1]}], {}, {"callbacks": None}])
    stored, back = roundtrip(kombu_message(body))
    assert stored == body
    assert back["body"] == body


@pytest.mark.parametrize("header", ["x-deduplication-id", "x-group-id", "task", "id"])
@pytest.mark.parametrize("text", ["BANaNa-1", "acct-NaN-1", "Infinity", "a\\u0000"])
def test_headers_the_server_reads_stay_readable_whatever_their_text(header, text):
    message = kombu_message("{}", headers={header: text, "argsrepr": "('\x00',)"})
    _, headers = encode(message)
    assert json.loads(headers)[header] == text  # where SQL reads it
    assert "argsrepr" not in json.loads(headers)  # that one only in the exact block
    assert decode(*encode(message))["headers"] == {header: text, "argsrepr": "('\x00',)"}


@pytest.mark.parametrize("header", ["x-deduplication-id", "x-group-id", "task", "id"])
@pytest.mark.parametrize("value", ["a\x00", "\udc80", float("nan"), float("-inf")])
def test_headers_the_server_reads_are_refused_when_jsonb_cannot_hold_them(header, value):
    with pytest.raises(ConfigurationError, match=f"message header '{header}'"):
        encode(kombu_message("{}", headers={header: value}))


@pytest.mark.parametrize(
    ("envelope", "error"),
    [
        ({"body-encoding": "base64"}, "base64"),
        ({"properties": [1]}, "must be JSON objects"),
        ({"properties": {"delivery_info": [1]}}, "delivery_info"),
    ],
)
def test_rows_that_cannot_be_kombu_messages_raise(envelope, error):
    headers = json.dumps({ENVELOPE_KEY: {"content-type": "application/json", **envelope}})
    with pytest.raises(Exception, match=error):
        decode('"%%% not base64"', headers)


def test_unknown_properties_are_ignored_known_ones_stored(caplog):
    """A property Kombu does not define (Celery passes the apply_async
    options it does not know, e.g. a signal object, as properties) is ignored with a debug
    log, not encoded; the properties Kombu and AMQP define round-trip."""
    message = kombu_message("{}")
    known = {
        "content_type": "application/json",
        "content_encoding": "utf-8",
        "delivery_mode": 2,
        "expiration": "1500",
        "message_id": "m-1",
        "timestamp": 1700000000,
        "type": "t",
        "user_id": "u",
        "app_id": "a",
        "cluster_id": "c",
        "pgmq_delay_seconds": 3,
    }
    message["properties"].update(known, signal=object(), custom="value")
    with caplog.at_level("DEBUG", logger="kombu_pgmq._encoding"):
        _, back = roundtrip(message)
    props = back["properties"]
    assert {k: props[k] for k in known} == known
    assert props["correlation_id"] == "cid" and props["reply_to"] == "r"
    assert props["priority"] == 3
    assert "signal" not in props and "custom" not in props
    assert "message properties custom, signal ignored" in caplog.text


def test_no_log_when_every_property_is_known(caplog):
    with caplog.at_level("DEBUG", logger="kombu_pgmq._encoding"):
        roundtrip(kombu_message("{}"))
    assert "ignored" not in caplog.text
