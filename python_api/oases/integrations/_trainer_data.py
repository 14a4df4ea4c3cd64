"""OasesTrainer's data: Trainer's loader split over the DP ranks only, each batch as train_step takes it.

The TP ranks of a group get the same batches; a packed row with fewer rows than the schedule's
sub-batches is cut at document starts (`split_packed`). See oases.integrations.transformers.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer
from transformers.trainer_utils import seed_worker
from transformers.utils import logging

from oases.schedule import MAX_SUB_BATCHES, SCHEDULES

BATCH_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")
# what padding-free collators (TRL's, DataCollatorWithFlattening) add beside position_ids for
# flash-attention's varlen kernels: derived from position_ids, which the model's forward reads
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
IGNORE_INDEX = -100

logger = logging.get_logger("oases.integrations.transformers")


class StepInputs(NamedTuple):
    """A micro-batch as oases.train_step takes it."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    position_ids: Optional[torch.Tensor]


def split_packed(
    input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor, parts: int
) -> Optional[StepInputs]:
    """A packed batch of one row [1, t] (documents one after another, position_ids restarting at
    each) cut at document starts into up to `parts` rows of one length, each padded at its end
    with a document of its own whose labels are -100; None where no cut qualifies (one document).

    ::

        starts = {s : position_ids[s] - position_ids[s - 1] != 1 and labels[s] == -100}
        cuts   = the start nearest j t / parts, j = 1 .. parts - 1
        row k  = tokens[cut_k : cut_k+1] + padding             # width = the longest piece

    The same token losses and gradients: a cut is made only where the document's first label is
    -100 (no loss term crosses it), each document keeps its tokens and positions, and padding
    after a row's tokens changes none of them (causal attention, a document of its own)."""
    if input_ids.shape[0] != 1 or parts < 2:
        return None
    t, pos = input_ids.shape[1], position_ids[0]
    starts = [int(s) + 1 for s in ((pos[1:] - pos[:-1]) != 1).nonzero().flatten()]
    starts = [s for s in starts if int(labels[0, s]) == IGNORE_INDEX]
    if not starts:
        return None
    cuts = sorted({min(starts, key=lambda s: abs(s - j * t / parts)) for j in range(1, parts)})
    bounds = list(zip([0, *cuts], [*cuts, t]))
    width = max(b - a for a, b in bounds)

    def piece(tensor: torch.Tensor, a: int, b: int, fill: Optional[int]) -> torch.Tensor:
        n = width - (b - a)
        pad = torch.arange(n, dtype=tensor.dtype, device=tensor.device) if fill is None else tensor.new_full((n,), fill)
        return torch.cat([tensor[0, a:b], pad])

    return StepInputs(
        torch.stack([piece(input_ids, a, b, 0) for a, b in bounds]),
        torch.stack([piece(labels, a, b, IGNORE_INDEX) for a, b in bounds]),
        None,
        torch.stack([piece(position_ids, a, b, None) for a, b in bounds]),
    )


class TrainerData(Trainer):
    """OasesTrainer's data methods (a base of OasesTrainer: dp_size, dp_rank, tp_size, schedule,
    sub_batches and _said_one_part are its attributes)."""

    def _get_dataloader(
        self,
        dataset,
        description: str,
        batch_size: int,
        sampler_fn=None,
        is_training: bool = False,
        dataloader_key: Optional[str] = None,
    ) -> DataLoader:
        """Trainer's data loader, sharded over the DP ranks only for training (the TP ranks of a
        group get the same batches); evaluation loads the whole set on every rank."""
        collator = self.data_collator
        try:
            import datasets

            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf_dataset = False
        if is_hf_dataset:
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(self.data_collator, description=description)
        args = self.args
        params: dict[str, Any] = {
            "batch_size": batch_size,
            "collate_fn": collator,
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
            "persistent_workers": args.dataloader_persistent_workers,
            "multiprocessing_context": args.dataloader_multiprocessing_context,
            "prefetch_factor": args.dataloader_prefetch_factor,
            "in_order": args.dataloader_in_order,
        }
        if not isinstance(dataset, IterableDataset):
            sampler = sampler_fn(dataset) if sampler_fn is not None else None
            if sampler is not None:
                params["sampler"] = sampler
            params["drop_last"] = args.dataloader_drop_last
            if is_training:
                params["worker_init_fn"] = functools.partial(
                    seed_worker, num_workers=args.dataloader_num_workers, rank=self.dp_rank
                )
        accelerator = self.accelerator
        replicas, index = (self.dp_size, self.dp_rank) if is_training else (1, 0)
        loader = prepare_data_loader(
            DataLoader(dataset, **params),
            accelerator.device,
            num_processes=replicas,
            process_index=index,
            split_batches=accelerator.split_batches,
            put_on_device=accelerator.device_placement,
            rng_types=accelerator.rng_types.copy(),
            dispatch_batches=False,
            even_batches=accelerator.even_batches,
            use_seedable_sampler=accelerator.use_seedable_sampler,
            data_seed=accelerator.dataloader_config.data_seed,
            non_blocking=accelerator.non_blocking,
            use_stateful_dataloader=accelerator.use_stateful_dataloader,
        )
        accelerator._dataloaders.append(loader)
        if dataloader_key is not None and args.dataloader_persistent_workers:
            if not hasattr(self, "_eval_dataloaders"):
                self._eval_dataloaders = {}
            self._eval_dataloaders[dataloader_key] = loader
        return loader

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """Trainer's accumulation window, remembering each micro-batch's sub-batches (the DP sync
        runs at the window's last one)."""
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._window = [self._parts(self._step_inputs(batch).input_ids.shape[0]) for batch in batch_samples]
        self._micro = 0
        return batch_samples, num_items

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """The window's labels[:, 1:] != -100 count: summed over the DP ranks with
        average_tokens_across_devices (Trainer's default), this rank's otherwise; None where
        Trainer divides by the accumulation steps instead (a model without loss kwargs)."""
        if not batch_samples or "labels" not in batch_samples[0] or not self.model_accepts_loss_kwargs:
            return None
        count = sum(batch["labels"][..., 1:].ne(IGNORE_INDEX).sum() for batch in batch_samples)
        count = torch.as_tensor(count, dtype=torch.int64, device=device)
        if self.args.average_tokens_across_devices and self.dp_size > 1:
            dist.all_reduce(count, group=self.device_mesh["dp"].get_group())
        return count

    def _track_num_input_tokens(self, inputs) -> None:
        """Trainer's count gathers every rank; the TP ranks of a group saw the same tokens."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // self.tp_size

    def _parts(self, rows: int) -> int:
        parts = SCHEDULES[self.schedule].sub_batches if self.sub_batches is None else self.sub_batches
        return max(1, min(parts, rows))

    def _step_inputs(self, inputs: dict[str, Any]) -> StepInputs:
        """The step's tensors of a batch, a packed row cut into rows at document starts where the
        batch has fewer rows than the schedule's sub-batches (split_packed); ValueError for what
        train_step cannot take."""
        keys = set(inputs) - set(BATCH_KEYS)
        if "position_ids" in inputs:
            keys -= set(VARLEN_KEYS)  # derived from position_ids: the model's own forward derives them again
        if keys:
            raise ValueError(
                f"OasesTrainer: the batch has {', '.join(sorted(keys))}; oases.train_step takes input_ids, labels, "
                f"attention_mask and position_ids (drop the others in the collator)"
            )
        if "labels" not in inputs or "input_ids" not in inputs:
            raise ValueError("OasesTrainer: the batch needs input_ids and labels (a causal LM's collator makes them)")
        step = StepInputs(
            inputs["input_ids"], inputs["labels"], inputs.get("attention_mask"), inputs.get("position_ids")
        )
        parts = self._parts(step.input_ids.shape[0])
        wanted = self._parts(MAX_SUB_BATCHES)
        if parts < wanted and step.position_ids is not None and step.attention_mask is None:
            cut = split_packed(step.input_ids, step.labels, step.position_ids, wanted)
            if cut is not None:
                return cut
        if parts < wanted and not self._said_one_part:
            self._said_one_part = True
            logger.warning(
                f"OasesTrainer: a batch of {step.input_ids.shape[0]} row(s) runs as {parts} sub-batch(es) of the "
                f"{wanted} schedule {self.schedule!r} interleaves: the overlap between sub-batches is given up for it "
                f"(per_device_train_batch_size >= {wanted}, or packed rows holding several documents, keep it)"
            )
        return step
