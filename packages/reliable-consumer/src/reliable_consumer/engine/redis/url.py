"""Redis URLs: the options the worker passes with one, and why redis-py would refuse one.

Settings are checked at load (``url_problem``, via ``RedisSettings``) so a bad URL is a
clear error naming the setting, not a crash loop at the first connection. So settings.py
imports this module, and this one names only the options it reads (``ClientOptions``,
which ``RedisSettings`` has), never settings.py.
"""

from __future__ import annotations

import ssl
from typing import Any, Protocol
from urllib.parse import parse_qs, unquote

from redis.exceptions import RedisError


class ClientOptions(Protocol):
    """The settings of a Redis connection besides its URL (``RedisSettings`` has them)."""

    @property
    def socket_timeout_s(self) -> float: ...
    @property
    def max_connections(self) -> int: ...
    @property
    def ssl_ca_certs(self) -> str | None: ...
    @property
    def ssl_certfile(self) -> str | None: ...
    @property
    def ssl_keyfile(self) -> str | None: ...


# Connection options the worker sets itself: a URL query option would silently win over
# them (redis-py lets the query string override keyword arguments), e.g. turn certificate
# checks off or decode replies the scripts expect as bytes.
_WORKER_OWNED_OPTIONS = {
    "decode_responses": "the worker reads replies as bytes",
    "retry_on_timeout": "the worker retries under its own policy",
    "socket_timeout": "use WORKER_REDIS__SOCKET_TIMEOUT_S",
    "socket_connect_timeout": "use WORKER_REDIS__SOCKET_TIMEOUT_S",
    "max_connections": "use WORKER_REDIS__MAX_CONNECTIONS",
    "health_check_interval": "set by the worker",
    "ssl_cert_reqs": "the worker always verifies the server's certificate",
    "ssl_check_hostname": "the worker always checks the server's name",
    "ssl_ca_certs": "use WORKER_REDIS__SSL_CA_CERTS",
    "ssl_certfile": "use WORKER_REDIS__SSL_CERTFILE",
    "ssl_keyfile": "use WORKER_REDIS__SSL_KEYFILE",
}


def client_kwargs(url: str, settings: ClientOptions | None = None) -> dict[str, Any]:
    """What ``make_client`` passes to redis-py besides the URL (defaults without settings)."""
    timeout = settings.socket_timeout_s if settings is not None else 5.0
    kwargs: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "max_connections": settings.max_connections if settings is not None else 32,
        "health_check_interval": 15,
        "retry_on_timeout": False,
        "decode_responses": False,
    }
    if url.startswith("rediss://"):
        # Verify the server's certificate and its name; redis-py 5 did not check names.
        kwargs["ssl_cert_reqs"] = ssl.CERT_REQUIRED
        kwargs["ssl_check_hostname"] = True
        if settings is not None and settings.ssl_ca_certs:
            kwargs["ssl_ca_certs"] = settings.ssl_ca_certs
        if settings is not None and settings.ssl_certfile:
            kwargs["ssl_certfile"] = settings.ssl_certfile
            kwargs["ssl_keyfile"] = settings.ssl_keyfile
    return kwargs


def url_problem(url: str) -> str | None:
    """Why redis-py would refuse this URL at the first connection, or None; never the password.

    redis-py is the judge: its parser and a connection object built (not connected) from
    the URL with the worker's own options, which is where ports, hosts, query options and
    ``ssl_cert_reqs`` are checked. A path that is not a database number (redis-py ignores
    it and uses db 0) and query options that override the worker's own are refused too.
    """
    from redis.asyncio.connection import ConnectionPool

    scheme, _, rest = url.partition("://")
    before_query, _, query = rest.partition("?")
    netloc, _, path = before_query.partition("/")
    try:
        pool = ConnectionPool.from_url(url, **client_kwargs(url))
        pool.make_connection()  # type: ignore[no-untyped-call]
    except (ValueError, TypeError, RedisError) as exc:
        return "not a usable Redis URL: " + _without_secret(str(exc), netloc)
    if scheme != "unix" and path.strip("/") and not path.strip("/").isdigit():
        return "the path must be a database number, e.g. redis://host:6379/0"
    owned = sorted(set(parse_qs(query)) & _WORKER_OWNED_OPTIONS.keys())
    if owned:
        return f"URL option {owned[0]!r} is not allowed: {_WORKER_OWNED_OPTIONS[owned[0]]}"
    return None


def _without_secret(text: str, netloc: str) -> str:
    """``text`` with the URL's user-info (the password, raw and decoded) masked."""
    userinfo = netloc.rpartition("@")[0]
    secrets = {userinfo, userinfo.partition(":")[2]}
    secrets |= {unquote(s) for s in secrets}
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text
