"""The keys of an on-disk checkpoint (torch.distributed.checkpoint entries): the model's, the
optimizer's and the run's, and the format they are written in.

    model.<key>                          the unsharded model's tensor (MODEL + state-dict key)
    optim.state.<param name>.<state>     e.g. optim.state.lm_head.weight.exp_avg (STATE)
    optim.master.<param name>            ZeRO's fp32 master of a 16-bit parameter (MASTER)
    optim.param_groups                   the optimizer's param_groups, params as parameter names (GROUPS)
    oases.extra                          what save_checkpoint was given as `extra` (EXTRA)
    oases.rng.<rank in the group>        that rank's RNG states (RNG)
    oases.format                         FORMAT_VERSION; absent in checkpoints of older oases (FORMAT_KEY)
"""

from __future__ import annotations

__all__ = ["MODEL", "STATE", "MASTER", "GROUPS", "EXTRA", "RNG", "FORMAT_KEY", "FORMAT_VERSION"]

MODEL = "model."
STATE = "optim.state."
MASTER = "optim.master."
GROUPS = "optim.param_groups"
EXTRA = "oases.extra"
RNG = "oases.rng."
FORMAT_KEY = "oases.format"  # a DCP entry every checkpoint of this format holds (absent in older ones)
FORMAT_VERSION = 1
