"""The basic auth middleware of ``kombu-pgmq metrics serve`` (kombu_pgmq._metrics_server)
on its own: which Authorization headers pass (RFC 7617), what a refusal looks like. Over
HTTP, with TLS and the real exporter: tests/integration/test_metrics_server.py."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from kombu_pgmq import errors
from kombu_pgmq._metrics_server import BasicAuth, is_loopback


def call(header: str | None) -> tuple[str, dict[str, str], bytes]:
    """Run the middleware around an app answering ``200 metrics``."""

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"metrics"]

    answered: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        answered.update(status=status, headers=dict(headers))

    environ = {} if header is None else {"HTTP_AUTHORIZATION": header}
    body = b"".join(BasicAuth(app, "prom", "pa:ss wörd")(environ, start_response))
    return answered["status"], answered["headers"], body


def basic(credentials: str, scheme: str = "Basic") -> str:
    return f"{scheme} {base64.b64encode(credentials.encode()).decode()}"


@pytest.mark.parametrize("scheme", ["Basic", "basic", "BASIC"])
def test_the_right_credentials_pass(scheme: str) -> None:
    assert call(basic("prom:pa:ss wörd", scheme))[::2] == ("200 OK", b"metrics")


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        basic("prom:pa:ss"),  # a prefix of the password (which holds a colon)
        basic("prom:pa:ss wörd "),
        basic("Prom:pa:ss wörd"),
        basic("prompa:ss wörd"),
        basic("prom"),
        "Basic !!!",
        "Basic",
        basic("prom:pa:ss wörd", "Bearer"),
    ],
)
def test_anything_else_is_401_with_the_realm(header: str | None) -> None:
    status, headers, body = call(header)
    assert status == "401 Unauthorized"
    assert headers["WWW-Authenticate"] == 'Basic realm="kombu_pgmq", charset="UTF-8"'
    assert b"metrics" not in body


@pytest.mark.parametrize(("user", "password"), [("", "pw"), ("a:b", "pw"), ("prom", "")])
def test_unusable_credentials_are_refused_up_front(user: str, password: str) -> None:
    with pytest.raises(errors.ConfigurationError):
        BasicAuth(lambda e, s: [], user, password)


def test_loopback_addresses() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("127.0.0.2") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::")
    assert not is_loopback("192.0.2.2") and not is_loopback("localhost")
