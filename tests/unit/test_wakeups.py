"""The poller's decisions (kombu_pgmq.transport.wakeups.Wakeups), without PostgreSQL:
which queues a round reads, which ones the connection starts or stops waiting on, when
delayed messages are read."""

from __future__ import annotations

import threading

from kombu_pgmq.transport.wakeups import BUSY_AFTER_FULL_READS, Wakeups


def test_a_queue_found_empty_stops_being_read_and_is_waited_on_once() -> None:
    w = Wakeups()
    w.ready |= {"a", "b"}
    to_wait, to_busy = w.after_round({"a"}, {"b"}, listening=True)
    assert (to_wait, to_busy) == ({"a"}, [])
    assert w.ready == {"b"}  # a filled read may leave more: read again
    w.now_waiting(to_wait)
    assert w.waiting == {"a"}
    assert w.ready == {"a", "b"}  # the final read after wait_for committed
    # found empty again while waited on: nothing more to send
    assert w.after_round({"a"}, set(), listening=True) == (set(), [])
    assert w.ready == {"b"}


def test_without_listen_no_queue_is_waited_on() -> None:
    w = Wakeups()
    w.ready.add("a")
    assert w.after_round({"a"}, set(), listening=False) == (set(), [])
    assert w.ready == set()


def test_a_waited_on_queue_whose_reads_keep_filling_stops_being_waited_on() -> None:
    w = Wakeups()
    w.now_waiting({"a", "b"})
    for _ in range(BUSY_AFTER_FULL_READS - 1):
        assert w.after_round(set(), {"a", "b"}, listening=True) == (set(), [])
    # "b" is found empty once: its streak starts over
    w.after_round({"b"}, set(), listening=True)
    assert w.after_round(set(), {"a", "b"}, listening=True) == (set(), ["a"])
    w.stopped_waiting(["a"])
    assert w.waiting == {"b"}
    assert "a" in w.ready


def test_full_reads_of_a_queue_not_waited_on_ask_for_nothing() -> None:
    w = Wakeups()
    for _ in range(BUSY_AFTER_FULL_READS + 2):
        assert w.after_round(set(), {"a"}, listening=True) == (set(), [])


def test_the_earliest_due_time_wins_and_due_queues_are_read() -> None:
    w = Wakeups()
    w.now_waiting({"a", "b"})
    w.ready.clear()
    w.due_at("a", 10.0)
    w.due_at("a", 12.0)  # later: the earlier one stays
    w.due_at("b", 11.0)
    assert w.earliest_due() == 10.0
    assert w.take_due(9.99) == set()
    assert w.take_due(10.5) == {"a"}
    assert w.ready == {"a"}
    assert w.waiting == {"b"}  # found empty, "a" is waited on again by its final read
    assert w.earliest_due() == 11.0
    w.due_at("b", 5.0)  # earlier than known
    assert w.earliest_due() == 5.0


def test_notified_due_times_are_the_servers_epoch_on_our_monotonic_clock() -> None:
    w = Wakeups()
    w.clock_offset = 2.0  # the server's clock runs 2 s ahead of ours
    w.notified({"a"}, {"b": 1010.0}, now=100.0, wall_now=1000.0)
    assert w.ready == {"a"}
    # due at the server's 1010 = our wall clock's 1008 = 8 s from now
    assert w.due == {"b": 108.0}


def test_the_fallback_poll_is_due_every_interval_or_when_forced() -> None:
    w = Wakeups()
    assert w.fallback_due(100.0, 1.0)  # never ran
    assert not w.fallback_due(100.5, 1.0)
    assert w.fallback_due(100.6, 1.0, force=True)  # notifications may have been missed
    assert not w.fallback_due(101.5, 1.0)
    assert w.fallback_due(101.6, 1.0)
    assert w.next_fallback == 102.6


def test_a_queue_no_consumer_is_left_for_is_forgotten() -> None:
    w = Wakeups()
    w.now_waiting({"a"})
    w.due_at("a", 5.0)
    w.after_round(set(), {"a"}, listening=True)
    assert w.forget("a") is True  # its waiting row is to be removed
    assert (w.ready, w.waiting, w.due) == (set(), set(), {})
    assert w.forget("a") is False
    # its streak of full reads went with it
    w.now_waiting({"a"})
    for _ in range(BUSY_AFTER_FULL_READS - 1):
        assert w.after_round(set(), {"a"}, listening=True) == (set(), [])


def test_a_lost_connection_reads_every_consumed_queue_and_waits_again() -> None:
    w = Wakeups()
    w.now_waiting({"a"})
    w.ready.clear()
    w.connection_lost({"a", "b"})
    assert w.waiting == set()
    assert w.ready == {"a", "b"}
    assert w.after_round({"a", "b"}, set(), listening=True)[0] == {"a", "b"}


def test_queues_found_below_their_positions_from_another_thread_are_read() -> None:
    w = Wakeups()
    thread = threading.Thread(target=w.found_below, args=({"a"},))
    thread.start()
    thread.join()
    assert w.ready == set()  # until the poller's thread takes them
    assert w.take_found_below() == {"a"}
    assert w.ready == {"a"}
    assert w.take_found_below() == set()


def test_clear_forgets_everything() -> None:
    w = Wakeups()
    w.now_waiting({"a"})
    w.due_at("b", 1.0)
    w.found_below({"c"})
    w.clear()
    assert (w.ready, w.waiting, w.due, w.take_found_below()) == (set(), set(), {}, set())
