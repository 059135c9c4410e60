"""Large task arguments and results through a real ``celery worker`` (prefork), broker
and result backend both kombu_pgmq (``postgresql://``): they come back equal, text and
binary. What they cost: ``benchmarks/large_payloads.py``.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable

import pytest
from celery import Celery

from tests.e2e.helpers import Worker

RESULT_TIMEOUT_S = 300.0
_ALNUM = (string.ascii_letters + string.digits).encode()
_TO_ALNUM = bytes(_ALNUM[i % len(_ALNUM)] for i in range(256))

#: A worker that accepts pickle; Celery refuses to run one as root unless C_FORCE_ROOT
#: is set (test containers run as root).
PICKLE_ENV = {"KPT_ACCEPT_PICKLE": "1", "C_FORCE_ROOT": "1"}


@pytest.fixture
def e2e_env(e2e_env: dict[str, str]) -> dict[str, str]:
    return {**e2e_env, "KPT_RESULT_BACKEND": "postgresql"}


def test_a_20_mb_argument_and_result_round_trip(
    app: Celery, start_worker: Callable[..., Worker]
) -> None:
    """Random letters and digits (as base64 of a file), with NaN and -Infinity inside
    the string: stored as JSON all the same, and back equal (the stored result also
    holds the argument: the e2e app has result_extended)."""
    start_worker()
    text = random.Random(20).randbytes(20_000_000).translate(_TO_ALNUM).decode("ascii")
    text = f"{text[:1000]} NaN, -Infinity {text[1000:]}"
    result = app.tasks["e2e.echo"].delay(text)
    back = result.get(timeout=RESULT_TIMEOUT_S)
    assert len(back) == len(text)
    assert back == text


def test_binary_arguments_and_results_round_trip(
    app: Celery, start_worker: Callable[..., Worker]
) -> None:
    """Bytes of every value: through Celery's JSON serializer (base64 inside the JSON
    body) and pickled (a binary message body, stored as base64). A binary result meta
    (pickle): tests/integration/test_large_values.py."""
    start_worker(**PICKLE_ENV)
    data = random.Random(5).randbytes(5_000_000) + bytes(range(256))
    echo = app.tasks["e2e.echo"]
    as_json = echo.delay(data)
    pickled = echo.apply_async((data,), serializer="pickle")
    assert as_json.get(timeout=RESULT_TIMEOUT_S) == data
    assert pickled.get(timeout=RESULT_TIMEOUT_S) == data
