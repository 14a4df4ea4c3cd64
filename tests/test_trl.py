"""oases.integrations.trl.OasesSFTTrainer against TRL's own SFTTrainer in one process.

A 2-layer Llama (hidden 64, vocabulary 96, fp32) on 24 prompt-completion rows (pre-tokenized:
SFTTrainer builds completion-only labels from completion_mask), 6 optimizer steps with gradient
accumulation 2, max_grad_norm 1.0, a linear LR schedule, an eval every 3 steps and one at the end.
At TP 2 (2 ranks; and DP 2 x TP 2 on 4 ranks, against a per-device batch of 4) the logged losses,
grad norms, eval losses and eval entropy / token accuracy equal the single process's (relative
5e-5), the trained weights too (tests/_tolerances.py), for: padded rows; packing (best-fit
decreasing: padding-free rows of several documents, which OasesTrainer cuts at document starts into
the schedule's two sub-batches); and LoRA from peft_config, whose saved adapter loads in PEFT on one
process and equals the trained one; at DP 2 x TP 2, padded rows and a PEFT model handed to the
trainer (PEFT's LoRA layers rewrapped on the shards).
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

import oases

from _spawn import harness_device, run_ranks
from _tolerances import state_atol
from test_trainer import _llama, _numpy, _world_env

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("trl", "peft", "accelerate", "datasets")),
    reason="the hf extra is not installed (pip install .[hf])",
)

VOCAB, ROWS, EVAL_ROWS = 96, 24, 6  # VOCAB: test_trainer's Llama
RTOL = 5e-5
ATOL = state_atol("adamw")


def _tokenizer():
    """A word-level tokenizer over t0 .. t95 built offline (t0 pads, t2 ends a sequence)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", eos_token="t2", unk_token="t1")


def _dataset(count: int, seed: int):
    """Pre-tokenized rows of 4..12 tokens: a prompt of 2..3 tokens, then the completion."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "completion_mask": []}
    for _ in range(count):
        length = int(torch.randint(4, 13, (1,), generator=g))
        prompt = int(torch.randint(2, 4, (1,), generator=g))
        rows["input_ids"].append(torch.randint(3, VOCAB, (length,), generator=g).tolist())
        rows["completion_mask"].append([0] * prompt + [1] * (length - prompt))
    return Dataset.from_dict(rows)


def _config(output_dir: str, **changes):
    from trl import SFTConfig

    settings = dict(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
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
        bf16=False,
        gradient_checkpointing=False,
        completion_only_loss=True,
        max_length=32,
    )
    settings.update(changes)
    args = SFTConfig(**settings)
    if args.n_gpu > 1:  # the one-process reference on a machine of several GPUs: one GPU, no DataParallel
        args._n_gpu = 1
    return args


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])


def _history(trainer) -> dict:
    keys = ("loss", "grad_norm", "eval_loss", "eval_entropy", "eval_mean_token_accuracy")
    return {key: [e[key] for e in trainer.state.log_history if key in e] for key in keys}


def _trainer(cls, output_dir: str, case: str, batch: int = 2, **kwargs):
    """case: "padded", "packed", "lora" (peft_config=) or "peft_model" (a PEFT model handed in)."""
    changes = {"packing": True, "per_device_train_batch_size": 1} if case == "packed" else {}
    changes.setdefault("per_device_train_batch_size", batch)
    model = _llama()
    if case == "lora":
        kwargs["peft_config"] = _lora()
    if case == "peft_model":
        from peft import get_peft_model

        model = get_peft_model(model, _lora())  # the adapters drawn here, the same on every rank
    if case in ("lora", "peft_model"):
        changes["max_grad_norm"] = 0.5  # the adapters' gradient norm is 0.4-0.65: clipped
    return cls(
        model=model,
        args=_config(output_dir, **changes),
        train_dataset=_dataset(ROWS, 1),
        eval_dataset=_dataset(EVAL_ROWS, 2),
        processing_class=_tokenizer(),
        **kwargs,
    )


def _trainable(model) -> dict:
    return {k: v for k, v in model.named_parameters() if v.requires_grad}


def _reference(tmp: str, case: str, batch: int = 2) -> dict:
    from accelerate.state import AcceleratorState, GradientState
    from trl import SFTTrainer

    os.environ.pop("LOCAL_RANK", None)  # set where cuda ranks share a GPU: accelerate would join the world
    trainer = _trainer(SFTTrainer, os.path.join(tmp, f"reference-{case}"), case, batch)
    trainer.train()
    trainer.evaluate()
    weights = _numpy(_trainable(trainer.model))
    AcceleratorState._reset_state(reset_partial_state=True)  # the ranks' trainers see the whole world
    GradientState._reset_state()
    return {"history": _history(trainer), "weights": weights}


def _run(tmp: str, case: str, rank: int) -> dict:
    from oases.integrations.trl import OasesSFTTrainer

    trainer = _trainer(OasesSFTTrainer, os.path.join(tmp, case), case, tp_size=2)  # per-device batch 2
    trainer.train()
    trainer.evaluate()
    full = oases.full_state_dict(trainer.model)  # a collective
    trainable = set(_trainable(trainer.model))
    result = {"history": _history(trainer), "weights": _numpy({k: v for k, v in full.items() if k in trainable})}
    if case in ("lora", "peft_model"):
        export = os.path.join(tmp, f"adapter-{case}")
        trainer.save_model(export)  # every rank; rank 0 writes PEFT's files
        if rank == 0:
            from peft import PeftModel

            loaded = PeftModel.from_pretrained(_llama(), export)
            result["adapter"] = _numpy({k: v for k, v in loaded.named_parameters() if "lora_" in k})
    return result


def _job(rank: int, world: int, tmp: str, cases: tuple) -> dict:
    """The single process's runs on rank 0 (per-device batch dp x 2), then OasesSFTTrainer's at TP 2."""
    result = {}
    if rank == 0:
        result["reference"] = {case: _reference(tmp, case, batch=world) for case in cases}
    _world_env(rank, world)
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    result["runs"] = {case: _run(tmp, case, rank) for case in cases}
    return result


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    return run_ranks(_job, 2, str(tmp_path_factory.mktemp("trl")), ("padded", "packed", "lora"), timeout=300)


def _assert_same(reference: dict, run: dict, where: str) -> None:
    for key, want in reference["history"].items():
        got = run["history"][key]
        assert len(got) == len(want) > 0, (where, key, want, got)
        for step, (a, b) in enumerate(zip(want, got)):
            assert math.isclose(a, b, rel_tol=RTOL), f"{where}: {key}[{step}]: SFTTrainer {a}, OasesSFTTrainer {b}"
    assert sorted(run["weights"]) == sorted(reference["weights"]), where
    for key, want in reference["weights"].items():
        diff = abs(run["weights"][key] - want).max()
        assert diff <= ATOL, f"{where}: {key}: trained weights differ by {diff:.3g}"


@pytest.mark.parametrize("case", ["padded", "packed", "lora"])
def test_tp2_matches_one_process_sft_trainer(tp2, case):
    _assert_same(tp2[0]["reference"][case], tp2[0]["runs"][case], case)
    assert tp2[0]["runs"][case]["history"] == tp2[1]["runs"][case]["history"]  # the TP ranks log alike
    clip = 0.5 if case == "lora" else 1.0
    assert max(tp2[0]["reference"][case]["history"]["grad_norm"]) > clip  # max_grad_norm clipped


def test_dp2_tp2_padded_and_a_peft_model_match_one_process_sft_trainer(tmp_path):
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    ranks = run_ranks(_job, 4, str(tmp_path), ("padded", "peft_model"), timeout=300)
    for case in ("padded", "peft_model"):
        _assert_same(ranks[0]["reference"][case], ranks[0]["runs"][case], f"dp 2 x tp 2 {case}")
        for rank in ranks:
            assert rank["runs"][case]["history"] == ranks[0]["runs"][case]["history"], case


def test_lora_adapter_loads_in_peft(tp2):
    adapter, trained = tp2[0]["runs"]["lora"]["adapter"], tp2[0]["runs"]["lora"]["weights"]
    assert len(adapter) == len(trained) > 0
    for key, value in trained.items():
        assert key in adapter, (key, sorted(adapter))
        assert abs(adapter[key] - value).max() == 0, key
