"""The cost rules the runtime and the planner share: pure functions of seconds and bytes.

::

    oases.costs.rate         parse_bandwidth("750mbit") -> bytes/s (tc's rate syntax)
    oases.costs.link         LinkFit: t(nbytes) = latency_s + nbytes / bytes_per_s
    oases.costs.chunks       Centauri: chunk count (Algorithm 1), backward priority (eq. 1), op_chunks
    oases.costs.collectives  Centauri: flat or hierarchical collective, all-reduce or RS + AG
    oases.costs.recompute    each layer's recomputation (full, selective, keep) for a byte budget: greedy
    oases.costs.schedules    the training schedules' table (sub-batches, recomputation, pass barriers)

The floor below oases.comm: nothing here imports torch or any other part of oases, so the fused
ops (their chunk counts), the hierarchical collectives (their partition), the launcher (its rates)
and the planner (its cost model) read one rule each.
"""
