"""TRL's `SFTTrainer` on Oases: supervised fine-tuning with tensor parallelism on the overlapped
schedules, by changing one class name.

    from oases.integrations.trl import OasesSFTTrainer
    trainer = OasesSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds, processing_class=tok,
                              peft_config=LoraConfig(...), tp_size=2)   # under torchrun / oases-launch
    trainer.train()

OasesSFTTrainer is SFTTrainer with OasesTrainer's layout, data, step, checkpoints and export
(oases.integrations.transformers: read its docstring first). SFTTrainer prepares the data as it
does (tokenizing, completion-only and assistant-only labels, truncation, packing) and its
collator pads or flattens the rows; the step is oases.train_step on those rows:

    labels            -100 where SFTTrainer masks (prompt, padding, a packed document's first token)
    padding_free /    one packed row of documents, position_ids restarting at each: cut at
    packing ("bfd")   document starts into the schedule's sub-batches (OasesTrainer)
    loss              the sum of the token losses over num_items_in_batch: SFTTrainer's "nll" loss
    peft_config       LoRA on the parallel layers (oases.nn.register_lora; adapters sharded with
                      their base layers), applied by SFTTrainer after OasesTrainer parallelized the
                      model; save_model writes PEFT's adapter (oases.save_adapter)
    gradient_checkpointing (SFTConfig's default True)   Oases' recomputation (recompute=True)

Metrics. Evaluation computes the loss, `entropy` and `mean_token_accuracy` from the model's
logits (gathered: parallelize's default LM head), as SFTTrainer defines them, and logs
`num_tokens`. Training logs the loss, grad_norm, learning rate and `num_tokens`; its `entropy`
and `mean_token_accuracy` are not computed (the step's logits stay inside oases.train_step, on the
vocabulary shards): said once.

Refused besides OasesTrainer's (a ValueError naming the flag, on every rank, before any
communication): a model given by name (load it on every rank alike and pass the module),
loss_type other than "nll", activation_offloading, a model on meta.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

if importlib.util.find_spec("trl") is None:
    raise ImportError(
        "oases.integrations.trl needs trl: pip install 'oases[hf]' (tested: trl==1.16.0, transformers==5.23.0, "
        "accelerate==1.15.0, peft==0.21.2)"
    )

from transformers.utils import logging  # noqa: E402
from trl import SFTTrainer  # noqa: E402

import oases  # noqa: E402
from oases.integrations.transformers import IGNORE_INDEX, OasesTrainer  # noqa: E402

__all__ = ["OasesSFTTrainer"]

logger = logging.get_logger(__name__)


def _sft_refusals(model: Any, args: Any) -> list[str]:
    found = []
    if not isinstance(model, nn.Module):
        found.append(
            f"OasesSFTTrainer: model={model!r}: pass the model itself (loaded alike on every rank), not its name"
        )
    if args is not None and getattr(args, "loss_type", "nll") != "nll":
        found.append(f"OasesSFTTrainer: loss_type={args.loss_type!r}: not supported; oases.train_step's loss is 'nll'")
    if args is not None and getattr(args, "activation_offloading", False):
        found.append(
            "OasesSFTTrainer: activation_offloading=True: not supported; oases.train_step(offload=True) "
            "offloads the inputs kept for recomputation"
        )
    return found


class OasesSFTTrainer(OasesTrainer, SFTTrainer):
    """trl.SFTTrainer training a tensor-parallel model on Oases' schedules (see the module docstring
    and OasesTrainer's).

    Args:
        model: a Hugging Face causal LM (the module, the same on every rank), or one already
            parallelized over the TP groups.
        args, *trainer_args, **trainer_kwargs: SFTTrainer's own (peft_config, processing_class, ...),
            and OasesTrainer's keywords (tp_size, schedule, sub_batches, recompute, zero).

    Raises:
        ValueError: what OasesTrainer refuses, a model given by name, loss_type other than "nll",
            activation_offloading: on every rank, before any communication.
    """

    def __init__(self, model: Any = None, args: Any = None, *trainer_args: Any, **trainer_kwargs: Any) -> None:
        problems = _sft_refusals(model, args)
        if problems:
            raise ValueError("\n".join(problems))
        peft_config = trainer_kwargs.get("peft_config")
        if peft_config is not None:
            oases.nn.register_lora(peft_config)  # LoRA layers for the parallel linears; refuses what they cannot run
        self._said_train_metrics = False
        super().__init__(model, args, *trainer_args, **trainer_kwargs)  # tp_size=, zero=, ...: OasesTrainer's

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        """OasesTrainer's step; SFTTrainer's `num_tokens` counted (the DP ranks' tokens summed)."""
        tokens = inputs["attention_mask"].sum() if "attention_mask" in inputs else inputs["input_ids"].numel()
        count = torch.as_tensor(tokens, dtype=torch.int64, device=self.args.device)
        if self.dp_size > 1:
            dist.all_reduce(count, group=self.device_mesh["dp"].get_group())
        self._total_train_tokens += int(count)
        self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        if not self._said_train_metrics:
            self._said_train_metrics = True
            logger.warning(
                "OasesSFTTrainer: entropy and mean_token_accuracy are logged in evaluation only (the training "
                "step's logits stay on the vocabulary shards inside oases.train_step)"
            )
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs=False, num_items_in_batch=None):
        """The model's own loss on its gathered logits (SFTTrainer's fused LM head would read this
        rank's shard of the head), with SFTTrainer's entropy and mean_token_accuracy from them."""
        mode = "train" if self.model.training else "eval"
        outputs = model(**inputs, use_cache=False)
        loss = outputs.loss
        labels = inputs["labels"][:, 1:]
        valid = labels != IGNORE_INDEX
        with torch.no_grad():
            logits = outputs.logits[:, :-1].float()
            logp = torch.log_softmax(logits, dim=-1)
            entropy = -(logp.exp() * logp).sum(-1)
            correct = logits.argmax(-1) == labels
            num_valid = int(valid.sum())
            metrics = self._metrics[mode]
            metrics["entropy"].append(float(entropy[valid].sum()) / num_valid if num_valid else 0.0)
            metrics["mean_token_accuracy"].append(float((correct & valid).sum()) / num_valid if num_valid else 0.0)
        return (loss, outputs) if return_outputs else loss
