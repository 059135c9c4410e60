"""Exchange routing shared by every process: AMQP matching over bindings stored in
PostgreSQL (``kombu_pgmq.exchanges`` / ``kombu_pgmq.bindings``).

Each connection caches the routing table together with the version it was read at
(``kombu_pgmq.routing_version``, bumped by a trigger on every bind, unbind or exchange
change). A publish sends the cached version along; the statement delivers only if the
version is unchanged, otherwise the table is reloaded and the publish repeated. So a
publish never uses stale routes, and costs one round trip while routes are stable.

Matching follows AMQP 0-9-1:

* ``direct``: the binding key equals the routing key;
* ``fanout``: every binding;
* ``topic``: keys are words separated by ``.``; ``*`` matches exactly one word, ``#``
  zero or more words (``logs.#`` matches ``logs``, ``logs.a`` and ``logs.a.b``). The
  empty routing key has zero words: ``#`` matches it, ``*`` does not.
"""

from __future__ import annotations

from collections import defaultdict
from functools import lru_cache

from .._db.broker import RoutingTable

#: Exchange types this transport routes.
EXCHANGE_TYPES = frozenset({"direct", "topic", "fanout"})


def _words(key: str) -> tuple[str, ...]:
    return tuple(key.split(".")) if key else ()


@lru_cache(maxsize=8192)
def topic_matches(binding_key: str, routing_key: str) -> bool:
    """True if the topic binding key (pattern) matches the routing key (AMQP rules)."""
    pattern, words = _words(binding_key), _words(routing_key)
    # reachable[j]: the pattern prefix seen so far can consume exactly words[:j].
    reachable = [True] + [False] * len(words)
    for token in pattern:
        if token == "#":
            for j in range(1, len(words) + 1):
                reachable[j] = reachable[j] or reachable[j - 1]
        else:
            nxt = [False] * (len(words) + 1)
            for j in range(1, len(words) + 1):
                nxt[j] = reachable[j - 1] and (token == "*" or token == words[j - 1])
            reachable = nxt
    return reachable[len(words)]


class Routes:
    """A routing table snapshot with lookups: ``route(exchange, key) -> [(queue, pgmq)]``."""

    def __init__(self, table: RoutingTable) -> None:
        self.version = table.version
        self.exchanges = table.exchanges
        #: Kombu queues of this table declared with ``x-deduplicate-task-id``.
        self.deduplicated = table.deduplicated
        by_exchange: dict[str, list[tuple[str, str, str]]] = defaultdict(list)
        for exchange, routing_key, queue, pgmq_queue in table.bindings:
            by_exchange[exchange].append((routing_key, queue, pgmq_queue))
        self._bindings = dict(by_exchange)
        self._cache: dict[tuple[str, str], list[tuple[str, str]]] = {}

    def exchange_type(self, exchange: str) -> str:
        """Declared type of ``exchange`` (``direct`` if undeclared, as kombu's default)."""
        return self.exchanges.get(exchange, "direct")

    def route(self, exchange: str, routing_key: str) -> list[tuple[str, str]]:
        """``[(kombu_queue, pgmq_queue)]`` a message published to ``exchange`` reaches,
        each queue once."""
        key = (exchange, routing_key)
        found = self._cache.get(key)
        if found is None:
            kind = self.exchange_type(exchange)
            seen: dict[str, str] = {}
            for binding_key, queue, pgmq_queue in self._bindings.get(exchange, ()):
                if (
                    kind == "fanout"
                    or (kind == "direct" and binding_key == routing_key)
                    or (kind == "topic" and topic_matches(binding_key, routing_key))
                ):
                    seen.setdefault(queue, pgmq_queue)
            found = self._cache[key] = list(seen.items())
        return found

    def bindings(self) -> list[tuple[str, str, str]]:
        """``[(queue, exchange, routing_key)]`` as kombu's ``list_bindings``."""
        return [
            (queue, exchange, routing_key)
            for exchange, rows in self._bindings.items()
            for routing_key, queue, _ in rows
        ]
