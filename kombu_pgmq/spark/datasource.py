"""``pgmq``: a PySpark Python Data Source for kombu_pgmq queues (Spark 4.2+).

Register it once per session (tasks of :class:`kombu_pgmq.spark.SparkTask` have it)::

    from kombu_pgmq.spark import register
    register(spark)

**DataFrame → queue** (batch write; ``mode("append")``)::

    df.write.format("pgmq").option("url", url).option("queue", "rows").mode("append").save()
    # one Celery task per row, called as process_flight(**row):
    df.write.format("pgmq").options(url=url, queue="celery", task="tasks.process_flight") \\
        .mode("append").save()
    # one task per partition, called as load_batch(rows) with rows a list of dicts:
    df.write.format("pgmq").options(url=url, queue="celery", task="tasks.load_batch",
                                    task_per="partition").mode("append").save()

Job-level atomicity: each Spark task stages its rows hidden (visibility 10 years ahead,
header ``x-kombu-pgmq-write``); when every Spark task succeeded the driver makes them
visible in one transaction; a failed job deletes them. Failed attempts of a retried Spark
task are deleted too, so each row is sent once. Consumers never see a partial write.
Writes are rows of ``kombu_pgmq.spark_writes`` (state ``open``/``committed``/``aborted``);
once a write ended no task can stage into it (stragglers of a failed job are refused). A
write left ``open`` by a driver that died keeps its staged rows hidden: find them with
``SELECT * FROM kombu_pgmq.spark_writes WHERE state = 'open'`` and remove them with
``SELECT kombu_pgmq.abort_write('<write_id>')``.

**Queue or archive → DataFrame** (batch read, nothing consumed)::

    spark.read.format("pgmq").options(url=url, queue="celery", source="archive").load()

Columns: ``msg_id long, read_ct int, enqueued_at timestamp, last_read_at timestamp,
vt timestamp, archived_at timestamp, task string, task_id string, message string,
headers string`` (``message``/``headers``: the stored JSON, see :mod:`kombu_pgmq._encoding`;
``task``/``task_id``: Celery's headers; ``last_read_at`` needs PGMQ 1.11+). A snapshot up
to the highest msg_id at planning time, in ``partitions`` msg_id ranges.

**Queue → stream** (consumes)::

    spark.readStream.format("pgmq").options(url=url, queue="events").load()

Micro-batches are msg_id ranges (offset ``{"msg_id": n}``); a batch's messages are archived
after the sink committed the batch: when Spark plans the next trigger (``commit`` or the
next offset request). A ``trigger(availableNow=True)`` run therefore leaves its last batch in
the queue until the next run starts. At least once; exactly once into a sink that is
idempotent on ``msg_id`` (or Spark's file sinks). The stream must be the queue's only consumer, and
it stops before the first hidden message (delayed, held, or staged by an uncommitted
write), so order and completeness hold.

Options (all strings, names case-insensitive):

=====================  =======================================================
``url``                PostgreSQL URL of the broker (required)
``queue``              Kombu queue name (required)
``task``               write: Celery task name; rows become task messages
``task_per``           write: ``row`` (default, ``task(**row)``) or
                       ``partition`` (``task(rows)``)
``batch_size``         write: messages per INSERT (default 5000)
``source``             read: ``queue`` (default) or ``archive``
``partitions``         read: msg_id ranges read in parallel (default 1)
``max_messages``       stream: messages per micro-batch (default 10000)
``wait_seconds``       stream: wait for writers in flight (default 5)
=====================  =======================================================
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceWriter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

from .. import _conninfo as conninfo
from .._db.connector import Connector
from .._db.declarations import Declarations
from .._db.spark_store import SnapshotRow, SparkStore
from .._naming import pgmq_queue_name
from ..errors import ConfigurationError
from ..schema import ensure_schema
from ._pgurl import unix_socket
from .messages import row_message, task_message

__all__ = ["SCHEMA", "PgmqDataSource", "register"]

SCHEMA = (
    "msg_id long, read_ct int, enqueued_at timestamp, last_read_at timestamp, "
    "vt timestamp, archived_at timestamp, task string, task_id string, "
    "message string, headers string"
)
DEFAULT_BATCH_SIZE = 5000
DEFAULT_MAX_MESSAGES = 10_000
DEFAULT_WAIT_SECONDS = 5.0


def register(spark: Any) -> None:
    """Register the ``pgmq`` format in a Spark session (classic or Connect)."""
    spark.dataSource.register(PgmqDataSource)


class _Options:
    """Validated options (plain values: pickled to Spark's Python workers)."""

    def __init__(self, options: Any) -> None:
        self.url = str(options.get("url") or "")
        if not self.url:
            raise ConfigurationError(
                "the pgmq data source needs option 'url' (the broker's postgresql:// URL)"
            )
        self.queue = str(options.get("queue") or "")
        if not self.queue:
            raise ConfigurationError("the pgmq data source needs option 'queue' (a queue name)")
        self.dsn = conninfo.to_dsn(self.url)
        self.pgmq_queue = pgmq_queue_name(self.queue)
        self.task = options.get("task") or None
        self.task_per = str(options.get("task_per") or "row")
        if self.task_per not in ("row", "partition"):
            raise ConfigurationError(
                f"option task_per must be 'row' or 'partition', not {self.task_per!r}"
            )
        self.batch_size = _positive(options, "batch_size", DEFAULT_BATCH_SIZE)
        self.source = str(options.get("source") or "queue")
        if self.source not in ("queue", "archive"):
            raise ConfigurationError(
                f"option source must be 'queue' or 'archive', not {self.source!r}"
            )
        self.partitions = _positive(options, "partitions", 1)
        self.max_messages = _positive(options, "max_messages", DEFAULT_MAX_MESSAGES)
        self.wait_seconds = float(options.get("wait_seconds") or DEFAULT_WAIT_SECONDS)

    def client(self) -> _Db:
        return _Db(self.dsn, bootstrap=True)


class _Db:
    """One connection of a data source step: declarations and the Spark store."""

    def __init__(self, dsn: str, *, bootstrap: bool = False) -> None:
        _reachable_socket(dsn)
        self.connector = Connector(dsn)
        try:
            if bootstrap:
                ensure_schema(self.connector, dsn)
        except BaseException:
            self.connector.close()
            raise
        self.declarations = Declarations(self.connector)
        self.store = SparkStore(self.connector)

    def close(self) -> None:
        self.connector.close()


def _reachable_socket(dsn: str) -> None:
    """On an executor of a cluster, a Unix-socket broker URL names a file on the
    database's machine: say so, with the fix, instead of libpq's "No such file".

    Raises:
        ConfigurationError: the URL is a Unix socket that does not exist on this host.
    """
    path = unix_socket(dsn)
    if path is not None and not os.path.exists(path):
        raise ConfigurationError(
            f"the pgmq data source's url is a Unix socket ({path}) that does not exist on "
            f"host {socket.gethostname()}, where this Spark task runs: executors on other "
            "machines need a TCP URL of a PostgreSQL they can reach, e.g. "
            "postgresql://user:password@db.example.com:5432/dbname (the embedded "
            "PostgreSQL listens on a Unix socket only, for one machine)"
        )


def _positive(options: Any, name: str, default: int) -> int:
    value = options.get(name)
    if value in (None, ""):
        return default
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise ConfigurationError(f"option {name} must be a positive integer, not {value!r}")
    return number


class PgmqDataSource(DataSource):
    """The ``pgmq`` format (see the module docstring)."""

    @classmethod
    def name(cls) -> str:
        return "pgmq"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return SnapshotReader(_Options(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        if overwrite:
            raise ConfigurationError(
                "the pgmq data source only appends messages: use mode('append')"
            )
        return QueueWriter(_Options(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return QueueStreamReader(_Options(self.options))


# -- write -------------------------------------------------------------------------------


@dataclass
class StagedAttempt(WriterCommitMessage):
    """What one Spark task attempt staged: its marker and how many messages."""

    marker: str
    count: int


class QueueWriter(DataSourceWriter):
    """Stages rows per Spark task; the driver's commit makes them visible at once."""

    def __init__(self, options: _Options) -> None:
        self.options = options
        self.write_id = uuid.uuid4().hex
        # Runs on the driver, once per write: the queue exists (declared as a plain
        # Kombu queue if missing); the write is a row of kombu_pgmq.spark_writes.
        client = options.client()
        try:
            client.declarations.create_queue(options.pgmq_queue, options.queue)
            client.store.open_write(self.write_id, options.pgmq_queue)
        finally:
            client.close()

    def write(self, iterator: Iterator[Any]) -> StagedAttempt:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        partition, attempt = (ctx.partitionId(), ctx.attemptNumber()) if ctx is not None else (0, 0)
        marker = f"{self.write_id}/{partition}/{attempt}"
        opts = self.options
        client = _Db(opts.dsn)
        count = 0
        try:
            for batch in _batches(self._messages(iterator, marker), opts.batch_size):
                client.store.stage_messages(
                    self.write_id, [m for m, _ in batch], [h for _, h in batch]
                )
                count += len(batch)
        finally:
            client.close()
        return StagedAttempt(marker, count)

    def _messages(self, rows: Iterator[Any], marker: str) -> Iterator[tuple[str, str]]:
        opts = self.options
        if opts.task is None:
            for row in rows:
                yield row_message(row.asDict(recursive=True), opts.queue, marker)
        elif opts.task_per == "row":
            for row in rows:
                yield task_message(opts.task, [], row.asDict(recursive=True), opts.queue, marker)
        else:
            dicts = [row.asDict(recursive=True) for row in rows]
            if dicts:
                yield task_message(opts.task, [dicts], {}, opts.queue, marker)

    def commit(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        attempts = [m.marker for m in messages if isinstance(m, StagedAttempt)]
        client = self.options.client()
        try:
            client.store.commit_write(self.write_id, attempts)
        finally:
            client.close()

    def abort(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        client = self.options.client()
        try:
            client.store.abort_write(self.write_id)
        finally:
            client.close()


def _batches(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


# -- batch read ----------------------------------------------------------------------------


class _Range(InputPartition):
    def __init__(self, lo: int, hi: int) -> None:
        super().__init__((lo, hi))
        self.lo, self.hi = lo, hi


def _read_range(opts: _Options, lo: int, hi: int, *, archive: bool) -> Iterator[SnapshotRow]:
    client = _Db(opts.dsn)
    try:
        yield from client.store.snapshot(opts.pgmq_queue, lo, hi, archive=archive)
    finally:
        client.close()


class SnapshotReader(DataSourceReader):
    """Reads a queue or its archive without consuming: msg_id ranges up to the highest id
    at planning time."""

    def __init__(self, options: _Options) -> None:
        self.options = options

    def partitions(self) -> Sequence[InputPartition]:
        opts = self.options
        client = opts.client()
        try:
            bounds = client.store.msg_id_range(opts.pgmq_queue, archive=opts.source == "archive")
        finally:
            client.close()
        if bounds is None:
            return [_Range(0, 0)]
        lo, hi = bounds[0] - 1, bounds[1]
        step = max(1, -(-(hi - lo) // opts.partitions))
        return [_Range(a, min(a + step, hi)) for a in range(lo, hi, step)]

    def read(self, partition: InputPartition) -> Iterator[SnapshotRow]:
        assert isinstance(partition, _Range)
        if partition.hi <= partition.lo:
            return iter(())
        return _read_range(
            self.options, partition.lo, partition.hi, archive=self.options.source == "archive"
        )


# -- stream read -----------------------------------------------------------------------------


class QueueStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Consumes a queue in msg_id ranges; archives a range when Spark commits it."""

    def __init__(self, options: _Options) -> None:
        self.options = options
        self._target: int | None = None  # trigger(availableNow=True): the last offset
        self._archived = 0  # archived through this msg_id (by this reader instance)

    def prepareForTriggerAvailableNow(self) -> None:
        opts = self.options
        client = opts.client()
        try:
            self._target = client.store.stream_horizon(
                opts.pgmq_queue, 0, 2**31 - 1, opts.wait_seconds
            )
        finally:
            client.close()

    def initialOffset(self) -> dict[str, int]:
        return {"msg_id": 0}

    def getDefaultReadLimit(self) -> Any:
        from pyspark.sql.streaming.datasource import ReadMaxRows  # Spark 4.2+

        return ReadMaxRows(self.options.max_messages)

    def latestOffset(self, start: dict[str, int], limit: Any) -> dict[str, int]:
        max_rows = getattr(limit, "max_rows", None) or getattr(limit, "maxRows", None)
        opts = self.options
        client = opts.client()
        try:
            # Spark plans the next micro-batch only after the previous one (ending at
            # start) was committed to the sink, so its messages can be archived now; Spark
            # itself calls commit() only when there is a next batch with data.
            if int(start["msg_id"]) > self._archived:
                self._archive_through(client, int(start["msg_id"]))
            horizon = client.store.stream_horizon(
                opts.pgmq_queue, int(start["msg_id"]), int(max_rows or 2**31 - 1), opts.wait_seconds
            )
        finally:
            client.close()
        if self._target is not None:
            horizon = max(int(start["msg_id"]), min(horizon, self._target))
        return {"msg_id": horizon}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        lo, hi = int(start["msg_id"]), int(end["msg_id"])
        return [_Range(lo, hi)] if hi > lo else []

    def read(self, partition: InputPartition) -> Iterator[SnapshotRow]:
        assert isinstance(partition, _Range)
        return _read_range(self.options, partition.lo, partition.hi, archive=False)

    def commit(self, end: dict[str, int]) -> None:
        # Everything up to end: also a range whose commit was lost in a crash after the
        # sink had committed (Spark does not replay it).
        client = self.options.client()
        try:
            self._archive_through(client, int(end["msg_id"]))
        finally:
            client.close()

    def _archive_through(self, client: _Db, msg_id: int) -> None:
        client.store.archive_range(self.options.pgmq_queue, 0, msg_id)
        self._archived = max(self._archived, msg_id)
