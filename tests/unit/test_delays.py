from datetime import datetime, timedelta, timezone

import pytest

from kombu_pgmq.errors import ConfigurationError
from kombu_pgmq.transport._delays import delay_seconds


def _eta(seconds: float) -> dict:
    eta = datetime.now(timezone.utc) + timedelta(seconds=seconds)
    return {"headers": {"eta": eta.isoformat()}}


def test_eta_minus_lead_rounded_down():
    assert delay_seconds(_eta(600.5), 2.0) in (597, 598)
    assert delay_seconds(_eta(2.5), 2.0) == 0  # under a second of delay: deliver now


def test_x_delay_rounded_up_and_bad_values_ignored():
    assert delay_seconds({"headers": {"x-delay": 1}}, 2.0) == 1
    assert delay_seconds({"headers": {"x-delay": 2000}}, 2.0) == 2
    assert delay_seconds({"headers": {"x-delay": "soon"}}, 2.0) == 0
    assert delay_seconds({"headers": {"x-delay": -5}}, 2.0) == 0


def test_no_header_naive_or_bad_eta_means_no_delay():
    assert delay_seconds({"headers": None}, 2.0) == 0
    assert delay_seconds({}, 2.0) == 0
    assert delay_seconds({"headers": {"eta": "tomorrow"}}, 2.0) == 0
    naive = (datetime.now() + timedelta(hours=1)).isoformat()
    assert delay_seconds({"headers": {"eta": naive}}, 2.0) == 0


@pytest.mark.parametrize("value", [float("inf"), float("nan"), "inf", 3e12])
def test_x_delay_out_of_range_is_a_clear_error(value):
    with pytest.raises(ConfigurationError, match="x-delay"):
        delay_seconds({"headers": {"x-delay": value}}, 2.0)


def test_eta_beyond_pgmq_range_is_a_clear_error():
    with pytest.raises(ConfigurationError, match="ETA 9999-01-01"):
        delay_seconds({"headers": {"eta": "9999-01-01T00:00:00+00:00"}}, 2.0)
