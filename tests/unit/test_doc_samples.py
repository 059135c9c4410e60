"""The check of the docs' sample outputs (tests/support/doc_samples.py): what it ignores,
what it catches, how it says so, and the update switch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import doc_samples
from tests.support.doc_samples import ENV_UPDATE, check_sample, mask

SAMPLE = (
    "worker: started (prefork, 2 processes) in 1.2 s\n"
    "add(2, 3) = 5                          86 ms\n"
    "20 tasks of one key, at most 20/s: delivered over 0.96 s\n"
    "  Spark Connect server (port 15002, pid 4321, 1.1 GB in memory; kept: --keep)\n"
    "broker: postgresql://postgres@/kombu_pgmq?host=/home/me/.local/share/kombu_pgmq/pg18\n"
    "limits of queue emails (set 2026-11-24 23:16:46 UTC by app):\n"
    "done: 78 tasks (+2 retries) in 53.4 s\n"
)
PAGE = (
    "# A page\n\nIt prints:\n\n"
    "<!-- sample: job (written by a test) -->\n```text\n" + SAMPLE + "```\n\n"
    "- in a list:\n\n"
    "  <!-- sample: job -->\n  ```console\n"
    + "".join(f"  {line}\n" for line in SAMPLE.splitlines())
    + "  ```\n\nThe end.\n"
)


@pytest.fixture
def docs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# Readme\n")
    (tmp_path / "docs" / "page.md").write_text(PAGE)
    monkeypatch.setattr(doc_samples, "ROOT", tmp_path)
    monkeypatch.delenv(ENV_UPDATE, raising=False)
    return tmp_path / "docs" / "page.md"


def test_times_pids_memory_dates_paths_and_column_widths_may_differ(docs: Path) -> None:
    other = (
        SAMPLE.replace("1.2 s", "13.0 s")
        .replace("86 ms", "1.1 s")
        .replace("0.96", "1.12")
        .replace("4321", "99")
        .replace("1.1 GB", "650 MB")
        .replace("/home/me", "/tmp/x")
        .replace("2026-11-24 23:16:46", "2027-01-02 03:04:05")
        .replace("53.4 s", "101.0 s")
    )
    check_sample("job", other)
    assert mask("a  b   c  ") == "a b c"


@pytest.mark.parametrize(
    ("changed", "shown"),
    [
        (SAMPLE.replace("78 tasks", "57 tasks"), "+done: 57 tasks"),
        (SAMPLE.replace("= 5", "= 6"), "+add(2, 3) = 6"),
        (SAMPLE.replace("port 15002", "port 15003"), "port 15003"),
        (SAMPLE + "one more line\n", "+one more line"),
    ],
)
def test_anything_else_fails_with_a_diff_of_each_block_and_the_way_to_update(
    docs: Path, changed: str, shown: str
) -> None:
    with pytest.raises(pytest.fail.Exception) as failed:
        check_sample("job", changed)
    message = str(failed.value)
    assert f"{ENV_UPDATE}=1" in message and shown in message
    first, second = message.index("docs/page.md:5 (masked)"), message.index("docs/page.md:18 ")
    assert first < second  # in the order of the page


def test_extra_masks_apply_before_the_common_ones(docs: Path) -> None:
    masks = [(r"\(\+\d+ retries\)", "(+<n> retries)")]
    check_sample("job", SAMPLE.replace("+2 retries", "+3 retries"), masks)


def test_a_sample_no_block_shows_fails_naming_the_marker(docs: Path) -> None:
    with pytest.raises(pytest.fail.Exception, match="<!-- sample: other -->"):
        check_sample("other", SAMPLE)


def test_update_rewrites_the_blocks_only_when_more_than_times_changed(
    docs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_UPDATE, "1")
    check_sample("job", SAMPLE.replace("86 ms", "90 ms"))
    assert docs.read_text() == PAGE  # only a time: left alone
    check_sample("job", SAMPLE.replace("78 tasks", "79 tasks"))
    assert docs.read_text() == PAGE.replace("78 tasks", "79 tasks")  # both blocks, indented
    monkeypatch.delenv(ENV_UPDATE)
    check_sample("job", SAMPLE.replace("78 tasks", "79 tasks"))
