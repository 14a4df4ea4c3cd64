"""oases.integrations.transformers.OasesTrainer against transformers' own Trainer in one process.

A 2-layer Llama (hidden 64, vocabulary 96, fp32) on 24 padded rows (prompt tokens and padding
labelled -100), 6 optimizer steps with gradient accumulation 2, max_grad_norm 1.0 (it clips), a linear
LR schedule with warm-up, AdamW with weight decay, an eval every 3 steps and one at the end: the
logged losses, grad norms and eval losses of TP 2 (2 ranks) and of DP 2 x TP 2 (4 ranks, two epochs)
equal the single process's (relative 5e-5; its per-device batch is dp times theirs), the trained
weights too (tests/_tolerances.py). The reference runs on rank 0 of the spawned job before the
distributed environment is set (accelerate sees one process), so each job imports Trainer once per
rank. Also: oases.train_step's num_items (accumulation over micro-batches equals the whole batch's
mean), the options OasesTrainer refuses (a ValueError on every rank, before any communication),
activation_checkpointing mapped to Oases' recompute (Hugging Face's own left off), a checkpoint
resumed bit-exactly, and save_model's export read back by transformers.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import warnings

import pytest
import torch

import oases

from _spawn import harness_device, rank_device, run_ranks
from _tolerances import state_atol

pytest.importorskip("transformers")

needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None,
    reason="accelerate is not installed: transformers' Trainer needs it (pip install accelerate==1.15.0)",
)

VOCAB, SEQ, ROWS, EVAL_ROWS = 96, 12, 24, 6
RTOL = 5e-5
ATOL = state_atol("adamw")


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config)


def _rows(count: int, seed: int) -> list[dict]:
    """Rows of 5..12 tokens padded to 12 (mask 0, label -100), their first two labels -100 (a prompt)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        length = int(torch.randint(5, SEQ + 1, (1,), generator=g))
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[:length] = torch.randint(1, VOCAB, (length,), generator=g)
        mask = (torch.arange(SEQ) < length).long()
        labels = ids.masked_fill(mask == 0, -100)
        labels[:2] = -100
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def _args(output_dir: str, batch: int, **changes):
    from transformers import TrainingArguments

    settings = dict(
        output_dir=output_dir,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=4,  # 6 eval rows: the last batch is cut to 2
        gradient_accumulation_steps=2,
        max_steps=6,
        learning_rate=1e-3,
        weight_decay=0.01,
        lr_scheduler_type="linear",
        warmup_steps=1,
        max_grad_norm=1.0,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        use_cpu=harness_device() == "cpu",  # cuda: accelerate puts each rank on GPU LOCAL_RANK % count
        seed=7,
        disable_tqdm=True,
    )
    settings.update(changes)
    args = TrainingArguments(**settings)
    if args.n_gpu > 1:  # the one-process reference on a machine of several GPUs: one GPU, no DataParallel
        args._n_gpu = 1
    return args


def _numpy(state: dict) -> dict:
    return {key: value.detach().float().cpu().numpy().copy() for key, value in state.items()}


def _history(trainer) -> dict:
    history = trainer.state.log_history
    return {
        "loss": [e["loss"] for e in history if "loss" in e],
        "grad_norm": [e["grad_norm"] for e in history if "grad_norm" in e],
        "eval_loss": [e["eval_loss"] for e in history if "eval_loss" in e],
    }


def _reference(output_dir: str, batch: int) -> dict:
    """transformers.Trainer on one process (accelerate not yet told of the others)."""
    from transformers import Trainer, default_data_collator

    os.environ.pop("LOCAL_RANK", None)  # set where cuda ranks share a GPU: accelerate would join the world
    trainer = Trainer(
        model=_llama(),
        args=_args(output_dir, batch),
        train_dataset=_rows(ROWS, 1),
        eval_dataset=_rows(EVAL_ROWS, 2),
        data_collator=default_data_collator,
    )
    trainer.train()
    trainer.evaluate()
    result = {"history": _history(trainer), "weights": _numpy(trainer.model.state_dict())}
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # the ranks' Trainers see the whole world
    GradientState._reset_state()
    return result


def _world_env(rank: int, world: int) -> None:
    """What torchrun sets (the process group is run_ranks')."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        OMP_NUM_THREADS="1",
    )


def _oases_trainer(output_dir: str, batch: int, tp_size: int, zero: bool = False, **changes):
    from transformers import default_data_collator

    from oases.integrations.transformers import OasesTrainer

    return OasesTrainer(
        model=_llama(),
        args=_args(output_dir, batch, **changes),
        train_dataset=_rows(ROWS, 1),
        eval_dataset=_rows(EVAL_ROWS, 2),
        data_collator=default_data_collator,
        tp_size=tp_size,
        schedule="oases",
        zero=zero,
    )


def _trained(output_dir: str, batch: int, tp_size: int, rank: int, zero: bool = False, **changes) -> dict:
    trainer = _oases_trainer(output_dir, batch, tp_size, zero, **changes)
    trainer.train()
    trainer.evaluate()
    weights = oases.full_state_dict(trainer.model)  # a collective
    sync = trainer.grad_sync
    return {
        "history": _history(trainer),
        "weights": _numpy(weights) if rank == 0 else None,
        "recompute": trainer.recompute,
        "hf_checkpointing": trainer.model.is_activation_checkpointing,
        "started_in_backward": None if sync is None else sync.started_in_backward,
        "optimizer": type(trainer._optimizer()).__name__,
    }


REFUSED = [
    ({"torch_compile": True}, {}, "torch_compile"),
    ({"label_smoothing_factor": 0.1}, {}, "label_smoothing_factor"),
    ({"neftune_noise_alpha": 5.0}, {}, "neftune_noise_alpha"),
    ({"fsdp": "full_shard"}, {}, "fsdp"),
    (
        {"load_best_model_at_end": True, "save_strategy": "steps", "save_steps": 3, "metric_for_best_model": "loss"},
        {},
        "load_best_model_at_end",
    ),
    ({"optim": "adafactor"}, {}, "optim='adafactor'"),
    ({}, {"compute_loss_func": lambda outputs, labels, num_items_in_batch=None: outputs.loss}, "compute_loss_func"),
    ({}, {"tp_size": 3}, "does not divide the world"),
    ({"parallelism_config": "dp_shard"}, {}, "parallelism_config.dp_shard_size=2"),
    ({"parallelism_config": "tp"}, {"tp_size": 1}, "tp_size=1"),  # contradicts parallelism_config.tp_size=2
    ({}, {"model": "quantized"}, "quantized (bitsandbytes, QLoRA)"),
]


def _refused_input(changes: dict, kwargs: dict) -> tuple[dict, dict]:
    """REFUSED's placeholders made: a ParallelismConfig, a model holding a bitsandbytes-like layer."""
    from accelerate.parallelism_config import ParallelismConfig

    configs = {"dp_shard": dict(dp_shard_size=2, tp_size=2), "tp": dict(tp_size=2)}
    changes = dict(changes)
    if "parallelism_config" in changes:
        changes["parallelism_config"] = ParallelismConfig(**configs[changes["parallelism_config"]])
    model = _llama()
    if kwargs.get("model") == "quantized":
        quantized = type("Linear4bit", (torch.nn.Linear,), {"__module__": "bitsandbytes.nn.modules"})
        model.model.layers[0].mlp.up_proj = quantized(64, 128, bias=False)
    return changes, {**kwargs, "model": model}


def _refusals(tmp: str) -> list[str]:
    """Each refused option's ValueError (one line); none communicates, so no rank is left waiting."""
    from transformers import default_data_collator

    from oases.integrations.transformers import OasesTrainer

    messages = []
    for changes, kwargs, _ in REFUSED:
        changes, kwargs = _refused_input(changes, {"tp_size": 2, **kwargs})
        try:
            OasesTrainer(
                args=_args(os.path.join(tmp, "refused"), 2, **changes),
                train_dataset=_rows(ROWS, 1),
                data_collator=default_data_collator,
                **kwargs,
            )
        except ValueError as error:
            messages.append(str(error))
        else:
            messages.append("(accepted)")
    return messages


def _resumed(tmp: str, rank: int) -> dict:
    """Checkpoints every step, the 4 newest kept (save_total_limit); a new trainer resumes from
    checkpoint-3, and one at TP 1 x DP 2 (the same global batch); save_model's export."""
    out = os.path.join(tmp, "ckpt")
    first = _oases_trainer(out, 2, 2, save_strategy="steps", save_steps=1, save_total_limit=4)
    first.train()
    kept = sorted(name for name in os.listdir(out) if name.startswith("checkpoint-"))
    straight = oases.full_state_dict(first.model)
    checkpoint = os.path.join(out, "checkpoint-3")
    listing = sorted(os.listdir(checkpoint))
    if rank == 0:  # the three newest damaged: a shard cut short, bytes flipped, Trainer's state not written
        shard = os.path.join(out, "checkpoint-6", "oases", "__1_0.distcp")
        os.truncate(shard, os.path.getsize(shard) - 10)
        with open(os.path.join(out, "checkpoint-5", "oases", "__0_0.distcp"), "r+b") as f:
            f.seek(200)
            data = f.read(8)
            f.seek(200)
            f.write(bytes(b ^ 0xFF for b in data))
        os.remove(os.path.join(out, "checkpoint-4", "trainer_state.json"))
    torch.distributed.barrier()
    second = _oases_trainer(out, 2, 2, save_strategy="no")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second.train(resume_from_checkpoint=True)  # the newest that verifies: checkpoint-3
    skipped = [str(w.message) for w in caught if "skipped checkpoints" in str(w.message)]
    resumed = oases.full_state_dict(second.model)
    # at another layout with the same global batch: TP 1 x DP 2, one row per device
    third = _oases_trainer(os.path.join(tmp, "relayout"), 1, 1, save_strategy="no")
    third.train(resume_from_checkpoint=checkpoint)
    relayout = {k: v.detach().clone() for k, v in third.model.state_dict().items()}
    export = os.path.join(tmp, "export")
    second.save_model(export)
    result = {
        "kept": kept,
        "listing": listing,
        "straight_loss": _history(first)["loss"],
        "resumed_loss": _history(second)["loss"],
        "skipped": skipped,
        "bit_exact": all(torch.equal(straight[k], resumed[k]) for k in straight),
        "relayout_loss": _history(third)["loss"],
        "relayout_diff": max(float((straight[k] - relayout[k]).abs().max()) for k in straight),
    }
    if rank == 0:
        from transformers import LlamaForCausalLM

        loaded = LlamaForCausalLM.from_pretrained(export).state_dict()
        result["export_exact"] = sorted(loaded) == sorted(resumed) and all(
            torch.equal(loaded[k], resumed[k].cpu()) for k in resumed
        )
    return result


def _fp16(tmp: str, rank: int) -> dict:
    """fp16 at TP 2 with oases.amp.GradScaler: a run saved at step 3, and one where rank 1 alone
    finds an inf in its shard of a gradient (every rank must skip the same steps)."""
    trainer = _oases_trainer(os.path.join(tmp, "fp16"), 2, 2, fp16=True, save_strategy="steps", save_steps=3)
    trainer.train()
    trainer.evaluate()
    result = {"history": _history(trainer), "scale": trainer.accelerator.scaler.get_scale()}
    result["listing"] = sorted(os.listdir(os.path.join(tmp, "fp16", "checkpoint-3")))
    overflow = _oases_trainer(os.path.join(tmp, "fp16-inf"), 2, 2, fp16=True, max_steps=2, eval_strategy="no")
    before = {k: v.clone() for k, v in overflow.model.state_dict().items()}
    if rank == 1:  # an overflow in one shard only
        overflow.model.model.layers[0].mlp.down_proj.weight.register_hook(lambda grad: grad * float("inf"))
    overflow.train()
    result["inf_scale"] = overflow.accelerator.scaler.get_scale()
    result["inf_unchanged"] = all(torch.equal(v, before[k]) for k, v in overflow.model.state_dict().items())
    return result


def _meta_built(tmp: str, rank: int) -> list:
    """The large-model path: built on meta, parallelized over the mesh's TP group with only this
    rank's shards, its weights loaded with oases.load_pretrained, then handed to OasesTrainer."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM, default_data_collator

    from oases.integrations.transformers import OasesTrainer

    ckpt = os.path.join(tmp, "pretrained")
    if rank == 0:
        _llama().save_pretrained(ckpt)
    dist.barrier()
    mesh = init_device_mesh(harness_device(), (1, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = LlamaForCausalLM(_llama().config)
    oases.parallelize(model, mesh["tp"], device=rank_device(), init_weights=False)
    oases.load_pretrained(model, ckpt)
    args = _args(os.path.join(tmp, "meta"), 2, max_steps=2, eval_strategy="no")
    trainer = OasesTrainer(
        model=model, args=args, train_dataset=_rows(ROWS, 1), data_collator=default_data_collator, tp_size=2
    )
    trainer.train()
    return _history(trainer)["loss"]


def _tp2_job(rank: int, world: int, tmp: str) -> dict:
    result = {}
    if rank == 0:
        result["reference"] = _reference(os.path.join(tmp, "reference"), batch=2)
    _world_env(rank, world)
    result["refusals"] = _refusals(tmp)
    from accelerate.parallelism_config import ParallelismConfig

    # the layout from accelerate's ParallelismConfig (tp_size=None)
    tp = ParallelismConfig(tp_size=2)
    result["run"] = _trained(
        os.path.join(tmp, "tp2"), 2, None, rank, activation_checkpointing=True, parallelism_config=tp
    )
    result["resume"] = _resumed(tmp, rank)
    result["fp16"] = _fp16(tmp, rank)
    result["meta"] = _meta_built(tmp, rank)
    return result


def _dp2_tp2_job(rank: int, world: int, tmp: str) -> dict:
    result = {}
    if rank == 0:
        result["reference"] = _reference(os.path.join(tmp, "reference"), batch=4)  # dp 2 x 2 rows
    _world_env(rank, world)
    result["run"] = _trained(os.path.join(tmp, "dp2tp2"), 2, 2, rank)
    zero = os.path.join(tmp, "zero")
    result["zero"] = _trained(zero, 2, 2, rank, zero=True, save_strategy="steps", save_steps=3)  # ZeRO-1 over dp
    resumed = _oases_trainer(os.path.join(tmp, "zero-resumed"), 2, 2, True)
    resumed.train(resume_from_checkpoint=os.path.join(zero, "checkpoint-3"))
    resumed_weights = oases.full_state_dict(resumed.model)
    if rank == 0:
        result["zero_resumed_exact"] = all(
            (resumed_weights[k].float().cpu().numpy() == v).all() for k, v in result["zero"]["weights"].items()
        )
    return result


def _assert_same_run(reference: dict, run: dict) -> None:
    for key in ("loss", "grad_norm", "eval_loss"):
        want, got = reference["history"][key], run["history"][key]
        assert len(got) == len(want) > 0, (key, want, got)
        for step, (a, b) in enumerate(zip(want, got)):
            assert math.isclose(a, b, rel_tol=RTOL), f"{key}[{step}]: single process {a}, OasesTrainer {b}"
    assert max(reference["history"]["grad_norm"]) > 1.0  # max_grad_norm clipped
    assert sorted(run["weights"]) == sorted(reference["weights"])
    for key, want in reference["weights"].items():
        diff = abs(run["weights"][key] - want).max()
        assert diff <= ATOL, f"{key}: trained weights differ by {diff:.3g}"


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    return run_ranks(_tp2_job, 2, str(tmp_path_factory.mktemp("tp2")), timeout=300)


@needs_accelerate
def test_tp2_matches_one_process_trainer(tp2):
    _assert_same_run(tp2[0]["reference"], tp2[0]["run"])
    assert tp2[0]["run"]["history"] == tp2[1]["run"]["history"]  # the TP ranks log alike


@needs_accelerate
def test_a_model_built_on_meta_and_loaded_trains_alike(tp2):
    """Steps 1-2 of a model built on meta and loaded (max_steps=2: its own LR schedule, so only
    the first step's loss is the reference's exactly; the second is close)."""
    reference = tp2[0]["reference"]["history"]["loss"]
    for rank in tp2:
        assert len(rank["meta"]) == 2
        assert math.isclose(rank["meta"][0], reference[0], rel_tol=RTOL), (rank["meta"], reference)


@needs_accelerate
def test_activation_checkpointing_is_oases_recompute(tp2):
    for rank in tp2:
        assert rank["run"]["recompute"] is True
        assert rank["run"]["hf_checkpointing"] is False  # Hugging Face's never enabled on top


@needs_accelerate
def test_refused_options_on_every_rank(tp2):
    for rank in tp2:
        for (_, _, flag), message in zip(REFUSED, rank["refusals"]):
            assert flag in message and message.startswith("OasesTrainer: "), (flag, message)
            assert "\n" not in message, message  # one line


@needs_accelerate
def test_checkpoint_resumes_bit_exactly_and_exports(tp2):
    for rank in tp2:
        resume = rank["resume"]
        assert "oases" in resume["listing"] and "trainer_state.json" in resume["listing"], resume["listing"]
        assert resume["kept"] == [f"checkpoint-{step}" for step in (3, 4, 5, 6)]  # save_total_limit=4 rotated
        assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(resume["listing"])
        assert resume["resumed_loss"] == resume["straight_loss"]  # steps 1-3 from the state, 4-6 trained again
        if rank is tp2[0]:  # resume_from_checkpoint=True skipped the damaged 6, 5, 4 by name, once, on rank 0
            (skipped,) = resume["skipped"]
            assert re.search(
                r"checkpoint-6 \(oases/__1_0\.distcp: size .*\); .*checkpoint-5 \(oases/__0_0\.distcp: "
                r"checksum: .*\); .*checkpoint-4 \(trainer_state\.json: missing .*\); resuming from .*checkpoint-3$",
                skipped,
            ), skipped
        else:
            assert resume["skipped"] == []
        assert resume["bit_exact"]
        # resumed at TP 1 x DP 2 from TP 2's checkpoint: the same steps 4-6 within the tolerances
        assert len(resume["relayout_loss"]) == len(resume["straight_loss"])
        for a, b in zip(resume["straight_loss"][3:], resume["relayout_loss"][3:]):
            assert math.isclose(a, b, rel_tol=RTOL), (resume["straight_loss"], resume["relayout_loss"])
        assert resume["relayout_diff"] <= ATOL, resume["relayout_diff"]
    assert tp2[0]["resume"]["export_exact"]


@needs_accelerate
def test_fp16_with_the_groups_loss_scaler(tp2):
    reference = tp2[0]["reference"]["history"]
    for rank in tp2:
        fp16 = rank["fp16"]
        assert fp16["history"] == tp2[0]["fp16"]["history"]  # the TP ranks log alike
        for key in ("loss", "eval_loss"):
            for a, b in zip(reference[key], fp16["history"][key], strict=True):
                assert math.isclose(a, b, rel_tol=2e-2), (key, reference[key], fp16["history"][key])
        assert fp16["scale"] == 65536.0  # no overflow: torch's initial scale kept (growth after 2000 steps)
        assert "scaler.pt" in fp16["listing"]  # Trainer checkpoints the scaler's state
        # an inf in rank 1's shard alone: every rank skips both steps and backs off alike (65536 / 4)
        assert (fp16["inf_unchanged"], fp16["inf_scale"]) == (True, 16384.0), fp16


@needs_accelerate
def test_dp2_tp2_matches_one_process_trainer(tmp_path):
    ranks = run_ranks(_dp2_tp2_job, 4, str(tmp_path), timeout=300)
    _assert_same_run(ranks[0]["reference"], ranks[0]["run"])
    for rank in ranks:
        assert rank["run"]["history"] == ranks[0]["run"]["history"]
        assert rank["run"]["recompute"] == "auto"  # activation_checkpointing off: chosen for the memory
        assert rank["run"]["started_in_backward"] > 0  # DP buckets overlapped the last micro-batch's backward
    _assert_same_run(ranks[0]["reference"], ranks[0]["zero"])  # ZeRO-1: the same run
    for rank in ranks:
        assert rank["zero"]["history"] == ranks[0]["zero"]["history"]
        assert rank["zero"]["optimizer"] == "ZeroOptimizer"
    assert ranks[0]["zero_resumed_exact"]  # its sharded state resumed from checkpoint-3, bit for bit


def test_train_step_num_items_accumulates_to_the_whole_batch_mean():
    """Two micro-batches, each divided by the whole batch's count, give its mean's loss and gradients."""
    model = _llama()
    batch = _rows(4, 3)
    ids = torch.stack([r["input_ids"] for r in batch])
    labels = torch.stack([r["labels"] for r in batch])
    mask = torch.stack([r["attention_mask"] for r in batch])
    count = int((labels[:, 1:] != -100).sum())
    loss = oases.train_step(model, ids[:2], labels[:2], attention_mask=mask[:2], num_items=count)
    loss = loss + oases.train_step(model, ids[2:], labels[2:], attention_mask=mask[2:], num_items=torch.tensor(count))
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    whole = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    whole.backward()
    assert math.isclose(loss.item(), whole.item(), rel_tol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
    for bad in (0, -1.0, float("nan"), torch.tensor([1, 2]), "12"):
        with pytest.raises(ValueError, match="num_items"):
            oases.train_step(model, ids[:2], labels[:2], num_items=bad)


@needs_accelerate
def test_rotation_counts_complete_checkpoints_only(tmp_path):
    """save_total_limit keeps the newest complete checkpoint-N folders; one whose save did not
    finish (no oases marker, or no trainer_state.json) is neither counted nor deleted."""
    from oases.integrations._trainer_checkpoints import rotate

    for step in range(1, 7):
        folder = tmp_path / f"checkpoint-{step}"
        (folder / "oases").mkdir(parents=True)
        if step != 6:  # checkpoint-6: its oases/ never published
            (folder / "oases" / "oases_checkpoint.json").write_text("{}")
        if step != 5:  # checkpoint-5: Trainer's state never written
            (folder / "trainer_state.json").write_text("{}")
    rotate(str(tmp_path), 2, None)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3", "checkpoint-4", "checkpoint-5", "checkpoint-6"]
