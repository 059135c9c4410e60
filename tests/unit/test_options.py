"""TransportOptions: parsed and validated once; documented by its fields' metadata, from
which the transport's docstring and the docs' table of transport options are generated."""

from __future__ import annotations

import importlib.util
import inspect
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import kombu_pgmq.transport as transport_module
from kombu_pgmq.errors import ConfigurationError
from kombu_pgmq.transport.options import (
    KOMBU_OPTIONS,
    OPTIONS,
    OPTIONS_MARKER,
    TransportOptions,
    option_docs,
    options_rst,
)

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _hooks():
    """``docs/_ext/hooks.py``, the MkDocs hooks that build the docs' table."""
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "_ext" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings, as MkDocs' ``toc`` makes them."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), re.MULTILINE)
    return {re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", h).strip().lower()) for h in headings}


def test_every_option_documents_itself():
    """A doc that says what the option does and why one would change it (checked by
    reading: here, that it is there and renders in reST and in a Markdown table), its
    type known to the docs, and pages that exist."""
    for option in option_docs():
        assert len(option.doc) > 80 and option.doc.endswith("."), option.name
        assert "|" not in option.doc, option.name  # a Markdown table cell
        assert not re.search(r":\w+:`", option.doc), option.name  # roles: reST only
        assert option.doc.count("``") % 2 == 0, option.name
        for _title, target in option.see:
            path, _, anchor = target.partition("#")
            assert (DOCS / path).is_file(), (option.name, target)
            assert not anchor or anchor in _anchors(DOCS / path), (option.name, target)


def test_the_generated_docs_follow_the_fields():
    docs = {option.name: option for option in option_docs()}
    assert list(docs) == list(OPTIONS)
    assert [d.unit for d in docs.values()] == [unit for unit, _, _ in OPTIONS.values()]
    assert docs["visibility_timeout"][1:4] == ("number", "seconds", "30")
    assert docs["lease_renewal_interval"].default == "visibility_timeout / 3"
    assert docs["max_deliveries"][1:4] == ("int or None", "deliveries", "None")
    assert docs["dead_letter_queue"].default == "'kombu_pgmq_dlq'"
    assert docs["priority_steps"].type == "list of ints or None"
    assert docs["confirm_publish"][1:4] == ("bool", "", "True")
    assert docs["connection_options"][1:4] == ("dict", "", "{}")
    assert docs["max_message_bytes"].default == "67108864"


def test_the_transport_docstring_lists_the_generated_options():
    """Generated into ``__doc__`` at import: the source holds the marker, no copy."""
    doc = transport_module.__doc__ or ""
    block = doc.split("Transport Options\n=================", 1)[1].split("\nPgBouncer\n")[0]
    assert options_rst() in block and OPTIONS_MARKER not in doc
    for name in OPTIONS:
        assert f"* ``{name}`` (" in block, name
    source = inspect.getsource(transport_module)
    assert source.count(OPTIONS_MARKER) == 1
    assert "* ``visibility_timeout``" not in source


def test_the_options_rst_breaks_lines_outside_code_only():
    rst = options_rst(width=60)
    assert all(line.count("``") % 2 == 0 for line in rst.splitlines())
    assert "``visibility_timeout / 3``" in rst


def test_the_docs_table_is_generated_from_the_fields():
    hooks = _hooks()
    assert hooks.TRANSPORT_OPTIONS == OPTIONS_MARKER
    table = hooks.options_table("guides/celery.md")
    lines = table.splitlines()
    assert lines[:2] == ["| option | type | unit | default | meaning |", "|---|---|---|---|---|"]
    rows = [
        re.match(r"\| `(\w+)` \| ([^|]+) \| ([^|]*) \| `([^`]+)` \| (.+) \|$", r) for r in lines[2:]
    ]
    assert all(rows), lines
    assert [(r[1], r[2], r[3].strip(), r[4]) for r in rows if r] == [
        (o.name, o.type, o.unit, o.default) for o in option_docs()
    ]
    assert "``" not in table  # Markdown code spans
    pooler = next(r[5] for r in rows if r and r[1] == "pooler")
    assert pooler.endswith("See [PgBouncer](../pgbouncer.md).")  # relative to the page
    page = SimpleNamespace(file=SimpleNamespace(src_uri="guides/celery.md"))
    built = hooks.on_page_markdown(f"before\n\n{OPTIONS_MARKER}\n\nafter", page=page)
    assert built == f"before\n\n{table}\n\nafter"


def test_the_docs_show_the_generated_table_and_no_copy():
    """The docs page holds the marker the hook fills in; it and the README keep no
    hand-written rows of transport options (the README links the page)."""
    page = (DOCS / "guides" / "celery.md").read_text(encoding="utf-8")
    section = page.split("## Transport options", 1)[1].split("\n## ", 1)[0]
    assert section.count(OPTIONS_MARKER) == 1
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(docs/guides/celery.md)" in readme
    for text in (section, readme):
        rows = re.findall(r"^\| `(\w+)` \|", text, re.MULTILINE)
        assert not set(rows) & set(OPTIONS), rows


def test_defaults_parse():
    options = TransportOptions.parse({})
    assert options.vt_seconds == 30
    assert options.renewal_interval_seconds == 10


def test_the_options_kombu_reads_itself_are_accepted_and_left_to_it():
    """kombu 5.7 reads these from the same dict: its virtual channel's
    ``from_transport_options``, ``Connection._extract_failover_opts``, and
    ``Connection.ensure``'s arguments (``Producer.publish(retry=True)`` writes the retry
    policy, Celery's ``task_publish_retry_policy`` included, into transport_options).
    Read from kombu's code, so a kombu release that reads another one fails here."""
    from kombu import Connection
    from kombu.transport import virtual

    failover = re.findall(
        r"'(\w+)' in transport_opts", inspect.getsource(Connection._extract_failover_opts)
    )
    assert len(failover) >= 7
    ensure = set(inspect.signature(Connection.ensure).parameters) - {"self", "obj", "fun"}
    kombus = {*virtual.Channel.from_transport_options, *failover, *ensure}
    assert kombus <= KOMBU_OPTIONS | set(OPTIONS)
    celery_policy = {"max_retries": 3, "interval_start": 0, "interval_max": 1, "interval_step": 0.2}
    given = {name: None for name in KOMBU_OPTIONS} | celery_policy | {"polling_interval": 2}
    assert TransportOptions.parse(given) == TransportOptions.parse({"polling_interval": 2})


def test_a_typo_is_refused_with_the_closest_name():
    """An unknown option is refused, not ignored with the default in force."""
    with pytest.raises(ConfigurationError) as info:
        TransportOptions.parse({"visibilty_timeout": 60})
    assert str(info.value) == (
        "unknown transport option 'visibilty_timeout': did you mean 'visibility_timeout'? "
        f"(kombu_pgmq's options: {', '.join(OPTIONS)})"
    )
    with pytest.raises(ConfigurationError, match="did you mean 'max_retries'"):
        TransportOptions.parse({"max_retry": 3})  # kombu's names are suggested too


def test_an_unknown_option_without_a_close_name_is_refused():
    with pytest.raises(ConfigurationError) as info:
        TransportOptions.parse({"fanout_prefix": True})  # kombu's Redis transport's
    assert str(info.value).startswith(
        "unknown transport option 'fanout_prefix': not an option of kombu_pgmq or kombu: "
        "remove it (kombu_pgmq's options: visibility_timeout, "
    )


def test_several_unknown_options_are_named_in_one_error():
    with pytest.raises(ConfigurationError) as info:
        TransportOptions.parse({"polling_intervall": 1, "zzz": 1, "visibility_timeout": 5})
    assert str(info.value).startswith(
        "unknown transport options 'polling_intervall' (did you mean 'polling_interval'?), "
        "'zzz': fix or remove them (kombu_pgmq's options: "
    )


SECONDS = [name for name, (unit, _, _) in OPTIONS.items() if unit == "seconds"]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "nan", "inf"])
@pytest.mark.parametrize("name", SECONDS)
def test_non_finite_numbers_are_refused(name, value):
    """NaN passed every comparison (NaN < 1 is False) and inf meant "never"."""
    with pytest.raises(ConfigurationError, match=f"transport option {name}="):
        TransportOptions.parse({name: value})


def test_a_bad_value_is_one_line_naming_the_option_the_value_and_the_fix():
    with pytest.raises(ConfigurationError) as info:
        TransportOptions.parse({"visibility_timeout": "abc"})
    assert str(info.value) == (
        "transport option visibility_timeout='abc' is invalid: expected seconds from 1 to "
        "43200 (default: 30.0)"
    )
    assert info.value.__cause__ is None and info.value.__context__ is None


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


def _celery_conf(broker_url: str, options: dict[str, object]) -> object:
    from celery import Celery

    app = Celery("options_check", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = options
    return app.conf


def test_a_celery_worker_stops_at_start_with_one_line():
    """The ``celeryd_init`` check (kombu_pgmq._worker_checks): ``celery worker`` exits
    with the error as its only line instead of the transport constructor's traceback."""
    from kombu_pgmq._worker_checks import check_transport_options

    url = "postgresql://u@db.example/app"
    with pytest.raises(SystemExit) as info:
        check_transport_options(conf=_celery_conf(url, {"visibility_timeout": "abc"}))
    assert info.value.code == (
        "kombu_pgmq: broker_transport_options: transport option visibility_timeout='abc' "
        "is invalid: expected seconds from 1 to 43200 (default: 30.0)"
    )
    assert info.value.__suppress_context__  # no "During handling of the above..."
    check_transport_options(conf=_celery_conf(url, {"visibility_timeout": 60, "max_retries": 3}))
    # another broker's options are not ours to judge
    check_transport_options(conf=_celery_conf("redis://h/0", {"fanout_prefix": True}))


def test_pooler_takes_none_session_or_transaction():
    assert TransportOptions.parse({}).pooler is None
    assert TransportOptions.parse({"pooler": "session"}).pooler is None  # nothing special
    assert TransportOptions.parse({"pooler": "transaction"}).pooler == "transaction"
    with pytest.raises(ConfigurationError, match=r"pooler='statement' is invalid.*'transaction'"):
        TransportOptions.parse({"pooler": "statement"})


def test_direct_url_is_validated_and_never_shown():
    url = "postgresql://app:s3cret@db:5432/app"
    options = TransportOptions.parse({"pooler": "transaction", "direct_url": url})
    assert options.direct_url == url
    assert "s3cret" not in repr(options)
    with pytest.raises(ConfigurationError, match="set pooler='transaction' too") as info:
        TransportOptions.parse({"direct_url": url})
    assert "s3cret" not in str(info.value)
    with pytest.raises(ConfigurationError, match="direct_url='mysql://app:\\*\\*@db/app'"):
        TransportOptions.parse({"pooler": "transaction", "direct_url": "mysql://app:pw@db/app"})


def test_confirm_publish_must_be_a_bool():
    with pytest.raises(ConfigurationError, match="confirm_publish='no' is invalid"):
        TransportOptions.parse({"confirm_publish": "no"})
    assert TransportOptions.parse({}).confirm_publish is True


@pytest.mark.parametrize("value", [False, True])
def test_a_removed_option_is_refused_saying_what_the_transport_does_instead(value):
    """Whatever its value: a configuration naming it was written for a behaviour the
    transport does not have, and a typo's closest name would not say so."""
    with pytest.raises(ConfigurationError) as info:
        TransportOptions.parse({"handover": value, "visibility_timeout": 60})
    assert str(info.value) == (
        "transport option 'handover' was removed: a consumer waiting on a queue is handed "
        "the next message published there in its wake-up whenever the message allows it "
        "(docs: Delivery semantics and durability, Hand-off); remove it"
    )
    assert "handover" not in OPTIONS


def test_pooler_prepared_statements_needs_a_transaction_pooler():
    with pytest.raises(ConfigurationError, match="pooler_prepared_statements=1 is invalid"):
        TransportOptions.parse({"pooler": "transaction", "pooler_prepared_statements": 1})
    with pytest.raises(ConfigurationError, match="needs pooler='transaction'"):
        TransportOptions.parse({"pooler_prepared_statements": True})
    options = TransportOptions.parse({"pooler": "transaction", "pooler_prepared_statements": True})
    assert options.pooler_prepared_statements is True
    assert TransportOptions.parse({}).pooler_prepared_statements is False
