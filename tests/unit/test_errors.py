import pickle

import psycopg
import pytest
from psycopg import errors as pg_errors

import kombu_pgmq.errors as errors_module
from kombu_pgmq.errors import (
    BrokerConnectionError,
    InvalidJsonBody,
    KombuPgmqError,
    QueueNotFound,
    StatementCanceled,
    StatementError,
    translate,
)

ALL_ERRORS = [
    getattr(errors_module, name)
    for name in errors_module.__all__
    if isinstance(getattr(errors_module, name), type)
]


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_every_error_is_picklable_and_keeps_its_message(cls):
    err = cls("queue 'x' is wrong: do y")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert str(back) == "queue 'x' is wrong: do y"
    assert isinstance(back, KombuPgmqError)


def test_value_errors():
    assert issubclass(errors_module.InvalidQueueName, ValueError)
    assert issubclass(errors_module.ConfigurationError, ValueError)
    assert issubclass(BrokerConnectionError, ConnectionError)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (
            psycopg.OperationalError("server closed the connection unexpectedly"),
            BrokerConnectionError,
        ),
        (
            pg_errors.AdminShutdown("terminating connection due to administrator command"),
            BrokerConnectionError,
        ),
        (psycopg.InterfaceError("the connection is closed"), BrokerConnectionError),
        (pg_errors.UndefinedTable('relation "pgmq.q_x" does not exist'), QueueNotFound),
        (
            pg_errors.InvalidTextRepresentation("invalid input syntax for type json"),
            InvalidJsonBody,
        ),
        (pg_errors.UniqueViolation("duplicate key"), StatementError),
    ],
)
def test_translate(exc, expected):
    err = translate(exc)
    assert type(err) is expected
    assert str(exc) in str(err)


def test_statement_error_is_not_a_connection_error():
    """The alias OperationalError meant the opposite of psycopg's OperationalError (a
    lost connection): StatementError says "the statement failed"; the alias warns."""
    assert not issubclass(StatementError, ConnectionError)
    with pytest.warns(DeprecationWarning, match="use StatementError"):
        alias = errors_module.OperationalError
    assert alias is StatementError
    import kombu_pgmq

    with pytest.warns(DeprecationWarning):
        assert kombu_pgmq.OperationalError is StatementError


@pytest.mark.parametrize("sqlstate", ["25006", "57P01", "57P02", "57P03"])
def test_failover_states_are_connection_errors(sqlstate):
    """A standby answering 25006 after a failover, or a server shutting
    down, makes kombu reconnect (to the new primary) instead of failing the statement."""
    exc = pg_errors.lookup(sqlstate)("server says no")
    assert isinstance(translate(exc), BrokerConnectionError)


@pytest.mark.parametrize(
    "message",
    ["canceling statement due to statement timeout", "canceling statement due to user request"],
)
def test_a_cancelled_statement_is_a_statement_error_not_a_lost_connection(message):
    """57014 (statement_timeout, pg_cancel_backend) is in class 57 with
    the shutdowns, but the connection survives it: the connector must not drop it, and
    kombu must not reconnect and retry. psycopg makes it an OperationalError."""
    exc = pg_errors.lookup("57014")(message)
    assert isinstance(exc, psycopg.OperationalError) and exc.sqlstate == "57014"
    err = translate(exc)
    assert type(err) is StatementCanceled
    assert isinstance(err, StatementError) and not isinstance(err, ConnectionError)
    assert str(err).startswith(f"57014: {message}")
    assert "statement_timeout" in str(err) and "connection is kept" in str(err)
