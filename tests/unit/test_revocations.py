"""Which published Kombu messages are Celery revokes (revocations.revoked_ids)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from kombu_pgmq.revocations import revoked_ids


def control(body: Any, *, encode: bool = False, content_type: str = "application/json") -> dict:
    text = json.dumps(body)
    properties: dict[str, Any] = {}
    if encode:
        text = base64.b64encode(text.encode()).decode()
        properties["body_encoding"] = "base64"
    return {"body": text, "content-type": content_type, "properties": properties}


@pytest.mark.parametrize("encode", [False, True])
def test_a_revoke_names_its_task_ids(encode: bool) -> None:
    one = {"method": "revoke", "arguments": {"task_id": "a", "terminate": False}}
    many = {"method": "revoke", "arguments": {"task_id": ["a", "b"]}}
    assert revoked_ids(control(one, encode=encode)) == ["a"]
    assert revoked_ids(control(many, encode=encode)) == ["a", "b"]


@pytest.mark.parametrize(
    "message",
    [
        control({"method": "ping", "arguments": {}}),
        control({"method": "revoke", "arguments": {}}),
        control({"method": "revoke", "arguments": {"task_id": "a"}}, content_type="x-pickle"),
        {"body": "not json", "content-type": "application/json", "properties": {}},
        {"body": None, "content-type": "application/json"},
        control(["revoke"]),
    ],
)
def test_anything_else_revokes_nothing(message: dict) -> None:
    assert revoked_ids(message) == []
