"""Give a model built on the meta device real values, keeping only this rank's shards.

    with torch.device("meta"):
        model = Cls(config)                               # no memory, no random draws
    values = replay_init(meta_copy, shard_of, device)     # {id(meta tensor): local tensor on device}

Which values. The ones `Cls(config)` would have had if built on the CPU from the CPU random state at
the call (so, with `torch.manual_seed(s)` before the meta build, those of `torch.manual_seed(s);
Cls(config)`), and the random state is left where that build leaves it. The build is replayed in
its two passes, one module at a time, each module's tensors materialised full-size on the CPU,
cut to this rank's part and dropped (peak: the local parts plus one module's full tensors):

    pass 1, construction: for module in post_order(model):     # children (registration order) first
        module.reset_parameters()                              # torch's own modules (nn.Linear's
                                                               # kaiming draws), HF Conv1D's normal_
    pass 2, Hugging Face post_init (a transformers PreTrainedModel only):
        for module in post_order(model):                       # PreTrainedModel.initialize_weights'
            owner._init_weights(module)                        # order and dispatch to sub-models

A tensor reachable under several names (tied weights) takes its values from its first name in
`named_parameters()` order (Hugging Face ties the later name to the first after its init); the
draws of the other names still happen, and are discarded. A pass-2 init that leaves part of a
tensor unwritten keeps pass 1's values there (written entries are told apart by a NaN fill). A
tensor neither pass writes (a plain nn.Parameter(torch.randn(...)) of a custom module, a buffer
computed in a constructor outside Hugging Face's init) cannot be recovered from a meta build:
`replay_init` raises a ValueError naming it, before anything is allocated beyond the replay.
Neither can an initialisation of a model's own outside a Hugging Face model (nanoGPT's
`self.apply(self._init_weights)`, torchtitan's `init_weights()`): a class of the model that defines
`_init_weights` or `init_weights` is refused by name before any draw. One that re-initialises in a
plain loop of its constructor, with no such method, cannot be seen and is not replayed.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Iterator, Mapping, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from oases._sharding import tp_rules
from oases.comm.topology import ring_of

__all__ = ["materialize", "replay_init", "empty_init", "is_on_meta", "check_replayable"]

# Constructors that draw without a reset_parameters method, by class name: {name: draw(module)}.
_CONSTRUCTOR_DRAWS: Mapping[str, Callable[[nn.Module], None]] = MappingProxyType(
    {
        "Conv1D": lambda m: nn.init.normal_(m.weight, std=0.02),  # transformers.pytorch_utils.Conv1D
    }
)

ShardOf = Callable[[str, torch.Tensor], torch.Tensor]  # (qualified name, full tensor) -> this rank's part


def is_on_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` is on the meta device."""
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def _is_pretrained(module: nn.Module) -> bool:
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.") for c in type(module).__mro__
    )


def _post_order(module: nn.Module, init: Callable[[nn.Module], None]) -> Iterator[tuple[nn.Module, Callable]]:
    """(module, its init function) in PreTrainedModel.initialize_weights' order: children first,
    each sub-model (a PreTrainedModel) with its own _init_weights."""
    for child in module.children():
        yield from _post_order(child, child._init_weights if _is_pretrained(child) else init)
    yield module, init


class _MetaWrites(TorchDispatchMode):
    """Records in-place ops on meta tensors (an init writing tensors it was not given stand-ins for)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.is_mutable and any(
            isinstance(a, torch.Tensor) and a.is_meta for a in (*args, *kwargs.values())
        ):
            self.ops.add(func.__name__)
        return func(*args, **kwargs)


def _unwritten_fill(t: torch.Tensor) -> torch.Tensor:
    """Fill `t` with a value no init writes (NaN; the smallest integer for integer tensors)."""
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(False)
    return t.fill_(torch.iinfo(t.dtype).min)


def _written(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        return ~torch.isnan(t)
    if t.dtype == torch.bool:
        return torch.ones_like(t)  # cannot tell: a bool buffer counts as written
    return t != torch.iinfo(t.dtype).min


class _Replay:
    """The values built so far: {id(meta tensor): this rank's part on `device`}."""

    def __init__(
        self,
        model: nn.Module,
        shard_of: ShardOf,
        device: torch.device,
        allocate: Callable[[str], bool] = lambda name: True,
    ) -> None:
        self.shard_of, self.device, self.allocate = shard_of, device, allocate
        self.values: dict[int, torch.Tensor] = {}
        self.canonical: dict[int, str] = {}  # id(tensor) -> the name whose writes count
        for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)
        ):
            self.canonical.setdefault(id(t), name)
        self.names: dict[int, str] = {id(m): n for n, m in model.named_modules()}
        self.partial: set[str] = set()  # names some of whose entries no init has written yet

    def run(self, module: nn.Module, init: Callable[[nn.Module], None]) -> None:
        """Run `init(module)` on full-size CPU stand-ins of the module's own meta tensors (filled
        with a value no init writes) and keep this rank's part of what it wrote, for each tensor's
        canonical name only; entries it did not write keep their earlier values."""
        slots = [(module._parameters, n) for n, t in module._parameters.items() if t is not None and t.is_meta]
        slots += [(module._buffers, n) for n, t in module._buffers.items() if t is not None and t.is_meta]
        prefix = self.names[id(module)]
        originals = [store[n] for store, n in slots]
        stand_ins = []
        for (store, n), meta in zip(slots, originals):
            full = _unwritten_fill(torch.empty(meta.shape, dtype=meta.dtype, device="cpu"))
            store[n] = nn.Parameter(full, requires_grad=False) if isinstance(meta, nn.Parameter) else full
            stand_ins.append(full)
        try:
            with torch.no_grad(), _MetaWrites() as stray:
                init(module)
        finally:
            for (store, n), meta in zip(slots, originals):
                store[n] = meta
        if stray.ops:
            raise ValueError(
                f"model: built on the meta device, and the initialisation of {prefix or type(module).__name__} "
                f"({type(module).__name__}) also writes tensors outside that module ({', '.join(sorted(stray.ops))} on "
                f"meta tensors), which oases cannot replay module by module; pass init_weights=False and load the "
                f"values (oases.load_pretrained / oases.load_checkpoint), or build the model on a real device"
            )
        for meta, full, (_, n) in zip(originals, stand_ins, slots):
            name = f"{prefix}.{n}" if prefix else n
            if self.canonical.get(id(meta)) != name or not self.allocate(name):
                continue  # a tied alias, or a tensor this rank does not hold: drawn, discarded
            written = ~self.shard_of(name, ~_written(full))  # a padded shard's padding counts as written (zeros)
            if not bool(written.any()):
                continue
            part = self.shard_of(name, full)
            kept = self.values.get(id(meta))
            if bool(written.all()):
                self.values[id(meta)] = part.to(self.device, copy=True)
                self.partial.discard(name)
            elif kept is None:
                self.values[id(meta)] = part.to(self.device, copy=True)
                self.partial.add(name)  # unless a later pass writes the rest
            else:
                kept.copy_(torch.where(written.to(kept.device), part.to(kept.device), kept))


def _reset(module: nn.Module) -> None:
    draw = _CONSTRUCTOR_DRAWS.get(type(module).__name__)
    if draw is not None:
        draw(module)
    elif callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()
    elif callable(getattr(module, "_reset_parameters", None)):  # nn.MultiheadAttention
        module._reset_parameters()


def _construct(module: nn.Module, root: nn.Module, replay: "_Replay", initialized: set[int]) -> None:
    """Pass 1 over `module`'s subtree in construction order: children in registration order, then
    the module's own reset (a constructor builds its children, then calls its reset_parameters at
    its end, as nn.MultiheadAttention does); a Hugging Face sub-model inside is built whole where
    it stands, its own post_init included."""
    if module is not root and _is_pretrained(module):
        _build_pretrained(module, replay, initialized)
        return
    for child in module.children():
        _construct(child, root, replay, initialized)
    if _draws_at_construction(module):
        replay.run(module, _reset)


def _build_pretrained(model: nn.Module, replay: "_Replay", initialized: set[int]) -> None:
    """A PreTrainedModel's __init__: its modules' constructors (sub-models built and initialised
    on the way), then its post_init: _init_weights over its modules not yet initialised, post-order."""
    _construct(model, model, replay, initialized)
    for module, init in _post_order(model, model._init_weights):
        if id(module) not in initialized:
            replay.run(module, init)
            initialized.add(id(module))


_OWN_INITS = ("_init_weights", "init_weights")  # a model's initialisation by convention (nanoGPT, torchtitan)


def check_replayable(model: nn.Module) -> None:
    """ValueError, before anything is changed, for a meta-built model whose own initialisation
    (a class defining one of _OWN_INITS, outside Hugging Face models) replay_init cannot replay."""
    own = [f"{method} ({where or 'the model'})" for method, where in _own_inits(model).items()]
    if own:
        raise ValueError(
            f"model: built on the meta device, with an initialisation of its own that oases cannot replay "
            f"({', '.join(own)}): only each module's reset_parameters() (and a Hugging Face model's "
            f"_init_weights) is replayed, so init_weights=True would not give the values of the model built on "
            f"the CPU; pass init_weights=False and load the values (oases.load_pretrained / "
            f"oases.load_checkpoint) or run your initialisation on the shards, or build the model on a real device"
        )


def _own_inits(module: nn.Module, prefix: str = "", found: Optional[dict[str, str]] = None) -> dict[str, str]:
    """{'Class.method': the first module name} for the modules of the tree outside Hugging Face
    models whose class (not torch's) defines one of _OWN_INITS."""
    found = {} if found is None else found
    if _is_pretrained(module):
        return found  # its _init_weights is replayed (_build_pretrained)
    for cls in type(module).__mro__:
        if not cls.__module__.startswith("torch."):
            for name in _OWN_INITS:
                if name in vars(cls):
                    found.setdefault(f"{cls.__name__}.{name}", prefix)
    for child_name, child in module.named_children():
        _own_inits(child, f"{prefix}.{child_name}" if prefix else child_name, found)
    return found


def _draws_at_construction(module: nn.Module) -> bool:
    return type(module).__name__ in _CONSTRUCTOR_DRAWS or any(
        callable(getattr(module, name, None)) for name in ("reset_parameters", "_reset_parameters")
    )


def empty_init(
    model: nn.Module,
    shard_of: ShardOf,
    device: torch.device,
    allocate: Callable[[str], bool] = lambda name: True,
    padded: Callable[[str], bool] = lambda name: False,
) -> dict[int, torch.Tensor]:
    """{id(meta tensor): an uninitialised tensor of this rank's part's shape on `device`}, for
    models whose values will be loaded: no random draws, no full-size parameter. Non-persistent
    buffers are not in any checkpoint, so they are computed as the model's init computes them
    (Hugging Face's _init_weights: rotary inv_freq); any other kind raises a ValueError naming it."""
    persistent = {id(t) for t in model.state_dict(keep_vars=True).values()}
    computed = {id(t) for name, t in model.named_buffers() if t.is_meta and id(t) not in persistent and allocate(name)}
    values: dict[int, torch.Tensor] = {}
    if computed and _is_pretrained(model):
        replay = _Replay(model, shard_of, device, allocate)
        for module, init in _post_order(model, model._init_weights):
            if any(t is not None and id(t) in computed for t in module._buffers.values()):
                replay.run(module, init)
        values.update((key, value) for key, value in replay.values.items() if key in computed)
    missing = [name for name, t in model.named_buffers() if id(t) in computed and id(t) not in values]
    if missing:
        raise ValueError(
            f"model: built on the meta device, with non-persistent buffers that no checkpoint holds and oases "
            f"cannot compute ({', '.join(missing)}); pass init_weights=True, or build the model on a real device"
        )
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta and id(t) not in values and allocate(name):
            make = torch.zeros if padded(name) else torch.empty  # padding rows stay zeros: no load writes them
            values[id(t)] = make(shard_of(name, t).shape, dtype=t.dtype, device=device)
    return values


def replay_init(
    model: nn.Module, shard_of: ShardOf, device: torch.device, allocate: Callable[[str], bool] = lambda name: True
) -> dict[int, torch.Tensor]:
    """{id(meta tensor): this rank's part of its initial value, on `device`} for every meta
    parameter and buffer of `model` (left unchanged: still on meta); see the module docstring.

    `shard_of(name, full)` cuts a full CPU tensor (a value or a bool mask of the same shape) to
    this rank's part for the tensor's qualified name (the full tensor itself when replicated).
    Raises ValueError, naming them, when some tensors are written by neither pass, or when an
    init writes tensors of modules other than the one it is run for (not replayable module by module).
    """
    check_replayable(model)
    replay = _Replay(model, shard_of, device, allocate)
    initialized: set[int] = set()  # modules a Hugging Face post_init has initialised (_is_hf_initialized)
    if _is_pretrained(model):
        _build_pretrained(model, replay, initialized)
    else:
        _construct(model, model, replay, initialized)
    missing = [
        name
        for name, t in list(model.named_parameters()) + list(model.named_buffers())
        if t.is_meta and id(t) not in replay.values and allocate(name)
    ] + sorted(replay.partial)
    if missing:
        raise ValueError(
            f"model: built on the meta device, and no initialisation oases can replay sets {', '.join(missing)} "
            f"(neither a reset_parameters() of their module nor, for a Hugging Face model, its _init_weights, "
            f"writes all of them); "
            f"pass init_weights=False and load their values (oases.load_pretrained / oases.load_checkpoint), "
            f"or build the model on a real device"
        )
    return replay.values


def materialize(
    model: nn.Module,
    original: nn.Module,
    device: torch.device,
    init_weights: bool,
    allocate: Callable[[str], bool] = lambda name: True,
) -> None:
    """Replace every meta tensor of `model` (sharded in place from `original`, an untouched copy
    of the meta build: the same qualified names) by this rank's part on `device`: the replayed
    initial values (init_weights) or uninitialised memory. Ties (one tensor under several names)
    are kept. Each sharded tensor's rule and rank come from its module's tp_layout(). Tensors whose
    (first) name `allocate` refuses stay on meta; their draws still happen (the same values elsewhere)."""
    rules = {name: (rule, ring_of(group)) for name, (rule, group) in tp_rules(model).items()}

    def shard_of(name: str, full: torch.Tensor) -> torch.Tensor:
        if name not in rules:
            return full
        rule, ring = rules[name]
        return rule.shard(full, ring.rank, ring.size)

    if init_weights:
        values = replay_init(original, shard_of, device, allocate)
    else:
        values = empty_init(
            original, shard_of, device, allocate, padded=lambda name: name in rules and rules[name][0].size is not None
        )
    source = dict(original.named_parameters(remove_duplicate=False))
    source.update(original.named_buffers(remove_duplicate=False))
    made: dict[int, torch.Tensor] = {}  # id(model's meta tensor) -> its replacement (ties kept)
    for prefix, module in model.named_modules(remove_duplicate=False):
        for store in (module._parameters, module._buffers):
            for leaf, t in store.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    name = f"{prefix}.{leaf}" if prefix else leaf
                    if id(source[name]) not in values:
                        continue  # not allocated on this rank (allocate): stays on meta
                    value = values[id(source[name])]
                    if tuple(value.shape) != tuple(t.shape):  # the layout and the rules disagree: a bug
                        raise RuntimeError(f"{name}: built {tuple(value.shape)} for a {tuple(t.shape)} tensor")
                    made[id(t)] = (
                        nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else value
                    )
                store[leaf] = made[id(t)]
