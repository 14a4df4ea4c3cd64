"""The keys of an on-disk checkpoint (torch.distributed.checkpoint entries): the model's, the
optimizer's and the run's."""

from __future__ import annotations

_MODEL = "model."  # model.<state-dict key>: the unsharded model's tensor
_STATE = "optim.state."  # optim.state.<parameter name>.<state name>, e.g. optim.state.lm_head.weight.exp_avg
_MASTER = "optim.master."  # optim.master.<parameter name>: ZeRO's fp32 master of a 16-bit parameter
_GROUPS = "optim.param_groups"  # the optimizer's param_groups, params as parameter names
_EXTRA = "oases.extra"
_RNG = "oases.rng."  # oases.rng.<rank in the group>: that rank's RNG states
