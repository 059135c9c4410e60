"""Options that document themselves: the shared part of the transport options
(:mod:`kombu_pgmq.transport.options`), the result backend's options
(:mod:`kombu_pgmq.results.options`) and the beat's settings (:mod:`kombu_pgmq.beat.settings`).

A frozen dataclass's fields carry their documentation in ``metadata`` (:func:`field_doc`);
:func:`field_docs` reads it as :class:`OptionDoc` rows, from which :func:`rst_list` makes a
module docstring's list and ``docs/_ext/hooks.py`` the docs' table, so no copy can drift.
:func:`refuse_unknown` refuses a name that is not an option, with the closest known one.
"""

from __future__ import annotations

import difflib
import math
import re
import textwrap
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any, NamedTuple

from .errors import ConfigurationError

__all__ = [
    "OptionDoc",
    "default_of",
    "field_doc",
    "field_docs",
    "finite_number",
    "refuse_unknown",
    "rst_list",
    "shown",
]


def field_doc(
    unit: str,
    text: str,
    *,
    default: str | None = None,
    see: tuple[tuple[str, str], ...] = (),
) -> dict[str, Any]:
    """A field's ``metadata``: its ``unit`` ("" when it has none), its documentation
    (``text``, reST inline markup: ``code`` only), how its default reads when not as
    Python writes it (``default``), and pages of the docs that say more (``see``:
    ``(title, path under docs/ with an optional #anchor)``)."""
    return {"unit": unit, "doc": text, "default": default, "see": see}


class OptionDoc(NamedTuple):
    """One option (or setting) as the docs show it."""

    name: str
    #: what a user passes (``"number"``, ``"dict"``...)
    type: str
    #: ``"seconds"``, ``"bytes"``...; ``""`` when it has none
    unit: str
    #: the default as Python writes it (``30``, ``None``, ``'kombu_pgmq_dlq'``), or as
    #: words when it depends on other settings
    default: str
    #: what it does and why one would change it (reST inline markup: ``code`` only)
    doc: str
    #: ``(title, path under docs/ with an optional #anchor)`` of pages that say more
    see: tuple[tuple[str, str], ...] = ()


#: How a field's annotation reads in the docs: what a user passes.
TYPE_NAMES = {
    "bool": "bool",
    "float": "number",
    "float | None": "number or None",
    "int": "int",
    "int | None": "int or None",
    "str": "str",
    "str | None": "str or None",
    "tuple[int, ...] | None": "list of ints or None",
    "Mapping[str, Any]": "dict",
    "Mapping[str, Mapping[str, Any]]": "dict of dicts",
}


def default_of(f: Any) -> Any:
    """A dataclass field's default value."""
    return f.default_factory() if callable(f.default_factory) else f.default


def field_docs(cls: type) -> list[OptionDoc]:
    """Every field of the dataclass ``cls`` as documented by its ``metadata``
    (:func:`field_doc`), in field order."""
    return [
        OptionDoc(
            f.name,
            TYPE_NAMES[str(f.type)],
            f.metadata["unit"],
            f.metadata["default"] or shown(default_of(f)),
            f.metadata["doc"],
            f.metadata["see"],
        )
        for f in fields(cls)
    ]


def rst_list(options: Iterable[OptionDoc], width: int = 88) -> str:
    """``options`` as a reST bullet list, one item per option: ``* ``name`` (type, unit,
    default ``value``): what it does. Docs: pages.`` (lines broken outside code only)."""
    items = []
    for option in options:
        head = ", ".join(
            part for part in (option.type, option.unit, f"default ``{option.default}``") if part
        )
        see = f" Docs: {'; '.join(title for title, _ in option.see)}." if option.see else ""
        text = _CODE.sub(
            lambda code: code.group(0).replace(" ", "\0"),
            f"* ``{option.name}`` ({head}): {option.doc}{see}",
        )
        wrapped = textwrap.fill(
            text,
            width,
            subsequent_indent="  ",
            break_long_words=False,
            break_on_hyphens=False,
        )
        items.append(wrapped.replace("\0", " "))
    return "\n".join(items)


_CODE = re.compile(r"``.+?``")


def shown(value: Any) -> str:
    """``value`` as a default reads: ``30`` for 30.0, ``'name'`` for a string."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, Mapping):
        return repr(dict(value))
    return repr(value)


def finite_number(value: Any) -> float | None:
    """``value`` as a finite float (None: not a number, a bool, NaN or infinite)."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def refuse_unknown(
    given: Iterable[Any],
    ours: Sequence[str],
    *,
    theirs: Collection[str] = (),
    what: str,
    owners: str,
) -> None:
    """Raise :class:`ConfigurationError` for the names in ``given`` that are neither
    ``ours`` nor ``theirs`` (names another library reads from the same dict), each with the
    closest known name when one is close: ``unknown <what> 'name': did you mean 'known'?
    (kombu_pgmq's options: ...)``; ``owners`` names who else could own one (``"kombu_pgmq or
    kombu"``)."""
    known = [*ours, *sorted(theirs)]
    unknown = sorted(str(name) for name in given if name not in ours and name not in theirs)
    if not unknown:
        return
    parts: list[tuple[str, str | None]] = []
    for name in unknown:
        matches = difflib.get_close_matches(name, known, n=1)
        parts.append((name, matches[0] if matches else None))
    listing = ", ".join(ours)
    if len(parts) == 1:
        name, close = parts[0]
        hint = f"did you mean {close!r}?" if close else f"not an option of {owners}: remove it"
        raise ConfigurationError(
            f"unknown {what} {name!r}: {hint} (kombu_pgmq's options: {listing})"
        )
    listed = ", ".join(
        f"{name!r} (did you mean {close!r}?)" if close else repr(name) for name, close in parts
    )
    raise ConfigurationError(
        f"unknown {what}s {listed}: fix or remove them (kombu_pgmq's options: {listing})"
    )
