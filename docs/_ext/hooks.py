"""MkDocs hooks for the docs site (``mkdocs.yml``: ``hooks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = "<!-- benchmarks/README.md -->"


def on_page_markdown(markdown: str, *, page: Any, **kwargs: Any) -> str:
    """Pages that are generated where they hold a marker: the command line reference
    (every command's ``--help``, from the click commands themselves) and the full
    benchmark report (``benchmarks/README.md``, its links to ``../docs/`` made relative to
    the docs directory)."""
    if CLI in markdown:
        markdown = markdown.replace(CLI, _cli_reference())
    if BENCHMARKS in markdown:
        report = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
        markdown = markdown.replace(BENCHMARKS, report.replace("](../docs/", "]("))
    return markdown


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
