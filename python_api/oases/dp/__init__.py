"""Data parallelism in the user's own loop: gradient averaging overlapped with the backward
(`GradientSync`, DDP's buckets) and ZeRO-1 (`ZeroOptimizer`: optimizer states split over dp).

::

    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = oases.parallelize(model, mesh["tp"].get_group())
    opt = oases.dp.ZeroOptimizer(model, mesh["dp"].get_group(), torch.optim.AdamW, lr=1e-4)
    loss = oases.train_step(model, ids, ids, grad_sync=opt.sync); opt.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()
"""

from oases.dp._sharded_optimizer import ShardedOptimizer, row_range
from oases.dp.grad_sync import AllReduceMean, GradientSync, Reducer
from oases.dp.zero import ZeroOptimizer

__all__ = ["GradientSync", "ZeroOptimizer", "ShardedOptimizer", "AllReduceMean", "Reducer", "row_range"]
