"""Reading the planner's JSON inputs with errors that name the argument they came from."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["read_json"]


def read_json(path: str, argument: str) -> Any:
    """json.load(open(path)); a file that cannot be read or is not JSON raises ValueError naming
    `argument` (the option or parameter the path was given as) and the reason."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as err:
        raise ValueError(f"{argument}: cannot read {path!r} ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{argument}: {path!r} is not JSON ({err})") from None
