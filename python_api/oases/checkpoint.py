"""Deprecated import path: checkpoints live in `oases.storage` (with safetensors in and out, one
package). Its names still work here for one release, each warning on use:

    from oases.checkpoint import save_checkpoint   # DeprecationWarning: use oases.storage.save_checkpoint
    from oases.storage import save_checkpoint      # (or oases.save_checkpoint, as before)
"""

from __future__ import annotations

from oases import storage as _storage
from oases._deprecated import renamed as _renamed

__all__: list[str] = []  # the names below warn: nothing new is to be imported from here

_NAMES = (
    "full_state_dict load_full_state_dict save_checkpoint load_checkpoint verify_checkpoint CheckpointState".split()
)

__getattr__ = _renamed(__name__, {name: name for name in _NAMES}, vars(_storage), public="oases.storage")
