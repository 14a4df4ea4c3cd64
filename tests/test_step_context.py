"""The step context: what parallelize and GPT record on a model, read by oases.train_step in one place,
and one StepOptions checked once per step.

- parallelize and GPT each keep one Parallelism record (group, size, layer degrees, offloader,
  Communicator) on the model, and oases.train_step runs on that record's group and Communicator;
- the step's arguments are checked once per oases.train_step and GPT.train_step (check_step
  counted), whichever of the two runs the step.
"""

import importlib.util

import pytest
import torch
import torch.distributed as dist

import oases
from oases.models import GPT, GPTConfig
from oases.nn.parallelism import ATTRIBUTE, Parallelism, find_parallelism, parallelism_of
from oases.schedule import StepOptions, options

from _spawn import rank_device, run_ranks

CONFIG = dict(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2)
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _batch(rows=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG["vocab_size"], (rows, CONFIG["seq_len"]), generator=g)
    return tokens.to(rank_device()), tokens.roll(-1, dims=1).to(rank_device())


def _counting_checks():
    """Wrap the step's argument check (oases.schedule.table.check_step, as StepOptions.check calls it)
    so each call is counted; returns (calls, restore)."""
    calls, real = [], options.check_step
    options.check_step = lambda *a, **k: calls.append(1) or real(*a, **k)
    return calls, lambda: setattr(options, "check_step", real)


def _gpt_record(rank, world_size):
    model = GPT(GPTConfig(**CONFIG), schedule="oases").to(rank_device())
    made = parallelism_of(model)
    assert isinstance(made, Parallelism) and getattr(model, ATTRIBUTE) is made
    assert made.size == world_size == model.tp and made.comm is model.comm and made.group is model.group
    assert made.layer_degrees is None and made.tp_degrees is None and made.offloader is None
    calls, restore = _counting_checks()
    try:
        tokens, targets = _batch()
        model.train_step(tokens, targets, recompute=True)
        per_gpt_step = len(calls)
        oases.train_step(model, tokens, targets, recompute=True, check_grads=False)
        per_oases_step = len(calls) - per_gpt_step
    finally:
        restore()
    return per_gpt_step, per_oases_step


def test_gpt_records_what_it_is_and_each_step_checks_its_arguments_once():
    """GPT's record names its own group, size and Communicator; GPT.train_step and oases.train_step
    on it each check the step's arguments once (twice before the step options)."""
    assert run_ranks(_gpt_record, 2) == [(1, 1), (1, 1)]


def _degrees_record(rank, world_size):
    model = GPT(GPTConfig(**CONFIG), schedule="oases", tp_degrees=[1, 2]).to(rank_device())
    made = parallelism_of(model)
    assert made.layer_degrees is model.layer_degrees and made.tp_degrees == (1, 2)
    return made.size


class _CountingCommunicator(oases.schedule.Communicator):
    def __init__(self, group, size):
        super().__init__(group, size)
        self.reduces = 0

    def all_reduce(self, t, phase):
        self.reduces += 1
        return super().all_reduce(t, phase)


def _replaced_comm(rank, world_size):
    """A Communicator given to GPT after construction is the one oases.train_step runs on (the record
    follows model.comm), as GPT.train_step does."""
    model = GPT(GPTConfig(**CONFIG), schedule="megatron").to(rank_device())
    counting = _CountingCommunicator(model.group, world_size)
    model.comm = counting
    assert parallelism_of(model).comm is counting and model.comm is counting
    tokens, targets = _batch()
    oases.train_step(model, tokens, targets, recompute=True, check_grads=False)
    after_oases = counting.reduces
    model.train_step(tokens, targets, recompute=True)
    return after_oases, counting.reduces - after_oases


def test_a_replaced_communicator_is_the_steps():
    (oases_calls, gpt_calls), _ = run_ranks(_replaced_comm, 2)
    assert oases_calls > 0 and gpt_calls > 0  # (the two counts differ, as before the record)


def _two_groups(rank, world_size):
    from oases.nn import ColumnParallelLinear

    model = torch.nn.Sequential(
        ColumnParallelLinear(4, 4, group=dist.group.WORLD), ColumnParallelLinear(4, 4, group=dist.new_group([0, 1]))
    )
    with pytest.raises(ValueError, match="different process groups"):
        find_parallelism(model)
    return True


def test_modules_on_two_groups_are_refused():
    assert run_ranks(_two_groups, 2) == [True, True]


def test_a_stack_keeping_its_own_communicator_runs_on_it():
    """A user's Stack (not a module) with `comm` (as GPT keeps one): the step context's record is on it."""
    from types import SimpleNamespace

    from oases._step_context import _made

    own = oases.schedule.Communicator(None, 1)
    made = _made(SimpleNamespace(comm=own))
    assert made.comm is own and made.size == 1


def test_per_layer_degrees_are_in_the_record():
    assert run_ranks(_degrees_record, 2) == [2, 2]


def test_a_plain_module_has_no_record_and_is_found_unsharded():
    """A model nobody parallelized: no record; find_parallelism sees no TP module (size 1)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert parallelism_of(model) is None
    assert find_parallelism(model) == Parallelism(None, 1)
    assert find_parallelism(object()) is None  # a user's Stack that is not a module: its step is told comm


def test_step_options_are_frozen_and_check_names_the_argument():
    opts = StepOptions(schedule="oases")
    with pytest.raises(AttributeError):
        opts.schedule = "megatron"  # type: ignore[misc]
    tokens, targets = torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="schedule"):
        StepOptions(schedule="nope").check(tokens, targets, world_size=1)
    with pytest.raises(ValueError, match="sub_batches"):
        StepOptions(sub_batches=9).check(tokens, targets, world_size=1)
    with pytest.raises(TypeError, match="offload"):
        StepOptions(offload=True).check(tokens, targets, world_size=1)  # type: ignore[arg-type]
    batch = StepOptions(schedule="megatron").check(tokens, targets, world_size=1)
    assert batch.parts == 1 and batch.input_ids is tokens and batch.attention_mask is None


def _hf_record(rank, world_size):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        vocab_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    model = oases.parallelize(tf.LlamaForCausalLM(config).to(rank_device()), dist.group.WORLD)
    made = parallelism_of(model)
    assert made.size == world_size and made.comm is None and made.layer_degrees is None
    calls, restore = _counting_checks()
    try:
        tokens, _ = _batch()
        loss = oases.train_step(model, tokens, tokens, recompute=True)
    finally:
        restore()
    return len(calls), float(loss)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_parallelize_records_its_group_and_the_step_checks_once():
    results = run_ranks(_hf_record, 2)
    assert [calls for calls, _ in results] == [1, 1]
    assert results[0][1] == results[1][1]


def test_agree_step_inputs_warns_and_still_agrees():
    """The old name (model, comm, mode, ...) warns and keeps its meaning (one rank: the inputs back)."""
    from oases.inputs import agree_step_inputs, agree_tp_inputs

    tokens = torch.zeros(2, 4, dtype=torch.long)
    with pytest.warns(DeprecationWarning, match="agree_tp_inputs"):
        (got,) = agree_step_inputs(torch.nn.Linear(2, 2), None, True, input_ids=tokens)
    assert got is tokens
    assert agree_tp_inputs(torch.nn.Linear(2, 2), None, 1, True, input_ids=tokens) == (tokens,)
