"""oases.degrees on one process: the LayerDegrees a model keeps (frozen, one public attribute), the
replica-sum switch's context manager, and the one refusal of the options per-layer degrees do not
combine with. The distributed behaviour (and that parallelize plants no private attribute) is
tested in tests/test_tp_degrees.py, test_tp_degrees_schedule.py and test_parallelize_degrees.py.
"""

import dataclasses

import pytest

from oases.degrees import LayerDegrees, ReplicaSums, refuse_with_degrees
from oases.models import GPT, GPTConfig


def test_replica_sums_suspended_nests_and_restores():
    sums = ReplicaSums()
    assert sums.on
    with sums.suspended():
        assert not sums.on
        with sums.suspended():
            assert not sums.on
        assert not sums.on
    assert sums.on
    with pytest.raises(RuntimeError, match="inside"), sums.suspended():
        raise RuntimeError("inside")
    assert sums.on  # put back after an error too


def test_gpt_keeps_one_frozen_layer_degrees():
    model = GPT(GPTConfig(layers=2), tp_degrees=[1, 1])
    plan = model.layer_degrees
    assert isinstance(plan, LayerDegrees) and plan.degrees == model.tp_degrees == (1, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.degrees = (1, 2)
    placements = model.layer_placements()
    with placements.while_scheduled():  # a schedule's step: the replica-sum hooks stand down
        assert not plan.replica_sums.on
    assert plan.replica_sums.on
    assert GPT(GPTConfig(layers=2)).layer_degrees is None and GPT(GPTConfig(layers=2)).tp_degrees is None


@pytest.mark.parametrize(
    "option, value, match",
    [
        (
            "sequence_parallel",
            True,
            r"^sequence_parallel=True: not supported with per-layer tp_degrees \(.*\); "
            r"pass sequence_parallel=False$",
        ),
        ("comm", object(), r"^comm: not supported with per-layer tp_degrees \(.*\); pass comm=None$"),
        ("offload", True, r"^offload=True: .*; pass offload=False$"),
        ("vocab_parallel", True, r"^vocab_parallel=True: .*; pass vocab_parallel=False$"),
    ],
)
def test_refuse_with_degrees(option, value, match):
    refuse_with_degrees(option, None)
    refuse_with_degrees(option, False)
    with pytest.raises(ValueError, match=match):
        refuse_with_degrees(option, value)
    with pytest.raises(ValueError, match=r"; or else this$"):
        refuse_with_degrees(option, value, fix="or else this")
