"""oases.parallelize: shard a model's nn.Linear / Conv1D (and nn.Embedding) layers in place, by a plan of name patterns.

    model = oases.parallelize(model)                                   # the default plan
    model = oases.parallelize(model, plan={"*.w1": "column", "*.w2": "row"})

A plan is data, {pattern: style}. Each projection's (nn.Linear, or Hugging Face's Conv1D as
GPT-2 has them) qualified name (as `model.named_modules()`
gives it) is matched with fnmatch against every pattern; a pattern may match the whole name or
any dotted tail of it, so "q_proj" matches "model.layers.0.self_attn.q_proj" and
"layers.*.mlp.w1" matches "model.layers.3.mlp.w1". The first matching pattern (plan order) wins.

    "column"     ColumnParallelLinear.from_linear: output features sharded
    "column:N"   the same with stacked=N: the outputs are N equal blocks, each sharded on its own
                 (nanoGPT's and GPT-2's c_attn = [q | k | v]: "column:3"; Phi-3's gate_up_proj: "column:2")
    "column:qkv" a fused [q | k | v] whose blocks differ (GQA): parts=(heads*d, kv_heads*d, kv_heads*d)
                 from the attention module's head counts (Phi-3's qkv_proj); rank r holds its heads'
                 rows of each block, [q_r | k_r | v_r]
    "column:a,b,..."  the same with the blocks' sizes given
    "row"        RowParallelLinear.from_linear: input features sharded, output reduced
    "vocab_head" ColumnParallelLinear.from_linear(gather_output=True): an LM head, its vocabulary
                 (output features) sharded and the logits gathered back to [..., V]
    "vocab"      VocabParallelEmbedding.from_embedding, for an nn.Embedding: its rows sharded
    "experts"    ParallelExperts.from_experts, for fused routed experts (Mixtral's, Qwen2/3-MoE's
                 3-D gate_up_proj [E, 2I, H] and down_proj [E, H, I]): each expert's intermediate
                 dim sharded, gate and up rows each on their own, down's columns (oases.nn.experts)

A Conv1D (weight [in, out], y = x @ W + b) becomes the same layer with transposed=True
(ColumnParallelLinear.from_conv1d / RowParallelLinear.from_conv1d): its weight keeps Conv1D's
layout and name, cut on dim 1 (column) or dim 0 (row), so state_dict keys, checkpoints and
oases.save_pretrained exports hold the unsharded [in, out] tensors transformers reads.

Only "vocab" entries match nn.Embedding modules and "experts" entries fused experts modules
(every other entry matches projections only).
Vocabulary parallelism is the default (vocab_parallel=True, Megatron's): without a plan, the
model's input embedding and LM head (Hugging Face's get_input_embeddings() / get_output_embeddings(),
nanoGPT's wte / lm_head) are planned "vocab" and "vocab_head"; vocab_parallel=False keeps them
replicated, and an explicit plan decides for itself ({**DEFAULT_PLAN, "embed_tokens": "vocab",
"lm_head": "vocab_head"}). The head gathers its logits, so the model's own forward and loss see
all V of them and stay exact, and Hugging Face's model.generate() (KV cache on: each rank's cache
holds its own heads' keys and values) picks the unsharded model's tokens, every rank given the
same prompts (the input check runs at each forward); oases.train_step never gathers them (its loss is
vocab_parallel_cross_entropy), and a loop of one's own may set `model.lm_head.gather_output = False`
and compute its loss with `oases.nn.vocab_parallel_cross_entropy` (see oases.nn.vocab). V need
not divide by p: each rank holds ceil(V/p) rows and the padding rows' logits are -inf (never in
a loss, dropped from gathered logits, absent from checkpoints and exports). A tied embedding and
head (tie_word_embeddings=True) are sharded together, one shard serving both; a tie of one
planned module to anything else raises a ValueError (untie first, or leave both replicated).

Without a plan, DEFAULT_PLAN recognises LLaMA/Mistral/Qwen2/3/Gemma/OLMo-2, Phi/Phi-3, GPT-NeoX/Falcon,
GPT-J, OPT, GPT-2 and nanoGPT naming. Projections no pattern places (an LM head, say) stay unsharded and
replicated, and one warning lists them with their share of the decoder layers' projection
parameters. Every check (features and heads divisible by the world size, head projections'
widths agreeing with the head counts, every module with a column layer also having a row layer
and no projection left out) runs on every rank before anything is replaced, so a bad plan raises
a ValueError naming the module and leaves the model as it was, on every rank alike. Linears wrapped
with adapters (PEFT's LoRA: a module with a base_layer and lora_A / lora_B) are refused the same
way: merge them first (model.merge_and_unload()).

Never a silent half-sharded model: when less than half of the decoder layers' projection
parameters would be sharded (oases.nn._coverage), parallelize raises a ValueError with the
default plan, a warning with an explicit one, naming the modules left whole and the plan entries
that would shard them ({'fc_in': 'column', 'fc_out': 'row'}). It also says (in its warning)
which decoder layers oases.train_step runs whole, unsplit (oases.models.hf). `oases.summary(model)`
gives each part's style and this rank's share of the parameters.

Mixture of experts. A block whose experts are planned "experts" is one TP region
(oases.nn._moe): its router and gates (shared_expert_gate) stay replicated, its shared expert
is sharded column / row by the plan, each rank computes its partial sum of the routed and shared
experts, and one all-reduce at the block's output sums them (dense MLP's pattern); the router's
and gates' gradients are summed over the group, so every gradient, the load-balancing loss's
(output_router_logits) included, is the unsharded model's. oases.train_step runs the block as a
split sublayer (its loss has no load-balancing term: a config asking for router logits is refused).
Experts stored as Mixtral's ([E, 2I, H] gate | up, [E, H, I] down) or GPT-OSS's (transposed, gate
and up interleaved, with biases: the down bias added in one rank's partial sum) are recognised
(oases.nn.experts).

Attention. Once q/k/v (or a fused qkv) are column-sharded, each rank computes num_heads/p query
heads and num_kv_heads/p key/value heads (whole heads: both counts must divide by p; or, at
p > num_kv_heads with p % num_kv_heads == 0, the one kv head its query heads use, held alike by
p / num_kv_heads ranks that sum its gradient: oases.nn._kv, for k/v projections and "column:qkv";
parallelize then makes their groups, a collective over every rank of the world), and the
attention module between them must think in per-rank counts. An attention module is the parent
of a sharded head projection (a name in HEAD_PROJECTIONS). parallelize divides by p every integer
attribute in PER_RANK_ATTRIBUTES that such a module holds itself -- head counts and the widths
made of them -- and gives it a view of the shared config with per-rank head counts (Phi-3 reads
config.num_attention_heads in its forward), never touching the config itself. Ratios and per-head
sizes (head_dim, num_key_value_groups, scaling) stay as they are. Norms of such a module over a
sharded projection's whole width (OLMo-2's q_norm / k_norm) become oases.nn.ShardedRMSNorm: weight
sharded like the projection, mean of squares all-reduced over the group. Its other parameters
(Qwen3's per-head q_norm / k_norm weights, shared by every head) see only this rank's heads, so
a hook sums their gradient over the group (oases.nn._heads); parameters with one entry per query
head (GPT-OSS's sinks) are split by head like q. A per-head bias the base model builds for every
head (BLOOM's and Falcon's ALiBi `alibi`, Falcon's per-head mask) is cut to this rank's heads by a
pre-hook on the attention (oases.nn._alibi). CodeGen, whose forward splits qkv_proj into fixed
groups, is refused. Per architecture:

    transformers 5.x Llama/Mistral/Qwen2   views with (..., -1, head_dim) and reads only head_dim and
                                           num_key_value_groups: nothing to change
    transformers GPT-NeoX                  views with (..., -1, 3 * head_size): nothing to change
    transformers Falcon, BLOOM             num_heads, num_kv_heads, hidden_size, split_size; ALiBi cut
    transformers Phi-3                     config.num_attention_heads (the config view), fused qkv
    transformers GPT-2                     num_heads, embed_dim, split_size; Conv1D projections
    transformers OLMo-2                    full-width q_norm / k_norm -> ShardedRMSNorm
    nanoGPT-style                          n_head, n_embd (its forward must view with -1 rather
                                           than the input's width, C // n_head)
    BERT-style self-attention              num_attention_heads, all_head_size

Sequence parallelism (sequence_parallel=True) is for models written for it: activations between
blocks are [s/p, b, h] sequence shards and the model itself sums its norms' gradients over the
ranks. Hugging Face models are not, so asking for it on one raises a ValueError; for them,
`oases.train_step(model, ..., sequence_parallel=True)` keeps the residual stream sequence-sharded
between sublayers itself.

Per-layer TP degrees (tp_degrees=[d_0, ..., d_{L-1}], one per decoder layer, each a power of two
dividing p; e.g. oases.plan.load(path)): decoder layer l is sharded over the d_l consecutive ranks
of its replica and runs on that replica's block of the batch rows (p / d_l replicas; d_l = 1: left
unsharded), as oases.models.GPT does. The decoder layers are the nn.ModuleList at the dotted path
`layers` (e.g. layers="model.blocks"), else the first non-empty nn.ModuleList of KNOWN_LAYERS:
model.base_model.layers (Hugging Face Llama, Mistral, Qwen2/3: model.layers; GPT-NeoX:
gpt_neox.layers), model.transformer.h or model.h (nanoGPT-style). Rank r runs layer l as TP rank
r % d_l of replica r // d_l, on rows [floor(j B d_l / p), floor((j + 1) B d_l / p)) of the batch,
j = r // d_l (blocks differ by a row at most where p / d_l does not divide B):

    x = <the model's code before layers[0]>           # [B, ...] on every rank (degree p): embeddings
    for l, layer in enumerate(layers):                # as the model's own forward calls them
        x = reshard_rows(x, d_{l-1} -> d_l)           # [~B d_l / p, ...]: replica j's rows (d_{-1} = p)
        args, kwargs = cut(args), cut(kwargs)         # every tensor with shape[0] == B -> its rows [j]
        out = layer(x, *args, **kwargs)               # (or layer(hidden_states=x, ...))
        x = out[0] if isinstance(out, tuple) else out
    x = reshard_rows(x, d_{L-1} -> p)                 # [B, ...] on every rank, in layers[-1]'s output
    <the model's code after layers[-1]>               # final norm, head, loss: the whole batch

Hooks on the decoder layers do the resharding and the cutting (oases.nn._degrees), and each
parameter gradient of a layer with d_l < p is summed over its replicas, so model(...) and
loss.backward() give the unsharded model's loss, logits and gradients when the model keeps this
contract (Hugging Face Llama, Mistral, Qwen2, GPT-NeoX and nanoGPT-style models do):
  - batch first: the hidden states reaching each layer are [B, ...] (not sequence-first [t, B, h]);
    they are the layer's first positional argument, or the keyword hidden_states;
  - a layer returns y or a tuple (y, ...); the model hands y to the next layer and does nothing
    between layers that mixes rows or needs the whole batch (it sees only the replica's rows); the
    other tuple elements of a layer's output stay at the replica's rows;
  - per-example arguments are tensors whose first dim is B (in tuples, lists and dicts too): masks
    [B, ...], position ids [B, t], rotary tables [B, t, d], per-row scalars [B]; they are cut.
    Everything else is passed as it is, so a tensor shared by every row must not have first dim B
    (give it a leading broadcast dim: [1, t, t], not [t, t] when t == B); cache_position is never cut;
  - only the hidden states carry a gradient into a layer: any other tensor argument that requires
    grad raises a ValueError (its gradient would be one replica's share); masks, position ids and
    Hugging Face rotary tables (computed under no_grad) do not;
  - each layer treats rows independently (no batch norm, no batch-wide reductions), its parameters
    are its own (not tied to another layer or the embedding), no dropout (replicas draw different
    masks), and the code outside the layers runs the same on every rank.
`group` must be the world (the subgroups are made on every rank); no vocabulary entries, no
sequence_parallel; oases.train_step runs Hugging Face models parallelized this way on its
schedules (oases.models.HFStack.layer_placements) and refuses the others. Bad input
raises on every rank before any communication: a `layers` path that does not name an nn.ModuleList
(ValueError / TypeError), tp_degrees of the wrong length or with a degree that is not a power of
two dividing p (ValueError), and, at the first forward, a batch of fewer rows than p / min(tp_degrees)
replicas (ValueError).
"""
from __future__ import annotations

import copy
import dataclasses
import fnmatch
import functools
import warnings
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from oases import _checks
from oases._compiled import original_module
from oases.comm._topology import ring_of
from oases.inputs import watch_inputs
from oases.nn import _alibi, _heads, _kv, _moe
from oases.nn import _coverage as _summary
from oases.nn._degrees import (
    DegreeGroups,
    check_tp_degrees,
    hook_decoder_layers,
    make_placements,
    sum_over_replicas_while,
)
from oases.nn._heads import PER_RANK_ATTRIBUTES
from oases.nn._materialize import is_on_meta, materialize
from oases.nn._parts import HEAD_PROJECTIONS
from oases.nn.layers import ColumnParallelLinear, RowParallelLinear, _SharedEntry, check_shardable, is_conv1d
from oases.nn.vocab import VocabParallelEmbedding, check_embedding, check_vocab

__all__ = ["parallelize", "DEFAULT_PLAN", "HEAD_PROJECTIONS", "KNOWN_LAYERS", "PER_RANK_ATTRIBUTES"]

DEFAULT_PLAN: Mapping[str, str] = MappingProxyType({
    # LLaMA, Mistral, Qwen2/3, Gemma, OLMo-2 (Hugging Face naming)
    "q_proj": "column", "k_proj": "column", "v_proj": "column", "o_proj": "row",
    "gate_proj": "column", "up_proj": "column", "down_proj": "row",
    # Phi-3: fused [q | k | v] (blocks of the attention's head counts: GQA's differ) and [gate | up]
    "qkv_proj": "column:qkv", "gate_up_proj": "column:2",
    # GPT-NeoX, Falcon: query_key_value is laid out head by head, so whole-block shards keep
    # whole heads; "dense" alone is too common a name (BERT's MLP has one), so only attention's
    "query_key_value": "column", "*attention.dense": "row",
    "dense_h_to_4h": "column", "dense_4h_to_h": "row",
    # Phi, OPT, GPT-J, BLOOM-style names: attention's output (out_proj, Phi's self_attn.dense) and a
    # two-linear MLP (fc1 / fc2, fc_in / fc_out)
    "*self_attn.dense": "row", "out_proj": "row", "fc1": "column", "fc2": "row", "fc_in": "column", "fc_out": "row",
    # nanoGPT, GPT-2 (Conv1D): c_attn's outputs are [q | k | v], each third sharded on its own
    "c_attn": "column:3", "c_fc": "column", "c_proj": "row",
    # Mixtral, Qwen2/3-MoE: routed experts fused in 3-D tensors, each expert sharded on its intermediate dim
    "experts": "experts",
})

@dataclass(frozen=True)
class _Style:
    kind: str  # "column", "row", "vocab_head" (an nn.Linear), "vocab" (an nn.Embedding) or "experts"
    stacked: int = 1
    parts: tuple[int, ...] = ()  # unequal blocks' sizes ("column:a,b,c")
    qkv: bool = False  # "column:qkv": parts from the attention module's head counts
    replicas: tuple[int, ...] = ()  # key-value heads at p > kv_heads: ranks per copy, per block (oases.nn._kv)


def _parse_style(pattern: str, value: object) -> _Style:
    bad = ValueError(f"plan[{pattern!r}]: expected 'column', 'column:N' (N equal stacked blocks), 'column:qkv' "
                     f"(a fused [q | k | v], blocks from the head counts), 'column:a,b,...' (blocks of these "
                     f"sizes), 'row', 'vocab_head' (an LM head nn.Linear), 'vocab' (an nn.Embedding) or 'experts' "
                     f"(fused routed experts), got {value!r}")
    if not isinstance(value, str):
        raise bad
    if value in ("vocab", "vocab_head", "experts"):
        return _Style(value)
    kind, _, stacked = value.partition(":")
    if kind == "row" and not stacked:
        return _Style("row")
    if kind != "column":
        raise bad
    if not stacked:
        return _Style("column")
    if stacked == "qkv":
        return _Style("column", qkv=True)
    sizes = stacked.split(",")
    if not all(n.isdigit() and int(n) >= 1 for n in sizes):
        raise bad
    if len(sizes) > 1:
        return _Style("column", parts=tuple(int(n) for n in sizes))
    return _Style("column", int(stacked))


def _features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of an nn.Linear or a Hugging Face Conv1D."""
    return (module.nx, module.nf) if is_conv1d(module) else (module.in_features, module.out_features)


def _matches(name: str, pattern: str) -> bool:
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[i:]), pattern) for i in range(len(parts)))


def _check_no_adapters(model: nn.Module) -> None:
    """A module wrapping a `base_layer` with adapters beside it (PEFT's LoRA: lora_A / lora_B) is
    refused: oases shards the base layer's weight, not its adapters (ValueError naming the modules)."""
    wrapped = [name for name, m in model.named_modules()
               if isinstance(getattr(m, "base_layer", None), nn.Module)
               and any(n != "base_layer" for n, _ in m.named_children())]
    if wrapped:
        lora = all(hasattr(model.get_submodule(n), "lora_A") for n in wrapped)
        raise ValueError(
            f"model: {wrapped[0]}" + (f" (and {len(wrapped) - 1} more)" if len(wrapped) > 1 else "")
            + f" wraps its base_layer with {'LoRA adapters (lora_A / lora_B)' if lora else 'adapters'}, as PEFT "
            f"does; oases.parallelize shards plain projections, not adapters. Merge them into the weights before "
            f"parallelize (model = model.merge_and_unload()), or train without them")


def _transformers_module(model: nn.Module) -> Optional[str]:
    """The class name of the first Hugging Face transformers module in `model`, if any."""
    for module in model.modules():
        if any(c.__module__.startswith("transformers.") for c in type(module).__mro__):
            return type(module).__name__
    return None


def _plan_layers(modules: dict[str, nn.Module], styles: dict[str, _Style]) -> dict[str, _Style]:
    placed = {}
    for name in modules:
        style = next((s for pattern, s in styles.items() if _matches(name, pattern)), None)
        if style is not None:
            placed[name] = style
    return placed


def _resolve_qkv(model: nn.Module, placed: dict[str, _Style], linears: dict[str, nn.Module]) -> None:
    """'column:qkv' entries get their blocks, (q, k, v) widths from their parent's head counts."""
    for name, style in placed.items():
        if style.qkv:
            parent = model.get_submodule(name.rpartition(".")[0])
            parts = _heads.qkv_parts(name, parent, _features(linears[name])[1])
            placed[name] = _Style("column", parts=parts)


def _check_layers(placed: dict[str, _Style], linears: dict[str, nn.Module], p: int) -> None:
    for name, style in placed.items():
        linear = linears[name]
        n_in, n_out = _features(linear)
        kind = "Conv1D" if is_conv1d(linear) else "nn.Linear"
        owner = f"{name} ({kind} {n_in} -> {n_out}, planned as {style.kind!r})"
        if style.kind == "column":
            check_shardable(owner, "out_features", n_out, p, style.stacked, style.parts, style.replicas)
        elif style.kind == "vocab_head":
            if is_conv1d(linear):
                raise ValueError(f"{owner}: a vocabulary-parallel head must be an nn.Linear; remove it from the plan")
            check_vocab(owner, "out_features", n_out, p)
        else:
            check_shardable(owner, "in_features", n_in, p)


def _check_parts(model: nn.Module, placed: dict[str, _Style], linears: dict[str, nn.Module]) -> None:
    """Every module a column or row layer is planned in (an attention, an MLP) is sharded whole: its
    column layers' outputs reach a row layer, so it needs one, and no projection of it is left out."""
    children: dict[str, list[str]] = {}
    for name in linears:
        children.setdefault(name.rpartition(".")[0], []).append(name)
    for parent, names in children.items():
        kinds = {n: placed[n].kind if n in placed else None for n in names}
        if "column" not in kinds.values():
            continue
        left = [n.rpartition(".")[2] for n, k in kinds.items() if k is None]
        where = parent or type(model).__name__
        if "row" not in kinds.values():
            raise ValueError(f"{where}: its projections are planned as column-parallel with no row-parallel one to "
                             f"reduce their sharded outputs; plan its output projection as 'row'")
        if left:
            raise ValueError(f"{where}: {', '.join(left)} would stay whole while the other projections of the same "
                             f"module are sharded (its input or output would be a shard); plan "
                             f"{', '.join(repr(n) for n in left)} as 'column' or 'row'")


def _check_kinds(styles: dict[str, _Style], linears: dict[str, nn.Linear],
                 embeddings: dict[str, nn.Embedding]) -> None:
    """A vocabulary entry that would place no module of its kind but names one of the other kind is a slip."""
    for pattern, style in styles.items():
        if style.kind not in ("vocab", "vocab_head"):
            continue
        own, other = (embeddings, linears) if style.kind == "vocab" else (linears, embeddings)
        if any(_matches(n, pattern) for n in own):
            continue
        wrong = next((n for n in other if _matches(n, pattern)), None)
        if wrong is not None:
            is_a, use = ("an nn.Linear", "'vocab_head'") if style.kind == "vocab" else ("an nn.Embedding", "'vocab'")
            raise ValueError(f"plan[{pattern!r}]: {style.kind!r} matches {wrong}, {is_a}; use {use} for it")


def _vocab_entries(model: nn.Module) -> dict[str, _Style]:
    """{exact qualified name: "vocab" | "vocab_head"} for the model's input embedding and LM head
    (Hugging Face's accessors, else nanoGPT's wte / lm_head), when they are a plain nn.Embedding and
    nn.Linear, keyed by their qualified names (as plan patterns, they also match a longer name ending
    in them: harmless for the model's own embedding and head paths)."""
    found: dict[str, _Style] = {}
    names = {id(m): n for n, m in model.named_modules() if n}
    pairs = []
    for getter, kind in (("get_input_embeddings", "vocab"), ("get_output_embeddings", "vocab_head")):
        get = getattr(model, getter, None)
        try:
            module = get() if callable(get) else None
        except (NotImplementedError, AttributeError):
            module = None
        pairs.append((module, kind))
    if all(m is None for m, _ in pairs):
        transformer = getattr(model, "transformer", model)
        pairs = [(getattr(transformer, "wte", None), "vocab"), (getattr(model, "lm_head", None), "vocab_head")]
    for module, kind in pairs:
        wanted = nn.Embedding if kind == "vocab" else nn.Linear
        if type(module) is wanted and id(module) in names:  # exactly: subclasses may change forward
            found[names[id(module)]] = _Style(kind)
    (embedding, _), (head, _) = pairs
    if (head is not None and embedding is not None and getattr(head, "weight", None) is getattr(embedding, "weight", 0)
            and len(found) == 1):  # tied to an embedding that stays whole (Gemma's scaled one): the head too
        found.clear()
    return found


def _check_ties(model: nn.Module, names: list[str]) -> list[tuple[str, str]]:
    """The (embedding, head) pairs among the vocabulary-planned modules `names` that share one
    weight (tie_word_embeddings): both sharded, they keep sharing one shard. Any other tie of a
    planned module raises a ValueError (sharding it alone would silently untie it)."""
    holders: dict[int, list[str]] = {}
    for qualified, param in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), []).append(qualified)
    planned = {f"{name}.weight": name for name in names}
    pairs = []
    for name in names:
        others = [n for n in holders[id(model.get_submodule(name).weight)] if n != f"{name}.weight"]
        if len(others) == 1 and others[0] in planned:
            a, b = name, planned[others[0]]
            embedding = a if isinstance(model.get_submodule(a), nn.Embedding) else b
            head = b if embedding == a else a
            if (isinstance(model.get_submodule(embedding), nn.Embedding)
                    and isinstance(model.get_submodule(head), nn.Linear)):
                if (embedding, head) not in pairs:
                    pairs.append((embedding, head))
                continue
        if others:
            raise ValueError(
                f"{name}: its weight is tied to {', '.join(others)} (the same Parameter, e.g. "
                f"tie_word_embeddings=True); sharding it alone would silently untie them. Plan both ends of the "
                f"tie (the embedding as 'vocab', the head as 'vocab_head': they share one shard), untie them "
                f"({name}.weight = nn.Parameter({name}.weight.detach().clone())), or leave the tied modules "
                f"replicated (remove {name} from the plan)"
            )
    return pairs


def _attention_modules(model: nn.Module, placed: dict[str, _Style]) -> dict[str, nn.Module]:
    """Parents of column-sharded head projections, checked to have all their head projections sharded."""
    found: dict[str, nn.Module] = {}
    for name, style in placed.items():
        parent, _, leaf = name.rpartition(".")
        if style.kind == "column" and leaf in HEAD_PROJECTIONS and parent not in found:
            found[parent] = model.get_submodule(parent)
    for parent, module in found.items():
        for child, sub in module.named_children():
            qualified = f"{parent}.{child}" if parent else child
            if child in HEAD_PROJECTIONS and (isinstance(sub, nn.Linear) or is_conv1d(sub)):
                style = placed.get(qualified)
                if style is None or style.kind != "column":
                    raise ValueError(
                        f"{parent or type(model).__name__}: its head projections must all be column-parallel, "
                        f"but {child} is planned as {style.kind if style else 'nothing (left unsharded)'}; "
                        f"add {child!r}: 'column' to the plan"
                    )
    return found


# Attention modules whose forward fixes how the fused projection's features map to heads, whatever
# the module's head counts say (the exceptions to sharding by parts).
_UNSHARDABLE_ATTENTION: Mapping[str, str] = MappingProxyType(
    {"CodeGenAttention": "splits its fused qkv_proj into mp_num = 4 groups fixed in its forward"})

# Where per-layer tp_degrees find decoder layers without `layers=` (the first that is a non-empty
# nn.ModuleList wins): Hugging Face decoders (LlamaForCausalLM's model.layers, GPTNeoXForCausalLM's
# gpt_neox.layers: base_model is the inner model), nanoGPT-style models (with or without `transformer`).
KNOWN_LAYERS = ("base_model.layers", "transformer.h", "h")


def _module_list(model: nn.Module, path: str) -> Optional[nn.ModuleList]:
    owner: object = model
    for part in path.split("."):
        owner = getattr(owner, part, None)
    return owner if isinstance(owner, nn.ModuleList) and len(owner) > 0 else None


def _decoder_layers(model: nn.Module, layers: Optional[str]) -> tuple[str, nn.ModuleList]:
    """(qualified name, module) of the decoder layers a per-layer plan applies to: `layers` (a dotted
    path), else the first of KNOWN_LAYERS; else ValueError / TypeError naming the fix."""
    if layers is None:
        found = next((m for m in (_module_list(model, path) for path in KNOWN_LAYERS) if m is not None), None)
        if found is None:
            raise ValueError(f"tp_degrees: {type(model).__name__} has no decoder layers where oases looks "
                             f"({', '.join('model.' + k for k in KNOWN_LAYERS)}: a non-empty nn.ModuleList); "
                             f"pass layers='dotted.path' naming your nn.ModuleList of decoder layers "
                             f"(e.g. layers='blocks'), or tp_degrees=None")
    else:
        if not isinstance(layers, str):
            raise TypeError(f"layers: expected a dotted path (str) to the model's nn.ModuleList of decoder layers, "
                            f"e.g. layers='model.blocks', got {type(layers).__name__}")
        try:
            found = model.get_submodule(layers) if layers else None
        except AttributeError:
            found = None
        if found is None:
            raise ValueError(f"layers: {type(model).__name__} has no submodule {layers!r}; pass the dotted path of "
                             f"its nn.ModuleList of decoder layers, as model.named_modules() names it")
        if not isinstance(found, nn.ModuleList):
            raise TypeError(f"layers: model.{layers} is a {type(found).__name__}, not an nn.ModuleList; name the "
                            f"nn.ModuleList holding the decoder layers (one tp_degrees entry per element)")
        if len(found) == 0:
            raise ValueError(f"layers: model.{layers} is an empty nn.ModuleList; name the one holding the "
                             f"decoder layers")
    name = next((n for n, m in model.named_modules() if m is found), "")
    if not name:  # the model itself, or a ModuleList held outside the module tree
        raise ValueError(f"layers: the decoder layers must be a registered submodule of {type(model).__name__} "
                         f"(a name in model.named_modules()); pass layers='dotted.path' naming it")
    return name, found


def _check_degree_plan(model: nn.Module, tp_degrees: object, layers: Optional[str], styles: dict[str, _Style],
                       p: int) -> tuple[str, nn.ModuleList, tuple[int, ...]]:
    """(decoder layers' name, the layers, the degrees) of a per-layer plan, or ValueError / TypeError
    (local checks, the same on every rank, before any subgroup is made)."""
    prefix, found = _decoder_layers(model, layers)
    if isinstance(tp_degrees, Sequence) and not isinstance(tp_degrees, (str, bytes)) and len(tp_degrees) != len(found):
        raise ValueError(f"tp_degrees: expected one degree per layer of model.{prefix} ({len(found)} layers), got "
                         f"{len(tp_degrees)}: {list(tp_degrees)}; pass {len(found)} degrees"
                         + ("" if layers else ", or layers='dotted.path' naming other decoder layers"))
    degrees = check_tp_degrees(tp_degrees, len(found), p)
    if p > 1 and p != dist.get_world_size():
        raise ValueError(f"group: per-layer tp_degrees make subgroups on every rank of the world, so the group "
                         f"must be the whole world ({dist.get_world_size()} ranks), got {p} ranks")
    for pattern, style in styles.items():
        if style.kind in ("vocab", "vocab_head"):
            raise ValueError(f"plan[{pattern!r}]: {style.kind!r} is not supported with per-layer tp_degrees (the "
                             f"embedding and the LM head run replicated on every rank); remove it or pass "
                             f"tp_degrees=None")
    return prefix, found, degrees


def _degree_of(prefix: Optional[str], degrees: Optional[tuple[int, ...]], p: int) -> Callable[[str], int]:
    """name -> the TP degree of the module: its decoder layer's, else p (embedding, head, no plan)."""
    def degree(name: str) -> int:
        if prefix is None or not name.startswith(prefix + "."):
            return p
        return degrees[int(name[len(prefix) + 1:].split(".")[0])]
    return degree


def _replace(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, layer)


def _target_device(model: nn.Module, device: object, init_weights: object) -> Optional[torch.device]:
    """The device a meta-built model is materialised on (None: the model has real tensors)."""
    if not isinstance(init_weights, bool):
        raise TypeError(f"init_weights: expected a bool, got {init_weights!r}")
    on_meta = is_on_meta(model)
    if device is None:
        if on_meta:
            raise ValueError("model: has tensors on the meta device; pass device='cpu' (or 'cuda', ...) so that "
                             "parallelize allocates this rank's shards there")
        return None
    try:
        target = torch.device(device)
    except (TypeError, RuntimeError) as err:
        raise TypeError(f"device: expected a torch.device or a device string such as 'cpu', got {device!r}") from err
    if target.type == "meta":
        raise ValueError("device: 'meta' allocates nothing; pass the device this rank's shards live on")
    if not on_meta:
        raise ValueError("device: is for models built on the meta device (`with torch.device('meta'): "
                         "model = Cls(config)`); this one has real tensors: drop device= (or move the model "
                         "with model.to(device) first)")
    return target


def parallelize(
    model: nn.Module,
    group: Optional[dist.ProcessGroup] = None,
    plan: Optional[Mapping[str, str]] = None,
    *,
    sequence_parallel: bool = False,
    chunks: Optional[int] = None,
    tp_degrees: Optional[Sequence[int]] = None,
    layers: Optional[str] = None,
    device: Optional[Union[torch.device, str]] = None,
    init_weights: bool = True,
    allocate: Optional[Callable[[str], bool]] = None,
    vocab_parallel: bool = True,
) -> nn.Module:
    """Replace `model`'s nn.Linear (and, as planned, nn.Embedding) modules in place with their
    tensor-parallel shards; return `model`.

    ::

        for name, linear in model.named_modules() if an nn.Linear (a Conv1D: from_conv1d below):
            style = first plan[pattern] whose pattern matches name (or a dotted tail of it)
            "column[:N]" -> ColumnParallelLinear.from_linear(linear, group, stacked=N, ...)
            "column:qkv" -> ColumnParallelLinear.from_linear(linear, group, parts=(q, k, v) widths, ...)
            "row"        -> RowParallelLinear.from_linear(linear, group, ...)
            "vocab_head" -> ColumnParallelLinear.from_linear(linear, group, gather_output=True, ...)
            no match     -> left as it is (and listed in a warning)
        for name, embedding in model.named_modules() if isinstance(embedding, nn.Embedding):
            "vocab" (first "vocab" plan entry matching name) -> VocabParallelEmbedding.from_embedding(embedding, group)
            no match                                         -> left as it is (no warning)
        attention modules over sharded head projections: head counts made per-rank, full-width
            norms -> ShardedRMSNorm
        check_coverage: mostly replicated decoder layers -> ValueError (default plan) / warning

    Run it on every rank of `group` (default: the world) with the same model (same seed or the
    same checkpoint). `plan` None means DEFAULT_PLAN; an explicit plan replaces it (merge with
    `{**DEFAULT_PLAN, ...}` to extend it). `sequence_parallel` and `chunks` go to every layer.
    `tp_degrees` (one per decoder layer): decoder layer l is sharded over d_l ranks and runs on
    its replica's rows; the batch needs at least p / min(tp_degrees) rows. `layers` (only with
    tp_degrees): the dotted path of the nn.ModuleList of decoder layers, as model.named_modules()
    names it, for models whose layers are not at a KNOWN_LAYERS path::

        oases.parallelize(model, plan={"up": "column", "down": "row"}, tp_degrees=[1, 2, 2, 1], layers="blocks")
        # for l, layer in enumerate(model.blocks):   (the model's own loop)
        #     x [B, t, h] -> this replica's rows [B d_l / p, t, h]; every other [B, ...] tensor argument too
        #     x = layer(x, ...) (or its tuple's first element), sharded over d_l ranks
        # after model.blocks[-1]: x -> [B, t, h] on every rank

    The contract a model keeps for this to be exact is in the module docstring (batch-first hidden
    states as the first argument, per-example tensors with first dim B, rows independent).

    A model built on the meta device (`with torch.device("meta"): model = Cls(config)`) takes
    `device`: only this rank's shards (and the replicated tensors) are allocated there, and
    init_weights=True gives them the values `Cls(config)` would have had, built on the CPU from
    the CPU random state of this call (so every TP degree and per-layer plan holds the same full
    model), replayed one module at a time (oases.nn._materialize: peak = this rank's tensors plus
    one module's full tensors). init_weights=False leaves them uninitialised, for weights that
    oases.load_pretrained or oases.load_checkpoint fill next (no draws, no full tensor).
    `vocab_parallel` (with plan=None): shard the input embedding and the LM head over the vocabulary
    (see the module docstring; not with per-layer tp_degrees, where they stay replicated).
    `allocate(name) -> bool` (with device): which tensors (by qualified name, as
    model.named_parameters() / named_buffers() give it) this rank holds; the others stay on meta
    (a pipeline stage holding some layers), their random draws still made, so every held tensor
    has the values of the whole model's build.
    A torch.compile'd model (OptimizedModule): its original module is sharded in place and the
    compiled wrapper returned (it traces the sharded model on its next call).
    """
    compiled, model = model, original_module(model)
    ring = ring_of(group)
    p = ring.size
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    target = _target_device(model, device, init_weights)
    if allocate is not None and (target is None or not callable(allocate)):
        raise TypeError("allocate: a callable name -> bool, only with device= (a model built on meta)")
    config = getattr(model, "config", None)
    if target is not None and getattr(config, "tie_word_embeddings", False) is True and callable(
            getattr(model, "tie_weights", None)):
        model.tie_weights()  # transformers < 5.x ties a meta-built model's head only when it inits weights
    if isinstance(model, nn.Linear):
        raise TypeError("model: is itself an nn.Linear; use ColumnParallelLinear.from_linear or "
                        "RowParallelLinear.from_linear for a single layer")
    if isinstance(model, nn.Embedding):
        raise TypeError("model: is itself an nn.Embedding; use VocabParallelEmbedding.from_embedding")
    if chunks is not None:
        _checks.chunks_arg(chunks)
    if layers is not None and tp_degrees is None:
        raise ValueError(f"layers={layers!r}: names the decoder layers of a per-layer plan, and no tp_degrees "
                         f"was given; pass tp_degrees=[one degree per layer] too, or drop layers")
    if tp_degrees is not None and sequence_parallel:
        raise ValueError("sequence_parallel=True: not supported with per-layer tp_degrees (layers of different "
                         "degrees split the batch rows, not the sequence); pass sequence_parallel=False")
    _check_no_adapters(model)
    hf = _transformers_module(model) if sequence_parallel else None
    if hf is not None:
        raise ValueError(
            f"sequence_parallel=True: {hf} is a Hugging Face transformers model, whose embeddings, "
            "norms and attention expect the whole sequence on every rank; sequence parallelism needs "
            "a model written for [s/p, b, h] activations. Use sequence_parallel=False here, and "
            "oases.train_step(model, ..., sequence_parallel=True) for sequence parallelism in training"
        )
    if not isinstance(vocab_parallel, bool):
        raise TypeError(f"vocab_parallel: expected a bool, got {vocab_parallel!r}")
    default = plan is None
    plan = DEFAULT_PLAN if plan is None else plan
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan: expected a mapping of module-name patterns to 'column' or 'row', "
                        f"got {type(plan).__name__}, e.g. {{'*.q_proj': 'column', '*.o_proj': 'row'}}")
    styles = {pattern: _parse_style(pattern, value) for pattern, value in plan.items()}
    if default and vocab_parallel and tp_degrees is None and p > 1:
        styles.update(_vocab_entries(model))
    linears = {name: m for name, m in model.named_modules() if name and (isinstance(m, nn.Linear) or is_conv1d(m))}
    embeddings = {name: m for name, m in model.named_modules() if name and isinstance(m, nn.Embedding)}

    prefix, decoder_layers, degrees = None, None, None
    if tp_degrees is not None:
        prefix, decoder_layers, degrees = _check_degree_plan(model, tp_degrees, layers, styles, p)
    degree = _degree_of(prefix, degrees, p)  # p for every module without tp_degrees
    placed = _plan_layers(linears, {k: s for k, s in styles.items() if s.kind not in ("vocab", "experts")})
    placed_embeddings = _plan_layers(embeddings, {k: s for k, s in styles.items() if s.kind == "vocab"})
    experts = _moe.find_experts(model)
    placed_experts = _plan_layers(experts, {k: s for k, s in styles.items() if s.kind == "experts"})
    _check_kinds(styles, linears, embeddings)
    _resolve_qkv(model, placed, linears)
    columns = {n: (s.stacked, s.parts) for n, s in placed.items() if s.kind == "column"}
    for name, replicas in _kv.plan_replicas(model, columns, degree, degrees is not None).items():
        placed[name] = dataclasses.replace(placed[name], replicas=replicas)  # kv heads at p > kv_heads
    for name, style in placed.items():
        _check_layers({name: style}, linears, degree(name))
    for name in placed_embeddings:
        embedding = embeddings[name]
        check_embedding(f"{name} (nn.Embedding {embedding.num_embeddings} x {embedding.embedding_dim}, "
                        f"planned as 'vocab')", embedding, p)
    tied = _check_ties(model, [n for n, s in placed.items() if s.kind == "vocab_head"] + list(placed_embeddings))
    attention = _attention_modules(model, placed)
    norms = {}  # {attention: {norm child: (eps, unit_offset)}}: norms over a sharded projection's whole width
    for name, module in attention.items():
        if type(module).__name__ in _UNSHARDABLE_ATTENTION:
            raise ValueError(f"{name}: {type(module).__name__} {_UNSHARDABLE_ATTENTION[type(module).__name__]}, so its "
                             f"heads cannot be split across ranks; leave its projections out of the plan (plan= "
                             f"without them) or use TP degree 1 for this model")
        if degrees is not None and _alibi.takes_head_biases(module):
            raise ValueError(f"{name}: tp_degrees with an attention that takes per-head biases from the base model "
                             f"(ALiBi: {type(module).__name__}) is not supported yet (its rows are not cut to a "
                             f"replica's); parallelize without tp_degrees")
        _heads.check_heads(name, module, degree(name))
        widths = {child: _features(sub)[1] for child, sub in module.named_children()
                  if placed.get(f"{name}.{child}" if name else child, _Style("row")).kind == "column"}
        _heads.check_widths(name, module, widths)
        found = _heads.full_width_norms(module, widths)
        norms[name] = {child: _heads.check_norm_form(f"{name}.{child}", module.get_submodule(child))
                       for child in found}
    routers = _moe.check_blocks(model, {n: experts[n] for n in placed_experts}, {n: s.kind for n, s in placed.items()},
                                degree, p)  # MoE blocks' replicated routers and gates
    explicit = plan is not DEFAULT_PLAN
    if p > 1:
        skip = frozenset(i for i, d in enumerate(degrees or ()) if d == 1)
        _summary.check_coverage(model, {n for n, s in placed.items() if s.kind in ("column", "row")}
                                | set(placed_experts), explicit, skip)
    _check_parts(model, placed, linears)

    original = copy.deepcopy(model) if target is not None else None  # the meta build, for its init (no memory)
    groups = {p: group}  # {degree: this rank's TP group at that degree}
    if degrees is not None:  # collective: every rank of the world makes every subgroup
        placements, row_groups = make_placements(group or dist.group.WORLD, p, ring.rank, degrees)
        groups.update((d, at.tp_group) for d, at in placements.items() if d < p)
    # q, k, v (gate, up) share one all-reduce of their input's gradient, one entry per group
    entries = {d: _SharedEntry(g) for d, g in groups.items()}
    counts = {c for s in placed.values() for c in s.replicas if c > 1}
    replica_groups = _kv.replica_groups(group, counts) if counts else {}  # collective over the world
    for name, style in placed.items():  # nothing is changed before every check has passed
        linear, d = linears[name], degree(name)
        if d == 1 < p:
            continue  # a decoder layer of degree 1 stays unsharded (its replica's rows, on this rank alone)
        column, row = ((ColumnParallelLinear.from_conv1d, RowParallelLinear.from_conv1d) if is_conv1d(linear)
                       else (ColumnParallelLinear.from_linear, RowParallelLinear.from_linear))
        if style.kind == "column":
            layer = column(linear, groups[d], stacked=style.stacked, parts=style.parts, replicas=style.replicas,
                           replica_group=replica_groups.get(max(style.replicas, default=1)),
                           sequence_parallel=sequence_parallel, chunks=chunks)
            layer._entry = entries[d]
        elif style.kind == "vocab_head":  # the full logits, for the model's own forward and loss
            layer = column(linear, group, gather_output=True, pad_vocab=True,
                           sequence_parallel=sequence_parallel, chunks=chunks)
        else:
            layer = row(linear, groups[d], sequence_parallel=sequence_parallel, chunks=chunks)
        _replace(model, name, layer)
    for name in placed_embeddings:
        _replace(model, name, VocabParallelEmbedding.from_embedding(embeddings[name], group))
    for name in placed_experts:
        if not degree(name) == 1 < p:
            _moe.shard_experts(model, name, groups[degree(name)])
    for embedding, head in tied:  # one shard serves both ends of the tie (same rows, same rule)
        model.get_submodule(head).weight = model.get_submodule(embedding).weight
    if target is not None:  # before any hook is registered on a parameter
        materialize(model, original, target, init_weights, allocate or (lambda name: True))
        del original
    for name, module in attention.items():
        d = degree(name)
        if not d == 1 < p:
            full_heads = _heads.heads(module)[0]
            if full_heads is not None:  # ALiBi slopes from the base model: this rank's heads' rows
                _alibi.slice_head_biases(module, full_heads, groups[d])
            _heads.shard_head_parameters(module, groups[d])  # GPT-OSS's sinks: this rank's heads (full counts)
            _heads.localize_heads(module, d)
            _heads.shard_norms(module, norms[name], groups[d])
            _heads.sum_head_shared_grads(module, groups[d])
    for name in placed_experts:  # each MoE block one TP region: one all-reduce, router gradients summed
        if not degree(name) == 1 < p:
            _moe.make_region(model, name, _summary.ROUTERS)
    if degrees is not None:
        sums_on = [True]  # oases.train_step turns the hooks off: its schedule sums the replicas itself
        for layer, d in zip(decoder_layers, degrees):
            if d < p:  # each replica saw its rows only: sum the gradients over the replicas
                for param in layer.parameters():
                    if param.requires_grad:
                        param.register_hook(functools.partial(sum_over_replicas_while, sums_on,
                                                              group=placements[d].replica_group))
        model._oases_degree_groups = DegreeGroups(placements, row_groups, sums_on)  # read by oases.models.hf
        hook_decoder_layers(decoder_layers, degrees, p, placements, row_groups, where=prefix)
        model.tp_degrees = degrees  # oases.train_step reads it (HF: runs it on the schedules)

    unplaced = [name for name in linears if name not in placed and name not in routers]
    unused = [pattern for pattern, s in styles.items() if explicit and s.kind != "vocab"
              and not any(_matches(n, pattern) for n in (experts if s.kind == "experts" else linears))]
    unused_vocab = [pattern for pattern, s in styles.items()
                    if s.kind == "vocab" and not any(_matches(n, pattern) for n in embeddings)]
    whole = _summary.whole_layers(model) if p > 1 else ""
    if unplaced or unused or unused_vocab or whole:
        message = "oases.parallelize:" + whole
        if unplaced:
            kind = "nn.Linear / Conv1D" if any(is_conv1d(linears[n]) for n in unplaced) else "nn.Linear"
            message += (f" left {len(unplaced)} {kind} module(s) unsharded (replicated on every rank; "
                        f"no plan pattern matches them): {', '.join(unplaced)}." + _summary.report(model, unplaced))
        if unused:
            message += f" Plan patterns matching no nn.Linear: {', '.join(map(repr, unused))}."
        if unused_vocab:
            message += f" Plan patterns matching no nn.Embedding: {', '.join(map(repr, unused_vocab))}."
        warnings.warn(message, UserWarning, stacklevel=2)
    if not sequence_parallel:  # every rank of the group must get the same inputs (a sequence-parallel one: its slice)
        watch_inputs(model, group)
    return compiled
