"""GPTConfig: the sizes of an oases.models.GPT (vocabulary, sequence, width, heads, blocks, MLP, dropout)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    """A GPT's sizes: vocabulary, longest sequence (seq_len), width, attention heads, blocks, MLP
    width as a multiple of hidden (mlp_ratio), and the residual dropout."""

    vocab_size: int = 256
    seq_len: int = 64
    hidden: int = 128
    heads: int = 4
    layers: int = 2
    mlp_ratio: int = 4
    dropout: float = 0.0  # residual dropout after each sublayer (same masks in recomputation)

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden: {self.hidden} is not divisible by heads={self.heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: must be in [0, 1), got {self.dropout}")
