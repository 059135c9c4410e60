"""ReadPositions without a database: where the next read of a queue starts, from what
the last read returned (its snapshot, its own transaction id, its transaction's start)."""

from __future__ import annotations

import math

import pytest

from kombu_pgmq._db import positions
from kombu_pgmq._db.positions import MARGIN_SECONDS, ReadPosition, ReadPositions


def read(snapshot: str, xid: str | None, at: float, scanned_to: float) -> ReadPosition:
    return ReadPosition(snapshot, xid, at, -math.inf, scanned_to)


def test_the_first_read_starts_at_the_beginning():
    assert ReadPositions().params("q")["scan_from"] == -math.inf
    assert ReadPositions().probe_from("q") == -math.inf


def test_a_read_that_saw_everything_moves_the_position_to_its_start_less_the_margin():
    # ids at or above the snapshot's xmax were assigned after the read's transaction began
    p = ReadPositions()
    p.advance("q", read("100:100:", "100", 1000.0, 1000.5))
    assert p.params("q")["scan_from"] == pytest.approx(1000.0 - MARGIN_SECONDS)


def test_a_filled_batch_stops_the_position_at_its_last_row():
    p = ReadPositions()
    p.advance("q", read("100:100:", None, 1000.0, 990.0))
    assert p.params("q")["scan_from"] == 990.0


def test_an_id_in_progress_is_watched_with_the_start_of_the_newest_read_below_it():
    p = ReadPositions()
    p.advance("q", read("50:50:", "50", 900.0, 900.0))
    p.advance("q", read("60:60:", "60", 950.0, 950.0))
    p.advance("q", read("55:80:55,70", "80", 1000.0, 1000.0))
    params = p.params("q")
    # 55 was assigned after the read with id 50 began, 70 after the one with id 60
    assert params["watch_xids"] == ["55", "70"]
    assert params["watch_bounds"] == [900.0 - MARGIN_SECONDS, 950.0 - MARGIN_SECONDS]
    # the probe counts them as committed
    assert p.probe_from("q") == 900.0 - MARGIN_SECONDS


def test_an_id_older_than_every_read_is_bounded_by_the_start_of_the_index():
    p = ReadPositions()
    p.advance("q", read("10:80:10", "80", 1000.0, 1000.0))
    assert p.params("q")["watch_bounds"] == [-math.inf]
    assert p.params("q")["scan_from"] == 1000.0 - MARGIN_SECONDS


def test_ids_going_back_forget_every_position():
    # a server with other ids (restored from a backup, a failover)
    p = ReadPositions()
    p.advance("q", read("100:100:", "100", 1000.0, 1000.0))
    p.advance("r", read("90:90:", "90", 1001.0, 1001.0))
    assert p.params("q")["scan_from"] == -math.inf
    assert p.params("r")["scan_from"] == 1001.0 - MARGIN_SECONDS


def test_a_read_starts_from_the_beginning_when_nothing_looked_below(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(positions.time, "monotonic", lambda: clock[0])
    p = ReadPositions()
    p.advance("q", ReadPosition("100:100:", "100", 1000.0, -math.inf, 1000.0))
    assert p.looks_due() == {}
    clock[0] = positions.LOOK_SECONDS
    # the heartbeat thread's look is due first, at the position
    assert p.looks_due() == {"q": 1000.0 - MARGIN_SECONDS}
    assert p.params("q")["scan_from"] > -math.inf
    clock[0] = positions.FULL_SCAN_SECONDS
    assert p.params("q")["scan_from"] == -math.inf  # no look came: the read starts over
    # a look sent a moment ago keeps the read at its position, and the next look is due
    # LOOK_SECONDS after it was sent
    sent = clock[0] - 1
    p.looked_below(["q"], sent)
    assert p.params("q")["scan_from"] > -math.inf
    assert p.looks_due() == {}
    clock[0] = sent + positions.LOOK_SECONDS
    assert p.looks_due() == {"q": 1000.0 - MARGIN_SECONDS}


def test_forget_reads_the_queue_from_the_start():
    p = ReadPositions()
    p.advance("q", read("100:100:", "100", 1000.0, 1000.0))
    p.forget("q")
    assert p.params("q")["scan_from"] == -math.inf
    assert p.age("q") is None


def test_the_queues_of_one_read_share_its_transaction_id():
    p = ReadPositions()
    p.advance("a", read("100:100:", "100", 1000.0, 1000.0))
    p.advance("b", read("100:100:", "100", 1000.0, 1000.0))
    assert p.params("a")["scan_from"] == p.params("b")["scan_from"] > -math.inf
