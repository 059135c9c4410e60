"""Chords completed by a counter in SQL, once per header task id: no ``chord_unlock``.

How a chord runs (Celery's canvas calls these through the backend):

1. ``apply_chord`` (the client, before the header is published): a new run of the
   group id is recorded (``kombu_pgmq.chord_start``: a re-applied frozen chord forgets
   its previous run). A header holding groups is saved as a GroupResult, so the callback
   gets the nested structure, as Celery's Redis backend does.
2. ``set_chord_size`` (the client, before the last header task is published) and
   ``add_to_chord`` (``Task.replace`` inside a header) set the number of parts.
3. ``on_chord_part_return`` (the worker, after storing a header task's result):
   ``kombu_pgmq.chord_part`` inserts ``(group id, task id)`` — a header task that runs
   again after its worker died counts once — and, under the chord row's lock, adds one
   to its counter. The one call that completes the chord gets ``fire``; it reads the
   header results (in header order), and publishes the callback with them, or, if a
   header task failed, fails the callback with :class:`~celery.exceptions.ChordError`
   (its ``link_error`` errbacks run), as Celery defines.

Exactly once: when the broker is kombu_pgmq in the same database, the count, the claim
and the callback's message commit in **one transaction** (the callback is published
through :func:`kombu_pgmq.using` on the result backend's connection). A worker killed
anywhere in between leaves nothing: the header task is delivered again (``acks_late``)
and its second run counts it. With another broker the callback is published before the
transaction commits: a worker killed between the two publishes it again when the task is
redelivered (at least once, never lost).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, Protocol

from celery import states
from celery.canvas import maybe_signature
from celery.exceptions import ChordError
from celery.result import GroupResult, allow_join_result
from celery.utils.functional import _regen

from .. import _conninfo as conninfo
from .. import errors
from .._db.results import ResultStore


class ChordBackend(Protocol):
    """What chords need of :class:`kombu_pgmq.results.backend.ResultBackend` (named
    here, so this module does not import the backend that imports it)."""

    app: Any
    chord_expires: Any

    @property
    def store(self) -> ResultStore: ...
    @property
    def publish_store(self) -> ResultStore: ...

    def same_database_as_broker(self) -> bool: ...
    def ensure_chords_allowed(self) -> None: ...
    def save_group(self, group_id: str, result: Any) -> Any: ...
    def encode(self, data: Any) -> Any: ...
    def decode(self, payload: Any) -> Any: ...
    def encode_result(self, result: Any, state: str) -> Any: ...
    def exception_to_python(self, exc: Any) -> Any: ...
    def chord_error_from_stack(self, callback: Any, exc: Any = None) -> Any: ...


logger = logging.getLogger(__name__)

__all__ = ["apply_chord", "broker_is_here", "on_chord_part_return"]


def apply_chord(backend: ChordBackend, header_result_args: Any) -> None:
    """Record a new run of the chord; save a header that holds groups (nested results)."""
    backend.ensure_chords_allowed()
    group_id = header_result_args[0]
    store = backend.publish_store
    store.chord_start(group_id, backend.chord_expires or None)
    if not isinstance(header_result_args[1], _regen):
        header_result = backend.app.GroupResult(*header_result_args)
        if any(isinstance(r, GroupResult) for r in header_result.results):
            backend.save_group(group_id, header_result)


def _broker_url(backend: ChordBackend) -> str | None:
    """The URL the app publishes to (kombu's ``url1;url2`` for a failover list)."""
    conf = backend.app.conf
    url = conf.broker_write_url or conf.broker_url
    return ";".join(url) if isinstance(url, (list, tuple)) else url


def broker_is_here(backend: ChordBackend) -> bool:
    """True when ``backend.app``'s broker is kombu_pgmq's and in the result backend's
    database (checked once: one query on each side)."""
    url = _broker_url(backend)
    if not url or not conninfo.is_ours(url, backend.app.conf.broker_transport) or ";" in url:
        return False
    from ..transactional import using

    bound = using(backend.store.db.connection, broker_url=url)
    try:
        bound.binding.check_broker(conninfo.to_dsn(url), "the Celery app's broker_url")
    except errors.ConfigurationError:
        return False
    return True


@contextlib.contextmanager
def _publishing_here(backend: ChordBackend) -> Iterator[None]:
    """Publishes of the block go into the result backend's open transaction when the
    broker is in its database."""
    if backend.same_database_as_broker():
        from ..transactional import using

        with using(backend.store.db.connection, broker_url=_broker_url(backend)):
            yield
    else:
        yield


def on_chord_part_return(backend: ChordBackend, request: Any, state: str, result: Any) -> None:
    """Count header task ``request.id`` of chord ``request.group``; the part that
    completes it publishes (or fails) the callback. See the module docstring."""
    app = backend.app
    group_id, task_id = request.group, request.id
    if not group_id or not task_id or not request.chord:
        return
    callback = maybe_signature(request.chord, app=app)
    encoded = backend.encode(backend.encode_result(result, state))
    encoded = encoded.encode() if isinstance(encoded, str) else bytes(encoded)
    store = backend.store
    failure: ChordError | None = None
    try:
        with store.transaction():
            part = store.chord_part(
                group_id,
                task_id,
                request.group_index,
                state,
                encoded,
                request.chord.get("chord_size"),
                backend.chord_expires or None,
            )
            if not part.fire:
                if part.total is not None and part.done > part.total:
                    logger.debug("chord %s: part %s counted after it fired", group_id, task_id)
                return
            with _publishing_here(backend):
                try:
                    values = _header_values(backend, group_id)
                except ChordError as exc:
                    logger.error("Chord %r raised: %r", group_id, exc)
                    failure = exc
                    # In the except block: Celery's fail_from_current_stack reads
                    # sys.exc_info() (outside one it fails when the part that completes
                    # the chord succeeded).
                    backend.chord_error_from_stack(callback, exc)
                else:
                    callback.delay(values)
            store.chord_done(group_id, backend.chord_expires or None)
    except (errors.KombuPgmqError, OSError) as exc:
        if failure is not None:
            raise
        # Nothing was committed: this part is not counted. The callback fails as
        # Celery's Redis backend fails it when its publish fails.
        logger.exception("Chord %r: publishing the callback failed: %r", group_id, exc)
        backend.chord_error_from_stack(callback, ChordError(f"Callback error: {exc!r}"))


def _header_values(backend: ChordBackend, group_id: str) -> list[Any]:
    """The header's results for the callback, in header order.

    Raises:
        ChordError: a header task failed (or was revoked): ``Dependency <id> raised ...``.
    """
    saved = GroupResult.restore(group_id, backend=backend)
    parts = backend.store.chord_results(group_id)
    for part in parts:
        if part.state in states.PROPAGATE_STATES:
            value = backend.decode(part.result)
            if part.state in states.EXCEPTION_STATES:
                value = backend.exception_to_python(value)
            error = ChordError(f"Dependency {part.task_id} raised {value!r}")
            if isinstance(value, Exception):
                # As Celery's Redis backend: a group body's tasks then fail with the
                # header's own exception (chord_error_from_stack reads __cause__).
                error.__cause__ = value
            raise error
    if saved is not None:  # a header holding groups: its nested structure
        saved.on_ready()
        with allow_join_result():
            joined: list[Any] = saved.join_native(
                timeout=backend.app.conf.result_chord_join_timeout, propagate=True
            )
        return joined
    return [backend.decode(part.result) for part in parts]
