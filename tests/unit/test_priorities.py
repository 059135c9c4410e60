import click
import pytest

from kombu_pgmq._naming import MAX_PGMQ_NAME_LENGTH, pgmq_queue_name
from kombu_pgmq._priorities import (
    band_queue_name,
    make_bands,
    max_priority_argument,
    single,
    validate_steps,
)
from kombu_pgmq.cli import parse_duration
from kombu_pgmq.errors import ConfigurationError


def test_band_zero_is_the_queue_itself_and_other_bands_are_distinct_valid_names():
    assert band_queue_name("celery", 0) == "celery"
    names = {band_queue_name("celery", f) for f in range(10)}
    assert len(names) == 10
    long = "x" * 60 + ".with.Dots@host"
    for floor in range(10):
        name = band_queue_name(long, floor)
        assert len(name) <= MAX_PGMQ_NAME_LENGTH
        assert name == name.lower()
    assert band_queue_name("celery", 9).startswith("celery_priority_9__")
    # never the name of another Kombu queue (band names hash a NUL)
    assert band_queue_name("celery", 9) != pgmq_queue_name("celery_priority_9")


def test_make_bands_every_level_or_steps_and_queue_for():
    bands = make_bands("q", 9, None)
    assert bands.floors == tuple(range(10))
    assert bands.queue_for(7) == band_queue_name("q", 7)
    assert bands.queue_for(12) == band_queue_name("q", 9)  # above 9 counts as 9
    assert bands.queue_for(-3) == "q"
    assert bands.read_order[0] == band_queue_name("q", 9) and bands.read_order[-1] == "q"
    coarse = make_bands("q", 5, (0, 3, 6, 9))
    assert coarse.floors == (0, 3)  # steps above x-max-priority are dropped
    assert coarse.queue_for(2) == "q" and coarse.queue_for(5) == band_queue_name("q", 3)
    assert make_bands("q", None, None) == single("q")
    assert single("q").queue_for(9) == "q"


@pytest.mark.parametrize("value", [0, 256, -1, "9", 2.5, True])
def test_bad_x_max_priority(value):
    with pytest.raises(ConfigurationError, match="x-max-priority"):
        max_priority_argument({"x-max-priority": value}, "q")


def test_x_max_priority_absent_or_valid():
    assert max_priority_argument(None, "q") is None
    assert max_priority_argument({"x-max-priority": 10}, "q") == 10


@pytest.mark.parametrize("steps", [[], [0, 10], ["a"], 5, [True]])
def test_bad_priority_steps(steps):
    with pytest.raises(ConfigurationError, match="priority_steps"):
        validate_steps(steps)


def test_priority_steps_sorted_and_deduplicated():
    assert validate_steps([9, 3, 3, 0]) == (0, 3, 9)
    assert validate_steps(None) is None


def test_parse_duration():
    assert parse_duration("90") == 90
    assert parse_duration("15m") == 900
    assert parse_duration("7d") == 7 * 86400
    assert parse_duration("1.5h") == 5400
    with pytest.raises(click.BadParameter, match="duration"):
        parse_duration("soon")
