"""The named statements: one file per area under sql/queries/, each name defined once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kombu_pgmq._db.queries import parse_queries, queries, sql_dir

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def test_every_file_of_sql_queries_is_loaded() -> None:
    files = sorted((sql_dir() / "queries").glob("*.sql"))
    assert len(files) > 1
    named = [name for path in files for name in _NAME.findall(path.read_text())]
    assert sorted(queries()) == sorted(named)
    assert all(queries()[name] for name in named)


def test_comment_lines_are_left_out(tmp_path: Path) -> None:
    path = tmp_path / "a.sql"
    path.write_text("-- what the file holds\n\n-- name: one\n-- says what\nSELECT 1\n\n")
    assert parse_queries([path]) == {"one": "SELECT 1"}


def test_a_name_defined_twice_in_two_files_is_refused(tmp_path: Path) -> None:
    first, second = tmp_path / "a.sql", tmp_path / "b.sql"
    first.write_text("-- name: one\nSELECT 1\n")
    second.write_text("-- name: two\nSELECT 2\n\n-- name: one\nSELECT 3\n")
    with pytest.raises(RuntimeError, match=r"'one' is defined twice: in .*a\.sql and in .*b\.sql"):
        parse_queries([first, second])


def test_a_name_defined_twice_in_one_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.sql"
    path.write_text("-- name: one\nSELECT 1\n\n-- name: one\nSELECT 2\n")
    with pytest.raises(RuntimeError, match="'one' is defined twice"):
        parse_queries([path])
