"""Sample outputs in the docs, checked against real runs so that they cannot drift.

A sample is the fenced code block that follows a marker line in README.md or a page of
docs/ (readable as is on GitHub and in the built site; the marker is an HTML comment)::

    <!-- sample: main_job (written by tests/e2e/test_main_job.py) -->
    ```text
    ...what the command printed in one real run...
    ```

The test that runs the command passes its output to :func:`check_sample`, which compares
it with every block marked with that name, both masked: what changes from run to run
(times, pids, dates, paths, memory) is replaced by a placeholder and runs of spaces by one
(column widths may change); everything else must be equal. On a difference it fails with a
diff of the masked texts.

``KOMBU_PGMQ_UPDATE_SAMPLES=1`` writes the output into the blocks instead, where the masked
texts differ (a run that differs only in times leaves the docs alone); review the change
with ``git diff``.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Set to 1 to write the samples from this run's output.
ENV_UPDATE = "KOMBU_PGMQ_UPDATE_SAMPLES"

#: A marker line and the fenced block after it (indented alike, e.g. in a list item).
_BLOCK = re.compile(
    r"^(?P<indent>[ \t]*)<!-- sample: (?P<name>[\w.-]+)[^\n]*-->\n"
    r"(?P=indent)(?P<fence>```+)[^\n]*\n"
    r"(?P<body>.*?)"
    r"^(?P=indent)(?P=fence)[ \t]*$",
    re.M | re.S,
)

#: Replacements for what changes from run to run in any output, applied in order.
COMMON_MASKS: tuple[tuple[str, str], ...] = (
    (r"\b\d+(?:\.\d+)? ?(?:ms|s)\b", "<time>"),  # 86 ms, 2.1 s
    (r"\b\d+(?:\.\d+)? [KMG]B\b", "<bytes>"),  # 1.2 GB
    (r"\bpid \d+", "pid <pid>"),
    (r"\b\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\b", "<datetime>"),  # 2026-11-24 23:16:46
    (r"(?<![\w.])/[^\s)]+", "<path>"),  # an absolute path (also inside a URL)
)


def doc_files() -> Iterator[Path]:
    yield ROOT / "README.md"
    yield from sorted((ROOT / "docs").rglob("*.md"))


def mask(text: str, masks: Sequence[tuple[str, str]] = ()) -> str:
    """``text`` with ``masks`` (pattern, replacement; multi-line mode) then
    :data:`COMMON_MASKS` applied, runs of spaces made one and trailing spaces removed."""
    for pattern, replacement in (*masks, *COMMON_MASKS):
        text = re.sub(pattern, replacement, text, flags=re.M)
    return "\n".join(re.sub(r" {2,}", " ", line).rstrip() for line in text.splitlines())


def _dedent(body: str, indent: str) -> str:
    return "".join(line.removeprefix(indent) for line in body.splitlines(keepends=True))


def _indent(text: str, indent: str) -> str:
    return "".join(indent + line if line.strip() else line for line in text.splitlines(True))


def check_sample(name: str, text: str, masks: Sequence[tuple[str, str]] = ()) -> None:
    """Fail unless ``text`` equals every docs block marked ``<!-- sample: name ... -->``
    once both are masked (see :func:`mask`); with ``$KOMBU_PGMQ_UPDATE_SAMPLES=1``, write
    ``text`` into the blocks that differ instead. Fails too if no block has that name."""
    text = "".join(line.rstrip() + "\n" for line in text.rstrip("\n").splitlines())
    update = os.environ.get(ENV_UPDATE) == "1"
    diffs, found = [], 0
    for path in doc_files():
        doc = path.read_text(encoding="utf-8")
        stale = []
        for block in _BLOCK.finditer(doc):
            if block["name"] != name:
                continue
            found += 1
            got, want = mask(text, masks), mask(_dedent(block["body"], block["indent"]), masks)
            if got == want:
                continue
            stale.append(block)
            where = f"{path.relative_to(ROOT)}:{doc.count(chr(10), 0, block.start()) + 1}"
            diff = difflib.unified_diff(
                want.splitlines(), got.splitlines(), f"{where} (masked)", "this run (masked)"
            )
            diffs.append("\n".join(line.rstrip("\n") for line in diff))
        if update and stale:
            for block in reversed(stale):  # from the end: the earlier spans stay valid
                start, end = block.span("body")
                doc = doc[:start] + _indent(text, block["indent"]) + doc[end:]
            path.write_text(doc, encoding="utf-8")
    if not found:
        pytest.fail(
            f"no block of README.md or docs/ is marked <!-- sample: {name} -->: add the "
            "marker line before the fenced block that shows this output",
            pytrace=False,
        )
    if diffs and not update:
        pytest.fail(
            f"the output differs from the docs' sample {name!r}; if the change is intended, "
            f"run this test again with {ENV_UPDATE}=1 to write it into the docs, and review "
            "it (git diff):\n" + "\n".join(diffs),
            pytrace=False,
        )
