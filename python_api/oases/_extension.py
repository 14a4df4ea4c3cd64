"""Lazy access to the compiled extension `oases._C`.

`import oases` never needs the extension; the first use of a compiled feature does, and gets a
clear message if it was not built.
"""

from __future__ import annotations

import functools
from types import ModuleType


@functools.lru_cache(maxsize=None)
def compiled() -> ModuleType:
    """Return `oases._C`, or raise ImportError saying how to build it."""
    import torch  # noqa: F401  (libc10 must be loaded before the extension)

    try:
        from oases import _C
    except ImportError as err:
        raise ImportError(
            "oases._C (the compiled extension) is not built: run "
            "`pip install --no-build-isolation -e .` in the Oases checkout "
            "(or `make setup`), then retry"
        ) from err
    return _C


def is_available() -> bool:
    """True when `oases._C` imports."""
    try:
        compiled()
    except ImportError:
        return False
    return True
