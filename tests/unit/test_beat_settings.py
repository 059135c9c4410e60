"""The beat's Celery settings: each one read by kombu_pgmq.beat.settings is described in
its SETTINGS, from which the scheduler's docstring and docs/beat.md's table are made."""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import kombu_pgmq.beat.scheduler as scheduler_module
from kombu_pgmq.beat import settings
from kombu_pgmq.beat.settings import OPTIONS_MARKER, SETTINGS, options_rst

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
_READ = re.compile(r"""conf\.get\(\s*["'](beat_\w+)["']""")


def test_every_setting_read_has_a_descriptor_and_every_descriptor_is_read():
    read = set(_READ.findall(inspect.getsource(settings)))
    assert read == {setting.name for setting in SETTINGS}
    assert len(SETTINGS) == len(read)  # no name twice
    # the scheduler reads its settings through the module's readers only
    assert not _READ.findall(inspect.getsource(scheduler_module))


def test_every_setting_has_a_type_unit_default_and_doc():
    for setting in SETTINGS:
        assert setting.type and setting.default and isinstance(setting.unit, str)
        assert len(setting.doc) > 40 and setting.doc.endswith("."), setting.name
        assert "|" not in setting.doc and setting.doc.count("``") % 2 == 0, setting.name
        for _title, target in setting.see:
            assert (DOCS / target.partition("#")[0]).is_file(), (setting.name, target)


def test_the_documented_defaults_are_the_readers():
    conf: dict[str, object] = {}
    defaults = {setting.name: setting.default for setting in SETTINGS}
    assert defaults["beat_takeover_seconds"] == f"{settings.takeover_seconds(conf):g}"
    assert defaults["beat_lookahead_seconds"] == f"{settings.lookahead_seconds(conf):g}"
    assert defaults["beat_history_seconds"] == f"{settings.history_seconds(conf):g}"
    assert defaults["beat_catch_up"] == repr(settings.catch_up(conf))
    assert defaults["beat_install_schema"] == repr(settings.install_schema(conf))


def test_the_docstring_and_the_docs_table_are_generated():
    doc = scheduler_module.__doc__ or ""
    assert options_rst() in doc and OPTIONS_MARKER not in doc
    assert inspect.getsource(scheduler_module).count(OPTIONS_MARKER) == 1
    page = (DOCS / "beat.md").read_text(encoding="utf-8")
    assert page.count(OPTIONS_MARKER) == 1 and "\n| `beat_takeover_seconds` |" not in page
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "_ext" / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    built = hooks.on_page_markdown(
        OPTIONS_MARKER, page=SimpleNamespace(file=SimpleNamespace(src_uri="beat.md"))
    )
    assert built.startswith("| setting | type | unit | default | meaning |")
    assert re.findall(r"^\| `(\w+)` \|", built, re.MULTILINE) == [s.name for s in SETTINGS]
