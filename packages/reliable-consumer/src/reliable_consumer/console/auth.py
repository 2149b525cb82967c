"""Who may act, and who may see record content: the console's token, in constant time.

Acting: the token is typed into every action form, with the actor's name. It travels only
in a POST body the operator typed it into, so it doubles as CSRF protection: another
site can make a browser send the form, never know the token. Without a configured token
every action is refused.

Seeing values, headers and keys as recorded (otherwise redacted, ``privacy.py``): the
token holder signs in once (``/login``, the token in a POST body) and gets a session
cookie (HttpOnly, SameSite=Strict, Secure over HTTPS) holding an expiry and an HMAC of
it keyed by the token, never the token itself: changing the token ends every session.
A script sends ``Authorization: Bearer <token>`` instead. The token never goes in a URL
(URLs end up in logs and histories).
"""

from __future__ import annotations

import hashlib
import hmac
import time

from pydantic import SecretStr

READ_ONLY = "console is read-only: set WORKER_CONSOLE__TOKEN"
WRONG_TOKEN = "wrong or missing token: nothing was moved"
NOT_SIGNED_IN = "wrong or missing token: not signed in"
NO_ACTOR = "say who you are: the actor field is required"
MAX_ACTOR = 200
SESSION_COOKIE = "console_session"
SESSION_S = 8 * 3600  # a working day; signing in again costs one form
_SESSION_KEY_LABEL = b"console view session v1"


class Refusal(Exception):
    """An action refused before it touched anything: the HTTP status and the reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def authorize(configured: SecretStr | None, typed: str | None, actor: str | None) -> str:
    """The actor's name when the typed token is the configured one; else ``Refusal``."""
    if configured is None:
        raise Refusal(403, READ_ONLY)
    if not token_matches(configured, typed):
        raise Refusal(403, WRONG_TOKEN)
    name = " ".join((actor or "").split())
    if not name:
        raise Refusal(400, NO_ACTOR)
    return name[:MAX_ACTOR]


def token_matches(configured: SecretStr | None, typed: str | None) -> bool:
    """Whether ``typed`` is the configured token (False when none is configured)."""
    if configured is None or not typed:
        return False
    return hmac.compare_digest(typed.encode(), configured.get_secret_value().encode())


def session_value(configured: SecretStr, now_s: float | None = None) -> str:
    """A new session cookie's value: ``<expiry>.<HMAC of it keyed by the token>``."""
    expires = int((time.time() if now_s is None else now_s) + SESSION_S)
    return f"{expires}.{_session_mac(configured, expires)}"


def session_valid(
    configured: SecretStr | None, value: str | None, now_s: float | None = None
) -> bool:
    """Whether a session cookie was made with this token and has not expired."""
    if configured is None or not value:
        return False
    expires_text, _, mac = value.partition(".")
    if not expires_text.isdigit():
        return False
    expires = int(expires_text)
    if expires < (time.time() if now_s is None else now_s):
        return False
    return hmac.compare_digest(mac.encode(), _session_mac(configured, expires).encode())


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, if that is what it is."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _session_mac(configured: SecretStr, expires: int) -> str:
    key = hmac.new(configured.get_secret_value().encode(), _SESSION_KEY_LABEL, hashlib.sha256)
    return hmac.new(key.digest(), b"view:%d" % expires, hashlib.sha256).hexdigest()
