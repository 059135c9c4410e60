"""Celery's result backend in PostgreSQL (``result_backend = "postgresql://..."``).

See :mod:`kombu_pgmq.results.backend` for what it does and its options;
:mod:`kombu_pgmq.results.consumer` for waiting without polling;
:mod:`kombu_pgmq.results.chords` for chords counted in SQL. Needs Celery
(``pip install kombu-pgmq-transport[celery]``).
"""

from __future__ import annotations

from .backend import ResultBackend, resolve_url

__all__ = ["ResultBackend", "resolve_url"]
