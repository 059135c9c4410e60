"""Leader election of beat processes in PostgreSQL: a session advisory lock, a heartbeat,
and deposition of a leader that hangs.

Every beat process runs :meth:`Leader.elect` once per ``round_seconds`` on a connection
of its own (``kombu_pgmq.beat_elect``):

- the session that holds the lock renews its heartbeat (``kombu_pgmq.beat_leader``);
- another session takes the lock when it is free: PostgreSQL frees it the moment the
  leader's session ends (the process was killed, its connection was cut, the server
  restarted), so a follower leads at its next round, within ``round_seconds``;
- a leader that hangs (``SIGSTOP``, a stuck thread, a network partition) keeps its session
  but stops its heartbeat: once the heartbeat is ``stale_seconds`` old, a follower ends
  that session (``pg_terminate_backend``) and leads at its next round.

``beat_takeover_seconds`` (default 10) bounds the whole: ``round_seconds`` is
``min(1, takeover / 5)`` and ``stale_seconds`` is ``takeover - 2 * round_seconds``, so a
hung leader is replaced within ``beat_takeover_seconds`` and a dead one within about one
second. (RedBeat's equivalent is ``redbeat_lock_timeout``, a Redis key's TTL.)

Fencing: the leader claims ticks on this same session, and ``kombu_pgmq.beat_claim``
claims nothing unless the session holds the lock at the epoch it was elected with. A
leader whose session was ended can send nothing more: its next statement fails (the
connector reconnects as a follower), or runs on a new session that does not hold the lock.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from time import monotonic

from .._db.beat import BeatStore, Election
from .._db.connector import Connector
from ..errors import BrokerConnectionError, KombuPgmqError

__all__ = ["Leader", "identity"]

logger = logging.getLogger(__name__)


def identity() -> str:
    """This process as the leader table shows it: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


class Leader:
    """One beat process's side of the election (see the module docstring).

    Log levels (logger ``kombu_pgmq.beat.leader``), as Celery's own: the normal course at
    INFO (this process leads now, after whom; it follows a leader; the database answers
    again), what an operator should look at as WARNING (this process lost the lead, or
    deposed a leader that stopped its heartbeat; the database cannot be reached; an
    election round failed).

    Arguments:
        dsn: libpq connection string of the schedule's database.
        takeover_seconds: longest time without a working leader (seconds, > 1).
        on_notify: called with ``(channel, payload)`` of notifications heard on the
            leader's connection (schedule changes).

    Attributes:
        is_leader: this process leads (as of the last round).
        epoch: the election count of the current lead (fences claims).
    """

    def __init__(
        self,
        dsn: str,
        takeover_seconds: float,
        on_notify: Callable[[str, str], None] | None = None,
    ) -> None:
        self.takeover_seconds = float(takeover_seconds)
        self.round_seconds = min(1.0, self.takeover_seconds / 5)
        self.stale_seconds = self.takeover_seconds - 2 * self.round_seconds
        timeout_ms = int(self.stale_seconds * 500)
        self.connector = Connector(
            dsn,
            settings={"lock_timeout": "1s", "statement_timeout": f"{timeout_ms}ms"},
            on_notify=on_notify,
            role="beat-leader",
        )
        self.store = BeatStore(self.connector)
        self.me = identity()
        self.is_leader = False
        self.epoch: int | None = None
        self.last: Election | None = None
        self._next_round = 0.0
        self._failing = False
        self._seen_leader: str | None = None

    @property
    def round_due(self) -> float:
        """Monotonic time of the next election round."""
        return self._next_round

    def elect(self) -> bool:
        """Run one election round now; True when this process just became the leader."""
        self._next_round = monotonic() + self.round_seconds
        try:
            result = self.store.elect(self.me, self.stale_seconds)
        except BrokerConnectionError as exc:
            self._lost(f"the database cannot be reached ({exc})")
            return False
        except KombuPgmqError as exc:  # a statement or lock timeout: try again next round
            logger.warning("beat: election round failed (%s); trying again", exc)
            return False
        if self._failing:
            logger.info("beat: the database answers again")
            self._failing = False
        self.last = result
        gained = result.leader and (not self.is_leader or self.epoch != result.epoch)
        if result.leader and gained:
            before = self._seen_leader if self._seen_leader != self.me else None
            logger.info(
                "beat: %s leads now (epoch %s%s): this process sends the periodic tasks",
                self.me,
                result.epoch,
                f", after {before}" if before else "",
            )
        elif not result.leader:
            if self.is_leader:
                logger.warning("beat: %s no longer leads; following", self.me)
            if result.deposed:
                logger.warning(
                    "beat: leader %s (server pid %s) stopped its heartbeat %.1f s ago; its "
                    "session was ended, taking over",
                    result.leader_identity,
                    result.leader_pid,
                    result.heartbeat_age or 0.0,
                )
            if result.leader_identity != self._seen_leader:
                logger.info("beat: following %s", result.leader_identity)
        self._seen_leader = result.leader_identity
        self.is_leader = bool(result.leader)
        self.epoch = result.epoch if result.leader else None
        return bool(gained)

    def step_down(self, reason: str) -> None:
        """Stop leading now (a fenced claim, a lost connection); the next round elects."""
        if self.is_leader:
            logger.warning("beat: %s stops leading: %s", self.me, reason)
        self.is_leader = False
        self.epoch = None
        self._next_round = min(self._next_round, monotonic())

    def _lost(self, reason: str) -> None:
        if not self._failing:
            logger.warning("beat: %s; trying every %.1f s", reason, self.round_seconds)
            self._failing = True
        self.step_down(reason)

    def close(self) -> None:
        """Give up the lead (followers take over at their next round) and close."""
        if self.is_leader:
            try:
                self.store.resign()
            except KombuPgmqError as exc:  # the session ends below anyway
                logger.debug("beat: resign failed: %s", exc)
        self.is_leader = False
        self.connector.close()
