"""MkDocs hooks for the docs site (``mkdocs.yml``: ``hooks``)."""

from __future__ import annotations

import importlib
import posixpath
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = "<!-- benchmarks/README.md -->"


def on_page_markdown(markdown: str, *, page: Any, **kwargs: Any) -> str:
    """Pages that are generated where they hold a marker: the command line reference
    (every command's ``--help``, from the click commands themselves), the tables of
    options (:data:`OPTION_TABLES`: the transport's, the result backend's, the beat's
    settings, from the code that documents them) and the full benchmark report
    (``benchmarks/README.md``, its links to ``../docs/`` made relative to the docs
    directory, its links to files beside it made their paths: see
    :func:`_benchmark_report`)."""
    if CLI in markdown:
        markdown = markdown.replace(CLI, _cli_reference())
    for marker, (module, heading) in OPTION_TABLES.items():
        if marker in markdown:
            docs = importlib.import_module(module).option_docs()
            markdown = markdown.replace(marker, options_table(page.file.src_uri, docs, heading))
    if BENCHMARKS in markdown:
        markdown = markdown.replace(BENCHMARKS, _benchmark_report())
    return markdown


#: A link of the benchmark report to a file of the repository outside ``docs/`` (a raw
#: result in ``benchmarks/results/``): not an image, not an anchor, not a URL, not a page.
_REPORT_FILE_LINK = re.compile(r"(?<!!)\[([^\]\n]+)\]\((?!https?:|#|\.\./docs/)([^)\s]+)\)")


def _benchmark_report() -> str:
    """``benchmarks/README.md`` for the site: links to ``../docs/`` become links to the
    pages; a link to a file beside it (``results/....json``), which the site has no copy
    of, becomes that file's path in the repository as code (``benchmarks/results/....json``)."""
    report = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    report = _REPORT_FILE_LINK.sub(
        lambda link: f"`{posixpath.normpath(posixpath.join('benchmarks', link.group(2)))}`",
        report,
    )
    return report.replace("](../docs/", "](")


#: Languages whose code blocks wrap long lines instead of scrolling (code to read and
#: copy); the others (``text``, ``console``: program output in aligned columns) scroll.
WRAPPED_LANGUAGES = frozenset({"bash", "sh", "shell", "python", "sql", "yaml", "ini"})

#: A table; a plain inline code span without whitespace (a name: an option, a metric, a
#: header, a URL); a code block with its language (``pygments_lang_class``); the text
#: between two tags; a word with a hyphen in it (``-m``, ``kombu-pgmq``, ``--url``).
_TABLE = re.compile(r"<table>.*?</table>", re.DOTALL)
_NAME = re.compile(r"<code>([^<\s]+)</code>")
_CODE_BLOCK = re.compile(r'<div class="language-(\w+) highlight">(.*?</pre>)', re.DOTALL)
_TEXT = re.compile(r"(?<=>)[^<]+")
_HYPHENATED = re.compile(r"[^\s<>]*-[^\s<>]*")


def on_page_content(html: str, **kwargs: Any) -> str:
    """Classes for ``docs/stylesheets/extra.css``, so that no code is cut off or split
    inside a name: names in tables get class ``name`` (kept on one line: the theme
    breaks inline code anywhere, ``connection_o`` / ``ptions``, and browsers break after
    any hyphen); code blocks of :data:`WRAPPED_LANGUAGES` get class ``wrap`` (long lines
    wrap), and in them each word with a hyphen is a ``word`` span, so that a line never
    wraps inside ``-m`` or ``kombu-pgmq`` (the copy button copies the text as is)."""
    html = _TABLE.sub(
        lambda table: _NAME.sub(r'<code class="name">\1</code>', table.group(0)), html
    )
    return _CODE_BLOCK.sub(_wrap_block, html)


def _wrap_block(block: re.Match[str]) -> str:
    language, body = block.group(1), block.group(2)
    if language not in WRAPPED_LANGUAGES:
        return block.group(0)
    body = _TEXT.sub(
        lambda text: _HYPHENATED.sub(r'<span class="word">\g<0></span>', text.group(0)), body
    )
    return f'<div class="language-{language} highlight wrap">{body}'


CLI = "<!-- kombu-pgmq --help -->"


def _cli_reference() -> str:
    """Every ``kombu-pgmq`` command's ``--help``, as click prints it, under a heading."""
    import click

    from kombu_pgmq.cli import main

    parts: list[str] = []

    def walk(command: click.Command, path: list[str], parent: click.Context | None) -> None:
        ctx = click.Context(
            command, info_name=path[-1], parent=parent, terminal_width=80, max_content_width=80
        )
        heading = "#" * min(len(path) + 1, 6)
        parts.append(f"{heading} `{' '.join(path)}`\n\n```text\n{command.get_help(ctx)}\n```\n")
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                if sub is not None and not sub.hidden:
                    walk(sub, [*path, name], ctx)

    walk(main, ["kombu-pgmq"], None)
    return "\n".join(parts)


#: Where a page gets a table of options: ``{marker: (module, first column's heading)}``;
#: each module's ``option_docs()`` gives the rows, its ``OPTIONS_MARKER`` is the marker
#: (its docstring's list is filled in at the same marker).
OPTION_TABLES = {
    "<!-- transport-options -->": ("kombu_pgmq.transport.options", "option"),
    "<!-- result-backend-options -->": ("kombu_pgmq.results.options", "option"),
    "<!-- beat-settings -->": ("kombu_pgmq.beat.settings", "setting"),
}
TRANSPORT_OPTIONS = "<!-- transport-options -->"
_RST_CODE = re.compile(r"``(.+?)``")


def options_table(page_path: str, docs: Any = None, heading: str = "option") -> str:
    """The Markdown table of ``docs`` (:class:`kombu_pgmq._option_docs.OptionDoc` rows;
    default: the transport options) for the page at ``page_path`` (under ``docs/``; links
    are made relative to it): name, type, unit, default, meaning and the pages that say
    more."""
    if docs is None:
        from kombu_pgmq.transport.options import option_docs

        docs = option_docs()
    up = "../" * page_path.count("/")
    rows = [f"| {heading} | type | unit | default | meaning |", "|---|---|---|---|---|"]
    for option in docs:
        meaning = _RST_CODE.sub(r"`\1`", option.doc)
        meaning += "".join(f" See [{title}]({up}{path})." for title, path in option.see)
        name, default = f"`{option.name}`", f"`{option.default}`"
        rows.append(f"| {name} | {option.type} | {option.unit} | {default} | {meaning} |")
    return "\n".join(rows)
