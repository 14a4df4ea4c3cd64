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
and no projection left out, a row layer fed by a column layer of its module, an attention's head
count found under a known name or a head_dim, no tie of a planned projection, each planned
projection a plain nn.Linear / Conv1D: no forward of its own, no other parameters, buffers or
submodules, no hooks, no parametrization, all of which the parallel layer would drop) runs on
every rank before anything is replaced, so a bad plan raises a ValueError naming the module and
leaves the model as it was, on every rank alike. PEFT's LoRA layers (peft.tuners.lora.Linear
around a planned linear) are sharded with their adapters, cut like their base layer (oases.nn.lora:
a column layer's B split on its rows, a row layer's A on its columns); other adapters, and LoRA
settings oases does not support (lora_dropout, DoRA, ...), are refused the same way, by name.

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
Experts stored as Mixtral's ([E, 2I, H] gate | up, [E, H, I] down), GPT-OSS's (transposed, gate
and up interleaved, with biases: the down bias added in one rank's partial sum) or DBRX's (packed
w1 / v1 / w2 [E*I, H], each expert's rows cut) are recognised (oases.nn.experts); another fused
layout planned "experts" (Llama-4's transposed one, Nemotron-H's ungated one) is refused by name.

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
groups, is refused.

Multi-head latent attention (DeepSeek-V2/V3, oases.nn._latent): the per-head up-projections
(q_b_proj or q_proj, kv_b_proj) column-parallel by heads, o_proj row-parallel, the low-rank
down-projections (LATENT_PROJECTIONS), their norms and the rotary key shared by every head
replicated with their gradients summed; the attention is one TP region (its input's gradient
all-reduced once at its entry, as an MoE block's).

A fused q/k/v projection is cut as its attention's forward reads it. Where the class fixes the
layout (oases.nn._heads.FUSED_LAYOUTS) the layout decides, whatever column variant the plan gives:
[q | k | v] blocks by the head counts (DBRX's Wqkv, multi-query GPTBigCode's c_attn and Falcon's
query_key_value: [q (heads * d) | k (d) | v (d)], K / V held by every rank), head by head
(GPT-NeoX, BLOOM, Persimmon, multi-head GPTBigCode and Falcon: whole-width shards) or group by
group (Falcon's new_decoder_architecture, [q (heads / kv_heads) | k | v] per kv head: whole groups,
so a TP degree above num_kv_heads is refused). Elsewhere the plan decides ("column:3" thirds for
GPT-2 and nanoGPT, "column:qkv" for Phi-3). Per architecture:

    transformers 5.x Llama/Mistral/Qwen2   views with (..., -1, head_dim) and reads only head_dim and
                                           num_key_value_groups: nothing to change
    transformers GPT-NeoX                  views with (..., -1, 3 * head_size): nothing to change
    transformers Falcon, BLOOM             num_heads, num_kv_heads, hidden_size, split_size; ALiBi cut
    transformers GPTBigCode                num_heads, kv_heads, embed_dim, split_size (multi-query:
                                           num_key_value_groups made this rank's query heads)
    transformers DBRX                      num_heads, num_key_value_heads, hidden_size; fused Wqkv
    transformers Phi-3                     config.num_attention_heads (the config view), fused qkv
    transformers GPT-2                     num_heads, embed_dim, split_size; Conv1D projections
    transformers OLMo-2                    full-width q_norm / k_norm -> ShardedRMSNorm
    nanoGPT-style                          n_head, n_embd (its forward must view with -1 rather
                                           than the input's width, C // n_head)
    BERT-style self-attention              num_attention_heads, all_head_size

Other parameters of a dense region (an MLP between its column and row layers) are placed by
where their gradient comes from (oases.nn._region_parameters): one entry per inner feature
(a learned per-channel gate or scale): sharded with the features; a child's other parameters (a
learned activation's scalars, Apertus' xIELU): their gradient summed over the group; the region's
own other parameters left whole (they see its input or its reduced output); norms over the inner
width: refused by name. What no rule sees (the region's own scalar applied to its shards, a hook)
is caught at run time by oases.check_gradients (oases.train_step's first step).

Sequence parallelism (sequence_parallel=True) is for models written for it: activations between
blocks are [s/p, b, h] sequence shards and the model itself sums its norms' gradients over the
ranks. Hugging Face models are not, so asking for it on one raises a ValueError; for them,
`oases.train_step(model, ..., sequence_parallel=True)` keeps the residual stream sequence-sharded
between sublayers itself.

Per-layer TP degrees (tp_degrees=[d_0, ..., d_{L-1}], one per decoder layer, each a power of two
dividing p; e.g. oases.plan.load(path)): decoder layer l is sharded over d_l ranks and runs on its
replica's rows, by hooks on the decoder layers; the pseudo-code, the contract a model must keep and
the checks are oases.degrees.hooks' (module docstring).
"""

from __future__ import annotations

import copy
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from oases._checks import process_group
from oases._compiled import original_module
from oases.comm.topology import ring_of
from oases.degrees import KNOWN_LAYERS
from oases.inputs import watch_inputs
from oases.nn._apply import (
    hook_degrees,
    localize_heads,
    make_groups,
    make_moe_regions,
    place_region_parameters,
    shard_modules,
    warn_unplaced,
)
from oases.nn._heads import PER_RANK_ATTRIBUTES
from oases.nn._layer_args import is_conv1d
from oases.nn._moe import find_experts
from oases.nn._plan_checks import check_arguments, check_degree_plan, check_model, check_plan
from oases.nn._styles import ResolvedPlan, Style, parse_style, place, vocab_entries
from oases.nn.lora import set_aside
from oases.nn.materialize import materialize
from oases.nn.parallelism import Parallelism, record
from oases.nn.parts import HEAD_PROJECTIONS

__all__ = ["parallelize", "DEFAULT_PLAN", "HEAD_PROJECTIONS", "KNOWN_LAYERS", "PER_RANK_ATTRIBUTES"]

DEFAULT_PLAN: Mapping[str, str] = MappingProxyType(
    {
        # LLaMA, Mistral, Qwen2/3, Gemma, OLMo-2 (Hugging Face naming)
        "q_proj": "column",
        "k_proj": "column",
        "v_proj": "column",
        "o_proj": "row",
        "gate_proj": "column",
        "up_proj": "column",
        "down_proj": "row",
        # Phi-3: fused [q | k | v] (blocks of the attention's head counts: GQA's differ) and [gate | up]
        "qkv_proj": "column:qkv",
        "gate_up_proj": "column:2",
        # DeepSeek-V2/V3 multi-head latent attention: the per-head up-projections (q_proj without
        # q_lora_rank), o_proj row; the low-rank q_a_proj / kv_a_proj_with_mqa stay replicated
        "q_b_proj": "column",
        "kv_b_proj": "column",
        # DBRX: fused Wqkv, [q | k | v] with grouped key-value heads (clip_qkv clamps elementwise: per shard)
        "Wqkv": "column:qkv",
        # GPT-NeoX, Falcon: query_key_value is laid out head by head, so whole-block shards keep
        # whole heads; "dense" alone is too common a name (BERT's MLP has one), so only attention's
        "query_key_value": "column",
        "*attention.dense": "row",
        "dense_h_to_4h": "column",
        "dense_4h_to_h": "row",
        # Phi, OPT, GPT-J, BLOOM-style names: attention's output (out_proj, Phi's self_attn.dense) and a
        # two-linear MLP (fc1 / fc2, fc_in / fc_out)
        "*self_attn.dense": "row",
        "out_proj": "row",
        "fc1": "column",
        "fc2": "row",
        "fc_in": "column",
        "fc_out": "row",
        # nanoGPT, GPT-2 (Conv1D): c_attn's outputs are [q | k | v], each third sharded on its own
        "c_attn": "column:3",
        "c_fc": "column",
        "c_proj": "row",
        # Mixtral, Qwen2/3-MoE: routed experts fused in 3-D tensors, each expert sharded on its intermediate dim
        "experts": "experts",
    }
)


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
    model), replayed one module at a time (oases.nn.materialize: peak = this rank's tensors plus
    one module's full tensors); outside Hugging Face models, a class defining its own `_init_weights`
    or `init_weights` (nanoGPT's apply) cannot be replayed: a ValueError, before anything is changed.
    init_weights=False leaves them uninitialised, for weights that
    oases.load_pretrained or oases.load_checkpoint fill next (no draws, no full tensor).
    `vocab_parallel` (with plan=None): shard the input embedding and the LM head over the vocabulary
    (see the module docstring; not with per-layer tp_degrees, where they stay replicated).
    `allocate(name) -> bool` (with device): which tensors (by qualified name, as
    model.named_parameters() / named_buffers() give it) this rank holds; the others stay on meta
    (a pipeline stage holding some layers), their random draws still made, so every held tensor
    has the values of the whole model's build.
    A torch.compile'd model (OptimizedModule): its original module is sharded in place and the
    compiled wrapper returned (it traces the sharded model on its next call).

    Args:
        model: the model to shard in place (with real tensors, built on meta, or torch.compile'd).
        group: the tensor-parallel process group, or a 1-D DeviceMesh such as `mesh["tp"]` (default None:
            the world).
        plan: {pattern: style} (default None: DEFAULT_PLAN, plus the embedding and LM head as
            `vocab_parallel` says); an explicit plan replaces it.
        sequence_parallel: passed to every layer (a Hugging Face model: ValueError).
        chunks: passed to every layer (None: the ops choose).
        tp_degrees: one TP degree per decoder layer, each a power of two dividing p (None: every layer at p).
        layers: with tp_degrees, the dotted path of the decoder layers' nn.ModuleList (None: a KNOWN_LAYERS path).
        device: only for a model built on meta: where this rank's shards and replicated tensors are allocated.
        init_weights: with device, give them `Cls(config)`'s values (False: leave them uninitialised).
        allocate: with device, `allocate(name) -> bool`: which tensors this rank holds (None: all of them).
        vocab_parallel: with plan=None, shard the input embedding and the LM head over the vocabulary.

    Returns:
        `model`, sharded in place (a torch.compile'd model: the compiled wrapper). What it was made
        into is kept on it as one record, `model.oases_parallelism` (an oases.nn.parallelism.Parallelism:
        the group and its size, the per-layer degrees), which oases.train_step
        reads. With tp_degrees it also keeps them as `model.layer_degrees` (an
        oases.degrees.LayerDegrees: the degrees, this rank's placements and groups) and
        `model.tp_degrees` (the degrees, a tuple).

    Raises:
        ValueError: a bad plan or argument (naming the module or argument), raised on every rank before
            anything is replaced; with the default plan, less than half of the decoder layers' projection
            parameters sharded.
        TypeError: a plan that is not a mapping, a bad argument type, or a `layers` path that does not
            name an nn.ModuleList.
    """
    compiled, model = model, original_module(model)
    group = process_group(group)  # a 1-D DeviceMesh (torch's parallelize_module takes mesh["tp"]): its group
    ring = ring_of(group)
    p = ring.size
    target = check_model(model, device, init_weights, allocate)  # None: a model with real tensors
    if target is not None:
        _tie_meta_head(model)
    check_arguments(model, chunks, tp_degrees, layers, sequence_parallel, vocab_parallel)
    # PEFT's LoRA layers: their base linears planned and sharded as any, the adapters put back around them (lora)
    adapters = set_aside(model, tp_degrees=tp_degrees, on_meta=target is not None, sequence_parallel=sequence_parallel)
    try:
        styles = _resolve_styles(model, plan, vocab_parallel and tp_degrees is None and p > 1)
        resolved = _match_modules(model, styles, plan is not None and plan is not DEFAULT_PLAN, tp_degrees, layers, p)
        inherited = frozenset(k for k, v in DEFAULT_PLAN.items() if plan is not None and plan.get(k) == v)
        if 2 * len(inherited) >= len(DEFAULT_PLAN):  # {**DEFAULT_PLAN, ...} (some removed): not the caller's patterns
            resolved.inherited = inherited
        check_plan(model, resolved, p)  # every check, on every rank alike, before anything is changed
        adapters.check_planned(resolved.placed)
    except BaseException:
        adapters.restore()  # the model as it was
        raise

    original = copy.deepcopy(model) if target is not None else None  # the meta build, for its init (no memory)
    groups = make_groups(group, ring.rank, p, resolved)  # collectives over the world
    shard_modules(model, resolved, groups, p, sequence_parallel=sequence_parallel, chunks=chunks)
    if target is not None:  # before any hook is registered on a parameter
        materialize(model, original, target, init_weights, allocate or (lambda name: True))
        del original
    localize_heads(resolved, groups, p)
    place_region_parameters(model, resolved, groups)
    make_moe_regions(model, resolved, p)
    hook_degrees(model, resolved, groups)
    warn_unplaced(model, resolved, p)
    adapters.put_back()  # oases' LoRA layers around the sharded linears (PEFT's around those left whole)
    record(model, Parallelism(group, p, groups.degrees))  # what oases.train_step reads
    if not sequence_parallel:  # every rank of the group must get the same inputs (a sequence-parallel one: its slice)
        watch_inputs(model, group)
    return compiled


def _tie_meta_head(model: nn.Module) -> None:
    """transformers < 5.x ties a meta-built model's head only when it inits weights: tie it here."""
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) is True and callable(getattr(model, "tie_weights", None)):
        model.tie_weights()


def _resolve_styles(model: nn.Module, plan: Optional[Mapping[str, str]], vocab: bool) -> dict[str, Style]:
    """{pattern: Style} of `plan` (None: DEFAULT_PLAN, with the model's embedding and head planned
    "vocab" / "vocab_head" when `vocab`), or a TypeError / ValueError naming the bad entry."""
    default = plan is None
    plan = DEFAULT_PLAN if default else plan
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"plan: expected a mapping of module-name patterns to 'column' or 'row', "
            f"got {type(plan).__name__}, e.g. {{'*.q_proj': 'column', '*.o_proj': 'row'}}"
        )
    styles = {pattern: parse_style(pattern, value) for pattern, value in plan.items()}
    if default and vocab:
        styles.update(vocab_entries(model))
    return styles


def _match_modules(
    model: nn.Module,
    styles: dict[str, Style],
    explicit: bool,
    tp_degrees: Optional[Sequence[int]],
    layers: Optional[str],
    p: int,
) -> ResolvedPlan:
    """The plan resolved against `model`: its projections, embeddings and experts, the style of each
    one a pattern places (the first matching, in plan order), and each module's TP degree."""
    prefix, decoder_layers, degrees = None, None, None
    if tp_degrees is not None:
        prefix, decoder_layers, degrees = check_degree_plan(model, tp_degrees, layers, styles, p)
    linears = {name: m for name, m in model.named_modules() if name and (isinstance(m, nn.Linear) or is_conv1d(m))}
    embeddings = {name: m for name, m in model.named_modules() if name and isinstance(m, nn.Embedding)}
    experts = find_experts(model)
    return ResolvedPlan(
        styles,
        explicit,
        linears,
        embeddings,
        experts,
        placed=place(linears, {k: s for k, s in styles.items() if s.kind not in ("vocab", "experts")}),
        placed_embeddings=place(embeddings, {k: s for k, s in styles.items() if s.kind == "vocab"}),
        placed_experts=place(experts, {k: s for k, s in styles.items() if s.kind == "experts"}),
        degree=_degree_of(prefix, degrees, p),
        prefix=prefix,
        decoder_layers=decoder_layers,
        degrees=degrees,
    )


def _degree_of(prefix: Optional[str], degrees: Optional[tuple[int, ...]], p: int) -> Callable[[str], int]:
    """name -> the TP degree of the module: its decoder layer's, else p (embedding, head, no plan)."""

    def degree(name: str) -> int:
        if prefix is None or not name.startswith(prefix + "."):
            return p
        return degrees[int(name[len(prefix) + 1 :].split(".")[0])]

    return degree
