"""The README's demo and the examples run end to end (tiny sizes, unshaped link; 2 ranks, train_gpt_3d 4;
finetune_trainer also starts a 1-rank process per rank)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--steps", "2", "--bandwidth", "none", "--hidden", "64", "--heads", "4", "--batch", "4", "--seq-len", "16"]


@pytest.mark.parametrize(
    "script, extra",
    [
        ("train_llama.py", ["--kv-heads", "2"]),
        ("train_gpt.py", []),
        ("train_gpt_3d.py", ["--layers", "4", "--batch", "8", "--segments", "auto"]),
        # OasesTrainer, Trainer on transformers' own TP, and a 1-rank Trainer per rank (not --lora)
        ("finetune_trainer.py", ["--kv-heads", "2"]),
    ],
)
def test_example_trains(script, extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", script), *TINY, *extra],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
