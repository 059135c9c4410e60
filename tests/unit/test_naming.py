import re
import subprocess
import sys

import pytest

from kombu_pgmq._naming import MAX_PGMQ_NAME_LENGTH, pgmq_queue_name
from kombu_pgmq.errors import InvalidQueueName

CELERY_NAMES = [
    "celery",
    "celery@worker-1.example.com.celery.pidbox",
    "0d6c9a0e-9b1f-4a49-9f39-2d4a1c8b7e42.reply.celery.pidbox",  # 56 characters
    "celeryev.0d6c9a0e-9b1f-4a49-9f39-2d4a1c8b7e42",
    "MyQueue",
    "myqueue",
    "my.queue",
    "my_queue",
    "my-queue",
    "a__b",
    "x" * 47,
    "x" * 48,
    "9lives",
    "ümlaut",
    "...",
]


@pytest.mark.parametrize("name", CELERY_NAMES)
def test_result_is_a_valid_pgmq_name(name):
    mapped = pgmq_queue_name(name)
    assert len(mapped) <= MAX_PGMQ_NAME_LENGTH
    assert re.fullmatch(r"[a-z0-9_]+", mapped), mapped


def test_plain_names_are_kept():
    assert pgmq_queue_name("celery") == "celery"
    assert pgmq_queue_name("my_queue") == "my_queue"
    assert pgmq_queue_name("x" * 47) == "x" * 47


def test_names_pgmq_would_fold_together_stay_distinct():
    mapped = [pgmq_queue_name(n) for n in CELERY_NAMES]
    assert len(set(mapped)) == len(CELERY_NAMES)
    # PGMQ lower-cases table names: MyQueue must not land on myqueue's table.
    assert pgmq_queue_name("MyQueue") != "myqueue"
    # A plain name that looks like an encoded one cannot be produced by the encoder.
    assert "__" in pgmq_queue_name("my.queue")
    assert pgmq_queue_name("a__b") != "a__b"


def test_encoded_names_are_readable():
    assert pgmq_queue_name("celery@host.celery.pidbox").startswith("celery_host_celery_pidbox__")


def test_mapping_is_stable_across_processes():
    name = "celery@worker-1.example.com.celery.pidbox"
    code = f"from kombu_pgmq._naming import pgmq_queue_name; print(pgmq_queue_name({name!r}))"
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    ).stdout.strip()
    assert other == pgmq_queue_name(name)


def test_many_random_names_do_not_collide():
    names = [f"celeryev.{i:06d}-Host.Name" for i in range(20000)]
    assert len({pgmq_queue_name(n) for n in names}) == len(names)


@pytest.mark.parametrize("bad", ["", None, 3, b"celery"])
def test_invalid_names_raise(bad):
    with pytest.raises(InvalidQueueName, match="non-empty string"):
        pgmq_queue_name(bad)
