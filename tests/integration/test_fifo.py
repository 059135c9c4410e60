"""FIFO groups (SQS FIFO's ``MessageGroupId``): on a queue declared with
``x-fifo-groups``, messages with the same ``x-group-id`` header are delivered one at a time
in publish order (the next only once the previous is acked or dead-lettered), different
groups in parallel; messages without the header are not grouped."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest
from kombu import Consumer, Producer, Queue

from kombu_pgmq import errors

from .helpers import connect, wait_for

FIFO = Queue("fifo", queue_arguments={"x-fifo-groups": True})


def _publish(conn: Any, items: list[tuple[str | None, str]]) -> None:
    producer = Producer(conn)
    for group, label in items:
        headers = {"x-group-id": group} if group else {}
        producer.publish({"label": label}, routing_key="fifo", declare=[FIFO], headers=headers)


def _deliveries(conn: Any, consumer_args: dict[str, Any], rounds: int = 3) -> list[Any]:
    got: list[Any] = []
    with Consumer(conn, [FIFO], on_message=got.append, **consumer_args):
        for _ in range(rounds):
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.3)
    return got


def test_one_message_per_group_at_a_time_in_publish_order(db_dsn):
    with connect(db_dsn, polling_interval=0.1) as conn:
        _publish(
            conn,
            [
                ("a", "a1"),
                ("a", "a2"),
                ("b", "b1"),
                ("a", "a3"),
                ("b", "b2"),
                (None, "u1"),
                (None, "u2"),
                ("c", "c1"),
            ],
        )
        first = _deliveries(conn, {"prefetch_count": 20})
        labels = sorted(m.payload["label"] for m in first)
        assert labels == ["a1", "b1", "c1", "u1", "u2"]  # heads of groups, ungrouped all
        by_label = {m.payload["label"]: m for m in first}
        by_label["a1"].ack()
        by_label["b1"].requeue()  # visible again: still the head of b
        by_label["c1"].reject()  # dead-lettered: c is free
        for label in ("u1", "u2"):
            by_label[label].ack()
        second = _deliveries(conn, {"prefetch_count": 20})
        assert sorted(m.payload["label"] for m in second) == ["a2", "b1"]
        for message in second:
            message.ack()
        third = _deliveries(conn, {"prefetch_count": 20})
        assert sorted(m.payload["label"] for m in third) == ["a3", "b2"]
        for message in third:
            message.ack()


def test_a_group_waits_for_its_head_even_across_connections(db_dsn):
    with connect(db_dsn, polling_interval=0.1) as one, connect(db_dsn, polling_interval=0.1) as two:
        _publish(one, [("g", "g1"), ("g", "g2")])
        held = _deliveries(one, {"prefetch_count": 5})
        assert [m.payload["label"] for m in held] == ["g1"]
        assert _deliveries(two, {"prefetch_count": 5}) == []  # g2 waits for g1
        held[0].ack()
        after = _deliveries(two, {"prefetch_count": 5})
        assert [m.payload["label"] for m in after] == ["g2"]
        after[0].ack()


def test_a_delayed_head_holds_its_group(db_dsn):
    with connect(db_dsn, polling_interval=0.1) as conn:
        producer = Producer(conn)
        published = time.monotonic()
        producer.publish(
            {"label": "later"},
            routing_key="fifo",
            declare=[FIFO],
            headers={"x-group-id": "d", "x-delay": 1500},
        )
        producer.publish({"label": "next"}, routing_key="fifo", headers={"x-group-id": "d"})
        assert _deliveries(conn, {"prefetch_count": 5}) == []
        # Polled (a closed consumer gives back what it got): the head once it is due.
        got = wait_for(
            lambda: _deliveries(conn, {"prefetch_count": 5}), 30, "the delayed head", interval=0
        )
        assert time.monotonic() - published >= 1.4  # not before its delay (1.5 s)
        assert [m.payload["label"] for m in got] == ["later"]
        got[0].ack()


def test_fifo_queues_cannot_have_priorities(db_dsn):
    with connect(db_dsn) as conn, pytest.raises(errors.ConfigurationError, match="FIFO"):
        Queue("both", queue_arguments={"x-fifo-groups": True, "x-max-priority": 5})(
            conn.default_channel
        ).declare()
    with connect(db_dsn) as conn, pytest.raises(errors.ConfigurationError, match="True or False"):
        Queue("bad", queue_arguments={"x-fifo-groups": "yes"})(conn.default_channel).declare()


@pytest.mark.parametrize("group", ["acct-NaN-1", "Infinity", "BANaNa"])
def test_a_group_id_that_looks_like_nan_keeps_its_order_beside_awkward_headers(db_dsn, group):
    """With another header jsonb cannot hold (a NUL in argsrepr), a group id containing
    'NaN' stays in the headers the server reads: the group's messages go out one at a
    time, not all at once."""
    with connect(db_dsn) as conn:
        producer = Producer(conn)
        for step in range(3):
            producer.publish(
                {"label": f"{group}-{step}"},
                routing_key="fifo",
                declare=[FIFO],
                headers={"x-group-id": group, "argsrepr": "('\x00',)"},
            )
        first = _deliveries(conn, {"prefetch_count": 20})
        assert [m.payload["label"] for m in first] == [f"{group}-0"]
        first[0].ack()
        second = _deliveries(conn, {"prefetch_count": 20})
        assert [m.payload["label"] for m in second] == [f"{group}-1"]
        assert second[0].headers == {"x-group-id": group, "argsrepr": "('\x00',)"}
        second[0].ack()


def test_a_group_id_jsonb_cannot_hold_is_refused(db_dsn):
    with connect(db_dsn) as conn, pytest.raises(errors.ConfigurationError, match="x-group-id"):
        Producer(conn).publish(
            {}, routing_key="fifo", declare=[FIFO], headers={"x-group-id": "acct\x001"}
        )
