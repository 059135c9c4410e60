"""The HTTP server of :func:`kombu_pgmq.metrics.serve`: prometheus-client's WSGI app
(``make_wsgi_app``) on its threading wsgiref server (``ThreadingWSGIServer``, one thread
per request), with optional HTTP basic auth (:class:`BasicAuth`, a WSGI middleware) and
optional TLS (:func:`tls_context`, the standard library's ``ssl``).

Why not ``prometheus_client.start_http_server``, which takes ``certfile``/``keyfile``:
it has no place for a WSGI middleware (prometheus-client has no server-side basic auth),
and it runs the TLS handshake in its accept loop, so one client that connects and sends
nothing stalls every scrape (tried with prometheus-client 0.26: the next HTTPS scrape
timed out). Here the handshake runs in the request's own thread, and a client silent for
:data:`CLIENT_TIMEOUT_SECONDS` is dropped.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import logging
import socket
import ssl
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client.exposition import ThreadingWSGIServer

from .errors import ConfigurationError

logger = logging.getLogger("kombu_pgmq.metrics")

#: Seconds a client may stay silent (TLS handshake, request line, headers) before its
#: connection is closed.
CLIENT_TIMEOUT_SECONDS = 10.0
#: The ``realm`` of the ``401`` answer's ``WWW-Authenticate: Basic`` header.
REALM = "kombu_pgmq"

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class BasicAuth:
    """WSGI middleware: requests carrying HTTP basic credentials ``user``/``password``
    (RFC 7617, UTF-8) go to ``app``; any other gets ``401`` with
    ``WWW-Authenticate: Basic realm="kombu_pgmq"``. User and password are both compared,
    in constant time (``hmac.compare_digest``), whichever is wrong.

    Raises:
        ConfigurationError: ``user`` is empty or holds ``:``, or ``password`` is empty.
    """

    def __init__(self, app: WsgiApp, user: str, password: str) -> None:
        if not user or ":" in user:
            raise ConfigurationError(
                f"basic auth user {user!r}: give a non-empty user name without ':' (RFC 7617)"
            )
        if not password:
            raise ConfigurationError("basic auth password is empty: give a non-empty password")
        self._app = app
        self._user = user.encode()
        self._password = password.encode()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        user, password = _credentials(environ.get("HTTP_AUTHORIZATION", ""))
        user_ok = hmac.compare_digest(user, self._user)
        password_ok = hmac.compare_digest(password, self._password)
        if user_ok and password_ok:
            return self._app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("WWW-Authenticate", f'Basic realm="{REALM}", charset="UTF-8"'),
            ],
        )
        return [b"401 Unauthorized: give the basic auth user and password of this exporter\n"]


def _credentials(header: str) -> tuple[bytes, bytes]:
    """``"Basic dTpw"`` -> ``(b"u", b"p")``; anything else -> ``(b"", b"")``."""
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return b"", b""
    try:
        decoded = base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):  # not base64, or not ASCII
        return b"", b""
    user, colon, password = decoded.partition(b":")
    return (user, password) if colon else (b"", b"")


def tls_context(certfile: str, keyfile: str, client_cafile: str | None = None) -> ssl.SSLContext:
    """A server-side TLS context (TLS 1.2 or newer) with the PEM certificate (chain)
    ``certfile`` and its unencrypted PEM key ``keyfile``; with ``client_cafile`` (PEM CA
    certificates), clients must present a certificate signed by one of them (mutual TLS).

    Raises:
        ConfigurationError: a file is missing or unreadable, not PEM, the key does not
            match the certificate or is encrypted (the message names the file, and the
            parameter and option that gave it).
    """

    def encrypted() -> str:
        raise ConfigurationError(
            f"TLS key {keyfile!r} (--tls-key, keyfile=) is encrypted: give an unencrypted "
            f"key (openssl pkey -in {keyfile} -out plain.key), readable by this user only"
        )

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(certfile, keyfile, password=encrypted)
    except OSError as exc:  # ssl.SSLError too
        raise ConfigurationError(
            f"cannot load TLS certificate {certfile!r} (--tls-cert, certfile=) with key "
            f"{keyfile!r} (--tls-key, keyfile=): {exc.strerror or exc}; give PEM files, "
            "the key matching the certificate"
        ) from None
    if client_cafile is not None:
        try:
            context.load_verify_locations(cafile=client_cafile)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot load client CA certificates {client_cafile!r} (--tls-client-ca, "
                f"client_cafile=): {exc.strerror or exc}; give a PEM file of the CA that "
                "signs the scrapers' certificates"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def bound(server: WSGIServer) -> tuple[str, int]:
    """``(address, port)`` the server listens on (``port`` 0 asked: the one chosen)."""
    address, port = server.server_address[:2]
    return (address if isinstance(address, str) else address.decode()), int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address as bound) is a loopback address."""
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


class _Handler(WSGIRequestHandler):
    timeout = CLIENT_TIMEOUT_SECONDS  # socketserver applies it to the connection

    def setup(self) -> None:
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()  # here, in this request's thread

    def log_message(self, format: str, *args: Any) -> None:
        """No access log (as prometheus-client's server)."""


class _Server(ThreadingWSGIServer):
    #: listen() backlog (socketserver's default, 5, drops the SYNs of a sixth scraper
    #: connecting at once: its retry comes a second later).
    request_queue_size = 64
    on_close: Callable[[], None] | None = None

    def server_close(self) -> None:
        """Close the listening socket, then run ``on_close`` (e.g. close the database)."""
        super().server_close()
        if self.on_close is not None:
            self.on_close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A failed request (TLS handshake, timeout, client gone) is one log line at
        INFO, not a traceback on stderr."""
        error = sys.exc_info()[1]
        logger.info("kombu_pgmq metrics: request from %s failed: %r", client_address, error)


def start(
    app: WsgiApp,
    host: str,
    port: int,
    tls: ssl.SSLContext | None = None,
    on_close: Callable[[], None] | None = None,
) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``app`` on ``host:port`` (IPv4 or IPv6, as ``host`` resolves) from a daemon
    thread; returns ``(server, thread)``: :func:`bound` gives the address (``port`` 0: a
    free one), ``server.shutdown()`` stops serving, then ``server.server_close()`` closes
    the socket and calls ``on_close``.

    Raises:
        OSError: ``host`` does not resolve or is not an address of this machine, or the
            port is taken (``errno.EADDRINUSE``).
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    class Server(_Server):
        address_family = family

    server = Server((str(sockaddr[0]), port), _Handler)  # what wsgiref's make_server does
    server.set_app(app)
    server.on_close = on_close
    if tls is not None:
        server.socket = tls.wrap_socket(
            server.socket, server_side=True, do_handshake_on_connect=False
        )
    thread = threading.Thread(target=server.serve_forever, name="kombu_pgmq-metrics", daemon=True)
    thread.start()
    return server, thread
