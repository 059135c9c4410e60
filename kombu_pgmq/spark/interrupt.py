"""``python -m kombu_pgmq.spark.interrupt TASK_ID [RETRIES]``: interrupt a task's Spark work.

Run by the worker's main process (:class:`kombu_pgmq.spark.task.SparkRequest`) when the
pool process of a Spark task died or was terminated; usable by hand for a task whose
worker is gone. Where: ``$SPARK_REMOTE`` (a cluster's Connect URL), else the local server
of ``$KOMBU_PGMQ_SPARK_CONNECT_PORT`` (default 15002), checked to be ours, with its token.
URLs are never arguments: a token there would show in ``ps``. Exit status 0 (also when
nothing was running), 1 on error.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .session import connect_url, interrupt_task


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kombu_pgmq.spark.interrupt",
        epilog="The Spark Connect URL comes from $SPARK_REMOTE, else the local server of "
        "$KOMBU_PGMQ_SPARK_CONNECT_PORT.",
    )
    parser.add_argument("task_id", help="Celery task id")
    parser.add_argument("retries", nargs="?", type=int, default=0, help="request.retries")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        ops = interrupt_task(connect_url(start=False), args.task_id, args.retries)
    except Exception as exc:
        print(f"interrupting task {args.task_id} failed: {exc}", file=sys.stderr)
        return 1
    print(f"interrupted {len(ops)} operation(s) of task {args.task_id}: {ops}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
