"""Lease renewal: messages a connection holds keep their visibility timeout.

A delivered message stays invisible in its queue table until its visibility timeout
(VT) passes; then it is delivered again. Redis and SQS brokers deliver a task that runs
longer than the VT a second time (celery/kombu#337, celery/celery#4400). kombu_pgmq keeps
the VT short (fast recovery after a crash) and renews it instead: a thread of each
connection pushes the VT of every message the connection holds - running, prefetched,
or waiting for its ETA, i.e. every unacked delivery of its channels - to now + VT, every
``lease_renewal_interval`` seconds (VT / 3 by default), one statement for all queues
(``kombu_pgmq.renew``, migration 0004). When the process dies, renewals stop and the
message is delivered again at most one VT after the last renewal.

The thread runs beside the consumer, so it renews while Celery's event loop waits,
while a plain Kombu callback runs for an hour, and while the pool runs the task. It uses
the connection's PostgreSQL connection; if that is lost it reconnects and renews at
once (retrying every second). A lease is *lost* when a renewal finds that the message
was read again by someone else (its ``read_ct`` moved on: the VT passed during an
outage longer than the VT) or is gone; that is logged as a warning, since the message
may then run twice.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from time import monotonic
from typing import Any, NamedTuple

from .. import errors
from .._db.client import PgmqClient

logger = logging.getLogger(__name__)

#: Seconds between attempts while the database cannot be reached.
RETRY_SECONDS = 1.0


class Held(NamedTuple):
    """A message this connection holds: PGMQ queue, msg_id, the read_ct it was read
    with, and the visibility timeout (seconds) its channel uses."""

    queue: str
    msg_id: int
    read_ct: int
    vt_seconds: int


class Renewal(NamedTuple):
    """Result of one renewal round: how many leases were renewed, the ``(queue, msg_id)``
    whose lease was lost, and the statements sent."""

    renewed: int
    lost: list[tuple[str, int]]
    statements: int


def held_by(channels: Iterable[Any]) -> list[Held]:
    """Unacked deliveries of kombu_pgmq channels (any thread: the QoS dicts are copied
    atomically under the GIL). Acked ones kombu has not yet removed (``QoS._dirty``) are
    left out."""
    held = []
    for channel in list(channels):
        qos = getattr(channel, "qos", None)
        delivered = getattr(qos, "_delivered", None)
        if not delivered:
            continue
        settled = set(getattr(qos, "_dirty", ()))  # acked/rejected, removed lazily by kombu
        for _ in range(3):  # a copy racing a resize raises; retry
            try:
                messages = list(delivered.copy().values())
                break
            except RuntimeError:
                continue
        else:
            continue
        vt = channel._vt_seconds
        for message in messages:
            if message.delivery_tag in settled:
                continue
            info = message.delivery_info
            held.append(Held(info["pgmq_queue"], info["pgmq_msg_id"], info["pgmq_read_ct"], vt))
    return held


class LeaseKeeper:
    """Renews the leases of the messages one Kombu connection holds, in a thread.

    Arguments:
        client: returns the connection's :class:`PgmqClient`, or None when it is closed.
        holdings: returns the messages held now (see :func:`held_by`).
        still_held: True if ``(queue, msg_id)`` is still held (not acked or rejected
            since the snapshot), so a missing renewal is a lost lease, not an ack.
        interval_seconds: seconds between renewal rounds.
    """

    def __init__(
        self,
        client: Callable[[], PgmqClient | None],
        holdings: Callable[[], list[Held]],
        still_held: Callable[[str, int], bool],
        interval_seconds: float,
    ) -> None:
        self._client = client
        self._holdings = holdings
        self._still_held = still_held
        self.interval_seconds = interval_seconds
        self._lost: set[tuple[str, int]] = set()  # reported once, not renewed again
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing_since: float | None = None
        #: Held during a round. Code that makes a held message visible again (requeue,
        #: restore) holds it too, so a round cannot push that message's visibility
        #: timeout back into the future right after.
        self.lock = threading.Lock()
        self.rounds = 0
        self.statements = 0

    def start(self) -> None:
        """Start the renewal thread (idempotent)."""
        if self._thread is None and self.interval_seconds > 0:
            self._thread = threading.Thread(target=self._run, name="kombu_pgmq-leases", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        wait = self.interval_seconds
        while not self._stop.wait(wait):
            wait = self.interval_seconds
            try:
                self.renew()
            except errors.BrokerConnectionError as exc:
                if self._stop.is_set():
                    return
                if self._failing_since is None:
                    self._failing_since = monotonic()
                    logger.warning(
                        "lease renewal failed: %s; reconnecting every %.0f s (held messages "
                        "stay invisible until their visibility timeout passes)",
                        exc,
                        RETRY_SECONDS,
                    )
                wait = RETRY_SECONDS
            except errors.KombuPgmqError as exc:
                if not self._stop.is_set():
                    logger.warning("lease renewal failed (%s); retrying", exc)
                wait = RETRY_SECONDS
            except Exception:  # never let the thread die: leases would silently stop
                logger.exception("lease renewal failed; retrying")
                wait = RETRY_SECONDS

    def renew(self) -> Renewal:
        """One round: renew every held lease (one statement per visibility timeout in
        use, normally one). Returns what happened.

        Raises:
            BrokerConnectionError: the database connection was lost (the next round
                reconnects).
        """
        with self.lock:
            client = self._client()
            held = [h for h in self._holdings() if (h.queue, h.msg_id) not in self._lost]
            if client is None or not held:
                self._forget_settled()
                return Renewal(0, [], 0)
            by_vt: dict[int, list[Held]] = defaultdict(list)
            for h in held:
                by_vt[h.vt_seconds].append(h)
            renewed: set[tuple[str, int]] = set()
            for vt, group in by_vt.items():
                renewed |= client.renew([(h.queue, h.msg_id, h.read_ct) for h in group], vt)
        self.rounds += 1
        self.statements += len(by_vt)
        if self._failing_since is not None:
            logger.warning(
                "lease renewal works again after %.1f s without the database",
                monotonic() - self._failing_since,
            )
            self._failing_since = None
        lost = [
            (h.queue, h.msg_id)
            for h in held
            if (h.queue, h.msg_id) not in renewed and self._still_held(h.queue, h.msg_id)
        ]
        for queue, msg_id in lost:
            self._lost.add((queue, msg_id))
            logger.warning(
                "lost the lease of message %s in PGMQ queue %r: its visibility timeout "
                "passed (e.g. during a database outage) and it was delivered again, or it "
                "was removed; it may be processed twice",
                msg_id,
                queue,
            )
        self._forget_settled()
        return Renewal(len(renewed), lost, len(by_vt))

    def _forget_settled(self) -> None:
        if self._lost:
            current = {(h.queue, h.msg_id) for h in self._holdings()}
            self._lost &= current
