"""Is one broker's Celery latency at or below another's? Rounds paired across runs.

    python benchmarks/latency_paired.py benchmarks/results/run1.json [run2.json ...]
        [--broker kombu_pgmq] [--against redis] [--json out.json]

Reads ``celery_bench.py`` results. Its latency rounds interleave the brokers (round 1 of
each broker, then round 2 of each, ...), so round *i* of two brokers ran under the same
machine conditions: each round is a pair. For p50 and p99 (each round's own percentile of
its 200 tasks) it prints the pairs' count, how many rounds ``--broker`` was at or below
``--against``, the median ratio, the mean difference in ms with a 95 % bootstrap interval
(10,000 resamples of the pairs, seeded), and the two-sided sign test's p (ties dropped).
An interval that holds 0 means the difference is within what the rounds' spread explains.
Only the standard library.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path


def pairs(files: list[Path], broker: str, against: str, key: str) -> list[tuple[float, float]]:
    """(broker, against) values of ``key`` (``round_p50_ms``, ``round_p99_ms``) per round."""
    out: list[tuple[float, float]] = []
    for path in files:
        results = json.loads(path.read_text())["results"]
        ours, theirs = results[broker]["latency"][key], results[against]["latency"][key]
        if len(ours) != len(theirs):
            raise SystemExit(f"{path}: {broker} has {len(ours)} rounds, {against} {len(theirs)}")
        out.extend(zip(ours, theirs, strict=True))
    return out


def sign_test(wins: int, losses: int) -> float:
    """Two-sided binomial sign test p-value (ties left out by the caller)."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def bootstrap(diffs: list[float], resamples: int = 10_000, seed: int = 30) -> tuple[float, float]:
    """95 % percentile interval of the mean of ``diffs`` (resampled with replacement)."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(diffs, k=len(diffs))) for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def summarise(values: list[tuple[float, float]]) -> dict:
    diffs = [a - b for a, b in values]
    wins = sum(1 for d in diffs if d < 0)
    losses = sum(1 for d in diffs if d > 0)
    low, high = bootstrap(diffs)
    return {
        "rounds": len(values),
        "at_or_below": sum(1 for d in diffs if d <= 0),
        "below": wins,
        "above": losses,
        "median_ratio": round(statistics.median(a / b for a, b in values), 3),
        "mean_diff_ms": round(statistics.fmean(diffs), 3),
        "mean_diff_ci95_ms": [round(low, 3), round(high, 3)],
        "sign_test_p": round(sign_test(wins, losses), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--broker", default="kombu_pgmq")
    parser.add_argument("--against", default="redis")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = {
        "files": [str(f) for f in args.files],
        "broker": args.broker,
        "against": args.against,
        **{
            metric: summarise(pairs(args.files, args.broker, args.against, f"round_{metric}_ms"))
            for metric in ("p50", "p99")
        },
    }
    for metric in ("p50", "p99"):
        s = report[metric]
        low, high = s["mean_diff_ci95_ms"]
        print(
            f"{metric}: {s['rounds']} rounds, {args.broker} at or below {args.against} in "
            f"{s['at_or_below']} (below {s['below']}, above {s['above']}); median ratio "
            f"{s['median_ratio']}; mean difference {s['mean_diff_ms']:+.3f} ms "
            f"(95 % CI {low:+.3f} .. {high:+.3f}); sign test p {s['sign_test_p']}"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
