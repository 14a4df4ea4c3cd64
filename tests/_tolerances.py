"""How close a distributed run's trained weights must be to one process's.

SGD moves a weight by lr * grad: a gradient summed in another order (micro-batches, DP replicas,
TP shards) moves it by lr * (a rounding error), far below 1e-5. AdamW moves it by about
lr * m / (sqrt(v) + eps), which is close to lr wherever the gradient is tiny, whatever its size:
the same rounding can then shift such an element by a few percent of lr. On torch 2.11 (the H200
image) one element in 2048 moved 2.2e-5 after AdamW at lr 1e-3. A wrong gradient moves most
elements by about lr, so 5e-5 (5% of one step at lr 1e-3) still fails it.
"""

from __future__ import annotations

STATE_ATOL = {"sgd": 1e-5, "adamw": 5e-5}


def state_atol(optimizer: str) -> float:
    """The absolute tolerance on weights trained with `optimizer` ("sgd" or "adamw") at lr <= 1e-3 for AdamW."""
    return STATE_ATOL[optimizer]
