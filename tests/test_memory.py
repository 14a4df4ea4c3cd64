"""Resident memory per rank (VmRSS, sampled every 2 ms) through build -> load -> train -> checkpoint
-> load -> export at TP 2, against F = the full model's parameter bytes (issue 17's limits):

    meta build + parallelize(device=) + load_pretrained   peak rise <= 0.7 F   (its shards: 0.5 F)
    save_checkpoint                                        peak rise <= 0.2 F   (no rank gathers the model)
    load_checkpoint (into the trained model and optimizer) peak rise <= 0.2 F   (no new optimizer state)
    save_pretrained                                        peak rise <= 0.2 F   (one full tensor at a time)

each with SLACK for the allocator. The process's first dcp.save is done before the phases, on a
one-element state: on torch 2.11 a process's first save costs a fixed ~118 MiB (measured on the
H200 image: the same for a 10 MiB and a 200 MiB state; later saves nothing), a cost of
torch's, not of the model's size, which the limits are about. The model is a Llama whose
embedding and head are vocab-parallel (plan entries "vocab" / "vocab_head"), so every tensor
is sharded, and whose largest tensor is about 0.16 F, as in a 1.5-2 GiB Llama with a 32k
vocabulary.
"""

import gc
import os
import sys
import warnings

import pytest
import torch

import oases

from _spawn import cpu_only, run_ranks

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: the repository root
from bench._rss import PeakRSS  # noqa: E402

pytest.importorskip("transformers")

SLACK = 30 * 2**20


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=16000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _warm_dcp(root):
    """A first, tiny dcp.save by this rank alone (see the module docstring)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(
        {"x": torch.zeros(1)},
        storage_writer=dcp.FileSystemWriter(os.path.join(root, f"warm-{os.getpid()}")),
        no_dist=True,
    )


def _phases(rank, world_size, pretrained, root, out, full_bytes):
    from transformers import LlamaForCausalLM

    _warm_dcp(root + "-warm")

    plan = {**oases.nn.DEFAULT_PLAN, "embed_tokens": "vocab", "lm_head": "vocab_head"}
    gc.collect()
    rises = {}
    with PeakRSS() as peak:
        with torch.device("meta"):
            model = LlamaForCausalLM(_config())
        oases.parallelize(model, plan=plan, device="cpu", init_weights=False)
        oases.load_pretrained(model, pretrained)
    rises["build + load_pretrained"] = peak.rise
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 16000, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    with PeakRSS() as peak:
        oases.save_checkpoint(model, root, optimizer=opt, step=1)
    rises["save_checkpoint"] = peak.rise
    gc.collect()
    with PeakRSS() as peak:
        oases.load_checkpoint(model, root, optimizer=opt)
    rises["load_checkpoint"] = peak.rise
    gc.collect()
    with PeakRSS() as peak:
        oases.save_pretrained(model, out)
    rises["save_pretrained"] = peak.rise
    return rises


@cpu_only("measures each rank's resident host memory (VmRSS)")
def test_memory_per_rank_tp2(tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert largest <= 0.17 * full_bytes
    model.save_pretrained(tmp_path / "pretrained")
    del model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_ranks(
            _phases,
            2,
            str(tmp_path / "pretrained"),
            str(tmp_path / "ckpt"),
            str(tmp_path / "out"),
            full_bytes,
            timeout=240,
        )
    limits = {"build + load_pretrained": 0.7, "save_checkpoint": 0.2, "load_checkpoint": 0.2, "save_pretrained": 0.2}
    report = "\n".join(
        f"rank {r} {phase}: {rise / 2**20:.1f} MiB = {rise / full_bytes:.2f} F"
        for r, rises in enumerate(results)
        for phase, rise in rises.items()
    )
    print(f"F = {full_bytes / 2**20:.1f} MiB\n{report}")  # pytest -s shows the figures
    for rank, rises in enumerate(results):
        for phase, limit in limits.items():
            assert rises[phase] <= limit * full_bytes + SLACK, f"F = {full_bytes / 2**20:.1f} MiB\n{report}"
