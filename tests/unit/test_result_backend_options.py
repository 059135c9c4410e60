"""ResultBackendOptions: ``result_backend_transport_options`` parsed and validated once
when the backend is made, refusing unknown names; documented by its fields' metadata,
from which the backend's docstring and docs/results.md's table are generated."""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from celery import Celery

import kombu_pgmq.results.backend as backend_module
from kombu_pgmq.errors import ConfigurationError
from kombu_pgmq.results.backend import ResultBackend
from kombu_pgmq.results.options import (
    OPTIONS_MARKER,
    ResultBackendOptions,
    option_docs,
    options_rst,
)

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
NAMES = [option.name for option in option_docs()]


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "_ext" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _backend(**options) -> ResultBackend:
    app = Celery("t", broker="memory://", set_as_current=False)
    app.conf.result_backend_transport_options = options
    app.conf.result_expires = 60  # Celery's own settings are not ours to check
    return ResultBackend(app=app, url="postgresql://u@h/db")


def test_every_option_has_a_unit_and_a_doc():
    for option in option_docs():
        assert isinstance(option.unit, str), option.name
        assert len(option.doc) > 40 and option.doc.endswith("."), option.name
        assert "|" not in option.doc and option.doc.count("``") % 2 == 0, option.name
        for _title, target in option.see:
            assert (DOCS / target.partition("#")[0]).is_file(), (option.name, target)
    assert {"result_max_bytes", "durable_states", "expire_batch", "global_keyprefix"} <= set(NAMES)


def test_an_unknown_name_is_refused_with_the_closest_one():
    with pytest.raises(ConfigurationError) as info:
        ResultBackendOptions.parse({"expire_bach": 3})
    assert str(info.value) == (
        "unknown result_backend_transport_options key 'expire_bach': did you mean "
        f"'expire_batch'? (kombu_pgmq's options: {', '.join(NAMES)})"
    )
    with pytest.raises(ConfigurationError, match="'fanout_prefix': not an option of"):
        ResultBackendOptions.parse({"fanout_prefix": True})


def test_the_backend_parses_its_options_once_when_made():
    backend = _backend(result_max_bytes=2000, expire_batch=3, global_keyprefix="app:")
    assert backend.options == ResultBackendOptions.parse(
        {"result_max_bytes": 2000, "expire_batch": 3, "global_keyprefix": "app:"}
    )
    assert (backend.max_bytes, backend.expire_batch) == (2000, 3)
    with pytest.raises(ConfigurationError, match="did you mean 'durable_states'"):
        _backend(durable_state="all")


def test_bad_values_keep_their_messages():
    with pytest.raises(ConfigurationError) as info:
        ResultBackendOptions.parse({"result_max_bytes": 0})
    assert str(info.value) == (
        "result_backend_transport_options result_max_bytes=0 must be between 1 and "
        "1000000000 (PostgreSQL stores at most 1 GB in one value)"
    )
    with pytest.raises(ConfigurationError) as info:
        ResultBackendOptions.parse({"durable_states": "some"})
    assert str(info.value) == (
        "result_backend_transport_options durable_states='some': use 'ready' (the default), "
        "'all' or 'none'"
    )
    for name, value in [
        ("expire_interval_seconds", -1),
        ("expire_batch", 0),
        ("polling_interval", "nan"),
        ("install_schema", "no"),
    ]:
        with pytest.raises(ConfigurationError, match=f"{name}="):
            ResultBackendOptions.parse({name: value})


def test_the_broker_pooler_applies_unless_given_here():
    broker = {"pooler": "transaction", "direct_url": "postgresql://u@db/app"}
    taken = ResultBackendOptions.parse({}, broker)
    assert (taken.pooler, taken.direct_url) == ("transaction", "postgresql://u@db/app")
    own = ResultBackendOptions.parse({"pooler": None}, broker)
    assert (own.pooler, own.direct_url) == (None, None)


def test_the_docstring_and_the_docs_table_are_generated():
    doc = backend_module.__doc__ or ""
    assert options_rst() in doc and OPTIONS_MARKER not in doc
    source = inspect.getsource(backend_module)
    assert source.count(OPTIONS_MARKER) == 1 and "* ``result_max_bytes``" not in source
    page = (DOCS / "results.md").read_text(encoding="utf-8")
    assert page.count(OPTIONS_MARKER) == 1 and "\n| `result_max_bytes` |" not in page
    hooks = _hooks()
    built = hooks.on_page_markdown(
        OPTIONS_MARKER, page=SimpleNamespace(file=SimpleNamespace(src_uri="results.md"))
    )
    rows = re.findall(r"^\| `(\w+)` \|", built, re.MULTILINE)
    assert rows == NAMES
    assert "See [PgBouncer](pgbouncer.md)." in built
