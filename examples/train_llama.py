"""Train a Hugging Face LlamaForCausalLM with tensor parallelism on the Megatron and Oases schedules.

    python examples/train_llama.py                       # 2 ranks on a 750 Mbit/s emulated link
    python examples/train_llama.py --bandwidth none      # unshaped loopback
    torchrun --nproc-per-node 2 examples/train_llama.py  # on a real cluster (no re-launch)

The model is transformers' own LlamaForCausalLM (a small config built here, random init, GQA),
sharded with one `oases.parallelize` call and trained with `oases.train_step` in a plain loop
with torch.optim.AdamW (labels are the inputs: the loss shifts them, as Hugging Face's does).
`oases-sp` is the oases schedule with sequence parallelism. Each schedule starts from the same
seed and sees the same batches of a deterministic character-level corpus, so the losses agree
step by step; only the time differs. Every schedule runs train_step's default recompute="auto"
(each layer kept, selective or recomputed to fit the memory); the table's last lines say what it
chose (sequence parallelism always recomputes). Started outside a distributed launch, the script
re-launches itself through `oases-launch`.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

import oases
from oases.schedule import Communicator, RecomputeMemory

from _common import VOCAB, batches, compare, corpus, launch_or_run, parser, train_loop


def _args(argv=None) -> argparse.Namespace:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument(
        "--schedules",
        default="megatron,oases,oases-sp",
        help="comma-separated, first is the baseline; a '-sp' suffix adds sequence parallelism",
    )
    return p.parse_args(argv)


def build(args):
    """The unsharded Llama on every rank (same seed), then sharded in place: one parallelize call."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # any vocabulary size: parallelize pads the embedding and head shards when the TP degree does not divide it
    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=args.hidden,
        intermediate_size=int(2.75 * args.hidden),
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    # A 29-token vocabulary is cheaper replicated: a vocabulary-parallel embedding (the default, for
    # real vocabularies) all-reduces its [b, t, h] output every forward to save a 29 x h table.
    return oases.parallelize(model, vocab_parallel=False)


def train(label: str, data: torch.Tensor, args, show: bool) -> dict:
    schedule, sp = label.removesuffix("-sp"), label.endswith("-sp")
    model = build(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    comm = Communicator(dist.group.WORLD, dist.get_world_size())  # counts the time blocked on it
    memory = RecomputeMemory()  # where train_step's default, recompute="auto", says what it chose

    def step(tokens: torch.Tensor, _: torch.Tensor) -> torch.Tensor:  # labels = inputs, shifted inside
        return oases.train_step(
            model, tokens, tokens, schedule=schedule, sequence_parallel=sp, comm=comm, memory=memory
        )

    result = train_loop(
        label,
        step,
        optimizer,
        batches(data, args.steps, args.batch, args.seq_len),
        lambda: comm.waited,
        args.steps,
        args.batch * args.seq_len,
        show,
    )
    return dict(result, recompute=memory.choice.describe())


def run(args) -> None:
    data = corpus(200_000)
    describe = (
        f"Hugging Face LlamaForCausalLM: {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
        f"({args.kv_heads} KV); batch {args.batch} x {args.seq_len} tokens; TP={{tp}} on {{link}}; "
        f"{args.steps} steps per schedule"
    )
    compare(describe, args.schedules.split(","), lambda label, show: train(label, data, args, show))


def main(argv=None) -> int:
    args = _args(argv)
    return launch_or_run(__file__, args.tp, args.bandwidth, argv, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
