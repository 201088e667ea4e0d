"""Forward and backward on a bf16 activation of more than 2**31 elements, checked against cuDNN chunk by chunk.

    python tests/gpu/huge_tensor.py                      # 1 x 64 x 32 x 1024 x 1024: 2.1e9 elements, ~4.3 GB
    python tests/gpu/huge_tensor.py --shape 1,64,40,1024,1024

Every offset past 2**31 elements must be computed in int64 by the kernels: an overflow shows as an illegal
memory access or as wrong values in the far end of the tensor, which the chunked cuDNN reference catches.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

import tconv3d
from tconv3d.testing import TOLERANCE, rel_l2

CL = torch.channels_last_3d


def chunks(depth: int, size: int):
    return [(start, min(start + size, depth)) for start in range(0, depth, size)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1,64,32,1024,1024", help="N,C,D,H,W of the input (Cout = C)")
    parser.add_argument("--chunk", type=int, default=4, help="depth slices per cuDNN reference chunk")
    parser.add_argument("--out", default=None, help="write the errors as JSON here")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to check the script itself on a small shape")
    args = parser.parse_args(argv)
    n, c, d, h, w = (int(v) for v in args.shape.split(","))
    torch.manual_seed(0)
    x = torch.randn(n, c, d, h, w, device=args.device, dtype=torch.bfloat16).contiguous(memory_format=CL)
    weight = (torch.randn(c, c, 3, 3, 3, device=args.device) / (27 * c) ** 0.5).to(torch.bfloat16)
    weight = weight.contiguous(memory_format=CL)
    print(f"input {tuple(x.shape)}: {x.numel():,} elements ({x.numel() / 2**31:.2f} x 2**31)", flush=True)

    xg, wg = x.detach().requires_grad_(), weight.detach().requires_grad_()
    y = tconv3d.conv3d(xg, wg, None, 1, 1)
    grad_out = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (xg, wg), grad_out)
    if args.device == "cuda":
        torch.cuda.synchronize()

    # cuDNN in fp32, one depth chunk at a time, with a one-slice halo from the zero-padded tensors.
    xp = F.pad(x, (1, 1, 1, 1, 1, 1))
    gp = F.pad(grad_out, (1, 1, 1, 1, 1, 1))
    w32 = weight.float()
    w_flipped = w32.flip(2, 3, 4).transpose(0, 1).contiguous(memory_format=CL)
    errors = {"output": [], "grad_input": []}
    grad_weight = torch.zeros_like(w32)
    for start, stop in chunks(d, args.chunk):
        x_chunk = xp[:, :, start : stop + 2].float()
        errors["output"].append(rel_l2(y[:, :, start:stop].float(), F.conv3d(x_chunk, w32)))
        errors["grad_input"].append(
            rel_l2(gx[:, :, start:stop].float(), F.conv3d(gp[:, :, start : stop + 2].float(), w_flipped))
        )
        grad_weight += torch.nn.grad.conv3d_weight(x_chunk, w32.shape, grad_out[:, :, start:stop].float())
    result = {
        "shape": [n, c, d, h, w],
        "elements": x.numel(),
        "max_rel_err_output": max(errors["output"]),
        "max_rel_err_grad_input": max(errors["grad_input"]),
        "rel_err_grad_weight": rel_l2(gw.float(), grad_weight),
        "last_chunk_rel_err_output": errors["output"][-1],
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    tolerance = TOLERANCE[torch.bfloat16]
    worst = max(result["max_rel_err_output"], result["max_rel_err_grad_input"], result["rel_err_grad_weight"])
    print(f"worst error {worst:.2e}, tolerance {tolerance}: {'ok' if worst < tolerance else 'FAIL'}")
    return 0 if worst < tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
