"""Old public names kept as aliases that warn (PEP 562 module `__getattr__`).

::

    __getattr__ = renamed(__name__, {"OldName": "NewName"}, globals())
    module.OldName   # DeprecationWarning "module.OldName is deprecated: use module.NewName"; module.NewName
    module.Other     # AttributeError, as without the hook
"""

from __future__ import annotations

import warnings
from types import MappingProxyType
from typing import Any, Callable, Mapping

__all__ = ["renamed"]


def renamed(module: str, names: Mapping[str, str], namespace: Mapping[str, Any]) -> Callable[[str], Any]:
    """A module `__getattr__` that answers each old name in `names` with the object `namespace` holds
    under its new name, warning; any other name raises AttributeError."""
    names = MappingProxyType(dict(names))

    def __getattr__(name: str) -> Any:
        new = names.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} is deprecated: use {module}.{new}", DeprecationWarning, stacklevel=2)
        return namespace[new]

    return __getattr__
