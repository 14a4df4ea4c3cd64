"""Deprecated import path: safetensors in and out live in `oases.storage` (with checkpoints, one
package). Its names still work here for one release, each warning on use:

    from oases.pretrained import load_pretrained   # DeprecationWarning: use oases.storage.load_pretrained
    from oases.storage import load_pretrained      # (or oases.load_pretrained, as before)
"""

from __future__ import annotations

from oases import storage as _storage
from oases._deprecated import renamed as _renamed

__all__: list[str] = []  # the names below warn: nothing new is to be imported from here

_NAMES = "load_pretrained save_pretrained save_adapter".split()

__getattr__ = _renamed(__name__, {name: name for name in _NAMES}, vars(_storage), public="oases.storage")
