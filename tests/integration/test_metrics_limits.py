"""The limit metrics of ``kombu-pgmq metrics serve`` (:mod:`kombu_pgmq._metrics_limits`)
on a real PostgreSQL: a queue's limits, its messages in flight held by a live consumer,
tokens, keys at their limit and the reads held back; none for a queue without limits;
left out, with ``kombu_pgmq_up 1``, without ``kombu_pgmq.limits_info`` or the privilege."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kombu_pgmq.management import Management

from .helpers import connect, drain, publish, sql
from .test_metrics_server import get, serving, value

LIMIT = "kombu_pgmq_queue_limit"
THROTTLED = "kombu_pgmq_queue_throttled_total"


def limit_samples(body: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(name, labels): value}`` of the limit samples of an exposition."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): float(sample.value)
        for family in text_string_to_metric_families(body)
        for sample in family.samples
        if sample.name.startswith(("kombu_pgmq_queue_limit", "kombu_pgmq_queue_throttled"))
    }


def set_limits(url: str, queue: str, **limits: Any) -> None:
    with Management(url) as management:
        management.set_limits(queue, limits)


def test_limits_use_and_reads_held_back(db_dsn: str) -> None:
    with connect(db_dsn) as conn:
        publish(conn, "mlim_api", [1, 2, 3, 4], headers={"x-limit-key": "customer-7"})
        publish(conn, "mlim_rated", [1])
        publish(conn, "mlim_free", [1])
    set_limits(db_dsn, "mlim_api", concurrency=3, key_concurrency=2)
    set_limits(db_dsn, "mlim_rated", rate="6000/m", burst=4)
    with serving(db_dsn, cache_seconds=0) as port:
        url = f"http://127.0.0.1:{port}/metrics"
        before = get(url)[2]
        assert value(before, LIMIT, queue="mlim_api", limit="concurrency") == 3
        assert value(before, LIMIT, queue="mlim_api", limit="key_concurrency") == 2
        assert value(before, LIMIT, queue="mlim_api", limit="rate_per_second") is None
        assert value(before, LIMIT, queue="mlim_rated", limit="rate_per_second") == 100
        assert value(before, LIMIT, queue="mlim_rated", limit="burst") == 4
        assert value(before, "kombu_pgmq_queue_limit_tokens", queue="mlim_rated") == 4
        assert value(before, "kombu_pgmq_queue_limit_tokens", queue="mlim_api") is None
        assert value(before, "kombu_pgmq_queue_limit_in_flight", queue="mlim_api") == 0
        assert value(before, "kombu_pgmq_queue_limit_keys_at_limit", queue="mlim_api") == 0
        assert value(before, THROTTLED, queue="mlim_api", limit="keys") == 0
        assert not [k for k in limit_samples(before) if ("queue", "mlim_free") in k[1]]

        with connect(db_dsn) as conn:
            held = drain(conn, "mlim_api", expect=4, ack=False, timeout=3)
            assert len(held) == 2  # the key's limit binds first
            during = get(url)[2]
        assert value(during, "kombu_pgmq_queue_limit_in_flight", queue="mlim_api") == 2
        assert value(during, "kombu_pgmq_queue_limit_keys_at_limit", queue="mlim_api") == 1
        throttled = value(during, THROTTLED, queue="mlim_api", limit="keys")
        assert throttled is not None and throttled >= 1
        assert value(during, THROTTLED, queue="mlim_api", limit="concurrency") == 0
        assert value(during, "kombu_pgmq_up") == 1


def test_no_limit_metrics_without_migration_0021_or_the_privilege(
    db_dsn: str, least_privilege_db: Any
) -> None:
    lp = least_privilege_db
    with connect(lp.worker_url) as conn:
        publish(conn, "mlim_lp", [1])
    set_limits(lp.worker_url, "mlim_lp", concurrency=2)
    with connect(db_dsn) as conn:
        publish(conn, "mlim_old", [1])
    set_limits(db_dsn, "mlim_old", concurrency=2)
    with serving(lp.worker_url, cache_seconds=0) as port:  # a worker may read them
        body = get(f"http://127.0.0.1:{port}/metrics")[2]
        assert value(body, LIMIT, queue="mlim_lp", limit="concurrency") == 2
    sql(db_dsn, "DROP FUNCTION kombu_pgmq.limits_info(text)")  # a schema without limits
    for url, queue in ((db_dsn, "mlim_old"), (lp.producer_url, "mlim_lp")):
        with serving(url, cache_seconds=0) as port:
            first, again = (get(f"http://127.0.0.1:{port}/metrics")[2] for _ in range(2))
        for body in (first, again):
            assert value(body, "kombu_pgmq_up") == 1, url
            assert value(body, "kombu_pgmq_queue_messages", queue=queue, state="ready") == 1
            assert limit_samples(body) == {}, url
