"""``kombu_pgmq.metrics.serve`` on a real PostgreSQL: it listens on 127.0.0.1
unless told otherwise, serves HTTPS with a certificate made here (openssl) and refuses
plain HTTP then, checks client certificates (mutual TLS), is not stalled by a client that
connects and sends nothing, requires HTTP basic auth, and reads the statistics once per
cache window, once for any number of concurrent scrapes. The beat metrics of a beat
leading in this process, and none (``up`` still 1) without the beat tables or the
privilege. (The command: test_cli_operations.)
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kombu_pgmq import errors
from kombu_pgmq.management import Management
from kombu_pgmq.metrics import serve

from .helpers import connect, publish, sql
from .test_cli_beat import TASK, history, leading_beat, ok


@dataclass(frozen=True)
class Certificates:
    """PEM files: the exporter's self-signed certificate for 127.0.0.1/localhost, a CA
    and a client certificate it signed, a self-signed client certificate (no CA's)."""

    server_cert: Path
    server_key: Path
    ca_cert: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path
    stranger_key: Path


def make_certificates(directory: Path) -> Certificates:
    """Make :class:`Certificates` in ``directory`` with the openssl command (the venv has
    no ``cryptography``); skip, visibly, without it."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates (not found)")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*args: str | Path) -> None:
        subprocess.run(["openssl", *map(str, args)], cwd=directory, check=True, capture_output=True)

    def self_signed(name: str, subject: str, *extra: str) -> None:
        openssl("req", "-x509", *ec, "-keyout", f"{name}.key", "-out", f"{name}.crt",
                "-days", "1", "-subj", subject, *extra)  # fmt: skip

    self_signed("server", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost")
    self_signed("ca", "/CN=kombu_pgmq test CA")
    self_signed("stranger", "/CN=stranger")
    openssl("req", "-new", *ec, "-keyout", "client.key", "-out", "client.csr", "-subj", "/CN=prom")
    openssl("x509", "-req", "-in", "client.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "client.crt", "-days", "1")  # fmt: skip
    d = directory
    return Certificates(
        d / "server.crt", d / "server.key", d / "ca.crt", d / "client.crt", d / "client.key",
        d / "stranger.crt", d / "stranger.key",
    )  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@contextlib.contextmanager
def serving(url: str, **kwargs: Any) -> Iterator[int]:
    """``serve(url, port=0, **kwargs)``; yields the port; stops and closes after."""
    server, _thread, _registry = serve(url, port=0, **kwargs)
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def get(
    url: str,
    *,
    context: ssl.SSLContext | None = None,
    auth: tuple[str, str] | None = None,
    authorization: str | None = None,
) -> tuple[int, Any, str]:
    """GET ``url``: ``(status, headers, body)``, also for 4xx answers."""
    request = urllib.request.Request(url)
    if auth is not None:
        authorization = "Basic " + base64.b64encode(":".join(auth).encode()).decode()
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read().decode()


def value(body: str, name: str, **labels: str) -> float | None:
    """The value of sample ``name{labels}`` in an exposition, ``None`` if absent."""
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


def client_context(certs: Certificates, cert: Path | None = None, key: Path | None = None):
    context = ssl.create_default_context(cafile=str(certs.server_cert))
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context


def non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine other than loopback (the one its default route
    uses), or ``None``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("203.0.113.1", 9))  # UDP: picks a route and source, sends nothing
        except OSError:
            return None
        address = str(s.getsockname()[0])
    return None if address.startswith("127.") else address


def test_listens_on_loopback_only_by_default(db_dsn: str) -> None:
    with connect(db_dsn) as conn:
        publish(conn, "srv_local", [1])
    server, _thread, _registry = serve(db_dsn, port=0)
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        status, _, body = get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and value(body, "kombu_pgmq_up") == 1
        other = non_loopback_ipv4()
        if other is not None:  # this machine's other address: nothing listens there
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((other, port), timeout=5).close()
    finally:
        server.shutdown()
        server.server_close()
    # addr, the old name of host, still works
    with serving(db_dsn, addr="127.0.0.1") as port:
        assert get(f"http://127.0.0.1:{port}/metrics")[0] == 200


def test_https_with_a_self_signed_certificate_and_no_plain_http(
    db_dsn: str, certs: Certificates
) -> None:
    with connect(db_dsn) as conn:
        publish(conn, "srv_tls", [1, 2])
    with serving(db_dsn, certfile=str(certs.server_cert), keyfile=str(certs.server_key)) as port:
        status, _, body = get(f"https://127.0.0.1:{port}/metrics", context=client_context(certs))
        assert status == 200
        assert value(body, "kombu_pgmq_queue_messages", queue="srv_tls", state="ready") == 2
        with pytest.raises((OSError, http.client.HTTPException)):
            get(f"http://127.0.0.1:{port}/metrics")
        # a client that does not trust the certificate gives up
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            get(f"https://127.0.0.1:{port}/metrics", context=ssl.create_default_context())


def test_mutual_tls_admits_only_certificates_of_the_client_ca(
    db_dsn: str, certs: Certificates
) -> None:
    with serving(
        db_dsn,
        certfile=str(certs.server_cert),
        keyfile=str(certs.server_key),
        client_cafile=str(certs.ca_cert),
    ) as port:
        url = f"https://127.0.0.1:{port}/metrics"
        signed = client_context(certs, certs.client_cert, certs.client_key)
        assert get(url, context=signed)[0] == 200
        for refused in (
            client_context(certs),  # no client certificate
            client_context(certs, certs.stranger_cert, certs.stranger_key),  # not the CA's
        ):
            with pytest.raises((OSError, http.client.HTTPException)):
                get(url, context=refused)


def test_a_client_that_sends_nothing_stalls_no_https_scrape(
    db_dsn: str, certs: Certificates
) -> None:
    """prometheus-client's own TLS server does the handshake in its accept loop: there
    the scrape below times out."""
    tls = {"certfile": str(certs.server_cert), "keyfile": str(certs.server_key)}
    with serving(db_dsn, **tls) as port, socket.create_connection(("127.0.0.1", port), timeout=5):
        time.sleep(0.2)  # connected, sending nothing
        started = time.monotonic()
        status, _, _ = get(f"https://127.0.0.1:{port}/metrics", context=client_context(certs))
        assert status == 200 and time.monotonic() - started < 5


def test_basic_auth_answers_401_unless_the_credentials_match(db_dsn: str) -> None:
    with serving(db_dsn, basic_auth=("prometheus", "s3cret pässword")) as port:
        url = f"http://127.0.0.1:{port}/metrics"
        for attempt in (
            {},
            {"auth": ("prometheus", "wrong")},
            {"auth": ("someone", "s3cret pässword")},
            {"auth": ("prometheus", "s3cret pässword!")},
            {"authorization": "Basic not-base64!"},
            {"authorization": "Bearer s3cret"},
        ):
            status, headers, body = get(url, **attempt)
            assert status == 401, attempt
            assert headers["WWW-Authenticate"] == 'Basic realm="kombu_pgmq", charset="UTF-8"'
            assert "kombu_pgmq_up" not in body
        status, _, body = get(url, auth=("prometheus", "s3cret pässword"))
        assert status == 200 and value(body, "kombu_pgmq_up") == 1


def test_bad_tls_or_auth_settings_raise_configuration_errors(
    db_dsn: str, certs: Certificates, tmp_path: Path
) -> None:
    cert, key = str(certs.server_cert), str(certs.server_key)
    with pytest.raises(errors.ConfigurationError, match="certfile and keyfile go together"):
        serve(db_dsn, port=0, certfile=cert)
    with pytest.raises(errors.ConfigurationError, match="client_cafile"):
        serve(db_dsn, port=0, client_cafile=str(certs.ca_cert))
    with pytest.raises(errors.ConfigurationError, match="key matching the certificate"):
        serve(db_dsn, port=0, certfile=cert, keyfile=str(certs.client_key))
    with pytest.raises(errors.ConfigurationError, match="--tls-client-ca"):
        serve(db_dsn, port=0, certfile=cert, keyfile=key, client_cafile=key)
    encrypted = tmp_path / "encrypted.key"
    subprocess.run(
        ["openssl", "pkey", "-in", key, "-aes256", "-passout", "pass:x", "-out", str(encrypted)],
        check=True,
    )
    with pytest.raises(errors.ConfigurationError, match="is encrypted"):
        serve(db_dsn, port=0, certfile=cert, keyfile=str(encrypted))
    with pytest.raises(errors.ConfigurationError, match="password is empty"):
        serve(db_dsn, port=0, basic_auth=("prometheus", ""))
    with pytest.raises(errors.ConfigurationError, match="without ':'"):
        serve(db_dsn, port=0, basic_auth=("a:b", "pw"))
    with pytest.raises(errors.ConfigurationError, match="cache_seconds"):
        serve(db_dsn, port=0, cache_seconds=-1)


def _with_application_name(url: str, name: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}application_name={name}"


def _last_statement(url: str, application_name: str) -> tuple[Any, str]:
    """``(query_start, query)`` of the exporter's session, from pg_stat_activity."""
    rows = sql(
        url,
        "SELECT query_start, query FROM pg_stat_activity WHERE application_name = %s",
        (application_name,),
    )
    assert len(rows) == 1, rows
    return rows[0][0], rows[0][1]


def test_a_snapshot_is_served_again_within_cache_seconds(db_dsn: str) -> None:
    """Two scrapes within the window: one statement (the session's last statement
    stays the same, in pg_stat_activity), a queue declared in between is not seen; a
    scrape after the window runs a new statement and sees it."""
    name = f"kombu_pgmq_cache_{uuid.uuid4().hex[:8]}"
    cache_seconds = 3.0
    with connect(db_dsn) as conn:
        publish(conn, "srv_cache_a", [1])
    with serving(_with_application_name(db_dsn, name), cache_seconds=cache_seconds) as port:
        url = f"http://127.0.0.1:{port}/metrics"
        first_at = time.monotonic()
        first = get(url)[2]
        statement = _last_statement(db_dsn, name)
        # a scrape's last statement: the beat entries (after the queues' statistics, the
        # results' counts and the beat leader)
        assert "beat_list" in statement[1], statement
        assert value(first, "kombu_pgmq_queue_messages", queue="srv_cache_a", state="ready") == 1
        with connect(db_dsn) as conn:
            publish(conn, "srv_cache_b", [1, 2])
        time.sleep(0.2)
        second = get(url)[2]
        assert time.monotonic() - first_at < cache_seconds, "too slow to test the cache"
        assert _last_statement(db_dsn, name) == statement  # no statement ran
        assert (
            value(second, "kombu_pgmq_queue_messages", queue="srv_cache_b", state="ready") is None
        )
        assert value(second, "kombu_pgmq_scrape_age_seconds") >= 0.2
        assert value(second, "kombu_pgmq_scrape_duration_seconds") == value(
            first, "kombu_pgmq_scrape_duration_seconds"
        )
        time.sleep(max(0.0, first_at + cache_seconds + 0.1 - time.monotonic()))
        third = get(url)[2]
        assert _last_statement(db_dsn, name)[0] > statement[0]  # a new statement
        assert value(third, "kombu_pgmq_queue_messages", queue="srv_cache_b", state="ready") == 2
        assert value(third, "kombu_pgmq_scrape_age_seconds") < cache_seconds


def test_concurrent_scrapes_share_one_read(db_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight scrapes at once, no cache (``cache_seconds=0``): the statistics are read
    once (counted around Management.queues, slowed to 1 s so the scrapes overlap) and
    every scrape serves that snapshot."""
    calls = []
    original = Management.queues

    def slow_queues(self: Management, **kwargs: Any) -> Any:
        calls.append(time.monotonic())
        time.sleep(1.0)
        return original(self, **kwargs)

    monkeypatch.setattr(Management, "queues", slow_queues)
    with serving(db_dsn, cache_seconds=0) as port:
        barrier = threading.Barrier(8)
        bodies: list[str] = []

        def scrape() -> None:
            barrier.wait()
            status, _, body = get(f"http://127.0.0.1:{port}/metrics")
            assert status == 200
            bodies.append(body)

        threads = [threading.Thread(target=scrape) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(bodies) == 8
        assert len(calls) == 1, calls
        durations = {value(body, "kombu_pgmq_scrape_duration_seconds") for body in bodies}
        assert len(durations) == 1 and durations.pop() >= 1.0
        get(f"http://127.0.0.1:{port}/metrics")  # a later scrape: a new read (no cache)
        assert len(calls) == 2


def beat_samples(body: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(name, labels): value}`` of the ``kombu_pgmq_beat_*`` samples of an exposition."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): float(sample.value)
        for family in text_string_to_metric_families(body)
        for sample in family.samples
        if sample.name.startswith("kombu_pgmq_beat_")
    }


def test_beat_metrics_of_a_leading_beat_then_of_a_gone_one(db_dsn: str) -> None:
    ok("add", "--url", db_dsn, "every-second", TASK, "--every", "1")
    ok("add", "--url", db_dsn, "late", TASK, "--every", "1")
    ok("add", "--url", db_dsn, "unknown", "beatcli.missing", "--every", "1")
    ok("add", "--url", db_dsn, "off", TASK, "--every", "60", "--disabled")
    sql(
        db_dsn,
        "UPDATE kombu_pgmq.beat_entries SET last_run_at = clock_timestamp() - interval '8.5 s'"
        " WHERE name = 'late'",
    )
    with serving(db_dsn, cache_seconds=0) as port:
        url = f"http://127.0.0.1:{port}/metrics"
        before = get(url)[2]
        assert value(before, "kombu_pgmq_up") == 1
        found = beat_samples(before)
        # no beat ever led: no leader sample; entries not run yet: no last/next run
        assert not [k for k in found if k[0].startswith("kombu_pgmq_beat_leader")], found
        assert value(before, "kombu_pgmq_beat_runs_total", entry="every-second") == 0
        last_run = "kombu_pgmq_beat_last_run_timestamp_seconds"
        assert value(before, last_run, entry="every-second") is None
        assert value(before, last_run, entry="late") == pytest.approx(time.time() - 8.5, abs=5)
        assert value(before, "kombu_pgmq_beat_next_run_timestamp_seconds", entry="off") is None

        with leading_beat(db_dsn) as beat:
            beat.run_until(lambda: len(history(db_dsn, "every-second")) >= 2)
            last_tick = history(db_dsn, "every-second")[0]
            body = get(url)[2]
            me = beat.identity
            assert value(body, "kombu_pgmq_beat_leader", identity=me) == 1
            age = value(body, "kombu_pgmq_beat_leader_heartbeat_age_seconds")
            assert age is not None and 0 <= age < 5
            runs = value(body, "kombu_pgmq_beat_runs_total", entry="every-second")
            assert runs is not None and runs >= 2
            last = value(body, "kombu_pgmq_beat_last_run_timestamp_seconds", entry="every-second")
            due = datetime.fromisoformat(last_tick["due_at"]).timestamp()
            assert last == pytest.approx(due, abs=1e-3)
            following = value(
                body, "kombu_pgmq_beat_next_run_timestamp_seconds", entry="every-second"
            )
            assert following is not None and following > due
            late = history(db_dsn, "late")
            missed = value(body, "kombu_pgmq_beat_missed_ticks_total", entry="late")
            assert missed == sum(t["missed"] for t in late) and missed >= 4
            assert value(body, "kombu_pgmq_beat_missed_ticks_total", entry="every-second") == 0
            assert value(body, "kombu_pgmq_beat_entry_error", entry="unknown") == 1
            assert value(body, "kombu_pgmq_beat_runs_total", entry="unknown") == 0
            assert value(body, "kombu_pgmq_beat_entry_error", entry="every-second") == 0
            assert value(body, "kombu_pgmq_beat_entry_enabled", entry="off") == 0
            assert value(body, "kombu_pgmq_beat_entry_enabled", entry="late") == 1
        gone = get(url)[2]  # the beat stopped: its record stays, not alive
        assert value(gone, "kombu_pgmq_beat_leader", identity=me) == 0
        assert value(gone, "kombu_pgmq_up") == 1


def test_no_beat_metrics_without_the_tables_or_the_privilege(
    db_dsn: str, least_privilege_db: Any
) -> None:
    from psycopg import sql as pgsql

    sql(db_dsn, "DROP FUNCTION kombu_pgmq.beat_list()")  # a schema without beat
    lp = least_privilege_db
    ok("add", "--url", lp.producer_url, "tick", TASK, "--every", "30")  # a producer may
    with serving(lp.producer_url, cache_seconds=0) as port:
        body = get(f"http://127.0.0.1:{port}/metrics")[2]
        assert value(body, "kombu_pgmq_beat_runs_total", entry="tick") == 0
    for function in ("beat_list()", "beat_leader_info()"):
        revoke = f"REVOKE EXECUTE ON FUNCTION kombu_pgmq.{function} FROM {{}}"
        sql(lp.owner_url, pgsql.SQL(revoke).format(pgsql.Identifier(lp.producer)))
    for url in (db_dsn, lp.producer_url):
        with serving(url, cache_seconds=0) as port:
            first, again = (get(f"http://127.0.0.1:{port}/metrics")[2] for _ in range(2))
        for body in (first, again):
            assert value(body, "kombu_pgmq_up") == 1, url
            assert beat_samples(body) == {}, url
