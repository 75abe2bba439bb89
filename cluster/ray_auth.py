"""Ray token authentication (Ray >= 2.52): one rule for every entry point of the project.

A Ray head started by `ray start --head` turns token authentication on when a token exists
(`RAY_AUTH_TOKEN`, the file `RAY_AUTH_TOKEN_PATH` names, or `~/.ray/auth_token`), and a local
`ray.init()` turns it on by default, writing `~/.ray/auth_token` when there is none. Clients
only send the token when `RAY_AUTH_MODE=token` is set in their environment, so a plain
`ray job submit` to such a head gets `401 Unauthorized`. `enable_token_auth_if_available`
applies the head's rule on the client side: with a token at hand and no explicit
`RAY_AUTH_MODE`, it sets `RAY_AUTH_MODE=token` for this process and the processes it starts.
"""

from __future__ import annotations

import os
from pathlib import Path

AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"


def token_path() -> Path:
    """Where Ray reads the token file from."""
    return Path(os.environ.get(TOKEN_PATH_ENV) or Path.home() / ".ray" / "auth_token")


def token_available() -> bool:
    """Whether a token is set in the environment or stored in the token file."""
    if os.environ.get(TOKEN_ENV):
        return True
    path = token_path()
    return path.is_file() and bool(path.read_text().strip())


def enable_token_auth_if_available() -> bool:
    """Set `RAY_AUTH_MODE=token` when a token exists and no mode was chosen; whether it is on.

    Call before anything imports and connects Ray (the mode is read once per process).
    """
    mode = os.environ.get(AUTH_MODE_ENV)
    if mode is not None:
        return mode.lower() == "token"
    if not token_available():
        return False
    os.environ[AUTH_MODE_ENV] = "token"
    return True
