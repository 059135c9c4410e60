"""Pooled mode of the connector (kombu_pgmq._db.pooling): what is decided without a
server (the behaviour through a real PgBouncer: tests/integration/test_pgbouncer.py)."""

from __future__ import annotations

import logging

import pytest

from kombu_pgmq._db import pooling
from kombu_pgmq._db.connector import Connector
from kombu_pgmq.errors import ConfigurationError


def test_a_marked_dsn_makes_pooled_connectors():
    dsn = "host=pooler.invalid dbname=unit_pooling_marked"
    assert not Connector(dsn).pooled
    pooling.mark_pooled(dsn)
    assert Connector(dsn).pooled
    assert not Connector(dsn, pooled=False).pooled


def test_listen_through_a_transaction_pooler_is_refused():
    with pytest.raises(ConfigurationError, match="direct_url"):
        Connector("host=pooler.invalid", pooled=True, on_notify=lambda c, p: None)


def test_local_settings_is_one_statement_for_this_transaction():
    statement, params = pooling.local_settings({"lock_timeout": "1s", "work_mem": "4MB"})
    assert statement == b"SELECT set_config(%s, %s, true), set_config(%s, %s, true)"
    assert params == ["lock_timeout", "1s", "work_mem", "4MB"]


def test_the_polling_warning_is_logged_once_per_key(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, "kombu_pgmq"):
        assert pooling.warn_polling_once("unit-test-key", "polls")
        assert not pooling.warn_polling_once("unit-test-key", "polls")
    assert [r.message for r in caplog.records] == ["polls"]


def test_direct_url_must_not_be_the_pooler_itself():
    from kombu import Connection

    url = "postgresql://app:pw@pooler.invalid:6432/app"
    with pytest.raises(ConfigurationError, match=r"direct_url='postgresql://app:\*\*@"):
        Connection(url, transport_options={"pooler": "transaction", "direct_url": url}).transport  # noqa: B018
