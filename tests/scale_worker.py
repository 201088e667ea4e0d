"""One rank of a 2-process training run of a converted TinyUNet (tests/test_scale.py starts two of these).

    python tests/scale_worker.py SCENARIO RANK WORLD_SIZE PORT OUT_DIR

SCENARIO: ddp, ddp_compile (torch.compile of the DDP model), fsdp2 (fully_shard on a CPU device mesh, after
tconv3d.nn.shardable), fsdp1 or fsdp1_orig_params (the FullyShardedDataParallel wrapper, use_orig_params False or
True, on the converted model as it is). Each rank trains on its slice of a batch that every rank generates alike,
over gloo, and writes OUT_DIR/rank{RANK}.pt: the full parameters after the steps, the losses, the warnings DDP gave
and, for the first step, the copies of weight-shaped tensors made in the forward and in the backward.
"""

import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import TinyUNet, memory_order, train_unet, unet_batch
from torch.utils._python_dispatch import TorchDispatchMode

import tconv3d

BATCH_PER_RANK = 2
aten = torch.ops.aten
COPY_OPS = {aten.clone.default, aten.contiguous.default, aten.copy_.default, aten._to_copy.default}
CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


class WeightCopies(TorchDispatchMode):
    """Counts the copies whose result has the shape of a conv weight, with their bytes, by phase and kind:
    "layout" where the copy changes the memory order (tconv3d's business), "same" where it keeps it (DDP filling
    its gradient buckets, for one)."""

    def __init__(self, weight_shapes):
        super().__init__()
        self.weight_shapes, self.phase, self.counts = set(weight_shapes), "forward", {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "tconv3d":  # count inside tconv3d's ops too: their CPU kernel, with this mode on
            with self:
                return func.redispatch(CPU, *args, **(kwargs or {}))
        result = func(*args, **(kwargs or {}))
        if func in COPY_OPS and tuple(result.shape) in self.weight_shapes:
            source = args[1] if func is aten.copy_.default else args[0]
            key = f"{self.phase} {'same' if memory_order(source) == memory_order(result) else 'layout'}"
            count, nbytes = self.counts.get(key, (0, 0))
            self.counts[key] = (count + 1, nbytes + result.numel() * result.element_size())
        return result


def full_state(model) -> dict:
    state = model.state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def main(scenario: str, rank: int, world_size: int, port: int, out_dir: Path) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    torch.manual_seed(0)
    model = tconv3d.nn.convert(TinyUNet())
    weight_shapes = [tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.modules.conv._ConvNd)]
    x, target = unet_batch(BATCH_PER_RANK * world_size)
    rows = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    x, target = x[rows], target[rows]
    if scenario.startswith("ddp"):
        trained = inner = torch.nn.parallel.DistributedDataParallel(model)
        if scenario == "ddp_compile":
            trained = torch.compile(inner)
    elif scenario == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        tconv3d.nn.shardable(model)
        for block in (model.stem, model.down, model.up, model.head):
            fully_shard(block, mesh=mesh)
        trained = inner = fully_shard(model, mesh=mesh)
    elif scenario.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel

        # No shardable: FSDP1's views of its flat buffer keep each parameter's strides (channels_last_3d weights)
        orig = scenario == "fsdp1_orig_params"
        trained = inner = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=orig)
    else:
        raise ValueError(f"unknown scenario {scenario!r}")

    copies = WeightCopies(weight_shapes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with copies:  # one step, counted by phase
            loss = torch.nn.functional.mse_loss(trained(x), target)
            copies.phase = "backward"
            loss.backward()
        for p in trained.parameters():
            p.grad = None
        losses = train_unet(trained, x, target)
    state = full_state(inner.module if scenario.startswith("ddp") else inner)
    torch.save(
        {"state": state, "losses": losses, "warnings": [str(w.message) for w in caught], "copies": copies.counts},
        out_dir / f"rank{rank}.pt",
    )
    dist.barrier()
    # Out without the interpreter's teardown (the results are saved, every collective done): on CI's 2-core VM a rank
    # that had saved its results then hung in it past the deadline (ddp, 300 s lost to the rerun) or aborted in it
    # (fsdp2: "terminate called without an active exception"), 2026-11-29.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
