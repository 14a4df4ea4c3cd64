"""The planner: an overlap-aware cost model and the searches that pick a layout from it.

::

    oases.planner.model     ModelShape, presets (llama-7b, ...), load_model(preset or config file)
    oases.planner.profile   Profile: measured (bench/profiles/*.json) or analytical rates
    oases.planner.cost      Oases eqs. 2-6: node cost per layer and TP degree, resharding edges, memory
    oases.planner.memory    resident bytes per rank through build, load, train, checkpoint, export
    oases.planner.ilp       the Oases ILP over per-layer strategies (scipy.optimize.milp)
    oases.planner.search    plan(): per-layer TP degrees inside a search over (dp, pp, tp, schedule, ...)
    oases.planner.fold3d    FOLD3D: segment count and DP overlap ratio (eqs. 2-5)
    oases.planner.cli       `oases plan ...`

Centauri's chunk and collective rules (chunk_count, partition, ...) live in oases.costs, which the
runtime reads too; they are re-exported here.

Pure functions of costs: nothing here talks to a process group.
"""

from oases.costs.chunks import backward_priority, chunk_count, overlapped_time
from oases.costs.collectives import CollectiveChoice, all_reduce_form, flat_time, hierarchical_time, partition
from oases.planner.cost import LayerCost, StepCost, Workload, edge_cost, fixed_memory, layer_cost, step_cost, tp_degrees
from oases.planner.fold3d import choose_segments, dp_overlap_ratio
from oases.planner.ilp import Solution, solve_chain
from oases.planner.memory import PHASES, MemoryJob, PhaseMemory, RankMemory, phase_memory, rank_memory
from oases.planner.model import PRESETS, ModelShape, load_model, shape_from_config
from oases.planner.profile import Profile, analytical_profile, load_profile, parse_bytes, parse_link
from oases.planner.search import DegreePlan, Plan, plan, plan_degrees

__all__ = [
    "ModelShape",
    "PRESETS",
    "load_model",
    "shape_from_config",
    "PHASES",
    "MemoryJob",
    "PhaseMemory",
    "RankMemory",
    "phase_memory",
    "rank_memory",
    "Profile",
    "analytical_profile",
    "load_profile",
    "parse_bytes",
    "parse_link",
    "Workload",
    "LayerCost",
    "StepCost",
    "layer_cost",
    "edge_cost",
    "fixed_memory",
    "step_cost",
    "tp_degrees",
    "Solution",
    "solve_chain",
    "DegreePlan",
    "Plan",
    "plan",
    "plan_degrees",
    "chunk_count",
    "overlapped_time",
    "backward_priority",
    "choose_segments",
    "dp_overlap_ratio",
    "CollectiveChoice",
    "partition",
    "all_reduce_form",
    "flat_time",
    "hierarchical_time",
]
