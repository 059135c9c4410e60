"""TransportOptions: parsed and validated once; README's table and the transport's
docstring list exactly these options."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kombu_pgmq.transport as transport_module
from kombu_pgmq.errors import ConfigurationError
from kombu_pgmq.transport.options import OPTIONS, TransportOptions

README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_table() -> dict[str, tuple[str, str]]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Transport options", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \| ([^|]+) \|", section, re.MULTILINE)
    return {name: (unit.strip(), default.strip()) for name, unit, default in rows}


def test_readme_table_lists_every_option_with_its_unit():
    table = _readme_table()
    assert sorted(table) == sorted(OPTIONS)
    for name, (unit, _default) in table.items():
        assert unit == OPTIONS[name][0], name


def _shown(value: object) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def test_readme_defaults_match():
    table = _readme_table()
    for name, (_unit, default) in table.items():
        if name == "lease_renewal_interval":
            continue  # "visibility_timeout / 3"
        shown = default.split("`")[1]
        assert shown == _shown(OPTIONS[name][1]), (name, shown)


def test_transport_docstring_documents_every_option():
    doc = transport_module.__doc__ or ""
    block = doc.split("Transport Options\n=================", 1)[1]
    for name in OPTIONS:
        assert f"``{name}``" in block, name


def test_defaults_parse():
    options = TransportOptions.parse({})
    assert options.vt_seconds == 30
    assert options.renewal_interval_seconds == 10
    assert TransportOptions.parse({"celery_only_option": 1}) == options


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("visibility_timeout", 0),
        ("lease_renewal_interval", 31),
        ("max_deliveries", 0),
        ("read_batch_size", "ten"),
        ("dead_letter_queue", ""),
        ("priority_steps", [10]),
        ("eta_lead_seconds", -1),
        ("polling_interval", 0),
        ("durable_acks", "yes"),
        ("install_schema", 1),
        ("vacuum_threshold", -5),
        ("connection_options", "sslmode=require"),
        ("consumer_heartbeat_interval", 0),
        ("consumer_stale_after", "soon"),
        ("max_message_bytes", 10),
        ("max_message_bytes", 2**30),
    ],
)
def test_bad_values_name_the_option(name, value):
    with pytest.raises(ConfigurationError, match=name):
        TransportOptions.parse({name: value})
