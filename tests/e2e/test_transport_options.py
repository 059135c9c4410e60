"""A ``celery worker`` with a bad transport option stops at once with
one line naming the option, the value and the fix, instead of starting with a misspelt
option ignored (the default silently in force) or dying with Python's 60-line traceback
from the transport's constructor (called inside ``app.Worker(...)``, before Celery's
logging and outside its error handling). See :mod:`kombu_pgmq._worker_checks`.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kombu_pgmq.transport.options import OPTIONS, REMOVED_OPTIONS
from tests.e2e.helpers import celery_cli
from tests.support.doc_samples import check_sample

OURS = ", ".join(OPTIONS)


@pytest.mark.parametrize(
    ("options", "line", "sample"),
    [
        (
            {"visibility_timeout": "abc"},
            "kombu_pgmq: broker_transport_options: transport option "
            "visibility_timeout='abc' is invalid: expected seconds from 1 to 43200 (default: 30.0)",
            "bad_transport_option",  # docs/guides/celery.md shows it
        ),
        (
            {"visibilty_timeout": 60},
            "kombu_pgmq: broker_transport_options: unknown transport option "
            "'visibilty_timeout': did you mean 'visibility_timeout'? "
            f"(kombu_pgmq's options: {OURS})",
            None,
        ),
        (
            {"polling_interval": float("nan")},  # JSON NaN: json.dumps writes it
            "kombu_pgmq: broker_transport_options: transport option polling_interval=nan "
            "is invalid: expected seconds > 0 (default: 1.0)",
            None,
        ),
        (
            {"handover": False},
            "kombu_pgmq: broker_transport_options: transport option 'handover' was removed: "
            f"{REMOVED_OPTIONS['handover']}; remove it",
            None,
        ),
    ],
    ids=["bad-value", "typo", "nan", "removed"],
)
def test_a_worker_with_a_bad_transport_option_stops_with_one_line(
    e2e_env: dict[str, str], options: dict[str, Any], line: str, sample: str | None
) -> None:
    env = {**e2e_env, "KPT_TRANSPORT_OPTIONS": json.dumps(options)}
    done = celery_cli(env, "worker", "-P", "solo", "-l", "info", "--without-mingle", timeout=60)
    output = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 1, output
    assert output == [line]  # all it prints: no traceback, no banner (it never started)
    if sample is not None:
        check_sample(sample, "$ celery -A proj worker\n" + "\n".join(output))
