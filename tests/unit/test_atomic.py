"""The parts of :mod:`kombu_pgmq.atomic` that need no database: which exceptions are a
lost connection (the task's message is then requeued), the refusal of an ``atomic_db``
of no accepted kind (naming its type), the refusal of ``acks_late=False``, and the
errors of ``self.db`` outside a task body and of a message without kombu_pgmq's receipt.
"""

from __future__ import annotations

import sqlite3
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
import sqlalchemy.exc
from celery import Celery
from psycopg import errors as pg_errors

from kombu_pgmq import AtomicTask, errors
from kombu_pgmq.atomic import _connection_lost, _open

BROKER_URL = "postgresql://nobody@127.0.0.1:1/none"


def caused(exc: BaseException, cause: BaseException) -> BaseException:
    """``exc`` raised ``from cause`` (as Django's and kombu_pgmq's wrappers raise)."""
    try:
        raise exc from cause
    except BaseException as raised:
        return raised


def during(exc: BaseException, context: BaseException) -> BaseException:
    """``exc`` raised while handling ``context`` (an implicit chain)."""
    try:
        try:
            raise context
        except BaseException:
            raise exc  # noqa: B904 - the implicit chain is what is tested
    except BaseException as raised:
        return raised


def sqlalchemy_wrapped(orig: Exception) -> sqlalchemy.exc.DBAPIError:
    """What SQLAlchemy raises for a DBAPI error: the driver's exception in ``.orig``."""
    return sqlalchemy.exc.OperationalError("SELECT 1", {}, orig)


LOST = psycopg.OperationalError("server closed the connection unexpectedly")


@pytest.mark.parametrize(
    "exc",
    [
        LOST,
        pg_errors.AdminShutdown("terminating connection due to administrator command"),
        psycopg.InterfaceError("the connection is closed"),
        errors.BrokerConnectionError("PostgreSQL connection failed or was lost"),
        sqlalchemy_wrapped(LOST),
        caused(RuntimeError("django.db.utils.OperationalError"), LOST),
        caused(errors.TransactionError("the statement failed"), sqlalchemy_wrapped(LOST)),
        during(ValueError("raised while handling it"), LOST),
    ],
    ids=[
        "psycopg-operational",
        "admin-shutdown",
        "interface-error",
        "kombu-pgmq-connection-error",
        "sqlalchemy-orig",
        "cause",
        "cause-then-orig",
        "context",
    ],
)
def test_a_lost_connection_is_found_through_its_wrappers(exc: BaseException) -> None:
    assert _connection_lost(exc)


@pytest.mark.parametrize(
    "exc",
    [
        None,
        ValueError("atomic_add fails"),
        pg_errors.QueryCanceled("canceling statement due to statement timeout"),
        pg_errors.UniqueViolation("duplicate key value violates unique constraint"),
        errors.StaleDelivery("no longer held"),
        sqlalchemy_wrapped(pg_errors.UniqueViolation("duplicate key")),
        caused(RuntimeError("wrapped"), ValueError("unrelated")),
    ],
    ids=[
        "none",
        "unrelated",
        "statement-canceled",
        "constraint",
        "stale-delivery",
        "sqlalchemy-constraint",
        "cause-unrelated",
    ],
)
def test_other_errors_are_not_a_lost_connection(exc: BaseException | None) -> None:
    assert not _connection_lost(exc)


def test_a_cycle_of_causes_ends() -> None:
    first, second = ValueError("first"), ValueError("second")
    first.__cause__, second.__cause__ = second, first
    assert not _connection_lost(first)
    first.__cause__ = LOST  # a lost connection further on is still found
    assert _connection_lost(second)


class Unsupported:
    """An object of no accepted kind."""


@pytest.mark.parametrize(
    ("target", "named"),
    [
        (Unsupported(), "tests.unit.test_atomic.Unsupported"),
        (42, "builtins.int"),
        (lambda: Unsupported(), "tests.unit.test_atomic.Unsupported"),  # a factory's result
        (sqlite3.connect(":memory:"), "sqlite3.Connection"),  # callable, yet not a factory
    ],
    ids=["object", "int", "callable", "another-driver"],
)
def test_an_unsupported_atomic_db_is_refused_naming_its_type(target: Any, named: str) -> None:
    with pytest.raises(errors.ConfigurationError, match=r"AtomicTask\.atomic_db") as info:
        _open(target, BROKER_URL)
    assert f"{named} is not a libpq URL" in str(info.value)


@pytest.fixture
def app() -> Celery:
    return Celery("unit_atomic", broker=BROKER_URL, set_as_current=False)


def test_acks_late_false_is_refused(app: Celery) -> None:
    def early() -> None:  # pragma: no cover - never runs
        pass

    with pytest.raises(errors.ConfigurationError, match=r"unit\.early: .*acks_late=False"):
        app.task(base=AtomicTask, acks_late=False, name="unit.early", shared=False, lazy=False)(
            early
        )
    with pytest.raises(errors.ConfigurationError, match=r"Early: .*acks_late=False"):

        class Early(AtomicTask):
            acks_late = False


def test_an_atomic_task_acks_late(app: Celery) -> None:
    def late() -> None:  # pragma: no cover - never runs
        pass

    task = app.task(base=AtomicTask, name="unit.late", shared=False, lazy=False)(late)
    assert isinstance(task, AtomicTask) and task.acks_late is True


def test_self_db_outside_a_task_body_says_where_it_works(app: Celery) -> None:
    def body() -> None:  # pragma: no cover - never runs
        pass

    task = app.task(base=AtomicTask, name="unit.outside", shared=False, lazy=False)(body)
    with pytest.raises(errors.ConfigurationError, match=r"unit\.outside: .*inside the task body"):
        task.db  # noqa: B018 - the property raises


def test_a_message_without_a_kombu_pgmq_receipt_is_refused(app: Celery) -> None:
    def body() -> None:  # pragma: no cover - never runs
        pass

    task = app.task(base=AtomicTask, name="unit.receipt", shared=False, lazy=False)(body)
    request = SimpleNamespace(properties={"delivery_info": {"routing_key": "celery"}})
    with pytest.raises(errors.ConfigurationError, match="carries no kombu_pgmq receipt"):
        task._receipt(request)
    info = {
        "pgmq_queue": "celery",
        "pgmq_msg_id": 7,
        "pgmq_read_ct": 2,
        "pgmq_enqueued_at": None,
    }
    held = task._receipt(SimpleNamespace(properties={"delivery_info": info}))
    assert (held.queue, held.msg_id, held.read_ct) == ("celery", 7, 2)


def test_a_function_given_as_atomic_db_is_called_without_the_task(app: Celery) -> None:
    # a function set on the task class is not bound as a method: called with no argument
    def factory() -> Any:
        return Unsupported()

    def body() -> None:  # pragma: no cover - never runs
        pass

    task = app.task(
        base=AtomicTask, atomic_db=factory, name="unit.factory", shared=False, lazy=False
    )(body)
    assert task._atomic_db() is factory
    with pytest.raises(errors.ConfigurationError, match=r"Unsupported is not a libpq URL"):
        _open(task._atomic_db(), BROKER_URL)
