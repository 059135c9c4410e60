import pytest

from kombu_pgmq._db.broker import RoutingTable
from kombu_pgmq.transport._routing import Routes, topic_matches

# (binding key, routing key, matches) — AMQP 0-9-1 topic semantics, as RabbitMQ.
TOPIC_CASES = [
    ("a.b.c", "a.b.c", True),
    ("a.b.c", "a.b", False),
    ("a.b", "a.b.c", False),
    ("a.*.c", "a.b.c", True),
    ("a.*.c", "a.c", False),
    ("a.*.c", "a.b.b.c", False),
    ("*", "a", True),
    ("*", "a.b", False),
    ("*", "", False),
    ("#", "", True),
    ("#", "a", True),
    ("#", "a.b.c", True),
    ("logs.#", "logs", True),
    ("logs.#", "logs.error", True),
    ("logs.#", "logs.error.disk", True),
    ("logs.#", "logsx", False),
    ("logs.#", "other.logs", False),
    ("#.error", "error", True),
    ("#.error", "logs.error", True),
    ("#.error", "logs.error.x", False),
    ("a.#.b", "a.b", True),
    ("a.#.b", "a.x.b", True),
    ("a.#.b", "a.x.y.b", True),
    ("a.#.b", "a.x.y", False),
    ("#.#", "", True),
    ("#.#", "a.b", True),
    ("*.#", "a", True),
    ("*.#", "", False),
    ("#.*", "a", True),
    ("#.*", "", False),
    ("*.*", "a", False),
    ("*.*", "a.b", True),
    ("a.*.#", "a.b", True),
    ("a.*.#", "a", False),
    ("a.#.#.b", "a.b", True),
    ("", "", True),
    ("", "a", False),
    ("a..b", "a..b", True),
    ("a.*.b", "a..b", True),
    ("worker.#", "worker.heartbeat", True),
    ("task.*", "task.succeeded", True),
    ("*.stock.#", "usd.stock", True),
    ("*.stock.#", "eur.stock.db", True),
    ("*.stock.#", "stock.nasdaq", False),
]


@pytest.mark.parametrize(("binding_key", "routing_key", "expected"), TOPIC_CASES)
def test_topic_matching_follows_amqp(binding_key, routing_key, expected):
    assert topic_matches(binding_key, routing_key) is expected


def routes(exchanges, bindings):
    return Routes(RoutingTable(1, exchanges, [(e, k, q, q.lower()) for e, k, q in bindings]))


def test_direct_fanout_topic_routing():
    r = routes(
        {"d": "direct", "f": "fanout", "t": "topic"},
        [
            ("d", "k1", "Q1"),
            ("d", "k2", "Q2"),
            ("d", "k1", "Q3"),
            ("f", "ignored", "F1"),
            ("f", "", "F2"),
            ("t", "logs.#", "T1"),
            ("t", "*.error", "T2"),
            ("t", "#", "T3"),
        ],
    )
    assert r.route("d", "k1") == [("Q1", "q1"), ("Q3", "q3")]
    assert r.route("d", "nope") == []
    assert sorted(q for q, _ in r.route("f", "anything")) == ["F1", "F2"]
    assert sorted(q for q, _ in r.route("t", "logs.error")) == ["T1", "T2", "T3"]
    assert sorted(q for q, _ in r.route("t", "logs")) == ["T1", "T3"]
    assert r.route("unknown", "k") == []


def test_a_queue_bound_twice_gets_one_copy():
    r = routes({"t": "topic"}, [("t", "a.*", "Q"), ("t", "#", "Q")])
    assert r.route("t", "a.b") == [("Q", "q")]
