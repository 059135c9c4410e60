"""docs/grafana-dashboard.json queries only metrics kombu_pgmq exports (a renamed metric
would leave a panel silently empty), and is a Grafana dashboard (panels with targets,
the queue variable)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kombu_pgmq.metrics import ProcessCollector, QueueCollector

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"


def exported() -> set[str]:
    names: set[str] = set()
    queues = QueueCollector("postgresql://nobody@127.0.0.1:1/none")  # describe(): no query
    for family in [*queues.describe(), *ProcessCollector().collect()]:
        names.add(family.name)
        names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


def test_every_query_uses_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 10
    used = {name for expr in exprs for name in re.findall(r"kombu_pgmq_[a-z_]+", expr)}
    assert used - exported() == set()
    # every queue metric is on the dashboard
    assert {
        "kombu_pgmq_queue_messages",
        "kombu_pgmq_queue_oldest_message_age_seconds",
        "kombu_pgmq_dead_letters",
        "kombu_pgmq_archive_messages",
        "kombu_pgmq_consumers",
    } <= used


def test_it_is_a_grafana_dashboard_with_a_queue_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "queue"}
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["type"] in {"timeseries", "stat"} and panel["gridPos"]["w"] > 0
