"""Row factories building a NamedTuple by column name (used by
:class:`~kombu_pgmq._db.connector.Connector`)."""

from __future__ import annotations

import functools
import operator
from typing import Any

from ..errors import StatementError

__all__ = ["named_row"]


@functools.lru_cache(maxsize=64)
def named_row(cls: Any) -> Any:
    """A row factory building NamedTuple ``cls`` by column name: the statement's columns
    are matched to the fields by name once per result, then each row is built with one
    ``itemgetter`` (fields the statement does not return take their defaults).

    Raises (when the statement runs):
        StatementError: the statement lacks a field that has no default.
    """
    fields = cls._fields
    defaults = cls._field_defaults

    def factory(cursor: Any) -> Any:
        names = [c.name for c in cursor.description or ()]
        missing = [f for f in fields if f not in names and f not in defaults]
        if missing:
            raise StatementError(
                f"the statement returns no column {', '.join(missing)} for {cls.__name__} "
                f"(it returns {', '.join(names)}): name the columns in sql/queries/"
            )
        if all(f in names for f in fields):
            getter = operator.itemgetter(*[names.index(f) for f in fields])
            if len(fields) == 1:
                return lambda values: cls._make((getter(values),))
            return lambda values: cls._make(getter(values))
        picks = [(names.index(f), None) if f in names else (None, defaults[f]) for f in fields]
        return lambda values: cls._make([values[i] if i is not None else d for i, d in picks])

    return factory
