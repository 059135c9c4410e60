"""The ack batch (kombu_pgmq.transport.acks.AckBatch) without PostgreSQL: acks put back
when their statement fails, and the pacing of acks in Celery's event loop (sent alone at
most every ACK_BATCH_SECONDS, only while the statement connection is free, else at a
timer or with the next read)."""

from __future__ import annotations

import logging

import pytest

from kombu_pgmq import errors
from kombu_pgmq._db.rows import Receipt
from kombu_pgmq.transport.acks import ACK_BATCH_SECONDS, AckBatch
from tests.unit.fakes import FakeBroker


def held(broker: FakeBroker, name: str = "q", n: int = 1) -> list[Receipt]:
    """``n`` deliveries of PGMQ queue ``name``, read from ``broker``."""
    for _ in range(n):
        broker.send(name)
    rows = broker.read(name, 30, n)
    return [Receipt(name, r.msg_id, r.read_ct, r.enqueued_at) for r in rows]


def failures() -> tuple[list[errors.KombuPgmqError], object]:
    seen: list[errors.KombuPgmqError] = []
    return seen, seen.append


def test_the_oldest_ack_of_the_batch_is_remembered_when_acks_are_put_back() -> None:
    batch = AckBatch(durable=True)
    assert not batch and batch.since == 0.0
    batch.add(Receipt("q", 1, 1, None))
    first = batch.since
    batch.add(Receipt("q", 2, 1, None))
    assert batch.since == first and len(batch) == 2
    taken = batch.take()
    assert not batch
    batch.add(Receipt("q", 3, 1, None))
    batch.put_back(taken, since=first - 1.0)
    assert [r.msg_id for r in batch.take()] == [1, 2, 3]  # put back first, in order
    assert batch.since == first - 1.0


def test_flush_archives_in_one_statement_and_keeps_the_acks_on_a_lost_connection() -> None:
    broker = FakeBroker()
    batch = AckBatch(durable=True)
    for receipt in held(broker, n=2):
        batch.add(receipt)
    broker.ack_error = errors.BrokerConnectionError("lost")
    with pytest.raises(errors.BrokerConnectionError):
        batch.flush(broker)
    assert len(batch) == 2  # kept for the next flush or read
    batch.flush(broker)
    assert not batch and not broker.held
    assert len(broker.names("ack")) == 2


def test_a_stale_ack_is_logged_never_applied(caplog: pytest.LogCaptureFixture) -> None:
    broker = FakeBroker()
    (receipt,) = held(broker)
    batch = AckBatch(durable=False)
    batch.add(receipt._replace(read_ct=receipt.read_ct - 1))  # an earlier delivery's
    with caplog.at_level(logging.WARNING, logger="kombu_pgmq.transport.acks"):
        batch.flush(broker)
    assert "stale ack of message 1" in caplog.text
    assert broker.held  # still held by its current delivery


def test_send_goes_without_waiting_where_the_broker_can_else_waits() -> None:
    broker = FakeBroker()
    batch = AckBatch(durable=True)
    acks = held(broker, n=2)
    batch.send(broker, acks, since=1.0)
    assert broker.names("ack_nowait") == [acks] and broker.held  # not settled yet
    broker.settle_nowait()
    assert not broker.held
    broker.nowait = False  # e.g. acks of several queues
    more = held(broker)
    batch.send(broker, more, since=2.0)
    assert broker.names("ack") == [more] and not broker.held


def test_send_puts_back_what_a_lost_connection_kept_from_the_server() -> None:
    broker = FakeBroker()
    batch = AckBatch(durable=True)
    acks = held(broker)
    broker.ack_error = errors.BrokerConnectionError("lost")
    with pytest.raises(errors.BrokerConnectionError):
        batch.send(broker, acks, since=5.0)
    assert batch.take() == acks and batch.since == 5.0


def test_a_lone_ack_goes_at_once_when_the_connection_is_free() -> None:
    broker = FakeBroker()
    batch = AckBatch(durable=True)
    seen, failed = failures()
    (receipt,) = held(broker)
    batch.add(receipt)
    assert batch.send_soon(broker, now=100.0, failed=failed) is None  # sent: no timer
    assert broker.names("ack_nowait") == [[receipt]]
    assert not batch and not batch.timer_pending and not seen


def test_acks_soon_after_the_last_ones_wait_for_a_timer_one_at_a_time() -> None:
    broker = FakeBroker()
    batch = AckBatch(durable=True)
    seen, failed = failures()
    first, second, third = held(broker, n=3)
    batch.add(first)
    batch.send_soon(broker, now=100.0, failed=failed)
    sent_at = batch.sent_at
    batch.add(second)
    # sent_at is monotonic() of the send: "now" half the interval later
    wait = batch.send_soon(broker, now=sent_at + ACK_BATCH_SECONDS / 2, failed=failed)
    assert wait == pytest.approx(ACK_BATCH_SECONDS / 2)
    assert batch.timer_pending and len(batch) == 1
    batch.add(third)
    # a timer is set already: nothing more (the next read may take them first)
    assert batch.send_soon(broker, now=sent_at + ACK_BATCH_SECONDS / 2, failed=failed) is None
    batch.timer_pending = False  # the timer fires
    assert batch.send_soon(broker, now=sent_at + ACK_BATCH_SECONDS, failed=failed) is None
    assert broker.names("ack_nowait")[-1] == [second, third] and not batch and not seen


def test_acks_wait_while_the_statement_connection_is_busy() -> None:
    broker = FakeBroker()
    batch = AckBatch(durable=True)
    seen, failed = failures()
    (receipt,) = held(broker)
    batch.add(receipt)
    broker.db.busy = True  # a read's result not collected yet
    assert batch.send_soon(broker, now=100.0, failed=failed) == ACK_BATCH_SECONDS
    assert batch.timer_pending and len(batch) == 1 and not broker.names("ack_nowait")
    assert not seen


def test_without_a_connection_acks_wait_for_the_timer() -> None:
    batch = AckBatch(durable=True)
    seen, failed = failures()
    batch.add(Receipt("q", 1, 1, None))
    assert batch.send_soon(None, now=100.0, failed=failed) == ACK_BATCH_SECONDS
    assert len(batch) == 1 and not seen


def test_a_lost_connection_is_reported_and_the_acks_tried_again_at_the_timer() -> None:
    broker = FakeBroker()
    batch = AckBatch(durable=True)
    seen, failed = failures()
    (receipt,) = held(broker)
    batch.add(receipt)
    broker.ack_error = errors.BrokerConnectionError("lost")
    assert batch.send_soon(broker, now=100.0, failed=failed) == ACK_BATCH_SECONDS
    assert [type(e) for e in seen] == [errors.BrokerConnectionError]
    assert batch.take() == [receipt]


def test_a_cancelled_ack_statement_is_reported_and_kept() -> None:
    broker = FakeBroker()
    broker.nowait = False
    batch = AckBatch(durable=True)
    seen, failed = failures()
    (receipt,) = held(broker)
    batch.add(receipt)
    broker.ack_error = errors.StatementCanceled("statement_timeout")
    assert batch.send_soon(broker, now=100.0, failed=failed) == ACK_BATCH_SECONDS
    assert [type(e) for e in seen] == [errors.StatementCanceled]
    assert len(batch) == 1
