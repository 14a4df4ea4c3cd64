"""A 1-D DeviceMesh wherever a process group is taken (as torch's parallelize_module takes
`mesh["tp"]`): `parallelize`, the parallel layers (and their replica_group), `GPT`,
`oases.amp.GradScaler`, `GradientSync` and `ZeroOptimizer` on `mesh["tp"]` / `mesh["dp"]` train
exactly as on `mesh[...].get_group()`; `agree_inputs`, `watch_inputs`, `Communicator`,
`LayerDegrees.make` and `save_pretrained` take it;
a mesh of several dimensions is refused naming them, on every rank before any collective.
"""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import oases
from oases.models import GPT, GPTConfig

from _spawn import harness_device, rank_device, run_ranks


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _trained(rank, world_size, tmp):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).to(rank_device())
    flat = init_device_mesh(harness_device(), (2,), mesh_dim_names=("tp",))
    grid = init_device_mesh(harness_device(), (1, 2), mesh_dim_names=("dp", "tp"))
    results = {}
    for name, group in (("mesh", flat), ("group", flat.get_group()), ("grid['tp']", grid["tp"])):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = oases.parallelize(_MLP().to(rank_device()), group, plan={"up": "column", "down": "row"})
        assert isinstance(model.up, oases.nn.ColumnParallelLinear), name
        model(x).square().sum().backward()
        results[name] = [p.grad.clone() for p in model.parameters()]
    for name in ("mesh", "grid['tp']"):
        for got, want in zip(results[name], results["group"]):
            assert torch.equal(got, want), name
    reference = _MLP().to(rank_device())
    reference(x).square().sum().backward()
    full, sharded = oases.full_state_dict(model), model
    assert set(full) == set(reference.state_dict())
    # the layers and GPT take it too
    layer = oases.nn.ColumnParallelLinear(8, 16, group=flat)
    assert layer.weight.shape == (8, 8) and layer.group is flat.get_group()
    assert oases.amp.GradScaler(harness_device(), group=flat).group is flat.get_group()
    config = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, mlp_ratio=2, layers=2)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(2)).to(rank_device())
    losses = [GPT(config, group, seed=3).to(rank_device())(tokens, tokens).item() for group in (flat, flat.get_group())]
    assert losses[0] == losses[1], losses
    # data parallel on mesh["dp"]: GradientSync and ZeroOptimizer average over the mesh's group
    dp = init_device_mesh(harness_device(), (2, 1), mesh_dim_names=("dp", "tp"))["dp"]
    for make in (
        lambda m: (oases.dp.GradientSync(m, dp), torch.optim.SGD(m.parameters(), lr=0.1)),
        lambda m: (None, oases.dp.ZeroOptimizer(m, dp, torch.optim.SGD, lr=0.1)),
    ):
        model, plain = _MLP().to(rank_device()), _MLP().to(rank_device())
        sync, opt = make(model)
        model(x[2 * rank : 2 * rank + 2]).square().sum().backward()
        opt.step()
        plain(x).square().sum().div(2).backward()
        torch.optim.SGD(plain.parameters(), lr=0.1).step()
        for p, q in zip(model.parameters(), plain.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        if sync is not None:
            sync.close()
    # the rest of the public entry points that take a group
    assert oases.inputs.agree_inputs({"x": x}, group=flat)["x"] is x
    watched = nn.Linear(8, 8).to(rank_device())
    oases.inputs.watch_inputs(watched, flat)
    with pytest.raises(
        ValueError, match="must get the same input"
    ):  # each rank a different input: refused over the mesh's group
        watched(x + rank)
    from oases.schedule import Communicator

    assert Communicator(flat, 2).group is flat.get_group()
    assert oases.degrees.LayerDegrees.make(flat, 2, rank, (2, 1)).degrees == (2, 1)
    copies = oases.nn.ColumnParallelLinear(8, 8, group=flat, parts=(4, 4), replicas=(2, 1), replica_group=flat)
    assert copies.replica_group is flat.get_group()
    out = tmp + "/export"
    oases.save_pretrained(sharded, out, group=flat)
    reloaded = oases.parallelize(_MLP().to(rank_device()), flat, plan={"up": "column", "down": "row"})
    oases.load_pretrained(reloaded, out)
    for p, q in zip(reloaded.parameters(), sharded.parameters()):
        assert torch.equal(p, q)
    # a mesh of two dimensions: which one is meant is not known
    for build in (
        lambda: oases.parallelize(_MLP(), grid),
        lambda: oases.dp.ZeroOptimizer(_MLP(), grid, torch.optim.SGD, lr=0.1),
        lambda: oases.dp.GradientSync(_MLP(), grid),
    ):
        with pytest.raises(ValueError, match=r"group: a 2-D DeviceMesh \(dimensions \('dp', 'tp'\)\); pass the one"):
            build()
    dist.barrier()  # no rank was left inside a collective
    return True


def test_a_1d_device_mesh_is_taken_as_its_group_2_ranks(tmp_path):
    assert run_ranks(_trained, 2, str(tmp_path), timeout=90) == [True, True]
