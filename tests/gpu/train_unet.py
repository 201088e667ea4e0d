"""Train a small 3D UNet twice from the same seed, with stock nn.Conv3d and after tconv3d.nn.convert, in bf16
autocast, and compare the loss curves and step times.

    python tests/gpu/train_unet.py --steps 500 --out tests/gpu_logs/train_unet.json     # on a GPU

The task is synthetic but learnable: segment random spheres out of a noisy volume. The UNet has 8 Conv3d layers,
GroupNorm and SiLU, a stride-2 convolution down and a nearest-upsample path back up with a skip connection.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import tconv3d

CL = torch.channels_last_3d


def block(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv3d(cin, cout, 3, stride=stride, padding=1), nn.GroupNorm(4, cout), nn.SiLU())


class UNet3D(nn.Module):
    def __init__(self, cin: int = 1, width: int = 16, cout: int = 1):
        super().__init__()
        self.encoder = nn.Sequential(block(cin, width), block(width, width))
        self.down = block(width, 2 * width, stride=2)
        self.middle = nn.Sequential(block(2 * width, 2 * width), block(2 * width, 2 * width))
        self.up = nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"), block(2 * width, width))
        self.decoder = nn.Sequential(block(2 * width, width), nn.Conv3d(width, cout, 1))

    def forward(self, x):
        skip = self.encoder(x)
        x = self.up(self.middle(self.down(skip)))
        return self.decoder(torch.cat([x, skip], dim=1))


def sphere_batch(generator: torch.Generator, batch: int, size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Volumes with 1-3 random spheres plus noise, and the sphere masks to segment."""
    axis = torch.linspace(-1, 1, size, device=device)
    grid = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"))  # [3, S, S, S]
    masks = torch.zeros(batch, 1, size, size, size, device=device)
    for b in range(batch):
        for _ in range(int(torch.randint(1, 4, (1,), generator=generator, device=device))):
            centre = torch.rand(3, 1, 1, 1, generator=generator, device=device) * 1.2 - 0.6
            radius = 0.15 + 0.25 * torch.rand((), generator=generator, device=device)
            masks[b, 0] = torch.maximum(masks[b, 0], ((grid - centre).square().sum(0) < radius**2).float())
    noise = 0.6 * torch.randn(masks.shape, generator=generator, device=device)
    return (masks + noise).contiguous(memory_format=CL), masks


def train(use_tconv3d: bool, args) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = UNet3D(width=args.width).to(device).to(memory_format=CL)
    if use_tconv3d:
        tconv3d.nn.convert(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator(device=device).manual_seed(args.seed + 1)
    losses, step_ms = [], []
    for step in range(args.steps):
        x, target = sphere_batch(generator, args.batch, args.size, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not args.no_autocast):
            logits = model(x)
        loss = F.binary_cross_entropy_with_logits(logits.float(), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= min(10, args.steps // 2):  # after warm-up (compilation, cuDNN autotuning)
            step_ms.append((time.perf_counter() - started) * 1e3)
        losses.append(loss.item())
    tail = max(1, min(20, args.steps // 5))
    return {
        "losses": [round(v, 5) for v in losses],
        "final_loss": statistics.fmean(losses[-tail:]),
        "step_ms_median": statistics.median(step_ms) if step_ms else None,
        "conv_layers": sum(isinstance(m, nn.Conv3d) for m in model.modules()),
        "tconv3d_layers": sum(isinstance(m, tconv3d.nn.Conv3d) for m in model.modules()),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=64, help="volume edge (voxels)")
    parser.add_argument("--width", type=int, default=32, help="channels of the first level")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-autocast", action="store_true")
    parser.add_argument("--tolerance", type=float, default=0.02, help="allowed relative gap of the final losses")
    parser.add_argument("--out", type=Path, default=None, help="write both runs' curves and times as JSON")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        torch.backends.cudnn.benchmark = True
    stock = train(False, args)
    ours = train(True, args)
    gap = abs(ours["final_loss"] - stock["final_loss"]) / stock["final_loss"]
    report = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
        "stock": stock,
        "tconv3d": ours,
        "final_loss_relative_gap": gap,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"first loss: stock {stock['losses'][0]:.4f}, tconv3d {ours['losses'][0]:.4f}")
    print(f"final loss (mean of the last steps): stock {stock['final_loss']:.4f}, tconv3d {ours['final_loss']:.4f}, "
          f"gap {100 * gap:.2f}% (allowed {100 * args.tolerance:.0f}%)")  # fmt: skip
    print(f"median step: stock {stock['step_ms_median']} ms, tconv3d {ours['step_ms_median']} ms; "
          f"{ours['tconv3d_layers']} of {ours['conv_layers']} Conv3d layers ran tconv3d")  # fmt: skip
    return 0 if gap <= args.tolerance and ours["tconv3d_layers"] == ours["conv_layers"] else 1


if __name__ == "__main__":
    sys.exit(main())
