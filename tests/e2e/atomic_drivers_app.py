"""Celery app of ``test_atomic_drivers.py``: :class:`kombu_pgmq.AtomicTask` tasks whose
``atomic_db`` is a SQLAlchemy ``Engine``, a ``sessionmaker`` and Django's
``django.db.connection``, on the broker's database.

The worker subprocess loads it with ``celery -A tests.e2e.atomic_drivers_app worker``;
importing it configures Django (settings from ``KPT_BROKER_URL``, once per process) and
builds the app of :func:`tests.e2e.celery_app.create_app` (same environment variables)
with these tasks added:

* ``drivers.engine`` (``atomic_db``: an ``Engine``; ``self.db`` is a ``Session``, written
  through ``self.db.execute(text(...))``), ``drivers.sessionmaker`` (a ``sessionmaker``;
  an ORM ``add``) and ``drivers.django`` (``django.db.connection``; a Django ORM
  ``create``): see :func:`atomic_write`.
* ``drivers.mark``: a plain task the atomic ones send; records ``(key, "sent")``.

Tables (created by the tests): ``e2e_driver_writes`` and ``e2e_driver_steps``
(:data:`tests.e2e.test_atomic_drivers.WRITES_DDL`, ``STEPS_DDL``). Importing it needs
``KPT_BROKER_URL`` (the test process does not import it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import django
import psycopg
from django.conf import settings
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy import create_engine, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from kombu_pgmq._conninfo import to_dsn
from kombu_pgmq.atomic import AtomicTask
from tests.e2e.celery_app import create_app, record_run, result_backend_url

#: Longest a gated task waits for the test's ``release`` step (seconds).
GATE_TIMEOUT_S = 60.0

BROKER_URL = os.environ["KPT_BROKER_URL"]


def _configure_django(broker_url: str) -> None:
    params = conninfo_to_dict(to_dsn(broker_url))
    settings.configure(
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": params["dbname"],
                "USER": params.get("user", ""),
                "PASSWORD": params.get("password", ""),
                "HOST": params.get("host", ""),
                "PORT": params.get("port", ""),
            }
        },
        INSTALLED_APPS=[],
        USE_TZ=True,
    )
    django.setup()


_configure_django(BROKER_URL)

from django.db import connection as django_connection  # noqa: E402  (after settings)
from django.db import models  # noqa: E402


class DjangoWrite(models.Model):
    """A row of ``e2e_driver_writes`` for the Django ORM (the table is the tests')."""

    key = models.TextField()
    writer = models.TextField()

    class Meta:
        app_label = "e2e_drivers"
        db_table = "e2e_driver_writes"
        managed = False


class Base(DeclarativeBase):
    pass


class SqlAlchemyWrite(Base):
    """A row of ``e2e_driver_writes`` for the SQLAlchemy ORM."""

    __tablename__ = "e2e_driver_writes"
    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str]
    writer: Mapped[str]


#: The application's SQLAlchemy engine (psycopg 3 driver; no connection before a task).
engine = create_engine(result_backend_url(BROKER_URL).removeprefix("db+"))


def _step(key: str, step: str) -> None:
    with psycopg.connect(BROKER_URL, autocommit=True, application_name="kpt_e2e_task") as c:
        c.execute("INSERT INTO e2e_driver_steps (key, step) VALUES (%s, %s)", (key, step))


def _wait_for_release(key: str) -> None:
    deadline = time.monotonic() + GATE_TIMEOUT_S
    with psycopg.connect(BROKER_URL, autocommit=True, application_name="kpt_e2e_task") as c:
        while time.monotonic() < deadline:
            found = c.execute(
                "SELECT 1 FROM e2e_driver_steps WHERE key = %s AND step = 'release'", (key,)
            ).fetchone()
            if found:
                return
            time.sleep(0.05)
    raise TimeoutError(f"{key}: no release step after {GATE_TIMEOUT_S} s")


def atomic_write(
    task: Any,
    write: Callable[[Any, str], None],
    key: str,
    *,
    send: bool = False,
    gate: bool = False,
    fail: bool = False,
) -> dict[str, Any]:
    """The body of the ``drivers.*`` tasks: record the run (``e2e_runs``, its own
    connection), ``write(task.db, key)`` in the task's transaction; *send*: send
    ``drivers.mark(key)``, then record step ``sent`` (own connection); *gate*: wait for
    the test's ``release`` step; *fail*: raise ``ValueError`` at the end."""
    runs = record_run(BROKER_URL, task)
    write(task.db, key)
    if send:
        task.app.tasks["drivers.mark"].delay(key)
        _step(key, "sent")
    if gate:
        _wait_for_release(key)
    if fail:
        raise ValueError(f"{task.name} {key} fails")
    return {"key": key, "runs": runs, "pid": os.getpid()}


def _write_text(session: Any, key: str) -> None:
    session.execute(
        text("INSERT INTO e2e_driver_writes (key, writer) VALUES (:key, 'engine')"), {"key": key}
    )


def _write_orm(session: Any, key: str) -> None:
    session.add(SqlAlchemyWrite(key=key, writer="sessionmaker"))


def _write_django(connection: Any, key: str) -> None:
    assert connection.in_atomic_block  # the task's transaction.atomic()
    DjangoWrite.objects.create(key=key, writer="django")


app = create_app()


@app.task(shared=False, name="drivers.engine", base=AtomicTask, bind=True, atomic_db=engine)
def engine_write(self: Any, key: str, **options: Any) -> dict[str, Any]:
    return atomic_write(self, _write_text, key, **options)


@app.task(
    shared=False,
    name="drivers.sessionmaker",
    base=AtomicTask,
    bind=True,
    atomic_db=sessionmaker(engine),
)
def sessionmaker_write(self: Any, key: str, **options: Any) -> dict[str, Any]:
    return atomic_write(self, _write_orm, key, **options)


@app.task(
    shared=False, name="drivers.django", base=AtomicTask, bind=True, atomic_db=django_connection
)
def django_write(self: Any, key: str, **options: Any) -> dict[str, Any]:
    return atomic_write(self, _write_django, key, **options)


@app.task(shared=False, name="drivers.mark")
def mark(key: str) -> str:
    """Record ``(key, "sent")`` in ``e2e_driver_writes`` (its own connection)."""
    with psycopg.connect(BROKER_URL, autocommit=True, application_name="kpt_e2e_task") as c:
        c.execute("INSERT INTO e2e_driver_writes (key, writer) VALUES (%s, 'sent')", (key,))
    return key
