"""The command line speaks in its own flags: an error of ``kombu-pgmq`` names the option
to give (``--all``, ``--batch-size``), never the Python API's parameters (``all=True``,
``batch_size=0``, ``None``), and bad usage is refused before anything is asked or sent
(exit status 2, no confirmation prompt, no traceback)."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner, Result

from kombu_pgmq import cli

#: Python API wording: a parameter with ``=`` (``all=True``), or a Python constant.
_API_WORDING = re.compile(r"\b[a-z_]+=|\bTrue\b|\bFalse\b|\bNone\b")


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli.main, list(args), prog_name="kombu-pgmq", input="")


@pytest.mark.parametrize(
    ("line", "wording"),
    [
        (
            ["dlq", "purge"],
            "say which dead letters to purge: --id N, --queue Q, --reason R or --task T, "
            "or --all for every one",
        ),
        (["dlq", "purge", "--yes"], "or --all for every one"),
        (["dlq", "replay"], "say which dead letters to replay:"),
        (["dlq", "list", "--limit", "0"], "Invalid value for '--limit'"),
        (["archive", "prune", "--older-than", "7d", "--batch-size", "0"], "'--batch-size'"),
        (["results", "expire", "--batch-size", "0"], "'--batch-size'"),
        (["queue", "limit", "q", "--concurrency", "-1"], "'--concurrency'"),
        (["queue", "limit", "q", "--burst", "0.5"], "'--burst'"),
        (["queue", "limit", "q", "--clear", "--key-burst", "3"], "--key-burst needs --key-rate"),
        (["metrics", "serve", "--port", "99999"], "'--port': 99999 is not in the range"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_usage_errors_name_the_flag(line: list[str], wording: str) -> None:
    """Refused before a database is chosen (the URL given is never reached) or a
    confirmation asked."""
    result = invoke(*line, "--url", "postgresql://postgres@127.0.0.1:1/x")
    assert result.exit_code == 2, result.output
    assert wording in result.stderr, result.stderr
    assert "Traceback" not in result.output and "database:" not in result.stderr
    assert "delete the matching" not in result.output  # no prompt before the refusal
    error = result.stderr.split("Error: ", 1)[1]
    assert not _API_WORDING.search(error.replace("x>=", "").replace("<=x", "")), error
