"""Sizes measured in bytes as stored (UTF-8), not characters: the publish limit
(``max_message_bytes``) and the hand-off's NOTIFY tail."""

from __future__ import annotations

import pytest

from kombu_pgmq._db import handoff
from kombu_pgmq.errors import ConfigurationError
from kombu_pgmq.transport.publisher import _check_size

LIMIT = 4096


@pytest.mark.parametrize(
    ("body", "fits"),
    [
        ("x" * 4000, True),
        ("x" * 4100, False),
        ("€" * 1300, True),  # 3,900 bytes
        ("€" * 1400, False),  # 4,200 bytes in 1,400 characters
        ("🙂" * 1100, False),  # 4,400 bytes in 1,100 characters
        ("x" * 3000 + "\ud800" * 400, False),  # lone surrogates: 3 bytes each
        ("x" * 5_000_000, False),
    ],
)
def test_the_message_limit_counts_bytes(body: str, fits: bool) -> None:
    if fits:
        _check_size("q", body, "{}", LIMIT)
    else:
        with pytest.raises(ConfigurationError, match=f"max_message_bytes={LIMIT}"):
            _check_size("q", body, "{}", LIMIT)


def test_non_ascii_headers_count_in_bytes() -> None:
    with pytest.raises(ConfigurationError, match="is 4202 bytes"):
        _check_size("q", "x" * 3000, '{"a":"' + "é" * 597 + '"}', LIMIT)


@pytest.mark.parametrize(
    ("message", "handed"),
    [
        ("x" * 7000, True),
        ("x" * 7900, False),
        ("€" * 2500, True),  # 7,500 bytes
        ("€" * 2700, False),  # 8,100 bytes in 2,700 characters
        ("x" * 20_000_000, False),
    ],
)
def test_the_handoff_tail_fits_a_notify_in_bytes(message: str, handed: bool) -> None:
    tail = handoff.tail(message, "{}", 0)
    assert (tail is not None) is handed
    if handed:
        assert tail == f"{message}{handoff.SEPARATOR}{{}}"
