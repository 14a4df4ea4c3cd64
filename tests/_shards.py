"""What a parallelized model's parameter holds of the unsharded tensor, and gradient checks by it.

expected_shard(tp, name, full, rank, p) = the ShardRule of parameter `name` (its module's
    tp_layout()) applied to `full`, or `full` for a replicated parameter
check_grads(tp, want, rank, p, where, tol): every parameter of `tp` has a gradient equal to
    expected_shard(want[name]) within `tol` (torch.testing.assert_close's rtol / atol)
check_export(tp, ref, path, rank, what): oases.save_pretrained(tp, path) reads back through
    transformers' from_pretrained (on rank 0) as the unsharded `ref`'s state dict, exactly
"""

import warnings

import torch
import torch.distributed as dist


def expected_shard(tp, name, full, rank, p):
    owner, _, leaf = name.rpartition(".")
    module = tp.get_submodule(owner)
    rule = module.tp_layout().get(leaf) if hasattr(module, "tp_layout") else None
    return full if rule is None else rule.shard(full, rank, p)


def check_grads(tp, want, rank, p, where, tol):
    for name, param in tp.named_parameters():
        assert param.grad is not None, f"{where}: {name} got no gradient"
        torch.testing.assert_close(
            param.grad,
            expected_shard(tp, name, want[name], rank, p),
            **tol,
            msg=lambda m: f"{where}: grad of {name}: {m}",
        )


def check_export(tp, ref, path, rank, what):
    import oases

    oases.save_pretrained(tp, path)  # the unsharded model's names and shapes (Conv1D: [in, out])
    if rank == 0:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a tiny config's own complaints (rope scaling, ...)
            got = type(ref).from_pretrained(path).state_dict()
        for key, value in ref.state_dict().items():
            assert key in got and got[key].shape == value.shape, f"{what}: {key} in the export"
            # from_pretrained loads on the CPU; `ref` lives on the rank's device (tests/_spawn.rank_device)
            torch.testing.assert_close(got[key], value.cpu(), rtol=0, atol=0, msg=lambda m: f"{what} export {key}: {m}")
    dist.barrier()
