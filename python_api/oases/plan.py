"""Plans written by `oases plan` (oases.planner), read back for the runtime.

degrees = oases.plan.load("plan.json")       # [2, 2, 4, 4, ..., 2]: one TP degree per layer
sp = oases.plan.sequence_parallel("plan.json")  # train_step(..., sequence_parallel=sp)
n = oases.plan.chunks("plan.json")           # parallelize(model, chunks=n)
r = oases.plan.recompute("plan.json")        # train_step(..., recompute=r): one mode per layer
doc = oases.plan.read("plan.json")           # the whole document: layout, predictions, per layer
"""

from __future__ import annotations

from typing import Any

from oases import _checks
from oases._files import read_json
from oases.planner.search import PLAN_FORMAT, PLAN_VERSION, Plan

__all__ = ["load", "read", "sequence_parallel", "chunks", "recompute", "Plan"]


def read(path: str) -> dict[str, Any]:
    """The plan document at `path` (checked: an oases plan of a version this library reads)."""
    doc = read_json(path, "path")
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        raise ValueError(f"path: {path!r} is not an oases plan (write one with `oases plan ...`)")
    if doc.get("version") != PLAN_VERSION:
        raise ValueError(f"path: {path!r} is plan version {doc.get('version')!r}; this library reads {PLAN_VERSION}")
    degrees = doc.get("tp_degrees")
    if not isinstance(degrees, list) or not degrees or not all(isinstance(d, int) and d >= 1 for d in degrees):
        raise ValueError(f"path: {path!r} has no valid tp_degrees list")
    return doc


def load(path: str) -> list[int]:
    """The per-layer TP degrees of the plan at `path`: `GPT(config, group, tp_degrees=load(path))`."""
    return list(read(path)["tp_degrees"])


def sequence_parallel(path: str) -> bool:
    """Whether the plan at `path` runs sequence parallel (all-reduces as reduce-scatter +
    all-gather): `oases.train_step(..., sequence_parallel=sequence_parallel(path))`. Plans written
    before the planner chose it have no such key: False."""
    value = read(path).get("sequence_parallel", False)
    if not isinstance(value, bool):
        raise ValueError(f"path: {path!r} has a sequence_parallel that is not true or false: {value!r}")
    return value


def chunks(path: str) -> int:
    """Pieces per fused GEMM + collective of the plan at `path`, for `parallelize(model, chunks=...)`
    or the layers' `chunks=`: Centauri's Algorithm 1 with the profile's measured chunked-GEMM
    efficiency. Plans written before the planner chose it have none: 1 (no chunking)."""
    value = read(path).get("chunks", 1)
    if not _checks.is_int(value) or value < 1:
        raise ValueError(f"path: {path!r} has a chunks that is not a positive integer: {value!r}")
    return value


_RECOMPUTE_VALUES = {"full": True, "selective": "selective", "keep": False}


def recompute(path: str) -> list:
    """Each layer's recomputation in the plan at `path`, as train_step's per-layer `recompute`
    (True: recomputed, "selective", False: kept): `oases.train_step(..., recompute=recompute(path))`.
    Plans written before the planner chose it recompute every layer (True each)."""
    doc = read(path)
    modes = doc.get("recompute") or ["full"] * len(doc["tp_degrees"])
    if (
        not isinstance(modes, list)
        or len(modes) != len(doc["tp_degrees"])
        or any(m not in _RECOMPUTE_VALUES for m in modes)
    ):
        raise ValueError(f"path: {path!r} has a recompute that is not one of full / selective / keep per layer")
    return [_RECOMPUTE_VALUES[m] for m in modes]
