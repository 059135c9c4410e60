"""Lease renewal (kombu_pgmq.transport._leases) against a real PostgreSQL: held messages keep their
visibility timeout, one statement per round, lost leases are reported, a killed
connection is survived."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from kombu import Consumer, Queue

from kombu_pgmq.errors import ConfigurationError
from kombu_pgmq.transport.acks import SETTLES_ITSELF

from .helpers import connect, publish, sql, table

#: Visibility timeout and renewal interval of the renewal tests: a renewal must land
#: within 1.8 s of the previous one (a loaded 2-core machine keeps that margin).
VT, RENEWAL = 2, 0.2


def test_held_message_outlives_its_visibility_timeout(db_dsn):
    with connect(db_dsn, visibility_timeout=VT, lease_renewal_interval=RENEWAL) as holder:
        publish(holder, "long", ["x"])
        message = holder.channel().basic_get("long")
        assert message is not None
        time.sleep(2.5 * VT)
        with connect(db_dsn) as other:
            assert other.channel().basic_get("long") is None
        assert holder.transport.leases.rounds >= 5
        message.ack()
    assert sql(db_dsn, f"SELECT read_ct FROM {table('long', 'a')}") == [(1,)]


def test_callback_running_longer_than_the_visibility_timeout_is_not_redelivered(db_dsn):
    """A plain Kombu consumer whose callback runs 2.5 x VT inside drain_events."""
    seen: list[int] = []
    stolen: list[object] = []
    with connect(db_dsn, visibility_timeout=VT, lease_renewal_interval=RENEWAL) as conn:
        publish(conn, "slow", ["job"])

        def thief() -> None:  # another consumer polls the queue meanwhile
            with connect(db_dsn) as other:
                channel = other.channel()
                deadline = time.monotonic() + 2.5 * VT
                while time.monotonic() < deadline:
                    got = channel.basic_get("slow")
                    if got is not None:
                        stolen.append(got)
                    time.sleep(0.1)

        def on_message(message):
            seen.append(message.delivery_info["pgmq_read_ct"])
            worker = threading.Thread(target=thief)
            worker.start()
            worker.join()  # "works" 2.5 x VT
            message.ack()

        with Consumer(conn.channel(), [Queue("slow")], on_message=on_message, prefetch_count=1):
            conn.drain_events(timeout=4 * VT)
    assert seen == [1]
    assert stolen == []


def test_one_statement_per_round_for_all_held_messages(db_dsn):
    options = {"visibility_timeout": 30, "lease_renewal_interval": 0}  # rounds by hand
    with connect(db_dsn, **options) as conn:
        publish(conn, "held.a", list(range(30)))
        publish(conn, "held.b", list(range(20)))
        channel = conn.channel()
        held = [channel.basic_get(q) for q in ["held.a"] * 30 + ["held.b"] * 20]
        assert all(m is not None for m in held)
        before = sql(db_dsn, f"SELECT max(vt) FROM {table('held.a')}")[0][0]
        result = conn.transport.leases.renew()
        assert result.statements == 1
        assert result.renewed == 50 and result.lost == []
        after = sql(db_dsn, f"SELECT min(vt) FROM {table('held.a')}")[0][0]
        assert after > before  # every lease pushed later than any was before


def test_lost_lease_is_logged(db_dsn, caplog):
    with connect(db_dsn, visibility_timeout=1, lease_renewal_interval=0) as holder:
        publish(holder, "lapsed", ["x"])
        message = holder.channel().basic_get("lapsed")
        assert message is not None
        time.sleep(1.3)  # no renewals: the lease runs out
        with connect(db_dsn) as other:
            again = other.channel().basic_get("lapsed")
            assert again is not None and again.delivery_info["pgmq_read_ct"] == 2
            with caplog.at_level(logging.WARNING, logger="kombu_pgmq.transport._leases"):
                result = holder.transport.leases.renew()
            name = message.delivery_info["pgmq_queue"]
            assert result.lost == [(name, message.delivery_info["pgmq_msg_id"])]
            assert "lost the lease" in caplog.text
            # reported once: not renewed (nor reported) again
            assert holder.transport.leases.renew().lost == []
            # the new holder's lease is untouched by the old one
            vt_left = sql(
                db_dsn, f"SELECT extract(epoch FROM vt - clock_timestamp()) FROM {table('lapsed')}"
            )[0][0]
            assert vt_left > 0


def test_expired_but_unclaimed_lease_is_taken_back(db_dsn):
    """The VT passed but nobody read the message: the holder renews it (read_ct is
    unchanged), nothing is lost."""
    with connect(db_dsn, visibility_timeout=1, lease_renewal_interval=0) as holder:
        publish(holder, "late", ["x"])
        assert holder.channel().basic_get("late") is not None
        time.sleep(1.3)
        result = holder.transport.leases.renew()
        assert result.renewed == 1 and result.lost == []
        with connect(db_dsn) as other:
            assert other.channel().basic_get("late") is None


@pytest.mark.slow
def test_renewals_survive_a_killed_connection(db_dsn, caplog):
    # After a kill the renewer reconnects (a failed round, then a new connection): 3.5 s
    # of margin before the lease renewed last (at most 0.5 s before the kill) lapses.
    with connect(db_dsn, visibility_timeout=4, lease_renewal_interval=0.5) as holder:
        publish(holder, "killed", ["x"])
        message = holder.channel().basic_get("killed")
        assert message is not None
        with caplog.at_level(logging.WARNING, logger="kombu_pgmq.transport._leases"):
            for _ in range(2):
                pid = holder.transport.leases.connector.backend_pid
                sql(db_dsn, "SELECT pg_terminate_backend(%s)", (pid,))
                time.sleep(4.5)  # longer than the visibility timeout
                with connect(db_dsn) as other:
                    assert other.channel().basic_get("killed") is None
        assert "lease renewal failed" in caplog.text
        assert "works again" in caplog.text
        message.ack()
    assert sql(db_dsn, f"SELECT read_ct FROM {table('killed', 'a')}") == [(1,)]


def test_closing_restores_held_messages_at_once(db_dsn):
    """Closing requeues (vt = now); a renewal round cannot push them back afterwards."""
    with connect(db_dsn, visibility_timeout=30, lease_renewal_interval=0.05) as conn:
        publish(conn, "closing", list(range(3)))
        channel = conn.channel()
        assert all(channel.basic_get("closing") is not None for _ in range(3))
        time.sleep(0.2)
        channel.close()
        time.sleep(0.2)  # rounds keep running on the connection
        rows = sql(db_dsn, f"SELECT vt <= clock_timestamp() FROM {table('closing')}")
    assert rows == [(True,)] * 3


@pytest.mark.parametrize("value", [30, 45, -1, "soon", True])
def test_lease_renewal_interval_must_be_below_the_visibility_timeout(db_dsn, value):
    conn = connect(db_dsn, visibility_timeout=30, lease_renewal_interval=value)
    with pytest.raises(ConfigurationError, match="lease_renewal_interval"), conn:
        conn.connect()


def test_a_message_its_task_settled_is_not_reported_lost(db_dsn, caplog):
    # an AtomicTask's message: its task's transaction archived it before the worker's ack
    with connect(db_dsn, lease_renewal_interval=0) as holder:
        publish(holder, "settles_itself", ["x", "y"])
        channel = holder.channel()
        settled, plain = channel.basic_get("settles_itself"), channel.basic_get("settles_itself")
        assert settled is not None and plain is not None
        settled.delivery_info[SETTLES_ITSELF] = True
        ids = [m.delivery_info["pgmq_msg_id"] for m in (settled, plain)]
        sql(db_dsn, f"DELETE FROM {table('settles_itself')} WHERE msg_id = ANY(%s)", (ids,))
        with caplog.at_level(logging.WARNING, logger="kombu_pgmq.transport._leases"):
            result = holder.transport.leases.renew()
        name = plain.delivery_info["pgmq_queue"]
        assert result.lost == [(name, plain.delivery_info["pgmq_msg_id"])]
        assert caplog.text.count("lost the lease") == 1
        assert f"message {ids[0]} " not in caplog.text
