"""PEFT's LoRA on oases' parallel layers (issue 37, item 3): a 2-layer Llama (hidden 64, 4 heads,
2 kv heads), LoRA r=4 on q/k/v/o and gate/up/down, against the unsharded PEFT model.

    PEFT model -> parallelize  get_peft_model(Llama) then oases.parallelize(peft_model), TP 2: oases'
                               LoRA layers around the sharded linears, the adapters cut like them
    parallelize -> PEFT        get_peft_model(oases.parallelize(Llama), oases.nn.register_lora(config)),
                               TP 2: the same adapters drawn (the same seed), then cut
    TP 4                       the second flow at TP 4 > kv heads (k / v and their B rows held by two ranks)

For each: logits, loss and every adapter gradient equal to the unsharded PEFT model's, through
model(...) + backward and oases.train_step on every schedule in oases.schedule.SCHEDULES (the LoRA
layers inside the overlapped sublayers, no layer run whole); only the
adapters have gradients; oases.check_gradients passes, clip_grad_norm_ takes the unsharded norm;
oases.save_adapter writes what PEFT's save_pretrained writes for the unsharded model (files equal),
which PeftModel.from_pretrained loads on one process with the same logits; merge_and_unload()
gives the unsharded merge's shards and logits. lora_dropout > 0 trains in train_step, both flows:
the column adapters' masks (on the replicated input) the same on every rank, the row adapters'
(on this rank's features) its own, recomputation redrawing them (every recompute mode bit-equal).
Refused by name: DoRA (in
both flows), modules_to_save and an initialisation that reads the base weight (register_lora);
parallelize leaves the model as it was.
"""

import copy
import importlib.util
import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist

import oases

from _spawn import rank_device, run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("peft") is None or importlib.util.find_spec("transformers") is None,
    reason="peft (pip install peft==0.21.2) and transformers are needed for PEFT's LoRA",
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOL = dict(rtol=1e-4, atol=1e-5)
CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=64,
    attn_implementation="eager",
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def _llama():
    import transformers as tf

    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**CONFIG))


def _lora_config(**extra):
    from peft import LoraConfig

    return LoraConfig(**{**dict(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0), **extra})


def _randomize(model, seed):
    """Every adapter factor drawn afresh (PEFT's B starts at zero: no term, no gradient of A)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, q in model.named_parameters():
            if "lora_" in name:
                q.copy_(torch.randn(q.shape, generator=g) * 0.2)


def _reference(ref, ids):
    ref.zero_grad(set_to_none=True)
    out = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: q.grad.clone() for n, q in ref.named_parameters() if q.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def _check_grads(tp, want, rank, p, where):
    """Exactly the adapters have gradients, each the matching part of the unsharded PEFT model's."""
    from oases._sharding import tp_rules

    rules = tp_rules(tp)
    have = {n: q.grad for n, q in tp.named_parameters() if q.grad is not None}
    assert set(have) == set(want), f"{where}: gradients of {sorted(set(have) ^ set(want))[:4]}"
    for name, grad in have.items():
        full = want[name]
        expected = full if name not in rules else rules[name][0].shard(full, rank, p)
        torch.testing.assert_close(grad, expected, **TOL, msg=lambda m: f"{where}: grad of {name}: {m}")


def _check_lora_model(ref, tp, rank, p, root, schedules):
    """tp (a parallelized PEFT model) against ref (the unsharded one, the same weights)."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from oases.nn._lora_layers import LoraColumnParallelLinear, LoraRowParallelLinear

    layers = [m for m in tp.modules() if isinstance(m, (LoraColumnParallelLinear, LoraRowParallelLinear))]
    assert len(layers) == len(TARGETS) * CONFIG["num_hidden_layers"], "oases' LoRA layer on every target"
    trainable = sorted(n for n, q in tp.named_parameters() if q.requires_grad)
    assert trainable == sorted(n for n, q in ref.named_parameters() if q.requires_grad), "trainable parameters"
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), "only the adapters train"

    ids = torch.randint(3, 90, (4, 12), generator=torch.Generator().manual_seed(1)).to(rank_device())
    want_logits, want_loss, want = _reference(ref, ids)
    tp.zero_grad(set_to_none=True)
    out = tp(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, want_logits, **TOL, msg=lambda m: f"logits {m}")
    torch.testing.assert_close(out.loss, want_loss, **TOL)
    out.loss.backward()
    _check_grads(tp, want, rank, p, "model(...)")
    oases.check_gradients(tp)
    total = oases.nn.clip_grad_norm_(tp, 1e9)  # the split factors' squares summed over the group, once each
    want_total = torch.nn.utils.clip_grad_norm_([q for q in ref.parameters() if q.grad is not None], 1e9)
    torch.testing.assert_close(total, want_total, **TOL)

    from oases.models.hf import HFStack

    # the LoRA layers are the branches' projections: every layer split into overlapped sublayers, none run whole
    assert [parts.kind for parts in HFStack(tp.get_base_model()).parts] == ["sequential"] * CONFIG["num_hidden_layers"]
    for schedule in schedules:
        tp.zero_grad(set_to_none=True)
        loss = oases.train_step(tp.get_base_model(), ids, ids, schedule=schedule, check_grads=1)
        torch.testing.assert_close(loss, want_loss, **TOL, msg=lambda m: f"{schedule}: loss {m}")
        _check_grads(tp, want, rank, p, f"train_step {schedule}")

    where = os.path.join(root, "adapter")
    oases.save_adapter(tp, where)  # every rank; each split factor gathered to rank 0, one at a time
    if rank == 0:
        ref.save_pretrained(os.path.join(root, "peft"))  # PEFT's own files of the unsharded model
        got, expected = (load_file(os.path.join(root, d, "adapter_model.safetensors")) for d in ("adapter", "peft"))
        assert sorted(got) == sorted(expected), "adapter keys"
        for key, value in expected.items():
            assert torch.equal(got[key], value), f"saved adapter {key}"
        configs = [json.load(open(os.path.join(root, d, "adapter_config.json"))) for d in ("adapter", "peft")]
        for config in configs:  # a set in the config: its order is the set's
            config["target_modules"] = sorted(config["target_modules"])
        assert configs[0] == configs[1], f"adapter_config.json: {configs}"
        loaded = PeftModel.from_pretrained(_llama().to(rank_device()), where)  # one process, PEFT's own layers
        torch.testing.assert_close(loaded(input_ids=ids).logits, want_logits, **TOL, msg=lambda m: f"loaded {m}")
    dist.barrier()

    merged_ref = copy.deepcopy(ref).merge_and_unload()
    merged = tp.merge_and_unload()  # the parallel layers, their shards merged
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    full = oases.full_state_dict(merged)
    for key, value in merged_ref.state_dict().items():
        torch.testing.assert_close(full[key], value, **TOL, msg=lambda m: f"merged {key}: {m}")
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want_logits, **TOL, msg=lambda m: f"merged {m}")


def _peft_then_parallelize(rank, p, root):
    from peft import get_peft_model

    warnings.simplefilter("ignore")
    ref = get_peft_model(_llama().to(rank_device()), _lora_config())
    _randomize(ref, 5)
    tp = copy.deepcopy(ref)
    oases.parallelize(tp)  # the PEFT model itself (or tp.get_base_model(): the same modules)
    embed = tp.get_base_model().model.embed_tokens
    assert isinstance(embed, oases.nn.VocabParallelEmbedding), "the embedding vocabulary-parallel as without PEFT"
    _check_lora_model(ref, tp, rank, p, root, oases.schedule.SCHEDULES)
    return True


def test_peft_model_parallelized_equals_unsharded_tp2(tmp_path):
    run_ranks(_peft_then_parallelize, 2, str(tmp_path), timeout=150)


def _parallelize_then_peft(rank, p, root, schedules):
    from peft import get_peft_model

    warnings.simplefilter("ignore")
    ref = _llama().to(rank_device())
    torch.manual_seed(7)
    ref = get_peft_model(ref, _lora_config())
    tp = oases.parallelize(_llama().to(rank_device()))
    torch.manual_seed(7)  # the same draws for the adapters
    tp = get_peft_model(tp, oases.nn.register_lora(_lora_config()))
    full = oases.full_state_dict(tp)  # the adapters drawn as PEFT draws them unsharded, then cut
    for key, value in ref.state_dict().items():
        assert torch.equal(full[key], value), f"initial {key}"
    _randomize(ref, 6)
    oases.load_full_state_dict(tp, ref.state_dict())  # each rank keeps its shards of the factors
    _check_lora_model(ref, tp, rank, p, root, schedules)
    return True


def test_lora_on_parallelized_model_equals_unsharded_tp2(tmp_path):
    run_ranks(_parallelize_then_peft, 2, str(tmp_path), tuple(oases.schedule.SCHEDULES), timeout=150)


def test_lora_on_parallelized_model_at_tp4_above_kv_heads(tmp_path):
    """k / v's B rows held alike by the two ranks of a kv head, their gradients summed over them."""
    run_ranks(_parallelize_then_peft, 4, str(tmp_path), tuple(oases.schedule.SCHEDULES), timeout=150)


def test_unsupported_lora_settings_refused_by_name():
    """register_lora (the flow onto an oases model) refuses before anything is registered."""
    from peft import LoraConfig

    for extra, what in (
        (dict(use_dora=True), r"use_dora=True \(DoRA\)"),
        (dict(modules_to_save=["lm_head"]), r"modules_to_save=\['lm_head'\]"),
        (dict(init_lora_weights="pissa"), r"init_lora_weights='pissa'"),
    ):
        config = _lora_config(**extra)
        with pytest.raises(
            ValueError, match=r"LoraConfig: oases' tensor-parallel LoRA layers do not support .*" + what
        ):
            oases.nn.register_lora(config)
        assert not config._custom_modules, f"{extra}: registered all the same"
    with pytest.raises(TypeError, match="expected a peft.LoraConfig"):
        oases.nn.register_lora(object())
    assert oases.nn.register_lora(LoraConfig(r=2, target_modules=["q_proj"]))._custom_modules


def _refused_in_parallelize(rank, p):
    from peft import get_peft_model

    warnings.simplefilter("ignore")
    for extra, what in ((dict(use_dora=True), r"DoRA \(use_dora=True\)"),):
        model = get_peft_model(_llama().to(rank_device()), _lora_config(**extra))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(
            ValueError, match=r"self_attn\.q_proj: oases' tensor-parallel LoRA layers do not support " + what
        ):
            oases.parallelize(model)
        after = model.state_dict()
        assert list(after) == list(before) and all(torch.equal(v, after[k]) for k, v in before.items())
        assert not any(isinstance(m, oases.nn.ColumnParallelLinear) for m in model.modules()), "model unchanged"
    return True


def test_unsupported_peft_layers_refused_by_parallelize_tp2():
    run_ranks(_refused_in_parallelize, 2, timeout=90)


def _lora_dropout(rank, p, flow):
    """lora_dropout=0.3 on a parallelized PEFT model in training mode: each adapter's mask recorded
    at its first draw, compared over the ranks; train_step at every recompute mode."""
    from peft import get_peft_model

    warnings.simplefilter("ignore")
    config = _lora_config(lora_dropout=0.3)
    if flow == "parallelize_then_peft":
        model = _llama().to(rank_device())
        oases.parallelize(model)
        tp = get_peft_model(model, oases.nn.register_lora(config))
    else:
        tp = get_peft_model(_llama().to(rank_device()), config)
        oases.parallelize(tp)
    tp.train()
    base = tp.get_base_model()
    masks = {}

    def record(name):
        def hook(module, args, out):
            masks.setdefault(name, out == 0)  # returns None: the output is kept

        return hook

    for name, module in base.named_modules():
        if name.endswith("lora_dropout.default"):
            module.register_forward_hook(record(name))
    ids = torch.randint(3, 90, (4, 12), generator=torch.Generator().manual_seed(1)).to(rank_device())
    runs = []
    for recompute in (True, False, "selective"):
        tp.zero_grad(set_to_none=True)
        torch.manual_seed(123)  # the step's dropout seed is drawn from it
        loss = oases.train_step(base, ids, ids, recompute=recompute, check_grads=1)
        runs.append((loss, {n: q.grad.clone() for n, q in tp.named_parameters() if q.grad is not None}))
    for loss, grads in runs[1:]:  # recomputation redraws the same masks
        assert torch.equal(loss, runs[0][0])
        worst = {
            n: float((g - runs[0][1][n]).abs().max()) for n, g in grads.items() if not torch.equal(g, runs[0][1][n])
        }
        assert not worst, (flow, worst)
    verdicts = {}
    for name, mask in sorted(masks.items()):
        every = [torch.empty_like(mask) for _ in range(p)]
        dist.all_gather(every, mask.contiguous())
        shared = all(torch.equal(every[0], other) for other in every[1:])
        verdicts[name.split(".")[-3]] = verdicts.get(name.split(".")[-3], set()) | {shared}
        assert 0.2 < mask.float().mean() < 0.4, (name, mask.float().mean())  # p = 0.3 drawn
    return verdicts


@pytest.mark.parametrize("flow", ["parallelize_then_peft", "peft_then_parallelize"])
def test_lora_dropout_masks_and_recomputation_tp2(flow):
    for verdicts in run_ranks(_lora_dropout, 2, flow, timeout=120):
        # column adapters (q/k/v, gate/up): one mask on every rank; row adapters (o, down): their own
        assert verdicts == {
            "q_proj": {True},
            "k_proj": {True},
            "v_proj": {True},
            "gate_proj": {True},
            "up_proj": {True},
            "o_proj": {False},
            "down_proj": {False},
        }, verdicts


def _all_reduces(rank, p):
    """Calls of oases.comm.all_reduce (the layers' blocking all-reduce: copy_to_tp's backward) and
    of the step's Communicator.all_reduce in one train_step, before and after LoRA is added."""
    from peft import get_peft_model

    from oases.schedule import Communicator

    warnings.simplefilter("ignore")
    model = _llama().to(rank_device())
    oases.parallelize(model)
    ids = torch.randint(3, 90, (4, 12), generator=torch.Generator().manual_seed(1)).to(rank_device())
    calls = {"blocking": 0, "scheduled": 0}
    blocking, scheduled = oases.comm.all_reduce, Communicator.all_reduce

    def counted_blocking(*args, **kwargs):
        calls["blocking"] += 1
        return blocking(*args, **kwargs)

    def counted_scheduled(self, *args, **kwargs):
        calls["scheduled"] += 1
        return scheduled(self, *args, **kwargs)

    counts = []
    for step in range(2):
        if step == 1:
            model = get_peft_model(model, oases.nn.register_lora(_lora_config())).get_base_model()
        calls.update(blocking=0, scheduled=0)
        oases.comm.all_reduce, Communicator.all_reduce = counted_blocking, counted_scheduled
        try:
            oases.train_step(model, ids, ids, check_grads=False)
        finally:
            oases.comm.all_reduce, Communicator.all_reduce = blocking, scheduled
        counts.append(dict(calls))
    return counts


def test_lora_factors_summed_once_after_the_step_not_in_the_cores_tp2():
    """Inside the schedule's cores the replicated factors' gradients stay partial (no blocking
    all-reduce per LoRA layer in the backward); the step sums them all in one all-reduce."""
    for without, with_lora in run_ranks(_all_reduces, 2, timeout=90):
        assert with_lora == {"blocking": without["blocking"], "scheduled": without["scheduled"] + 1}, (
            without,
            with_lora,
        )
