"""``python -m kombu_pgmq.cli``: the ``kombu-pgmq`` command."""

from . import main

if __name__ == "__main__":  # pragma: no cover
    main()
