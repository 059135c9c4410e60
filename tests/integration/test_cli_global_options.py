"""``--url``, ``--embedded`` and ``--json`` go before the command, between a group and its
command, or after the command, for every command: the same result in each position, the
later one winning when given twice, over ``$KOMBU_PGMQ_URL`` either way; a command that
has no such option refuses it (usage error naming the command), and an unknown option
stays click's "No such option" error.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

from kombu_pgmq import cli, embedded
from kombu_pgmq.cli._base import GLOBAL_OPTIONS

from .helpers import connect, publish
from .test_cli import UNREACHABLE, _commands

#: A command line split where the global options may go: the groups, then the command
#: and its own arguments.
COMMANDS = [
    ([], ["queues"]),
    ([], ["messages", "glob_q"]),
    (["queue"], ["limit", "glob_q", "--concurrency", "3"]),
    (["queue"], ["pause", "glob_q"]),
    (["dlq"], ["purge", "--all", "--yes"]),
    (["dlq"], ["list"]),
    (["beat"], ["add", "glob_entry", "glob.task", "--every", "60", "--replace"]),
    (["beat"], ["list"]),
    (["results"], ["expire"]),
    (["schema"], ["status"]),
    (["task"], ["find", "0b5c4a9e"]),
    (["archive"], ["prune", "--older-than", "7d"]),
]


def invoke(args: list[str], env: dict[str, str | None] | None = None) -> Result:
    env = {"KOMBU_PGMQ_URL": None, **(env or {})}
    return CliRunner().invoke(cli.main, args, env=env, prog_name="kombu-pgmq")


def positions(groups: list[str], command: list[str], options: list[str]) -> list[list[str]]:
    """The command line with ``options`` before everything, after the first group (when
    the command is in a group), and after the command."""
    lines = [[*options, *groups, *command], [*groups, *command, *options]]
    if groups:
        lines.append([groups[0], *options, *groups[1:], *command])
    return lines


@pytest.fixture
def url(db_dsn: str) -> str:
    with connect(db_dsn) as conn:
        publish(conn, "glob_q", [1])
    return db_dsn


#: Commands whose output shows ages or times (compared without them).
_TIMED = {"queues", "messages", "limit", "find"}


def _same(result: Result, command: list[str]) -> tuple[int, str]:
    """What must not depend on the options' position."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    return result.exit_code, "" if command[0] in _TIMED else result.stdout


@pytest.mark.parametrize(("groups", "command"), COMMANDS, ids=lambda v: " ".join(v) or "-")
def test_url_before_between_or_after_the_command(
    url: str, groups: list[str], command: list[str]
) -> None:
    results = [invoke(line) for line in positions(groups, command, ["--url", url])]
    for result in results:
        assert result.stderr.splitlines()[0].startswith("database: "), result.output
        assert "No such option" not in result.stderr, result.stderr
    assert len({_same(r, command) for r in results}) == 1, [r.output for r in results]
    assert results[0].exit_code in (0, 1), results[0].output  # schema status: 1 if stale


@pytest.mark.parametrize(
    ("groups", "command"),
    [
        ([], ["queues"]),
        (["queue"], ["limit", "glob_q"]),
        (["beat"], ["list"]),
        (["dlq"], ["list"]),
        (["results"], []),
        ([], ["messages", "glob_q"]),
    ],
    ids=lambda v: " ".join(v) or "-",
)
def test_json_before_between_or_after_the_command(
    url: str, groups: list[str], command: list[str]
) -> None:
    for line in positions(groups, command, ["--json", "--url", url]):
        result = invoke(line)
        assert result.exit_code == 0, (line, result.output)
        for out in result.stdout.splitlines():
            json.loads(out)  # every line is a JSON object: --json was applied


def test_the_later_url_wins_and_a_given_url_beats_the_environment(url: str) -> None:
    later = invoke(["--url", UNREACHABLE, "queues", "--url", url])
    assert later.exit_code == 0 and later.stderr.startswith("database: postgresql"), later.output
    assert UNREACHABLE not in later.stderr
    earlier = invoke(["--url", url, "queues", "--url", UNREACHABLE])
    assert earlier.exit_code == 1 and "Connection refused" in earlier.stderr
    over_env = invoke(["--url", url, "queues"], env={"KOMBU_PGMQ_URL": UNREACHABLE})
    assert over_env.exit_code == 0, over_env.output
    from_env = invoke(["queues"], env={"KOMBU_PGMQ_URL": url})
    assert from_env.exit_code == 0, from_env.output


def test_embedded_before_the_command_starts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv(embedded.ENV_DIR, str(tmp_path / "embedded"))
    started: list[None] = []
    monkeypatch.setattr(embedded, "start", lambda: started.append(None) or UNREACHABLE)
    for line in (["--embedded", "queues"], ["dlq", "--embedded", "list"]):
        result = invoke(line)
        assert result.stderr.splitlines()[0].endswith("(the embedded PostgreSQL, --embedded)")
    assert started == [None, None]
    both = invoke(["--embedded", "queues", "--url", UNREACHABLE])
    assert both.exit_code == 2 and "give one of them" in both.stderr, both.output


@pytest.mark.parametrize(
    ("line", "option", "command"),
    [
        (["--json", "queue", "pause", "glob_q"], "--json", "kombu-pgmq queue pause"),
        (["queue", "--json", "resume", "glob_q"], "--json", "kombu-pgmq queue resume"),
        (["--json", "beat", "add", "x", "y", "--every", "5"], "--json", "kombu-pgmq beat add"),
        (["--url", UNREACHABLE, "embedded", "start"], "--url", "kombu-pgmq embedded start"),
        (
            ["spark", "--embedded", "server", "status"],
            "--embedded",
            "kombu-pgmq spark server status",
        ),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_a_command_without_the_option_refuses_it(
    line: list[str], option: str, command: str
) -> None:
    result = invoke(line)
    assert result.exit_code == 2, result.output
    assert f"{option} does not apply to '{command}'" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "line", [["--nope", "queues"], ["queues", "--nope"], ["dlq", "--nope", "list"]], ids=" ".join
)
def test_an_unknown_option_is_still_a_usage_error(line: list[str]) -> None:
    result = invoke(line)
    assert result.exit_code == 2, result.output
    assert "No such option '--nope'" in result.stderr, result.stderr


def test_every_group_takes_the_global_options() -> None:
    for path, command in _commands(cli.main):
        if isinstance(command, click.Group):
            names = {opt for p in command.params for opt in getattr(p, "opts", ())}
            assert set(GLOBAL_OPTIONS) <= names, path
