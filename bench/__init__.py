"""Oases benchmark suites: `python -m bench <suite> [options]`, run from the repository root.

    python -m bench primitives                          # 2 ranks, unshaped loopback
    python -m bench primitives --bandwidth 1gbit        # 2 ranks on a 1 Gbit/s shaped link
    python -m bench primitives --quick --out /tmp/b     # small shapes, seconds (tests)

Outside a distributed launch (no RANK in the environment) the command re-launches itself on
`--nproc` ranks through `python -m oases.launch` (which shapes the link); inside one (under
oases-launch or torchrun) it runs the suite on this rank. Rank 0 prints the tables and writes,
under `--out` (default bench/results/): `<suite>-<timestamp>.json`, `.png` and `.trace.json`.

A suite is a module registered in `SUITES` (name -> module path) with:

    add_arguments(parser)            its own command-line options (optional)
    run(args, ctx) -> list[dict]     called on every rank; returns the case records, identical
                                     on every rank (times already MAX-reduced over ranks); may
                                     record trace events into ctx.trace
    tables(records) -> list[Table]   what rank 0 prints (bench._report.Table)
    plot(records, path) -> bool      optional: write a PNG; False when there is nothing to plot

`ctx` is a `bench._context.Context`: rank, world size, device, process group, the `Timer`
(barrier-aligned medians, MAX over ranks), the run's metadata and the trace recorder. Times in
records are seconds. Every suite reports each overlapped time beside its bound
max(t_compute, t_comm) and the overlap efficiency (see bench._metrics).
"""

SUITES: dict[str, str] = {
    "primitives": "bench.primitives",
    "layers": "bench.layers",
    "pipeline": "bench.pipeline",
    "offload": "bench.offload",
    "profile": "bench.profile",
    "planner": "bench.planner",
    "memory": "bench.memory",
    "recompute": "bench.recompute",
    "trainer": "bench.trainer",
    "checkpoint": "bench.checkpoint",
    "link": "bench.link",
}

__all__ = ["SUITES"]
