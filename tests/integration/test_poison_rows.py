"""A row no consumer can turn into a Kombu message (an unknown body
encoding, a body the named encoding cannot decode, headers of the wrong shape) is
dead-lettered alone with reason ``undecodable`` and the error; the rest is delivered.
Whoever may insert a row must not be able to stop a queue."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import pytest
from kombu import Consumer, Queue

from .helpers import connect, publish, sql, table


def _envelope(body_encoding: Any, **extra: Any) -> str:
    return json.dumps(
        {
            "x-kombu": {
                "content-type": "application/json",
                "content-encoding": "utf-8",
                "body-encoding": body_encoding,
                "properties": {},
                **extra,
            }
        }
    )


#: (message jsonb, headers jsonb) that the transport cannot turn into a Kombu message.
BAD_ROWS = {
    "unknown body encoding": ('"cm90MTM="', _envelope("rot13")),
    "upper-case BASE64": ('"eyJuIjogMH0="', _envelope("BASE64")),
    "base64 that is not base64": ('"%%%"', _envelope("base64")),
    "properties not an object": ('{"n": 0}', json.dumps({"x-kombu": {"properties": [1]}})),
    "compressed body that does not decompress": (
        '"bm90IGd6aXA="',
        json.dumps({"compression": "application/x-gzip", **json.loads(_envelope("base64"))}),
    ),
    "exact envelope not base64": ('{"n": 0}', _envelope(None, exact="!!")),
    "application headers a list": (
        '{"n": 0}',
        json.dumps({"x-kombu": {"exact": "eyJoZWFkZXJzIjogWzFdLCAicHJvcGVydGllcyI6IHt9fQ=="}}),
    ),
}


def _insert(db_dsn: str, queue: str, message: str, headers: str) -> None:
    sql(
        db_dsn,
        "SELECT pgmq.send(%s, %s::jsonb, %s::jsonb)",
        (queue, message, headers),
    )


def _dead_letters(db_dsn: str) -> list[tuple[str, str]]:
    return [
        (reason, error)
        for reason, error in sql(
            db_dsn,
            "SELECT headers->'x-dead-letter'->>'reason', headers->'x-dead-letter'->>'error'"
            " FROM pgmq.q_kombu_pgmq_dlq ORDER BY msg_id",
        )
    ]


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_a_row_kombu_cannot_decode_is_dead_lettered_and_the_rest_delivered(db_dsn, case):
    message, headers = BAD_ROWS[case]
    got: list[Any] = []

    def on_message(msg: Any) -> None:
        got.append(msg.payload["n"])
        msg.ack()

    with connect(db_dsn) as conn:
        publish(conn, "poisoned", [{"n": 1}])
        _insert(db_dsn, "poisoned", message, headers)
        publish(conn, "poisoned", [{"n": 2}])
        with Consumer(conn.channel(), [Queue("poisoned")], on_message=on_message):
            deadline = time.monotonic() + 10
            while len(got) < 2 and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=1)
    assert got == [1, 2]
    letters = _dead_letters(db_dsn)
    assert [reason for reason, _ in letters] == ["undecodable"], letters
    assert letters[0][1]  # the error is recorded
    assert sql(db_dsn, f"SELECT count(*) FROM {table('poisoned')}") == [(0,)]


def test_basic_get_dead_letters_an_undecodable_row_and_returns_the_next(db_dsn):
    with connect(db_dsn) as conn:
        Queue("got")(conn.channel()).declare()
        _insert(db_dsn, "got", *BAD_ROWS["unknown body encoding"])
        publish(conn, "got", [{"n": 7}])
        channel = conn.channel()
        message = channel.basic_get("got")
        assert message is not None and message.payload == {"n": 7}
        message.ack()
        assert channel.basic_get("got") is None
    assert [r for r, _ in _dead_letters(db_dsn)] == ["undecodable"]


def _same(a: Any, b: Any) -> bool:
    """Equality where NaN equals NaN (headers may carry it)."""
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.slow
def test_fuzz_1000_random_rows_are_each_delivered_exactly_or_dead_lettered(db_dsn):
    """The fault suite's fuzz: 1,000 rows inserted by SQL with random envelopes,
    headers, body encodings and compression. Every row written by kombu_pgmq's encoder
    comes back exactly (body and headers); every other row is delivered or dead-lettered
    with reason ``undecodable``; each is accounted for once; the consumer never stops."""
    from tests.support import fuzz_rows

    fuzz = fuzz_rows.rows(1000)
    with connect(db_dsn) as conn:
        Queue("fuzz")(conn.channel()).declare()
        ids = [
            sql(db_dsn, "SELECT pgmq.send('fuzz', %s::jsonb, %s::jsonb)", (m, h))[0][0]
            for m, h, _ in fuzz
        ]
        expected = dict(zip(ids, (e for _, _, e in fuzz), strict=True))
        delivered: dict[int, Any] = {}

        def on_message(message: Any) -> None:
            delivered[message.delivery_info["pgmq_msg_id"]] = message
            message.ack()

        with Consumer(conn.channel(), [Queue("fuzz")], on_message=on_message, prefetch_count=50):
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=1)  # never raises anything else
                if not sql(db_dsn, f"SELECT count(*) FROM {table('fuzz')}")[0][0]:
                    break
    letters = {
        int(msg_id): reason
        for msg_id, reason in sql(
            db_dsn,
            "SELECT headers->'x-dead-letter'->>'msg_id', headers->'x-dead-letter'->>'reason'"
            " FROM pgmq.q_kombu_pgmq_dlq",
        )
    }
    assert not delivered.keys() & letters.keys()
    assert delivered.keys() | letters.keys() == set(ids)
    assert set(letters.values()) <= {"undecodable"}
    valid = {i for i, e in expected.items() if e is not None}
    assert not valid & letters.keys(), "a message kombu_pgmq wrote was dead-lettered"
    for msg_id in valid:
        message, want = delivered[msg_id], expected[msg_id]
        if want["json"]:
            assert json.loads(message.body) == json.loads(want["body"]), msg_id
        else:
            assert message.body == want["body"], msg_id
        assert _same(message.headers, want["headers"]), msg_id
    print(
        f"fuzz: {len(valid)} valid rows delivered exactly, {len(delivered) - len(valid)} "
        f"other rows delivered, {len(letters)} dead-lettered"
    )
    assert sql(db_dsn, f"SELECT count(*) FROM {table('fuzz')}") == [(0,)]


def test_a_callback_that_raises_in_the_event_loop_dead_letters_its_message_alone(db_dsn):
    """In Celery's event loop an exception out of the consumer's callback would end the
    worker, and the restored message the next one: it is dead-lettered alone (reason
    ``consumer_error``, with the error) and the rest is delivered. In ``drain_events``
    it reaches the caller, as in kombu's transports, and the message stays held."""
    from kombu_pgmq.dlq import DeadLetterQueue

    from .helpers import FakeHub

    with connect(db_dsn) as conn:
        publish(conn, "raising", ["ok-0", "boom", "ok-1"])
        got: list[str] = []

        def on_message(message: Any) -> None:
            if message.payload == "boom":
                raise KeyError("id")
            got.append(message.payload)
            message.ack()

        loop = FakeHub()
        conn.transport.register_with_event_loop(conn.connection, loop)
        with Consumer(conn.default_channel, [Queue("raising")], on_message=on_message):
            for _ in range(6):
                loop.run_once()
            assert got == ["ok-0", "ok-1"]
        conn.transport.poller.unregister_from_event_loop()
    with DeadLetterQueue(db_dsn) as dlq:
        [letter] = dlq.list()
    assert letter.reason == "consumer_error"
    assert letter.headers["x-dead-letter"]["error"] == "KeyError: 'id'"
    assert sql(db_dsn, f"SELECT count(*) FROM {table('raising')}") == [(0,)]

    with connect(db_dsn) as conn:
        publish(conn, "raising_drain", ["boom"])
        consumer = Consumer(conn.default_channel, [Queue("raising_drain")], on_message=on_message)
        with consumer, pytest.raises(KeyError):
            conn.drain_events(timeout=5)
    assert sql(db_dsn, f"SELECT count(*) FROM {table('raising_drain')}") == [(1,)]
