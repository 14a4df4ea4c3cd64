"""OasesTrainer's checkpoints: checkpoint-N holds `oases/` (oases.save_checkpoint) beside Trainer's
state; resuming finds the newest that verifies, rotation counts the complete ones only, and
save_model exports with oases.save_pretrained. See oases.integrations.transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from transformers import Trainer
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

import oases
from oases.integrations._trainer_checks import is_peft
from oases.storage.integrity import MARKER

OASES_CHECKPOINT = "oases"  # the sharded checkpoint's folder inside checkpoint-N


def checkpoints(run_dir: str) -> list[str]:
    """The checkpoint-N folders of run_dir, oldest (lowest N) first."""
    steps = []
    for name in os.listdir(run_dir):
        prefix, _, step = name.partition("-")
        if prefix == PREFIX_CHECKPOINT_DIR and step.isdigit() and os.path.isdir(os.path.join(run_dir, name)):
            steps.append((int(step), os.path.join(run_dir, name)))
    return [folder for _, folder in sorted(steps)]


def complete(folder: str) -> bool:
    """Whether checkpoint-N `folder` was written to the end: its oases/ published (its marker) and
    Trainer's trainer_state.json, written after it (stats only)."""
    return os.path.isfile(os.path.join(folder, OASES_CHECKPOINT, MARKER)) and os.path.isfile(
        os.path.join(folder, TRAINER_STATE_NAME)
    )


def rotate(run_dir: str, limit: int, best: Optional[str]) -> None:
    """Delete the oldest complete checkpoint-N folders of run_dir by N until `limit` complete ones
    are left; the newest and `best` are kept whatever the limit (as Trainer's rotation).
    Incomplete ones (a save that died) are neither counted nor deleted, so they never push out
    the newest one that loads."""
    folders = [folder for folder in checkpoints(run_dir) if complete(folder)]
    kept = {folders[-1]} if folders else set()
    if best is not None:
        kept.add(os.path.normpath(best))
    left = len(folders)
    for folder in folders:
        if left <= max(limit, len(kept)):
            break
        if os.path.normpath(folder) not in kept:
            shutil.rmtree(folder, ignore_errors=True)
            left -= 1


class TrainerCheckpoints(Trainer):
    """OasesTrainer's checkpoint and export methods (a base of OasesTrainer: tp_size, dp_size,
    _saving_checkpoint and _optimizer() are its)."""

    def _newest_sound(self, run_dir: str) -> str:
        """The newest checkpoint-N of run_dir that verifies, agreed by every rank (a collective):

        for folder in rank 0's checkpoint-N folders, newest first:
            every rank: trainer_state.json present and JSON; oases/ there   -> all-gathered
            oases.verify_checkpoint(folder/oases): sizes, every file's crc32 read once between the ranks
            the first that passes is returned; the newer ones skipped, one warning on rank 0 naming each

        A ValueError on every rank when none verifies (Trainer's own when there is none)."""
        world = dist.is_initialized() and dist.get_world_size() > 1
        box = [checkpoints(run_dir) if os.path.isdir(run_dir) else []]
        if world:
            dist.broadcast_object_list(box, src=0)
        skipped: list[str] = []
        for folder in reversed(box[0]):
            why: Optional[str] = None
            try:
                with open(os.path.join(folder, TRAINER_STATE_NAME)) as f:
                    json.load(f)
            except FileNotFoundError:
                why = f"{TRAINER_STATE_NAME}: missing (the save did not finish)"
            except (OSError, ValueError) as e:
                why = f"{TRAINER_STATE_NAME}: unreadable ({type(e).__name__}: {e})"
            if why is None and not os.path.isdir(os.path.join(folder, OASES_CHECKPOINT)):
                why = f"{OASES_CHECKPOINT}/: missing (not written by OasesTrainer, or the save did not finish)"
            whys = [why]
            if world:
                whys = [None] * dist.get_world_size()
                dist.all_gather_object(whys, why)
            why = next((w for w in whys if w is not None), None)
            if why is None:
                found = oases.verify_checkpoint(os.path.join(folder, OASES_CHECKPOINT))
                why = None if found is None else f"{OASES_CHECKPOINT}/{found}"
            if why is None:
                if skipped and self.args.process_index == 0:
                    warnings.warn(
                        f"OasesTrainer: resume_from_checkpoint=True skipped checkpoints that do not verify: "
                        f"{'; '.join(skipped)}; resuming from {folder}",
                        UserWarning,
                        stacklevel=3,
                    )
                return folder
            skipped.append(f"{folder} ({why})")
        if skipped:
            raise ValueError(
                f"resume_from_checkpoint=True: no checkpoint in {run_dir!r} verifies: {'; '.join(skipped)}"
            )
        raise ValueError(f"No valid checkpoint found in output directory ({run_dir})")

    def _save_checkpoint(self, model: nn.Module, trial) -> None:
        """Trainer's checkpoint (every rank writes its shards: save_model), then the rotation of
        save_total_limit once every rank has finished writing: on each node (its local rank 0),
        by step number, so a node's own shards of old steps go too and no rank deletes a step
        another is still writing."""
        args = self.args
        limit = args.save_total_limit
        self._saving_checkpoint = True
        args.save_total_limit = None  # Trainer rotates on rank 0 alone, before the others finished
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._saving_checkpoint = False
            args.save_total_limit = limit
        if limit is None or limit <= 0:
            return
        if dist.is_initialized():
            dist.barrier()
        if args.local_process_index == 0:
            rotate(self._get_output_dir(trial=trial), limit, self.state.best_model_checkpoint)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """In a checkpoint: the oases sharded checkpoint (every rank writes its shards). Otherwise
        the Hugging Face export, `oases.save_pretrained` (every rank takes part; rank 0 writes)."""
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if not self._saving_checkpoint:
            return super().save_model(output_dir, _internal_call=_internal_call)
        with_optimizer = not self.args.save_only_model and self.optimizer is not None
        scheduler = self.lr_scheduler.state_dict() if with_optimizer and self.lr_scheduler is not None else None
        extra = {
            "scheduler": scheduler,
            "global_step": self.state.global_step,
            "epoch": self.state.epoch,
            "tp_size": self.tp_size,
            "dp_size": self.dp_size,
            "optimizer": with_optimizer,
        }
        oases.save_checkpoint(
            self.model,
            os.path.join(output_dir, OASES_CHECKPOINT),
            optimizer=self._optimizer() if with_optimizer else None,
            extra=extra,
        )

    def _save(self, output_dir: Optional[str] = None, state_dict: Optional[dict] = None) -> None:
        """The Hugging Face export of the unsharded model (a PEFT model: its adapter, PEFT's format),
        written by rank 0 with every rank's shards."""
        if state_dict is not None:
            raise ValueError("OasesTrainer: _save(state_dict=...) is not supported; the model's own shards are saved")
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if is_peft(self.model):
            oases.save_adapter(self.model, output_dir)  # PEFT's format, unsharded
        else:
            oases.save_pretrained(self.model, output_dir)
        if not self.args.should_save:
            return
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Nothing: the optimizer and the scheduler are in the checkpoint's oases/ (save_model)."""

    def _checkpoint_dir(self, checkpoint: str) -> str:
        where = os.path.join(checkpoint, OASES_CHECKPOINT)
        if not os.path.isdir(where):
            raise ValueError(
                f"OasesTrainer: resume_from_checkpoint={checkpoint!r} holds no {OASES_CHECKPOINT}/ (not written "
                f"by OasesTrainer); start from its weights with oases.load_pretrained instead"
            )
        return where

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[nn.Module] = None) -> None:
        """Checks the checkpoint is OasesTrainer's; the model, optimizer and scheduler are read
        together once the optimizer exists (_load_optimizer_and_scheduler)."""
        self._checkpoint_dir(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        """oases.load_checkpoint: the model's shards and the optimizer's state (a collective), then
        the LR scheduler from its extra state."""
        if checkpoint is None:
            return
        where = self._checkpoint_dir(checkpoint)
        with open(os.path.join(where, MARKER)) as f:
            with_optimizer = bool(json.load(f).get("optimizer"))  # save_only_model: the weights alone
        state = oases.load_checkpoint(self.model, where, optimizer=self._optimizer() if with_optimizer else None)
        scheduler = (state.extra or {}).get("scheduler")
        if scheduler is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(scheduler)
