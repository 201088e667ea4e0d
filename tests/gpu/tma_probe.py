"""Which tiled tensor maps the driver and the TMA unit take: the ones cuda.h documents as valid, and the ones
CCCL's cuda::make_tma_descriptor refuses although cuda.h does not (utils.tensor_map_problems' "risks"), each as
tconv3d's kernels would hand it over (a host descriptor, the box the compiled kernel encodes).

    python tests/gpu/tma_probe.py [--out probe.json]          # on a GPU: every case, each in its own process
    TRITON_INTERPRET=1 python tests/gpu/tma_probe.py --device cpu   # the script's own logic, on the interpreter

Each load case loads one box with a Triton kernel and compares it with the box cut from the tensor in torch, zeros
past the tensor's extent; each store case stores one into a tensor inside a buffer of sentinels and compares the
whole buffer (what lies past the tensor, or between a phase view's elements, must not change). A case runs in a
process of its own: an illegal address there cannot touch the others. The verdict per case: "ok" (encoded, moved
right), "refused" (the driver would not encode it: a Python error at the launch), "wrong" (moved, but not as the
reference has it), "crashed" (the process died: a fault on the device).
What it says decides bench/NOTES.md's open question on those risks (issue 30); no case here is timed."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

# Each case: (tensor shape, its strides (None: contiguous), the box, the box's coordinates, what it stands for).
# Shapes and strides are row-major, innermost dimension last, in elements (bf16); the tensor is a view of a buffer
# just large enough for its last element.
CASES = {
    "inside": ((2, 4, 8, 16, 64), None, (1, 1, 4, 8, 64), (1, 1, 2, 4, 0), "a box inside the tensor (the control)"),
    "past_edges": ((2, 4, 8, 16, 64), None, (1, 1, 4, 8, 64), (1, 3, 6, 12, 0),
                   "a box over the tensor's far edges, zeros past them (documented)"),
    "negative_origin": ((2, 4, 8, 16, 64), None, (1, 1, 4, 8, 64), (0, 0, -1, -3, 0),
                        "a box starting before the tensor (padding: the kernels' first taps)"),
    "batch1_16B_stride": ((1, 4, 8, 16, 64), (8, 8192, 1024, 64, 1), (1, 1, 4, 8, 64), (0, 1, 2, 4, 0),
                          "N of size 1 with a 16-byte stride (ndhwc_descriptor before 2026-11-24)"),
    "box_past_h": ((1, 2, 3, 16, 64), None, (1, 1, 8, 16, 64), (0, 1, 0, 0, 0),
                   "8 box rows over 3 (a patch taller than a small volume)"),
    "row_box_past_w": ((1, 2, 4, 32, 64), None, (1, 1, 1, 128, 64), (0, 1, 2, 0, 0),
                       "a one-row box of 128 voxels over a 32-voxel row (down_s2's row-box candidates)"),
    "box_past_channels": ((1, 2, 4, 8, 32), None, (1, 1, 4, 8, 64), (0, 0, 0, 0, 0),
                          "64 box channels over 32"),
    "weight_cout3": ((3, 27, 96), None, (16, 1, 64), (0, 5, 32),
                     "last_cout3's weight [Cout 3, taps, Cin]: 16 box rows over 3"),
    "odd_phase_view": ((1, 3, 4, 5, 64), (12096, 4032, 1152, 128, 1), (1, 1, 4, 4, 64), (0, 1, 0, 1, 0),
                       "phase (0, 0) of a stride-2 view of H 7, W 9: its D stride is shorter than its H rows span"),
}  # fmt: skip

# The same for TMA stores (the forward's output, the input gradient's phase views): a box of random values stored at
# the coordinates into a tensor that is a view of a buffer full of a sentinel value; everything outside what the
# tensor's extent takes of the box must keep the sentinel, the rest of the buffer too (a guard before and after).
STORES = {
    "store_inside": ((2, 4, 8, 16, 64), None, (1, 1, 4, 8, 64), (1, 1, 2, 4, 0), "a store inside the tensor (control)"),
    "store_past_edges": ((2, 4, 8, 16, 64), None, (1, 1, 4, 8, 64), (1, 3, 6, 12, 0),
                         "a store over the tensor's far edges, clipped there (documented; control)"),
    "store_box_past_h": ((1, 2, 3, 16, 64), None, (1, 1, 8, 16, 64), (0, 1, 0, 0, 0),
                         "a store of 8 box rows into 3 (a patch taller than a small volume's output)"),
    "store_odd_phase_view": ((1, 3, 4, 5, 64), (12096, 4032, 1152, 128, 1), (1, 1, 4, 4, 64), (0, 1, 0, 1, 0),
                             "a store into phase (0, 0) of H 7, W 9 (an input gradient's): other phases untouched"),
}  # fmt: skip
CONTROLS = ("inside", "past_edges", "negative_origin", "store_inside", "store_past_edges")
GUARD = 64  # elements of sentinel before and after a store's tensor (128 bytes: its base stays 16-byte aligned)


def overlap(shape, box, coords):
    """(the tensor's slices, the box's slices) where the box at `coords` meets the tensor, or None."""
    inside, within = [], []
    for start, extent, size in zip(coords, box, shape, strict=True):
        lo, hi = max(start, 0), min(start + extent, size)
        if hi <= lo:
            return None
        inside.append(slice(lo, hi))
        within.append(slice(lo - start, hi - start))
    return tuple(inside), tuple(within)


def reference(t, shape, strides, box, coords):
    """The box at `coords` of the strided view, zeros past its extent."""
    import torch

    out = torch.zeros(box, dtype=t.dtype, device=t.device)
    meet = overlap(shape, box, coords)
    if meet is not None:
        out[meet[1]] = t.as_strided(shape, strides)[meet[0]]
    return out


def stored_reference(buffer, shape, strides, box, coords, values):
    """The buffer after storing `values` (the box) at `coords` into its tensor (the view GUARD elements in)."""
    expected = buffer.clone()
    meet = overlap(shape, box, coords)
    if meet is not None:
        expected[GUARD:].as_strided(shape, strides)[meet[0]] = values[meet[1]]
    return expected


def run_case(name: str, device: str) -> dict:
    import torch
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from tconv3d.kernels.utils import tensor_map_problems

    @triton.jit
    def load_box(desc, out_ptr, c0, c1, c2, c3, c4, RANK: tl.constexpr, NUMEL: tl.constexpr):
        if RANK == 3:  # noqa: SIM108  (one load compiled, the other rank's never traced)
            block = desc.load([c0, c1, c2])
        else:
            block = desc.load([c0, c1, c2, c3, c4])
        tl.store(out_ptr + tl.arange(0, NUMEL), tl.reshape(block, [NUMEL]))

    @triton.jit
    def store_box(desc, values_ptr, c0, c1, c2, c3, c4, NUMEL: tl.constexpr):
        desc.store([c0, c1, c2, c3, c4], tl.reshape(tl.load(values_ptr + tl.arange(0, NUMEL)), desc.block_shape))

    store = name in STORES
    shape, strides, box, coords, _ = STORES[name] if store else CASES[name]
    if strides is None:
        strides = [1]
        for size in reversed(shape[1:]):
            strides.insert(0, strides[0] * size)
    span = 1 + sum((s - 1) * st for s, st in zip(shape, strides, strict=True))
    torch.manual_seed(0)
    problems, risks = tensor_map_problems(shape, strides, box, 2, None)
    record = {"case": name, "problems": problems, "risks": risks}
    values = torch.randn(box, device=device).to(torch.bfloat16)
    if store:
        buffer = torch.full((GUARD + span + GUARD,), 7.0, device=device, dtype=torch.bfloat16)
        t = buffer[GUARD : GUARD + span]
        expected = stored_reference(buffer, shape, strides, box, coords, values)
    else:
        t = torch.randn(span, device=device).to(torch.bfloat16)
        expected = reference(t, shape, strides, box, coords)
        out = torch.empty(box, dtype=torch.bfloat16, device=device)
    try:
        desc = TensorDescriptor(t, list(shape), list(strides), list(box))
        rest = (0,) * (5 - len(coords))
        if store:
            store_box[(1,)](desc, values, *coords, *rest, NUMEL=values.numel())
        else:
            load_box[(1,)](desc, out, *coords, *rest, RANK=len(shape), NUMEL=out.numel())
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as error:  # the driver refusing the map raises at the launch, in Triton's launcher
        return {**record, "verdict": "refused", "error": f"{type(error).__name__}: {error}"[:400]}
    got = buffer if store else out
    same = torch.equal(got, expected)
    return {**record, "verdict": "ok" if same else "wrong", "mismatches": int((got != expected).sum())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default=None, help="run this case here (the parent runs each in a child)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None, help="write the verdicts as JSON here")
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case, args.device)))
        return 0
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    names = [*CASES, *STORES]

    def child(name: str) -> dict:
        command = [sys.executable, __file__, "--case", name, "--device", args.device]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
        except subprocess.TimeoutExpired:
            return {"case": name, "verdict": "crashed", "error": "no result in 120 s (a hang)"}
        lines = done.stdout.strip().splitlines()
        if done.returncode == 0 and lines:
            return json.loads(lines[-1])
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"case": name, "verdict": "crashed", "error": last[:400]}

    # The children at once (each one's start, torch's import and a compile, is most of its time: one after the
    # other they took over 90 s on the H200, run 1 of 2026-11-26), each verdict printed and written as it comes.
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(names), os.cpu_count() or 1)) as pool:
        for future in concurrent.futures.as_completed([pool.submit(child, name) for name in names]):
            r = future.result()
            results[r["case"]] = r
            note = r.get("error") or (f"{r['mismatches']} elements differ" if r.get("mismatches") else "")
            risk = "; ".join({**CASES, **STORES}[r["case"]][4:] + tuple(r.get("risks", [])))
            print(f"{r['case']:20s} {r['verdict']:8s} {note[:120]}\n{'':29s}{risk}", flush=True)
            if args.out:
                ordered = [results[n] for n in names if n in results]
                Path(args.out).write_text(json.dumps(ordered, indent=1) + "\n")
    results = [results[n] for n in names]
    controls = [r for r in results if r["case"] in CONTROLS]
    return 0 if all(r["verdict"] == "ok" for r in controls) else 1


if __name__ == "__main__":
    sys.exit(main())
