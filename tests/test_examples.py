"""The README's demo and the examples run end to end (tiny sizes, unshaped link; 2 ranks, train_gpt_3d 4;
finetune_trainer also starts a 1-rank process per rank).

The README's demo (train_llama.py) runs as a user starts it: `python examples/train_llama.py`, which
re-launches itself through oases-launch (examples/_common.launch_or_run). The others run their rank
code as that launch would: on the harness's ranks (tests/_spawn.py), each with the launch's
environment (RANK, WORLD_SIZE, MASTER_ADDR, ...; OMP_NUM_THREADS=1) and the script run as __main__,
which then makes its own process group; no interpreter to start for the script, the launcher and
each rank (10-15 s an example on 2 cores).
"""

import os
import runpy
import socket
import subprocess
import sys

import pytest

from _spawn import cpu_only, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--steps", "2", "--bandwidth", "none", "--hidden", "64", "--heads", "4", "--batch", "4", "--seq-len", "16"]
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")


def _example_rank(rank, world_size, path, argv, port, log):
    """One rank of `python PATH ARGV` as `oases-launch --nproc WORLD_SIZE` starts it (unshaped);
    its output to LOG.RANK; the exit code."""
    import torch.distributed as dist

    dist.destroy_process_group()  # the harness's: the example makes its own, as under a launch
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",  # the launcher's default
    )
    for name in ("GROUP_RANK", "GROUP_WORLD_SIZE"):
        os.environ.pop(name, None)
    sys.path.insert(0, os.path.dirname(path))
    sys.argv = [path, *argv]
    os.chdir(ROOT)
    with open(f"{log}.{rank}", "w") as out:  # what the rank prints, and what its subprocesses do
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            runpy.run_path(path, run_name="__main__")
            code = 0
        except SystemExit as exit:  # sys.exit(main()), or SystemExit("the schedules' losses differ ...")
            code = 0 if exit.code is None else exit.code
            if not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
    return code


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_demo_trains():
    """`python examples/train_llama.py` (the README's `make demo`), re-launched through oases-launch."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train_llama.py"), *TINY, "--kv-heads", "2"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "per training step, same losses (to 1e-4)" in done.stdout, done.stdout[-3000:]


@cpu_only("the examples run on the CPU only: their own gloo process group, a 'cpu' mesh, use_cpu=True")
@pytest.mark.parametrize(
    "script, nproc, extra, summary",
    [
        ("train_gpt.py", 2, [], "oases vs megatron: "),
        ("train_gpt_3d.py", 4, ["--layers", "4", "--batch", "8", "--segments", "auto"], "vs 1f1b: "),
        # OasesTrainer, Trainer on transformers' own TP, and a 1-rank Trainer per rank (not --lora)
        ("finetune_trainer.py", 2, ["--kv-heads", "2"], "(steps/s after step 3): oases "),
    ],
    ids=["train_gpt.py", "train_gpt_3d.py", "finetune_trainer.py"],
)
def test_example_trains(script, nproc, extra, summary, tmp_path):
    """The example's ranks exit 0, and rank 0 printed its comparison (the schedules' losses agree:
    the example exits 1 where they do not)."""
    path = os.path.join(ROOT, "examples", script)
    log = tmp_path / "rank"
    codes = run_ranks(_example_rank, nproc, path, [*TINY, *extra], _free_port(), str(log), timeout=180)
    printed = {r: (tmp_path / f"rank.{r}").read_text() for r in range(nproc)}
    assert codes == [0] * nproc, {r: text[-3000:] for r, text in printed.items()}
    assert summary in printed[0], printed[0][-3000:]
