"""The advisory lock keys kombu_pgmq's Python code takes, one constant each.

These are keys of one bigint (``pg_advisory_lock(bigint)``: ``pg_locks.objsubid`` 1).
The schema's functions take keys of two integers (class, object: ``objsubid`` 2, a
space of its own), each class defined once in ``sql/schema.sql``, area "Advisory lock
keys" (``kombu_pgmq.lock_key_publish()``...). A LISTEN connection's hand-off slot holds
a random key of its own (:func:`kombu_pgmq._db.handoff.new_slot`).
"""

from __future__ import annotations

__all__ = ["BOOTSTRAP", "CREATE_DATABASE"]

#: Installing or upgrading the schema (:func:`kombu_pgmq.schema.bootstrap`, a lock of the
#: transaction): b"kombu_pg". Another application using the same key would wait for it.
BOOTSTRAP = 0x6B6F6D62755F7067

#: Creating the embedded server's database (:mod:`kombu_pgmq.embedded`, a session lock):
#: b"kpgmqemb".
CREATE_DATABASE = 0x6B70676D71656D62
