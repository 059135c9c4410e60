"""Griffe extension for the docs site: kombu_pgmq's docstrings are written for Sphinx-ish
readers (``:mod:`x```, ``text::`` literal blocks, ``.. code-block::``, underlined section
titles, two-space nested lists); mkdocstrings renders Markdown. This rewrites each
docstring's text into the Markdown that says the same thing, before griffe parses its
Google-style sections, so the library code stays as it is.

Used by ``mkdocs.yml`` (``plugins.mkdocstrings.handlers.python.options.extensions``).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:mod|class|func|meth|data|attr|exc|obj|const):`(~?)([^`]+)`")
_SECTION = re.compile(
    r"^(Args|Arguments|Attributes|Raises|Returns|Yields|Examples?|Notes?|Warns|Warnings?|"
    r"Parameters|Other Parameters|Receives|Methods|Functions|Classes|Modules):\s*$"
)
_SECTION_ITEM = re.compile(r"^\s*[\w.*]+(\s*\([^)]*\))?(\s*,\s*[\w.*]+)*\s*:(\s|$)")
_LIST_ITEM = re.compile(r"^(\s*)([*-]|\d+\.)\s+")
_UNDERLINE = {"=": "#", "-": "##", "~": "###"}


def _role(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    if tilde:
        target = target.rsplit(".", 1)[-1]
    return f"``{target}``"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _language(body: list[str]) -> str:
    first = next((line.strip() for line in body if line.strip()), "")
    if re.match(r"(\$ |kombu-pgmq|python -m|pip |celery |export |psql )", first):
        return "bash"
    if re.match(r"(SELECT|CREATE|INSERT|UPDATE|DELETE|WITH|GRANT|BEGIN)\b", first):
        return "sql"
    if first.startswith(("postgresql://", "postgres://")):
        return "text"
    return "python"


def rst_to_markdown(text: str) -> str:
    """The docstring ``text`` with its reST constructs turned into Markdown."""
    lines = text.split("\n")
    out: list[str] = []
    in_section = False  # inside a Google-style section: griffe reads its indentation
    item_indent = 0  # indentation of the section's items (``name: description``)
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if _SECTION.match(line):
            in_section = True
            item_indent = 0
        elif stripped and _indent(line) == 0:
            in_section = False
        elif in_section and stripped:
            # A description's continuation written at its item's indentation would be
            # read as a new item: indent it under its item.
            if not item_indent:
                item_indent = _indent(line)
            elif _indent(line) == item_indent and not _SECTION_ITEM.match(line):
                line = " " * 4 + line

        # A section title underlined with = - ~ (reST) -> an ATX heading.
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if (
            stripped
            and _indent(line) == 0
            and len(nxt.strip()) >= 3
            and len(set(nxt.strip())) == 1
            and nxt.strip()[0] in _UNDERLINE
            and len(nxt.strip()) >= len(stripped)
        ):
            out.append(f"{_UNDERLINE[nxt.strip()[0]]} {stripped}")
            i += 2
            continue

        # A literal block: "text::" or ".. code-block:: lang", then an indented block.
        language = None
        head = None
        directive = re.match(r"^(\s*)\.\. code-block::\s*(\w*)\s*$", line)
        literal = bool(directive) or (stripped.endswith("::") and not stripped.startswith(".."))
        if directive:
            language = directive.group(2) or "text"
            base = _indent(line)
        elif literal:
            base = _indent(line)
            item = _LIST_ITEM.match(line)
            if item:
                base = len(item.group(0))
            if stripped == "::":
                pass
            elif stripped.endswith(" ::"):
                head = line.rstrip()[:-3]
            else:
                head = line.rstrip()[:-1]
        if literal:
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            body_start = j
            while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > base):
                j += 1
            body = lines[body_start:j]
            while body and not body[-1].strip():
                body.pop()
            if body:
                if head is not None:
                    out.append(_convert(head, in_section))
                    out.append("")
                cut = min(_indent(b) for b in body if b.strip())
                pad = " " * (base if in_section else 2 * base)
                out.append(f"{pad}```{language or _language(body)}")
                out.extend((pad + b[cut:]) if b.strip() else "" for b in body)
                out.append(f"{pad}```")
                out.append("")
                i = j
                continue

        out.append(_convert(line, in_section))
        i += 1
    return "\n".join(out)


def _convert(line: str, in_section: bool) -> str:
    line = _ROLE.sub(_role, line)
    # Python-Markdown nests lists at four spaces, reST at two or three: double indents.
    if not in_section and line.strip():
        line = " " * _indent(line) + line
    return line


#: Modules that fill a list of options into a docstring at import, at their
#: ``OPTIONS_MARKER``, with their ``options_rst()``.
_FILLED_IN = (
    "kombu_pgmq.transport.options",
    "kombu_pgmq.results.options",
    "kombu_pgmq.beat.settings",
)


def _fill_in(text: str) -> str:
    """``text`` with what a module fills into its docstring at import done here too
    (griffe reads the source): the lists of options (:data:`_FILLED_IN`, e.g.
    :func:`kombu_pgmq.transport.options.options_rst`)."""
    for name in _FILLED_IN:
        module = importlib.import_module(name)
        if module.OPTIONS_MARKER in text:
            text = text.replace(module.OPTIONS_MARKER, module.options_rst())
    return text


class RstDocstrings(griffe.Extension):
    """Rewrite every docstring's reST into Markdown as griffe loads it."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(_fill_in(obj.docstring.value))
