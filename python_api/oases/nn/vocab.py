"""The vocabulary split over the tensor-parallel ranks: embedding, LM head and cross-entropy.

Megatron's VocabParallelEmbedding and vocab_parallel_cross_entropy. p ranks in `group`, r this
rank, V the vocabulary, h the hidden size; rank r owns the token ids [r*V/p, (r+1)*V/p), the rows
of the embedding table E [V, h] and of the LM head's W [V, h]. When p does not divide V (GPT-2's
50257), every rank holds ceil(V/p) rows and the last ranks' rows past V are padding (Megatron pads
the vocabulary the same way): zeros never looked up, whose logits are -inf, so they never reach a
softmax, a loss or the gathered logits (ShardRule(0, size=V), `vocab_rule`). Below, V/p reads ceil(V/p):

    VocabParallelEmbedding   weight E[r*V/p : (r+1)*V/p]  [V/p, h]          tp_layout: ShardRule(0)
        forward(ids [...]) -> y [..., h], replicated
            own = vocab_start_index <= ids < vocab_end_index
            y_r = where(own, E_r[ids - vocab_start_index], 0)     # [..., h]: the rows this rank owns
            y   = reduce_from_tp(y_r)                             # all-reduce; bwd: identity
    LM head                  ColumnParallelLinear(h, V, bias=False)   (W's rows, like E's)
        logits_r = x @ W[r*V/p : (r+1)*V/p].T                     # [..., V/p]; gather_output=False
    vocab_parallel_cross_entropy(logits_r [..., V/p], labels [...]) -> loss
        == F.cross_entropy(cat_r(logits_r, dim=-1).flatten(0, -2), labels.flatten(), ignore_index, reduction)
        x    = logits_r.flatten(0, -2) in fp32                    # [N, V/p]
        m    = all_reduce_max(max_j x[i, j])                      # [N]
        s    = all_reduce_sum(sum_j exp(x[i, j] - m_i))           # [N]  } one all-reduce of [2, N]
        t    = all_reduce_sum(x[i, labels_i - vocab_start] - m_i  # [N]  }
                              if this rank owns labels_i else 0)
        loss_i = log(s_i) - t_i,  0 where labels_i == ignore_index
        bwd (local, no communication), w_i = d(reduced loss)/d(loss_i), 0 where ignored:
            grad_x[i, j] = w_i * (exp(x[i, j] - m_i - log(s_i)) - [j == labels_i - vocab_start])

The full logits [..., V] never exist on any rank: the LM head's output, the largest activation of
a language model, stays p times smaller, and the loss costs two all-reduces of N and 2N floats.

Training with logits never gathered. `oases.parallelize` with the plan entries "vocab" (an
nn.Embedding) and "vocab_head" (the LM head nn.Linear) makes the head a ColumnParallelLinear with
gather_output=True, so the model's own forward and its own loss still see the full logits and
stay exact. A training loop that wants the logits sharded turns the gather off and computes the
loss itself (do not pass `labels` to a Hugging Face model then: its loss expects V logits):

    plan = {**oases.nn.DEFAULT_PLAN, "embed_tokens": "vocab", "lm_head": "vocab_head"}
    model = oases.parallelize(model, group, plan)
    model.lm_head.gather_output = False
    logits_r = model(input_ids=ids).logits                        # [b, s, V/p]
    loss = vocab_parallel_cross_entropy(logits_r[:, :-1], ids[:, 1:], group)   # == the model's loss

Every rank must pass the same `ids` and `labels` (they are replicated, like the activations).
Numerics: the embedding adds zeros to one rank's rows, so its output is bitwise the unsharded
lookup; the loss is computed in fp32 (for fp16/bf16 logits, like the `logits.float()` that
Hugging Face's loss does first) and matches F.cross_entropy to rounding.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from oases import _checks, comm
from oases._sharding import ShardRule, vocab_rule
from oases.comm.topology import Ring, ring_of
from oases.nn.mappings import reduce_from_tp

__all__ = ["VocabParallelEmbedding", "vocab_parallel_cross_entropy", "vocab_rule", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # a label without a loss (padding, a masked prompt), as torch's and Hugging Face's

_REDUCTIONS = ("mean", "sum", "none")


def check_vocab(owner: str, arg: str, size: int, world_size: int) -> None:
    """A vocabulary of `size` tokens: at least one token (p need not divide it: shards are padded)."""
    if not _checks.is_int(size) or size < 1:
        raise ValueError(f"{owner}: {arg} must be a positive int (the vocabulary), got {size!r}")


def check_embedding(owner: str, embedding: nn.Module, world_size: int) -> None:
    """`embedding` is a plain nn.Embedding whose rows split over `world_size` ranks."""
    if not isinstance(embedding, nn.Embedding):
        raise TypeError(f"{owner}: expected an nn.Embedding, got {type(embedding).__name__}")
    if type(embedding).forward is not nn.Embedding.forward:
        raise ValueError(
            f"{owner}: {type(embedding).__name__} overrides nn.Embedding.forward, which a "
            f"VocabParallelEmbedding would drop; leave it replicated (remove it from the plan)"
        )
    options = {
        "max_norm": embedding.max_norm,
        "scale_grad_by_freq": embedding.scale_grad_by_freq,
        "sparse": embedding.sparse,
    }
    unsupported = [f"{k}={v!r}" for k, v in options.items() if v not in (None, False)]
    if unsupported:
        raise ValueError(
            f"{owner}: {', '.join(unsupported)} is not supported by VocabParallelEmbedding; "
            f"leave this embedding replicated (remove it from the plan)"
        )
    check_vocab(owner, "num_embeddings", embedding.num_embeddings, world_size)


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with its rows (the vocabulary) sharded over the ranks of `group`.

    ::

        weight [V/p, h] = E[vocab_start_index : vocab_end_index],  vocab_start_index = r*V/p
        forward(ids [...] integer, the same on every rank)  ->  y [..., h] (replicated)
            y_r = where(vocab_start_index <= ids < vocab_end_index, weight[ids - vocab_start_index], 0)
            y   = reduce_from_tp(y_r)                          # all-reduce; bwd: identity

    `padding_idx` as in nn.Embedding (a negative one counts from the end): its row starts at zero
    and its gradient stays zero on the rank that owns it. Ids outside [0, V) raise an IndexError
    (as nn.Embedding does) on every rank, before the all-reduce. Initialisation: nn.Embedding's
    own (N(0, 1), padding row zero) of the full table on every rank, which keeps its shard; with
    the same seed on every rank the shards tile the table the unsharded layer would have had.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        *,
        group: Optional[dist.ProcessGroup] = None,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        group = _checks.process_group(group)  # a 1-D DeviceMesh: its group
        ring = ring_of(group)
        check_vocab(type(self).__name__, "num_embeddings", num_embeddings, ring.size)
        full = nn.Embedding(num_embeddings, embedding_dim, padding_idx, device=device, dtype=dtype)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = full.padding_idx  # normalised to [0, V) by nn.Embedding
        self.group, self.world_size, self.rank = group, ring.size, ring.rank
        self._rule = vocab_rule(num_embeddings, ring.size)
        # the ids this rank owns; its rows past them (the last ranks', when p does not divide V) are padding
        self.vocab_start_index, self.vocab_end_index = self._rule.held(num_embeddings, ring.rank, ring.size)
        self.weight = nn.Parameter(self.shard(full.weight.detach()).clone())  # [ceil(V/p), h]

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full [V, h] table (a view; zero-padded copy when p does not divide V)."""
        return self._rule.shard(full, self.rank, self.world_size)

    def tp_layout(self) -> dict[str, ShardRule]:
        """How this layer's parameters cut the full layer's (see oases._sharding): the rows."""
        return {"weight": self._rule}

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, group: Optional[dist.ProcessGroup] = None
    ) -> "VocabParallelEmbedding":
        """This rank's shard of `embedding` (values and requires_grad copied)."""
        check_embedding(f"{cls.__name__}.from_embedding", embedding, ring_of(group).size)
        layer = torch.nn.utils.skip_init(
            cls,
            embedding.num_embeddings,
            embedding.embedding_dim,
            embedding.padding_idx,
            group=group,
            device=embedding.weight.device,
            dtype=embedding.weight.dtype,
        )
        with torch.no_grad():
            layer.weight.copy_(layer.shard(embedding.weight))
        layer.weight.requires_grad_(embedding.weight.requires_grad)
        return layer

    def _local_padding_idx(self) -> Optional[int]:
        if self.padding_idx is None or not self.vocab_start_index <= self.padding_idx < self.vocab_end_index:
            return None
        return self.padding_idx - self.vocab_start_index

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] (int64 or int32, the same on every rank) -> y [..., h], replicated: this rank's rows
        for the ids it owns, zeros for the others, all-reduced over `group`."""
        return reduce_from_tp(self.partial(ids), self.group)

    def partial(self, ids: torch.Tensor) -> torch.Tensor:
        """forward without its all-reduce: this rank's share y_r [..., h] (its rows for the ids it
        owns, zeros for the others), whose sum over `group` is forward(ids). For a caller that
        sums it itself, overlapped with other work (the schedules do)."""
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
            got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise TypeError(f"ids: expected an int64 or int32 tensor of token ids, got {got}")
        compiling = torch.compiler.is_compiling()  # a host sync there would break the graph
        if ids.numel() and not compiling and bool(((ids < 0) | (ids >= self.num_embeddings)).any()):
            raise IndexError(
                f"ids: every id must be in [0, num_embeddings={self.num_embeddings}), got ids in "
                f"[{int(ids.min())}, {int(ids.max())}]"
            )
        local = ids - self.vocab_start_index  # [...]
        elsewhere = (local < 0) | (local >= self.vocab_end_index - self.vocab_start_index)  # ids other ranks own
        y = F.embedding(local.masked_fill(elsewhere, 0), self.weight, self._local_padding_idx())  # [..., h]
        return y.masked_fill(elsewhere.unsqueeze(-1), 0.0)  # their rows add nothing here, nor their grads

    def extra_repr(self) -> str:
        """The sizes, the ids this rank owns and padding_idx if set."""
        s = (
            f"{self.num_embeddings}, {self.embedding_dim}, tp={self.world_size} (rank {self.rank}: ids "
            f"[{self.vocab_start_index}, {self.vocab_end_index}))"
        )
        return s if self.padding_idx is None else s + f", padding_idx={self.padding_idx}"


def runs_as_partial(embedding: VocabParallelEmbedding) -> bool:
    """Whether embedding(ids) is all_reduce(embedding.partial(ids)): its forward not overridden and
    no forward hooks on it (a caller that sums `partial` itself would skip them)."""
    return (
        type(embedding).forward is VocabParallelEmbedding.forward
        and not embedding._forward_hooks
        and not embedding._forward_pre_hooks
    )


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token losses [N] (0 where ignored) of the full logits from this rank's [N, V/p] shard."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, ring: Ring) -> torch.Tensor:
        width = logits.shape[-1]
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # [N, V/p]; a copy for half inputs
        m = x.amax(dim=-1)  # [N]
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ring.group)  # the row max over the whole vocabulary
        shifted = x.sub_(m.unsqueeze(-1)) if x is not logits else x - m.unsqueeze(-1)  # never the caller's
        local = labels - ring.rank * width  # [N]: the label's column in this shard, if it is here
        own = valid & (local >= 0) & (local < width)
        local = local.clamp(0, width - 1).unsqueeze(-1)  # [N, 1]
        target = torch.where(own, shifted.gather(-1, local).squeeze(-1), 0.0)  # [N]
        stats = torch.stack([shifted.exp_().sum(-1), target])  # [2, N]: sum of exps, target logit
        comm.all_reduce(stats, ring.group)
        log_sum = stats[0].log()
        ctx.save_for_backward(logits, m, log_sum, local, own, valid)
        return torch.where(valid, log_sum - stats[1], 0.0)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        logits, m, log_sum, local, own, valid = ctx.saved_tensors
        w = torch.where(valid, grad_loss, 0.0).unsqueeze(-1)  # [N, 1]
        x = logits.to(m.dtype)
        shifted = x.sub_(m.unsqueeze(-1)) if x is not logits else x - m.unsqueeze(-1)
        grad = shifted.sub_(log_sum.unsqueeze(-1)).exp_().mul_(w)  # [N, V/p]: w * softmax
        grad.scatter_add_(-1, local, -(w * own.unsqueeze(-1)))  # - w at the label, on its owner
        return grad.to(logits.dtype), None, None, None


def _check_cross_entropy_args(logits: torch.Tensor, labels: torch.Tensor, reduction: str) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        got = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise TypeError(f"logits_shard: expected a floating-point tensor, got {got}")
    if (
        not isinstance(labels, torch.Tensor)
        or labels.is_floating_point()
        or labels.is_complex()
        or labels.dtype == torch.bool
    ):
        got = labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise TypeError(f"labels: expected an integer tensor of class indices, got {got}")
    if logits.dim() == 0 or logits.shape[-1] == 0 or logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits_shard {tuple(logits.shape)} and labels {tuple(labels.shape)}: expected logits_shard "
            f"[..., V/p] (this rank's slice of the vocabulary) and labels [...] with the same leading shape"
        )
    if labels.device != logits.device:
        raise ValueError(f"labels: on {labels.device} but logits_shard is on {logits.device}; move one with .to()")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: expected one of {', '.join(map(repr, _REDUCTIONS))}, got {reduction!r}")


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """Cross-entropy of the full logits, from this rank's vocabulary shard of them.

    ::

        logits_shard [..., V/p]: logits[..., r*V/p : (r+1)*V/p] (a column-parallel LM head's output)
        labels [...]: class ids in [0, V) or ignore_index, the same on every rank
        returns F.cross_entropy(cat_r(logits_shard, dim=-1).flatten(0, -2), labels.flatten(),
                                ignore_index=ignore_index, reduction=reduction)
            "mean": a scalar, the mean over the labels that are not ignore_index (nan if none is)
            "sum":  a scalar;  "none": [N] per-token losses, N = labels.numel(), 0 where ignored

    Forward: one all-reduce MAX of N floats and one all-reduce SUM of 2N (see the module
    docstring); backward: local, no communication. The math is fp32 (fp64 for fp64 logits), so
    the loss is fp32 for fp16/bf16 logits, as if computed on `logits.float()`; the gradient has
    the logits' dtype. Labels outside [0, V) raise a ValueError on every rank before any
    communication. `vocab_size`: V when the shards are padded (a ColumnParallelLinear(pad_vocab=True)
    head's out_features; its padding columns are -inf): labels in [V, padded V) raise too.
    """
    ring = ring_of(group)
    _check_cross_entropy_args(logits_shard, labels, reduction)
    vocab = logits_shard.shape[-1] * ring.size if vocab_size is None else vocab_size
    labels = labels.reshape(-1).long()  # [N]
    valid = labels != ignore_index
    bad = valid & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        raise ValueError(f"labels: {int(labels[bad][0])} is neither in [0, V={vocab}) nor ignore_index={ignore_index}")
    with torch.profiler.record_function("oases::vocab_parallel_cross_entropy"):
        loss = _VocabParallelCrossEntropy.apply(logits_shard.reshape(-1, logits_shard.shape[-1]), labels, valid, ring)
    if reduction == "none":
        return loss  # [N]
    total = loss.sum()
    return total if reduction == "sum" else total / valid.sum()
