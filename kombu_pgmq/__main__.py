"""``python -m kombu_pgmq``: the ``kombu-pgmq`` command (:mod:`kombu_pgmq.cli`), for
environments without the console script on ``PATH``::

    python -m kombu_pgmq schema install --url postgresql://app@db:5432/app
"""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":  # pragma: no cover - run as a process by the tests
    main(prog_name="kombu-pgmq")
