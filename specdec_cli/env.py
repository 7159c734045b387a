"""What the commands share: the default coordinator port, flag defaults from the environment."""

from __future__ import annotations

import os
from typing import Any

DEFAULT_PORT = 50051
DEFAULT_HTTP_PORT = 8000  # `specdec up`'s OpenAI-compatible HTTP API


def env_default(command: str, flag: str, default: Any) -> Any:
    """The default of a non-service flag: SPECDEC_<COMMAND>_<FLAG> if set."""
    value = os.environ.get(f"SPECDEC_{command.upper()}_{flag.upper()}")
    if value is None:
        return default
    return type(default)(value) if default is not None and not isinstance(default, bool) else value
