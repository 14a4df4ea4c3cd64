"""Stand-ins the Hugging Face adapter puts in a model while its own forward runs a piece of it:
an embedding given its output, the decoder stack replaced by hidden states, a head on shards
(oases.models.hf).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from oases.nn.layers import ColumnParallelLinear
from oases.nn.mappings import copy_to_tp
from oases.nn.vocab import VocabParallelEmbedding


@contextlib.contextmanager
def _standing_in(owner: nn.Module, name: str, module: nn.Module) -> Iterator[None]:
    """owner.<name> (the decoder layers, the input embedding) replaced by `module` for the block (restored after)."""
    kept = getattr(owner, name)
    setattr(owner, name, module)
    try:
        yield
    finally:
        setattr(owner, name, kept)


class _Given(nn.Module):
    """Stands in for the input embedding `embedding` called with `ids`: gives the token embeddings
    the schedule summed (a fresh tensor each call: the base may scale it in place); any other
    attribute is the embedding's (a base model may read its weight's device)."""

    def __init__(self, embedding: nn.Module, ids: torch.Tensor, embeddings: torch.Tensor) -> None:
        super().__init__()
        self.__dict__["_embedding"] = embedding  # not a submodule: read for attributes only
        self.ids, self.embeddings = ids, embeddings

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_embedding"], name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids is not self.ids and (ids.shape != self.ids.shape or not torch.equal(ids, self.ids.to(ids.device))):
            raise RuntimeError(
                "oases: the base model embedded other ids than the step's; its input embedding cannot "
                "be split from its all-reduce: parallelize it with vocab_parallel=False"
            )
        return self.embeddings.clone()


def _vocab_embedding(base: nn.Module) -> Optional[tuple[nn.Module, str]]:
    """(owner, name) of the base model's input embedding where it is a VocabParallelEmbedding, else None."""
    try:
        embedding = base.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if not isinstance(embedding, VocabParallelEmbedding):
        return None
    path = next((n for n, m in base.named_modules() if m is embedding), None)
    if not path:
        return None
    owner, _, name = path.rpartition(".")
    return base.get_submodule(owner), name


def _top_names(model: nn.Module, base: nn.Module, head: nn.Module) -> Optional[tuple[str, str]]:
    """The names of the base model and the head among the model's children, where both are
    children of a model that is not its own base (a Hugging Face XForCausalLM), else None."""
    children = dict(model.named_children())
    names = [next((n for n, m in children.items() if m is part), None) for part in (base, head)]
    return None if base is model or None in names else (names[0], names[1])


class _ShardHead(nn.Module):
    """A vocab-parallel head's shard of the logits, its input's gradient all-reduced over `group`
    (copy_to_tp); None: left as this rank's share (the schedule sums it: head_split)."""

    def __init__(self, head: ColumnParallelLinear, group: Optional[dist.ProcessGroup]) -> None:
        super().__init__()
        self.weight, self.bias, self.group = head.weight, head.bias, group

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h if self.group is None else copy_to_tp(h, self.group), self.weight, self.bias)


class _Hidden(tuple):
    """What the stood-in base model returns: the final hidden states as index 0 and as
    last_hidden_state, and None for any other field the model's forward reads (past_key_values,
    hidden_states, router_logits, ...)."""

    def __new__(cls, h: torch.Tensor) -> "_Hidden":
        return super().__new__(cls, (h,))

    @property
    def last_hidden_state(self) -> torch.Tensor:
        return self[0]

    def __getattr__(self, name: str) -> None:
        return None


class _GivesHidden(nn.Module):
    def __init__(self, h: torch.Tensor) -> None:
        super().__init__()
        self.h = h

    def forward(self, *args: Any, **kwargs: Any) -> _Hidden:
        return _Hidden(self.h)


@contextlib.contextmanager
def _standing_in_for_top(model: nn.Module, names: tuple[str, str], h: torch.Tensor, head: nn.Module) -> Iterator[None]:
    """model.<base> returns h and model.<head> is `head` for the block (both restored after)."""
    kept = [getattr(model, n) for n in names]
    setattr(model, names[0], _GivesHidden(h))
    setattr(model, names[1], head)
    try:
        yield
    finally:
        for n, m in zip(names, kept):
            setattr(model, n, m)
