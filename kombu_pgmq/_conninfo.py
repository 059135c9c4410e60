"""Broker URL and connection parameters.

Accepted URLs (the scheme picks this transport once ``kombu_pgmq`` is imported):

* ``postgresql://user:password@host:5432/dbname?sslmode=require&application_name=w1``
* ``postgres://...`` (as in a ``DATABASE_URL``)
* ``pgmq+postgresql://...`` is *not* registered: kombu's own ``pgmq`` alias stays kombu's.

Everything in the query string is passed to libpq (``sslmode``, ``application_name``,
``connect_timeout``, ``host=/socket/dir``, ``options``, ...), so any libpq keyword works.
Percent-encoded user names and passwords are decoded (``p%40ss`` is ``p@ss``).
Passwords never appear in :func:`redact` output, in logs or in ``repr``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .errors import ConfigurationError

#: URL schemes this transport registers with kombu.
SCHEMES = ("postgresql", "postgres")
_DEFAULT_APPLICATION_NAME = "kombu_pgmq"
DEFAULT_PORT = 5432


def url_to_params(url: str) -> dict[str, Any]:
    """Parse a broker URL into libpq keyword parameters.

    Shapes: ``"postgresql://u:p@h:5432/db?k=v" -> {"user": "u", "password": "p",
    "host": "h", "port": "5432", "dbname": "db", "k": "v"}``. Keys absent from the URL
    are absent from the result (libpq then uses its defaults and ``PG*`` variables).

    Raises:
        ConfigurationError: the scheme is not ``postgresql``/``postgres`` or the URL
        cannot be parsed (the message shows the URL with the password masked).
    """
    hosts = _multi_host(url)
    if hosts is not None:  # postgresql://u@a:5432,b:5433/db (libpq's multi-host form)
        url = url.replace(hosts[0], "placeholder", 1)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigurationError(
            f"cannot parse broker URL {redact(url)!r}: {exc}; expected "
            "postgresql://user:password@host:5432/dbname"
        ) from None
    scheme = parts.scheme.split("+")[-1]
    if scheme not in SCHEMES:
        raise ConfigurationError(
            f"broker URL {redact(url)!r} has scheme {parts.scheme!r}; kombu_pgmq takes "
            "postgresql:// or postgres://"
        )
    params: dict[str, Any] = {}
    if hosts is not None:
        params["host"], ports = hosts[1], hosts[2]
        if ports:
            params["port"] = ports
    elif parts.hostname:
        # urlsplit lower-cases hostname; keep the original spelling for socket paths.
        host = parts.netloc.rpartition("@")[2]
        host = host[1 : host.index("]")] if host.startswith("[") else host.split(":")[0]
        params["host"] = unquote(host)
    if port is not None:
        params["port"] = str(port)
    if parts.username:
        params["user"] = unquote(parts.username)
    if parts.password:
        params["password"] = unquote(parts.password)
    dbname = unquote(parts.path.lstrip("/"))
    if dbname:
        params["dbname"] = dbname
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        params[key] = value
    return params


def is_ours(url: Any, transport: Any = None) -> bool:
    """True if a broker (``url``: a URL, kombu's ``url1;url2``, or a list of URLs;
    ``transport``: Celery's ``broker_transport``) is this transport's: a scheme it
    registers, or a ``broker_transport`` naming ``kombu_pgmq``."""
    if transport and "kombu_pgmq" in str(transport):
        return True
    first = url[0] if isinstance(url, (list, tuple)) and url else url
    if not isinstance(first, str) or "://" not in first:
        return False
    return first.split(";", 1)[0].partition("://")[0].split("+")[-1] in SCHEMES


def failover_params(urls: Sequence[str]) -> dict[str, Any]:
    """Fold kombu's failover list (``url1;url2``, ``Connection(alternates=...)``) into
    one libpq multi-host parameter set: ``host`` and ``port`` become comma lists in the
    order given (libpq tries them in turn on every connect) and
    ``target_session_attrs=read-write`` picks the primary (see :func:`make_dsn`).

    kombu's own switching (``Connection.switch``) re-parses the next URL generically and
    passes its libpq query parameters (``host=``, ``sslmode=``) to
    ``Connection._init_params``, which fails; and a URL without them would silently lose
    ``sslmode``. libpq's failover needs neither.

    Shapes: ``["postgresql://u@a:5432/db?sslmode=require", "postgresql://u@b/db?sslmode=require"]
    -> {"user": "u", "dbname": "db", "sslmode": "require", "host": "a,b",
    "port": "5432,5432"}``.

    Raises:
        ConfigurationError: a URL cannot be parsed, or the URLs differ in anything but
            host and port (user, password, database, libpq parameters: one connection
            string cannot express that); the message names the parameters.
    """
    hosts: list[str] = []
    ports: list[str] = []
    common: dict[str, Any] | None = None
    for url in urls:
        params = url_to_params(url)
        url_hosts = str(params.pop("host", "") or "").split(",")
        url_ports = str(params.pop("port", "") or "").split(",")
        if len(url_ports) == 1:
            url_ports = url_ports * len(url_hosts)
        hosts += url_hosts
        ports += url_ports
        if common is None:
            common = params
        elif params != common:
            differ = sorted(k for k in {*params, *common} if params.get(k) != common.get(k))
            raise ConfigurationError(
                f"failover URLs {' ; '.join(redact(u) for u in urls)} differ in "
                f"{', '.join(differ)}: they may differ only in host and port (kombu_pgmq "
                "folds them into one libpq connection string); or list every host in one "
                "URL: postgresql://user@host1:5432,host2:5432/dbname"
            )
    params = dict(common or {})
    params["host"] = ",".join(hosts)
    if any(ports):
        params["port"] = ",".join(port or str(DEFAULT_PORT) for port in ports)
    return params


def _multi_host(url: str) -> tuple[str, str, str] | None:
    """``(netloc host part, "a,b", "5432,5433")`` of a URL listing several hosts in its
    authority, else None."""
    rest = url.split("://", 1)[-1]
    authority = rest.split("/", 1)[0].split("?", 1)[0]
    hostports = authority.rpartition("@")[2]
    if "," not in hostports:
        return None
    hosts, ports = [], []
    for item in hostports.split(","):
        host, _, port = item.partition(":") if not item.startswith("[") else item.partition("]:")
        hosts.append(unquote(host.strip("[]")))
        ports.append(port)
    return hostports, ",".join(hosts), ",".join(ports) if any(ports) else ""


def make_dsn(params: Mapping[str, Any]) -> str:
    """Return a libpq ``key=value`` connection string (with ``application_name``; with
    ``target_session_attrs=read-write`` when several hosts are listed, unless given).

    Raises:
        ConfigurationError: libpq rejects a parameter (the message names it).
    """
    merged = {"application_name": _DEFAULT_APPLICATION_NAME, **params}
    if "," in str(merged.get("host") or "") and "target_session_attrs" not in merged:
        # several hosts (a primary and standbys): connect to the one that takes writes
        merged["target_session_attrs"] = "read-write"
    merged = {k: v for k, v in merged.items() if v is not None and v != ""}
    try:
        return make_conninfo("", **merged)
    except Exception as exc:  # psycopg.ProgrammingError: invalid keyword
        raise ConfigurationError(
            f"invalid connection parameter in {sorted(merged)}: {exc}; see libpq's "
            "'Parameter Key Words' for valid names"
        ) from None


def redact(url_or_dsn: str) -> str:
    """Return *url_or_dsn* with its password replaced by ``**`` (for logs and errors)."""
    if "://" in url_or_dsn:
        try:
            parts = urlsplit(url_or_dsn)
        except ValueError:
            return "<unparseable URL>"
        query = "&".join(
            f"{k}=**" if k == "password" else f"{k}={quote(v, safe='/')}"
            for k, v in parse_qsl(parts.query, keep_blank_values=True)
        )
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, hostport = netloc.rpartition("@")
            user = userinfo.split(":", 1)[0]
            netloc = f"{user}:**@{hostport}" if ":" in userinfo else f"{user}@{hostport}"
        return parts._replace(netloc=netloc, query=query).geturl()
    try:
        params = conninfo_to_dict(url_or_dsn)
    except Exception:
        return "<unparseable connection string>"
    if "password" in params:
        params["password"] = "**"
    return " ".join(f"{k}={v}" for k, v in params.items())


def to_dsn(url_or_dsn: str) -> str:
    """A broker URL (``postgresql://...``) or a libpq ``key=value`` string -> a libpq
    connection string."""
    if "://" in url_or_dsn:
        return make_dsn(url_to_params(url_or_dsn))
    return url_or_dsn
