"""Fine-tune a small Llama with transformers' Trainer on Oases (OasesTrainer, TP 2), beside transformers' own TP and one rank.

    python examples/finetune_trainer.py                   # full fine-tuning, 2 ranks on a 750 Mbit/s emulated link
    python examples/finetune_trainer.py --lora            # PEFT LoRA adapters on the parallel layers
    python examples/finetune_trainer.py --bandwidth none  # unshaped loopback
    torchrun --nproc-per-node 2 examples/finetune_trainer.py  # on a real cluster (no re-launch)

The text is this repository's own documentation, read from disk: README.md and docs/**/*.md
(about 190 kB of Markdown; --text takes other files). Nothing is downloaded. A byte-level BPE
tokenizer (`tokenizers`, --vocab tokens) is trained on it on rank 0 and sent to the other ranks;
`datasets.load_dataset("text", data_files=...)` reads the same files, which are tokenized and cut
into rows of --seq-len tokens (one row in ten, 64 at most, held out for evaluation). The model is
transformers' LlamaForCausalLM (4 layers, hidden 256, 8 heads, 4 KV heads) drawn from one seed,
standing in for a pretrained checkpoint (none is at hand offline): every run starts from those
weights and sees the same batches in the same order.

Three runs with the same TrainingArguments (AdamW, cosine schedule, clipping at 1.0), each with
Trainer's logging and progress bar, then an evaluation:

    oases    OasesTrainer(model=model, args=args, ..., tp_size=2): the one class name changed;
             Oases shards the model and trains it on its overlapped schedule
    hf_tp    transformers.Trainer on LlamaForCausalLM.from_pretrained(dir,
             distributed_config=DistributedConfig(tp_size=2)): transformers' own tensor
             parallelism (the weights saved to a temporary directory first; save_strategy="no")
    1 rank   transformers.Trainer in one process with one intra-op thread, as each rank has, on the
             same rows (saved for it); every rank starts one at once, so that each runs with the
             other cores as busy as under TP (on a shared machine, others' load counts alike),
             and the slowest is reported

and one line compares them: steps/s (after the first --warmup steps) and the final training loss.

With --lora, `peft.get_peft_model(model, LoraConfig(r=8, every projection))` wraps the plain model
before the trainer takes it; OasesTrainer shards each adapter with its base layer. PEFT 0.21.2's
LoRA layers do not take transformers' TP-sharded projections (a shape error in the first training step),
so there the hf_tp run is tried on one batch and skipped with that error.

transformers' own TP on CPU ranks needs one check of accelerate's lifted (accelerate_tp_on_cpu):
accelerate 1.15 refuses the ParallelismConfig that Trainer makes for it unless the ranks run on
GPUs. Started outside a distributed launch, the script re-launches itself through `oases-launch`.
"""  # noqa: E501 (its first line is argparse's description: kept whole)

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

import torch
import torch.distributed as dist
from transformers import PrinterCallback, TrainerCallback

from _common import launch_or_run, parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS = "<|endoftext|>"
EVAL_ROWS = 64
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# what a 1-rank process reads (the tokenizer, the rows) and writes (its figures)
TOKENIZER, TRAIN, EVAL, RESULT = "tokenizer.json", "train", "eval", "result.json"
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")


def _args(argv=None) -> argparse.Namespace:
    p = parser(__doc__.splitlines()[0])
    p.set_defaults(steps=20, batch=8, seq_len=128, hidden=256, heads=8, layers=4, lr=1e-3)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary size (default 2048)")
    p.add_argument("--text", nargs="+", help="text files to train on (default: README.md and docs/**/*.md)")
    p.add_argument("--lora", action="store_true", help="train PEFT LoRA adapters (r=8) instead of every weight")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of steps/s (default 3)")
    p.add_argument("--schedule", default="oases", help="OasesTrainer's schedule (default oases)")
    p.add_argument("--single", metavar="DIR", help=argparse.SUPPRESS)  # a 1-rank run, started by a rank
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)  # ... by a rank other than 0
    return p.parse_args(argv)


# ---- data ----------------------------------------------------------------------------------------
def text_files(args) -> list[str]:
    """--text, or this repository's Markdown: README.md and docs/**/*.md."""
    if args.text:
        return list(args.text)
    return [
        os.path.join(ROOT, "README.md"),
        *sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)),
    ]


def train_tokenizer(files: list[str], vocab: int) -> str:
    """A byte-level BPE tokenizer trained on `files` (no download), as JSON; EOS is token 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(files, trainer)
    return tokenizer.to_str()


def wrap_tokenizer(tokenizer_json: str):
    """The trained tokenizer as transformers takes it (Trainer's processing_class)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json), eos_token=EOS, pad_token=EOS)


def datasets_of(files: list[str], tokenizer, seq_len: int):
    """(train, eval): the files through `datasets`, tokenized (EOS after each file), concatenated and
    cut into rows of seq_len tokens, labels = input_ids (the model shifts them); every 10th row
    held out, EVAL_ROWS at most."""
    import datasets

    datasets.disable_progress_bars()
    raw = datasets.load_dataset("text", data_files=files, split="train", sample_by="document", keep_in_memory=True)

    def tokenize(batch):
        return {"ids": [tokenizer(text)["input_ids"] + [tokenizer.eos_token_id] for text in batch["text"]]}

    def rows(batch):
        stream = [token for ids in batch["ids"] for token in ids]
        cut = [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]
        return {"input_ids": cut, "labels": [list(row) for row in cut]}

    tokenized = raw.map(tokenize, batched=True, remove_columns=["text"], keep_in_memory=True)
    blocks = tokenized.map(rows, batched=True, batch_size=None, remove_columns=["ids"], keep_in_memory=True)
    held_out = [i for i in range(len(blocks)) if i % 10 == 9][:EVAL_ROWS]
    kept = sorted(set(range(len(blocks))) - set(held_out))
    return blocks.select(kept), blocks.select(held_out)


# ---- model, arguments, timing --------------------------------------------------------------------
def build(args, vocab: int):
    """transformers' LlamaForCausalLM from seed 0: the same weights on every rank and in every run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=int(2.75 * args.hidden),
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def with_lora(model, args):
    """`model` with PEFT LoRA adapters on every projection (--lora), else `model`. lora_dropout 0:
    Oases refuses dropout in an adapter until dropout trains under its schedules."""
    if not args.lora:
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)  # the adapters' own draws, alike in every run
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, lora_dropout=0.0))


def training_args(args, output_dir: str, show: bool):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch,  # TP ranks share each batch: the global batch
        per_device_eval_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=args.lr * (2 if args.lora else 1),
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.steps // 10),
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=max(1, args.steps // 6),
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=not show,  # the bar and the logs on rank 0
    )


class StepClock(TrainerCallback):
    """When each optimizer step ended (steps/s after a warm-up)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if not self.ends:
            self.ends.append(time.perf_counter())  # the first step's start

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.ends.append(time.perf_counter())

    def steps_per_s(self, warmup: int) -> float:
        warmup = min(warmup, len(self.ends) - 2)  # at least one step timed
        return (len(self.ends) - 1 - warmup) / (self.ends[-1] - self.ends[warmup])


def fit(trainer_class, model, args, data, tokenizer, output_dir: str, show: bool, **extra) -> dict:
    """trainer_class(model, training_args, ...).train(), then evaluate(): steps/s and losses."""
    clock = StepClock()
    trainer = trainer_class(
        model=model,
        args=training_args(args, output_dir, show),
        train_dataset=data[0],
        eval_dataset=data[1],
        processing_class=tokenizer,
        callbacks=[clock],
        **extra,
    )
    if not show:
        trainer.remove_callback(PrinterCallback)  # without the bar, Trainer prints its logs on process 0
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {
        "steps_per_s": clock.steps_per_s(args.warmup),
        "loss": losses[-1],
        "eval_loss": trainer.evaluate()["eval_loss"],
    }


def reset_accelerate() -> None:
    """Forget the last Trainer's accelerate state, so that the next one sets up its own layout."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


# ---- the three runs --------------------------------------------------------------------------------
def run_oases(args, data, tokenizer, output_dir: str, show: bool) -> dict:
    from oases.integrations.transformers import OasesTrainer

    model = with_lora(build(args, len(tokenizer)), args)  # the plain model: OasesTrainer shards it
    tp = dist.get_world_size()
    return fit(OasesTrainer, model, args, data, tokenizer, output_dir, show, tp_size=tp, schedule=args.schedule)


@contextlib.contextmanager
def accelerate_tp_on_cpu():
    """Let accelerate take transformers' TP on CPU ranks.

    Trainer hands accelerate a ParallelismConfig(tp_size=2) for a model loaded with
    DistributedConfig, and accelerate 1.15 refuses it on CPU ranks: "ParallelismConfig is only
    compatible DistributedType.FSDP (version 2) or DistributedType.Multi{Device} or
    DistributedType.DEEPSPEED, but got DistributedType.MULTI_CPU." (on GPUs, MULTI_GPU, it
    passes). Inside, that one check is skipped on CPU; the mesh, the data split by DP rank and the
    rest are accelerate's own."""
    from accelerate.parallelism_config import ParallelismConfig

    check = ParallelismConfig._validate_accelerator

    def validate(config, accelerator) -> None:
        if accelerator.distributed_type.name != "MULTI_CPU":
            check(config, accelerator)

    ParallelismConfig._validate_accelerator = validate
    try:
        yield
    finally:
        ParallelismConfig._validate_accelerator = check


def first_step_error(model, data, batch: int) -> Optional[str]:
    """The error of one forward and backward on a training batch, on any rank (None: it ran on
    every rank); the gradients it left are cleared."""
    from transformers import default_data_collator

    inputs = default_data_collator([data[0][i] for i in range(batch)])
    model.train()
    try:
        model(**inputs).loss.backward()
        error = None
    except RuntimeError as e:
        error = f"{type(e).__name__}: {e}"
    model.zero_grad(set_to_none=True)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


def run_hf_tp(args, data, tokenizer, output_dir: str, show: bool) -> dict:
    """transformers' own TP: the starting weights saved by rank 0, every rank loads its shards."""
    from transformers import LlamaForCausalLM, Trainer
    from transformers.distributed import DistributedConfig

    box = [tempfile.mkdtemp(prefix="finetune-start-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)  # the ranks share a host (on a cluster: a shared directory)
    try:
        build(args, len(tokenizer)).save_pretrained(box[0])  # rank 0 writes
        dist.barrier()
        model = LlamaForCausalLM.from_pretrained(
            box[0], distributed_config=DistributedConfig(tp_size=dist.get_world_size()), attn_implementation="sdpa"
        )
        dist.barrier()
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(box[0], ignore_errors=True)
    model = with_lora(model, args)
    error = first_step_error(model, data, args.batch) if args.lora else None
    if error is not None:
        return {"skipped": f"PEFT's LoRA on transformers' TP-sharded projections failed: {error}"}
    with accelerate_tp_on_cpu():
        return fit(Trainer, model, args, data, tokenizer, output_dir, show)


def run_one_rank(argv: Optional[list[str]], tokenizer_json: str, data, where: str, show: bool) -> dict:
    """A 1-rank run in a process of its own (no distributed environment: a plain Trainer), on this
    tokenizer and these rows (saved for it: the files may change meanwhile); its figures."""
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, TOKENIZER), "w") as f:
        f.write(tokenizer_json)
    data[0].save_to_disk(os.path.join(where, TRAIN))
    data[1].save_to_disk(os.path.join(where, EVAL))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    command = [sys.executable, os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv), "--single", where]
    subprocess.run(command + ([] if show else ["--quiet"]), env=env, check=True)
    with open(os.path.join(where, RESULT)) as f:
        return json.load(f)


def one_rank(args) -> None:
    """Inside the 1-rank process (--single DIR): a plain Trainer; its figures to DIR/result.json."""
    import datasets
    from transformers import Trainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with open(os.path.join(args.single, TOKENIZER)) as f:
        tokenizer = wrap_tokenizer(f.read())
    data = tuple(datasets.load_from_disk(os.path.join(args.single, split)) for split in (TRAIN, EVAL))
    model = with_lora(build(args, len(tokenizer)), args)
    figures = fit(Trainer, model, args, data, tokenizer, os.path.join(args.single, "trainer"), not args.quiet)
    with open(os.path.join(args.single, RESULT), "w") as f:
        json.dump(figures, f)


# ---- the comparison ----------------------------------------------------------------------------------
def summary_line(results: dict[str, dict], warmup: int) -> str:
    """oases 2.10 steps/s, loss 5.1234 | hf_tp ... | 1 rank ...: oases 2.0x hf_tp, 1.1x 1 rank"""
    parts, ratios = [], []
    for name, r in results.items():
        if "skipped" in r:
            parts.append(f"{name} skipped")
            continue
        parts.append(f"{name} {r['steps_per_s']:.2f} steps/s, loss {r['loss']:.4f}")
        if name != "oases":
            ratios.append(f"{results['oases']['steps_per_s'] / r['steps_per_s']:.2f}x {name}")
    return f"{' | '.join(parts)} (steps/s after step {warmup}): oases {', '.join(ratios)}"


def run(args, argv) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = dist.get_rank(), dist.get_world_size()
    files = text_files(args)
    box = [train_tokenizer(files, args.vocab) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)  # every rank the same tokenizer
    tokenizer = wrap_tokenizer(box[0])
    data = datasets_of(files, tokenizer, args.seq_len)
    out = [tempfile.mkdtemp(prefix="finetune-trainer-") if rank == 0 else None]
    dist.broadcast_object_list(out, src=0)  # Trainer's output_dir (nothing is saved in it)
    out = out[0]
    if rank == 0:
        print(
            f"LlamaForCausalLM {args.layers} layers, hidden {args.hidden}, {args.heads} heads ({args.kv_heads} KV), "
            f"vocab {len(tokenizer)}; {'LoRA r=8' if args.lora else 'full fine-tuning'}; {len(data[0])} rows of "
            f"{args.seq_len} tokens from {len(files)} local files ({len(data[1])} more for eval); batch {args.batch}, "
            f"{args.steps} steps; TP={world} on {os.environ.get('OASES_BANDWIDTH', 'unshaped loopback')}",
            flush=True,
        )
    results = {}
    for name, train in (("oases", run_oases), ("hf_tp", run_hf_tp)):
        if rank == 0:
            print(f"\n== {name}: TP {world} ==", flush=True)
        results[name] = train(args, data, tokenizer, os.path.join(out, name), rank == 0)
        if rank == 0 and "skipped" in results[name]:
            print(f"{name} skipped: {results[name]['skipped']}", flush=True)
        reset_accelerate()
    if rank == 0:
        print("\n== 1 rank: one on every rank at once (each core as busy as under TP) ==", flush=True)
    mine = run_one_rank(argv, box[0], data, os.path.join(out, f"1-rank-{rank}"), rank == 0)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    results["1 rank"] = min(everyone, key=lambda r: r["steps_per_s"])  # the slowest, as a TP step waits for it
    if rank == 0:
        print("\n" + summary_line(results, args.warmup), flush=True)
        shutil.rmtree(out, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = _args(argv)
    if args.single:
        one_rank(args)
        return 0
    return launch_or_run(__file__, args.tp, args.bandwidth, argv, lambda: run(args, argv))


if __name__ == "__main__":
    sys.exit(main())
