"""The Django side of ``test_transactional.py``, in a process of its own (Django's settings
are configured once per process): enqueue ``e2e.record`` tasks inside
``transaction.atomic()`` through ``kombu_pgmq.using(connection)``.

Usage: ``python -m tests.e2e.django_enqueue`` with ``KPT_BROKER_URL`` set (the broker's
database is also Django's). Prints one JSON object: ``{"committed": [task ids],
"rolled_back": [task ids]}``:

* ``commit``: an atomic block that commits;
* ``rollback``: an atomic block that raises;
* ``savepoint``: an outer block that commits around an inner block (a savepoint) that
  raises: the inner task is rolled back, the outer one committed.
"""

from __future__ import annotations

import json
import os
from typing import Any

import django
from django.conf import settings
from psycopg.conninfo import conninfo_to_dict

import kombu_pgmq
from kombu_pgmq._conninfo import to_dsn
from tests.e2e.celery_app import create_app


class Rollback(Exception):
    pass


def main() -> None:
    params = conninfo_to_dict(to_dsn(os.environ["KPT_BROKER_URL"]))
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
    from django.db import connection, transaction

    app = create_app()
    record = app.tasks["e2e.record"]
    committed: list[str] = []
    rolled_back: list[str] = []

    def enqueue(label: str) -> Any:
        return record.apply_async((label,), connection=kombu_pgmq.using(connection))

    with transaction.atomic():
        committed.append(enqueue("django-commit").id)
    try:
        with transaction.atomic():
            rolled_back.append(enqueue("django-rollback").id)
            raise Rollback
    except Rollback:
        pass
    with transaction.atomic():
        committed.append(enqueue("django-outer").id)
        try:
            with transaction.atomic():  # a savepoint
                rolled_back.append(enqueue("django-savepoint").id)
                raise Rollback
        except Rollback:
            pass
    print(json.dumps({"committed": committed, "rolled_back": rolled_back}))
    app.close()


if __name__ == "__main__":
    main()
