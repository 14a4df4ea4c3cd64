"""Tensor-parallel modules over `oases.ops`, and `parallelize` to shard an existing model.

::

    ColumnParallelLinear          output features sharded (weight [out/p, in])
    RowParallelLinear             input features sharded, output reduced (weight [out, in/p])
    ParallelExperts               fused routed experts, each expert's intermediate dim sharded (partial sums)
    VocabParallelEmbedding        the vocabulary sharded (weight [V/p, h]), output reduced
    vocab_parallel_cross_entropy  F.cross_entropy of the full logits from a [..., V/p] shard of them
    parallelize(model)            nn.Linear (and, by plan, nn.Embedding) -> the layers above, in place
    clip_grad_norm_(model, max)   clip by the unsharded model's gradient norm (shards summed over the group)
    ShardRule                     how a module's tp_layout() says a parameter is cut (checkpoints read it)
    ShardedRMSNorm                an RMS norm over features sharded over the ranks (OLMo-2's q_norm / k_norm)
    check_gradients(model)        raise if a gradient ranks should hold alike differs between them (the invariant)
    summary(model)                how much of a model is sharded: its parts, their styles, this rank's share
    no_tp_communication(module)   inside, the TP linears compute this rank's part only (schedules reduce)
    register_lora(config)         a peft.LoraConfig that puts oases' LoRA layers on the parallel layers (oases.nn.lora)

The communication mappings the layers use (copy/reduce, split/gather) are in `oases.nn.mappings`.
"""

from oases._sharding import ShardRule
from oases.nn._coverage import Summary, summary
from oases.nn.clip import clip_grad_norm_
from oases.nn.experts import ParallelExperts
from oases.nn.grad_check import check_gradients
from oases.nn.layers import ColumnParallelLinear, RowParallelLinear, no_tp_communication
from oases.nn.lora import register_lora
from oases.nn.norm import ShardedRMSNorm
from oases.nn.parallelize import DEFAULT_PLAN, parallelize
from oases.nn.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ParallelExperts",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "parallelize",
    "DEFAULT_PLAN",
    "no_tp_communication",
    "clip_grad_norm_",
    "check_gradients",
    "ShardRule",
    "ShardedRMSNorm",
    "summary",
    "Summary",
    "register_lora",
]
