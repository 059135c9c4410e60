"""kombu_pgmq.limits: rates parsed as Celery writes ``rate_limit``, limits
checked before they reach the server (every error names the queue, the limit and the
fix), and transport option ``queue_limits`` refused at Connection time when malformed."""

from __future__ import annotations

import pytest
from kombu import Connection

import kombu_pgmq  # noqa: F401  (registers postgresql://)
from kombu_pgmq.errors import ConfigurationError
from kombu_pgmq.limits import LIMIT_NAMES, parse_rate, validate_limits
from kombu_pgmq.transport.options import TransportOptions


@pytest.mark.parametrize(
    ("rate", "per_second"),
    [
        ("100/s", 100.0),
        ("6000/m", 100.0),
        ("50/h", 50 / 3600),
        ("2.5/s", 2.5),
        (" 10 / m ", 10 / 60),
        ("7", 7.0),
        (7, 7.0),
        (0.5, 0.5),
    ],
)
def test_parse_rate(rate, per_second):
    assert parse_rate(rate) == pytest.approx(per_second)


@pytest.mark.parametrize("rate", ["fast", "10/d", "10/", "/s", "-1/s", "1e3/s", "", True, None])
def test_parse_rate_refuses_what_is_not_a_rate_and_says_how_to_write_one(rate):
    with pytest.raises(ConfigurationError) as info:
        parse_rate(rate, what="queue 'q': rate")
    message = str(info.value)
    assert "queue 'q': rate" in message
    assert "'100/s'" in message  # the fix: how a rate is written


@pytest.mark.parametrize("rate", ["0/s", "0", 0, "0.0/m"])
def test_parse_rate_refuses_zero_and_says_to_clear_the_limit(rate):
    with pytest.raises(ConfigurationError, match=r"above 0.*clear the limit"):
        parse_rate(rate)


def test_validate_limits_normalizes_every_limit():
    given = {
        "concurrency": 20,
        "rate": " 100/s ",
        "burst": 10,
        "key_concurrency": 2,
        "key_rate": "5/m",
        "key_burst": 1.5,
        "limit_key": " task ",
    }
    assert validate_limits("q", given) == {
        "concurrency": 20,
        "rate": "100/s",
        "burst": 10.0,
        "key_concurrency": 2,
        "key_rate": "5/m",
        "key_burst": 1.5,
        "limit_key": "task",
    }
    assert sorted(given) == sorted(LIMIT_NAMES)


def test_zero_or_none_removes_a_limit():
    limits = {"concurrency": 0, "rate": 0, "key_concurrency": None, "key_rate": "0"}
    assert validate_limits("q", limits) == dict.fromkeys(limits)
    assert validate_limits("q", {"limit_key": None}) == {"limit_key": None}
    assert validate_limits("q", {}) == {}


def test_a_rate_is_kept_as_written_for_the_server():
    assert validate_limits("q", {"rate": 3})["rate"] == "3"


def _error(limits, *, complete=True, queue="orders"):
    with pytest.raises(ConfigurationError) as info:
        validate_limits(queue, limits, complete=complete)
    return str(info.value)


def test_not_a_mapping_names_the_queue_and_shows_the_shape():
    message = _error([("concurrency", 2)])
    assert "'orders'" in message and "{'concurrency': 20, 'rate': '100/s'}" in message


def test_an_unknown_limit_is_named_with_the_known_ones():
    message = _error({"concurency": 2, "rate_limit": "1/s"})
    assert "'concurency'" in message and "'rate_limit'" in message
    assert "'orders'" in message
    for name in LIMIT_NAMES:
        assert name in message.split(":", 1)[1]


@pytest.mark.parametrize("name", ["concurrency", "key_concurrency"])
@pytest.mark.parametrize("value", [-1, 1.5, "3", True])
def test_a_bad_concurrency_names_queue_limit_and_what_is_expected(name, value):
    message = _error({name: value})
    assert "'orders'" in message and f"{name}={value!r}" in message
    assert "int >= 1" in message and "0 or None: no limit" in message


@pytest.mark.parametrize("name", ["rate", "key_rate"])
def test_a_bad_rate_names_queue_and_limit(name):
    message = _error({name: "10 per second"})
    assert f"queue 'orders': {name}" in message and "'100/s'" in message


@pytest.mark.parametrize(("burst", "rate"), [("burst", "rate"), ("key_burst", "key_rate")])
@pytest.mark.parametrize("value", [0.5, -2, "5", True])
def test_a_bad_burst_names_queue_and_limit(burst, rate, value):
    message = _error({rate: "1/s", burst: value})
    assert "'orders'" in message and f"{burst}={value!r}" in message
    assert "tokens >= 1" in message


@pytest.mark.parametrize(("burst", "rate"), [("burst", "rate"), ("key_burst", "key_rate")])
def test_a_burst_needs_its_rate(burst, rate):
    message = _error({burst: 5})
    assert "'orders'" in message and f"{burst} needs {rate}" in message
    # a change of some limits: the stored rate may be there
    assert validate_limits("orders", {burst: 5}, complete=False) == {burst: 5.0}
    # but not when the same change removes it
    message = _error({burst: 5, rate: None}, complete=False)
    assert f"{burst} needs {rate}" in message


@pytest.mark.parametrize("key", ["", "  ", 3, ["task"]])
def test_a_bad_limit_key_says_what_a_key_is(key):
    message = _error({"limit_key": key})
    assert "'orders'" in message and "limit_key=" in message
    assert "'x-limit-key'" in message and "'task'" in message


# -- transport option queue_limits -------------------------------------------------------


def test_queue_limits_option_is_parsed_and_normalized():
    options = TransportOptions.parse(
        {"queue_limits": {"api": {"concurrency": 3, "rate": "20/s"}, "batch": {"rate": 0}}}
    )
    assert options.queue_limits == {
        "api": {"concurrency": 3, "rate": "20/s"},
        "batch": {"rate": None},
    }
    assert TransportOptions.parse({}).queue_limits == {}
    assert TransportOptions.parse({"queue_limits": None}).queue_limits == {}


@pytest.mark.parametrize(
    ("queue_limits", "expected"),
    [
        (["api"], "queue_limits"),
        ("api=3", "queue_limits"),
        ({"api": 3}, "the limits of queue 'api' must be a dict"),
        ({"api": {"concurrency": "three"}}, "queue 'api': concurrency='three'"),
        ({"api": {"rates": "1/s"}}, "unknown limit(s) 'rates' (did you mean 'rate'?)"),
        ({"api": {"concurrency": False}}, "queue 'api': concurrency=False is invalid"),
        ({"api": {"rate": "1/d"}}, "queue 'api': rate '1/d' is not a rate"),
        ({"api": {"burst": 3}}, "queue 'api': burst needs rate"),
    ],
)
def test_a_bad_queue_limits_option_raises_at_connection_time(queue_limits, expected):
    """Checked when the Connection is made (no server needed: nothing is sent before)."""
    conn = Connection(
        "postgresql://nobody@127.0.0.1:1/none", transport_options={"queue_limits": queue_limits}
    )
    with pytest.raises(ConfigurationError) as info:
        conn.transport  # noqa: B018  (the transport parses its options)
    assert expected in str(info.value)
