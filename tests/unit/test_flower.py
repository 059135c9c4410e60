"""Flower's Broker page for kombu_pgmq brokers: a ``Delayed`` column of its own,
so Messages = Unacked + Ready + Delayed. Flower's app served in this process (tornado),
the queue statistics faked (no database); the real browser test is
``tests/e2e/test_flower.py``."""

from __future__ import annotations

import asyncio
import re
import types
from pathlib import Path
from typing import Any

import pytest

import kombu_pgmq.flower as kombu_pgmq_flower  # flower is a dev dependency: no silent skip


def _cells(html: str, tag: str) -> list[str]:
    return [
        re.sub(r"<[^>]+>", "", cell).strip()
        for cell in re.findall(rf"<{tag}[ >].*?</{tag}>", html, flags=re.S)
    ]


def _get_broker_page(stats: dict[str, Any] | Exception, monkeypatch: pytest.MonkeyPatch) -> str:
    from celery import Celery
    from flower.app import Flower
    from flower.urls import settings
    from tornado.httpclient import AsyncHTTPClient
    from tornado.httpserver import HTTPServer
    from tornado.testing import bind_unused_port

    def fake_stats(self: Any) -> dict[str, Any]:
        if isinstance(stats, Exception):
            raise stats
        return stats

    monkeypatch.setattr(kombu_pgmq_flower.PgmqBroker, "_stats", fake_stats)

    async def fetch() -> str:
        capp = Celery(broker="postgresql://user@127.0.0.1:1/broker", set_as_current=False)
        app = Flower(capp=capp, **settings)
        sock, port = bind_unused_port()
        server = HTTPServer(app)
        server.add_sockets([sock])
        try:
            response = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{port}/broker")
            return response.body.decode()
        finally:
            server.stop()
            app.executor.shutdown(wait=True)
            capp.close()

    return asyncio.run(fetch())


def test_the_broker_page_counts_delayed_messages_in_their_own_column(monkeypatch):
    queue = types.SimpleNamespace(messages=9, in_flight=2, ready=3, delayed=4, consumers=1)
    html = _get_broker_page({"celery": queue}, monkeypatch)
    headers = _cells(html, "th")
    assert headers[:6] == ["Queue", "Messages", "Unacked", "Ready", "Delayed", "Consumers"]
    row = dict(zip(headers, _cells(html.split("<tbody>", 1)[1], "td"), strict=False))
    assert row["Queue"] == "celery"
    assert (row["Messages"], row["Unacked"], row["Ready"], row["Delayed"]) == ("9", "2", "3", "4")
    assert int(row["Messages"]) == int(row["Unacked"]) + int(row["Ready"]) + int(row["Delayed"])


def test_the_empty_broker_table_spans_every_column(monkeypatch):
    html = _get_broker_page(RuntimeError("database down"), monkeypatch)  # Flower: no rows
    columns = len(_cells(html, "th"))
    assert "Delayed" in _cells(html, "th")
    assert re.search(rf'colspan="{columns}">No queue data', html), html


def test_the_template_is_flowers_own_with_the_delayed_column_added():
    import flower

    source = kombu_pgmq_flower.broker_template_source()
    assert source is not None  # this Flower's page has the Ready column to follow
    original = (Path(flower.__file__).parent / "templates" / "broker.html").read_text()
    columns = len(re.findall(r"<th[ >]", source))
    restored = (
        source.replace("\n          <th>Delayed</th>", "")
        .replace("\n          <td>{% raw format_value(queue.get('delayed')) %}</td>", "")
        .replace(f'colspan="{columns}"', f'colspan="{columns - 1}"')
    )
    assert restored == original
