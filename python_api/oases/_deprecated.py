"""Old public names kept as aliases that warn (PEP 562 module `__getattr__`).

::

    __getattr__ = renamed(__name__, {"OldName": "NewName"}, globals(), public="package")
    module.OldName   # DeprecationWarning "module.OldName is deprecated: use package.NewName"; module.NewName
    module.Other     # AttributeError, as without the hook
"""

from __future__ import annotations

import warnings
from types import MappingProxyType
from typing import Any, Callable, Mapping

__all__ = ["renamed"]


def renamed(
    module: str, names: Mapping[str, str], namespace: Mapping[str, Any], public: str = ""
) -> Callable[[str], Any]:
    """A module `__getattr__` that answers each old name in `names` with the object `namespace` holds
    under its new name, warning (it names the new one in `public`, default `module`); any other
    name raises AttributeError."""
    names = MappingProxyType(dict(names))

    def __getattr__(name: str) -> Any:
        new = names.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} is deprecated: use {public or module}.{new}", DeprecationWarning, stacklevel=2)
        return namespace[new]

    return __getattr__
