"""Every transport option error the docs quote is what the code says, word for word.

The docs (README.md, docs/, benchmarks/README.md) and the transport's docstring quote
:class:`~kombu_pgmq.transport.options.TransportOptions`' errors in code spans and code
blocks: ``transport option NAME=VALUE ...``, ``unknown transport option 'NAME' ...`` and
``transport option 'NAME' was removed ...``, optionally after ``ConfigurationError:`` or
the worker's ``kombu_pgmq: broker_transport_options:``. Each quote is checked against the
message ``parse`` raises for that option and value: ``...`` in a quote stands for any
text, and a quote may stop early, at the end of a word (a heading quotes the start of a
message).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kombu_pgmq.errors import ConfigurationError
from kombu_pgmq.transport.options import TransportOptions

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    [
        ROOT / "README.md",
        ROOT / "benchmarks" / "README.md",
        ROOT / "kombu_pgmq" / "transport" / "__init__.py",
        *(ROOT / "docs").rglob("*.md"),
    ]
)
#: What may come before the message in a quote: the worker's line
#: (:func:`kombu_pgmq._worker_checks.check_transport_options`), Python's traceback line.
PREFIXES = (
    "kombu_pgmq: broker_transport_options: ",
    "kombu_pgmq.errors.ConfigurationError: ",
    "ConfigurationError: ",
)
_QUOTE_START = re.compile(
    r"^(?:[\w.]*ConfigurationError: |kombu_pgmq: broker_transport_options: )?"
    r"(?:unknown )?transport options? "
)
_FENCE = re.compile(r"^\s*```[^\n]*\n(.*?)^\s*```", re.DOTALL | re.MULTILINE)
_SPAN = re.compile(r"(``?)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
_BAD_VALUE = re.compile(r"transport option (\w+)=(.+?) is invalid")
_UNKNOWN = re.compile(r"unknown transport option '(\w+)'")
_REMOVED = re.compile(r"transport option '(\w+)' was removed")


def _quotes(text: str) -> list[str]:
    """Code-block lines and code spans (a span's line breaks read as spaces) that start
    like a transport option error."""
    found = [line.strip() for block in _FENCE.findall(text) for line in block.splitlines()]
    prose = _FENCE.sub("", text)
    found += [" ".join(span.split()) for _ticks, span in _SPAN.findall(prose)]
    return [quote for quote in found if _QUOTE_START.match(quote)]


def _value(text: str) -> object:
    if text in ("nan", "inf", "-inf"):
        return float(text)
    return ast.literal_eval(text)


def _message(quote: str) -> str:
    """What the code says for the option and value the quote names, with the quote's
    prefix."""
    prefix = next((p for p in PREFIXES if quote.startswith(p)), "")
    core = quote[len(prefix) :]
    if match := _BAD_VALUE.match(core):
        options = {match.group(1): _value(match.group(2))}
    elif match := _UNKNOWN.match(core) or _REMOVED.match(core):
        options = {match.group(1): 1}
    else:
        raise AssertionError(f"a quote this test cannot check yet (teach it): {quote!r}")
    with pytest.raises(ConfigurationError) as raised:
        TransportOptions.parse(options)
    return prefix + str(raised.value)


def _matches(quote: str, message: str) -> bool:
    pattern = ".*?".join(re.escape(part) for part in quote.split("..."))
    match = re.match(pattern, message)
    return match is not None and not re.match(r"\w", message[match.end() :])


def _all_quotes() -> list[tuple[str, str]]:
    return [
        (str(path.relative_to(ROOT)), quote)
        for path in SOURCES
        for quote in _quotes(path.read_text(encoding="utf-8"))
    ]


def test_the_docs_quote_option_errors_in_the_places_checked_here():
    where = {path for path, _quote in _all_quotes()}
    assert {
        "docs/guides/celery.md",
        "docs/troubleshooting.md",
        "kombu_pgmq/transport/__init__.py",
    } <= where, where


@pytest.mark.parametrize(("path", "quote"), _all_quotes())
def test_each_quoted_option_error_is_what_the_code_says(path: str, quote: str):
    message = _message(quote)
    assert _matches(quote, message), f"{path} quotes\n  {quote}\nthe code says\n  {message}"
