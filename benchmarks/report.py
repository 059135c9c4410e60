"""Summary table (Markdown) and plot (PNG) of the benchmark results in ``benchmarks/results``.

Usage::

    python benchmarks/report.py [--results benchmarks/results] [--png docs/benchmarks.png]

Reads ``kombu_throughput.json``, ``celery_bench.json``, ``scale.json``,
``producers.json`` and ``churn_*.json`` (whichever exist), prints one table comparing
the brokers, and draws a six-panel figure: Kombu publish and consume+ack, Celery latency,
Celery backlog drain, consume rate by consumer processes (small vs 1M backlog), publish
rate by producer processes, and dead tuples during the churn runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

BROKERS = ["kombu_pgmq", "redis", "rabbitmq", "kombu57_pgmq"]
LABELS = {
    "kombu_pgmq": "kombu_pgmq",
    "kombu_pgmq_async_publish": "kombu_pgmq, async-commit publishes",
    "kombu_pgmq async-commit": "kombu_pgmq, async-commit publishes",
    "redis": "Redis",
    "rabbitmq": "RabbitMQ",
    "kombu57_pgmq": "kombu 5.7 pgmq",
}
#: The same variant under the names each benchmark gives it.
ALIASES = {
    "kombu_pgmq async_commit": "kombu_pgmq_async_publish",  # kombu_throughput.py
    "kombu_pgmq async-commit": "kombu_pgmq_async_publish",  # producers.py
}
COLORS = {
    "kombu_pgmq": "#336791",
    "redis": "#d82c20",
    "rabbitmq": "#ff6600",
    "kombu57_pgmq": "#999999",
}


def load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def fmt(value: Any, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def backlog_cell(back: dict[str, Any]) -> str:
    rounds = back.get("round_tasks_per_s") or []
    if len(rounds) > 1:
        return f"{fmt(back.get('tasks_per_s'))} ({fmt(min(rounds))}-{fmt(max(rounds))})"
    return fmt(back.get("tasks_per_s"))


def table(kombu: Any, celery: Any, scale: Any, producers: Any = None) -> str:
    kombu_rows = {
        ALIASES.get(r["broker"], r["broker"]): r for r in (kombu or {}).get("results", [])
    }
    celery_rows = (celery or {}).get("results", {})
    scale_rows = (scale or {}).get("results", {})
    producer_rows = {ALIASES.get(k, k): v for k, v in (producers or {}).get("results", {}).items()}
    head = [
        "broker",
        "Kombu publish/s",
        "Kombu consume+ack/s",
        "Celery latency p50 ms",
        "p99 ms",
        "Celery backlog tasks/s",
        "consume/s, 1M backlog, 1 / 8 / 16 consumers",
        "publish/s, 1 / 4 / 16 producers",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    extras = [n for n in celery_rows if n not in BROKERS]
    for name in BROKERS + extras:
        k = kombu_rows.get(name, {})
        c = celery_rows.get(name, {})
        if not (k or c or name in scale_rows or name in producer_rows):
            continue
        lat, back = c.get("latency") or {}, c.get("backlog") or {}
        runs = (scale_rows.get(name, {}).get("large") or {}).get("runs", [])
        by_k = {r["consumers"]: r["per_s"] for r in runs}
        by_p = {int(n): v["median"] for n, v in (producer_rows.get(name) or {}).items()}
        lines.append(
            "| "
            + " | ".join(
                [
                    LABELS.get(name, name),
                    fmt(k.get("publish_per_s")),
                    fmt(k.get("consume_ack_per_s")),
                    fmt(lat.get("p50_ms"), ".1f"),
                    fmt(lat.get("p99_ms"), ".1f"),
                    backlog_cell(back),
                    " / ".join(fmt(by_k.get(n)) for n in (1, 8, 16)),
                    " / ".join(fmt(by_p.get(n)) for n in (1, 4, 16)),
                ]
            )
            + " |"
        )
    raw = kombu_rows.get("kombu_pgmq", {}).get("raw_pgmq_send_per_s")
    if raw:
        lines.append(f"\nRaw `SELECT pgmq.send(...)` loop, same run: {raw:,}/s.")
    return "\n".join(lines)


def plot(
    kombu: Any, celery: Any, scale: Any, churns: list[Any], png: Path, producers: Any = None
) -> None:
    fig, axes = plt.subplots(2, 3, figsize=(19, 9))
    (ax_kombu, ax_lat, ax_backlog), (ax_scale, ax_producers, ax_churn) = axes

    rows = {r["broker"]: r for r in (kombu or {}).get("results", [])}
    names = [n for n in BROKERS if n in rows and "publish_per_s" in rows[n]]
    xs = range(len(names))
    ax_kombu.bar(
        [x - 0.2 for x in xs],
        [rows[n]["publish_per_s"] for n in names],
        0.4,
        label="publish",
        color="#8fb3d9",
    )
    ax_kombu.bar(
        [x + 0.2 for x in xs],
        [rows[n]["consume_ack_per_s"] for n in names],
        0.4,
        label="consume + ack",
        color="#336791",
    )
    ax_kombu.set_xticks(list(xs), [LABELS[n] for n in names])
    ax_kombu.set_ylabel("messages/s")
    ax_kombu.set_title(f"Kombu, {kombu['messages'] if kombu else '?'} messages, prefetch 10")
    ax_kombu.legend()

    results = (celery or {}).get("results", {})
    names = [n for n in BROKERS if (results.get(n) or {}).get("latency")]
    xs = range(len(names))
    ax_lat.bar(
        [x - 0.2 for x in xs],
        [results[n]["latency"]["p50_ms"] for n in names],
        0.4,
        label="p50",
        color="#8fb3d9",
    )
    ax_lat.bar(
        [x + 0.2 for x in xs],
        [results[n]["latency"]["p99_ms"] for n in names],
        0.4,
        label="p99",
        color="#336791",
    )
    ax_lat.set_xticks(list(xs), [LABELS[n] for n in names])
    ax_lat.set_ylabel("ms (apply_async -> task start)")
    ax_lat.set_yscale("log")
    ax_lat.set_title("Celery task latency, prefork x2, 200 tasks 20 ms apart")
    ax_lat.legend()

    results = (celery or {}).get("results", {})
    names = [
        n
        for n in [*BROKERS, "kombu_pgmq_async_publish"]
        if ((results.get(n) or {}).get("backlog") or {}).get("tasks_per_s")
    ]
    medians = [results[n]["backlog"]["tasks_per_s"] for n in names]
    rounds = [
        results[n]["backlog"].get("round_tasks_per_s") or [m]
        for n, m in zip(names, medians, strict=True)
    ]
    ax_backlog.bar(
        range(len(names)),
        medians,
        0.6,
        yerr=[
            [m - min(r) for m, r in zip(medians, rounds, strict=True)],
            [max(r) - m for m, r in zip(medians, rounds, strict=True)],
        ],
        capsize=4,
        color=[COLORS.get(n, "#8fb3d9") for n in names],
    )
    ax_backlog.set_xticks(
        list(range(len(names))), [LABELS[n].replace(", ", ",\n") for n in names], fontsize=8
    )
    ax_backlog.set_ylabel("tasks/s (median, bars: range)")
    backlog = (celery or {}).get("environment", {}).get("backlog")
    ax_backlog.set_title(f"Celery backlog drain, {backlog or '?':,} noop tasks, prefork x2")

    for name, entry in ((producers or {}).get("results") or {}).items():
        counts = sorted(int(k) for k in entry)
        ax_producers.plot(
            counts,
            [entry[str(k)]["median"] for k in counts],
            "--" if "async" in name else "-",
            marker="o",
            color=COLORS.get(name.split()[0]),
            label=LABELS.get(name, name),
        )
    ax_producers.set_xscale("log", base=2)
    ax_producers.set_xlabel("producer processes")
    ax_producers.set_ylabel("messages/s published (all producers)")
    ax_producers.set_title("Kombu publish, concurrent producers")
    ax_producers.legend(fontsize=7)

    for name, entry in ((scale or {}).get("results") or {}).items():
        for label, style in (("small", "--"), ("large", "-")):
            runs = (entry.get(label) or {}).get("runs") or []
            if runs:
                ax_scale.plot(
                    [r["consumers"] for r in runs],
                    [r["per_s"] for r in runs],
                    style,
                    marker="o",
                    color=COLORS.get(name),
                    label=f"{LABELS.get(name, name)}, {entry[label]['backlog']:,}",
                )
    ax_scale.set_xscale("log", base=2)
    ax_scale.set_xlabel("consumer processes")
    ax_scale.set_ylabel("messages/s (consume + ack)")
    ax_scale.set_title("Consume rate: backlog of --consume (dashed) vs 1,000,000 (solid)")
    ax_scale.legend(fontsize=7)

    ax_rate = ax_churn.twinx()
    for index, churn in enumerate(churns):
        samples = churn["samples"]
        minutes = [s["t_s"] / 60 for s in samples]
        color = f"C{index}"
        ax_churn.plot(
            minutes, [s["dead_tuples"] for s in samples], color=color, label=churn["label"]
        )
        ax_rate.plot(minutes, [s["consumed_per_s"] for s in samples], ":", color=color, linewidth=1)
    ax_churn.set_xlabel("minutes")
    ax_churn.set_ylabel("dead tuples in the queue table (solid)")
    ax_rate.set_ylabel("messages consumed/s (dotted)")
    ax_rate.set_ylim(bottom=0)
    ax_churn.set_title("Sustained churn, 10 min (1 producer, 2 consumers)")
    ax_churn.legend(fontsize=7, loc="upper left")

    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main() -> None:
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=here / "results")
    parser.add_argument("--png", type=Path, default=here.parent / "docs" / "benchmarks.png")
    args = parser.parse_args()
    kombu = load(args.results / "kombu_throughput.json")
    celery = load(args.results / "celery_bench.json")
    scale = load(args.results / "scale.json")
    producers = load(args.results / "producers.json")
    churns = [load(p) for p in sorted(args.results.glob("churn_*.json"))]
    print(table(kombu, celery, scale, producers))
    plot(kombu, celery, scale, churns, args.png, producers)
    print(f"\nplot: {args.png}")


if __name__ == "__main__":
    main()
