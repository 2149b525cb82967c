"""Who may act: the console's token, typed into every action form, and the actor's name.

The token travels only in a POST body the operator typed it into, so it doubles as CSRF
protection: another site can make a browser send the form, never know the token. Compared
in constant time. Without a configured token every action is refused.
"""

from __future__ import annotations

import hmac

from pydantic import SecretStr

READ_ONLY = "console is read-only: set WORKER_CONSOLE__TOKEN"
WRONG_TOKEN = "wrong or missing token: nothing was moved"
NO_ACTOR = "say who you are: the actor field is required"
MAX_ACTOR = 200


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
    expected = configured.get_secret_value().encode()
    if not typed or not hmac.compare_digest(typed.encode(), expected):
        raise Refusal(403, WRONG_TOKEN)
    name = " ".join((actor or "").split())
    if not name:
        raise Refusal(400, NO_ACTOR)
    return name[:MAX_ACTOR]
