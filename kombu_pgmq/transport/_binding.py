"""Which application connection a publish goes through (:func:`kombu_pgmq.using`): the
transport option naming a bound connection's binding, and the binding of the innermost
``with using(conn):`` block. Kept here, below both, so the transport reads what
:mod:`kombu_pgmq.transactional` sets without importing it."""

from __future__ import annotations

import contextvars
from typing import Any

__all__ = [
    "BINDING_OPTION",
    "CURRENT_BINDING",
    "CURRENT_TRANSACTION",
    "current_binding",
    "current_transaction",
]

#: Transport option carrying the :class:`~kombu_pgmq.transactional.Binding` of a
#: :class:`~kombu_pgmq.transactional.BoundConnection`.
BINDING_OPTION = "kombu_pgmq_binding"

#: The binding of the innermost ``with using(conn):`` block (set by
#: :class:`~kombu_pgmq.transactional.BoundConnection`).
CURRENT_BINDING: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "kombu_pgmq_binding", default=None
)


def current_binding() -> Any:
    """The binding of the innermost ``with using(conn):`` block, if any (a
    :class:`~kombu_pgmq.transactional.Binding`, or None)."""
    return CURRENT_BINDING.get()


#: The binding of the :class:`~kombu_pgmq.atomic.AtomicTask` transaction open in this
#: context (None: none): the result backend writes a task's result there.
CURRENT_TRANSACTION: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "kombu_pgmq_transaction", default=None
)


def current_transaction() -> Any:
    """The binding of the AtomicTask transaction open in this context, if any (a
    :class:`~kombu_pgmq.transactional.Binding`, or None)."""
    return CURRENT_TRANSACTION.get()
