"""A real model's layers one by one: each module's output in a 16-bit dtype against float64 of stock's module on the
same input, for stock and for the converted model, where a whole model's error says only that they differ
(bench/NOTES.md, forty-eighth session: DenseNet121's bf16 logits on the H200).

    python tests/gpu/layer_errors.py --model monai_densenet121             # on a GPU; any CUDA_MODELS name
    python tests/gpu/layer_errors.py --model monai_unet --device cpu --size 16 --json out.json

Each model runs its own input once. Every module stock and converted share by name (convert replaces modules in
place) is hooked at its first call: its inputs and output are kept, and stock's module in float64 recomputes the
output from those inputs (a converted conv is held to stock's conv in float64: the same parameters; a norm convert
fused with the activation after it, to stock's norm and that activation; the activation's slot it left, an
nn.Identity, is not rated). The hooks make the model run as hooked: MONAI's containers are called whole, and a
PReLU fused into its norm applies itself in its own call (tconv3d.nn.hooks), rated as stock's PReLU, its norm as
stock's norm. A module's error is its own, not what it inherits: both sides' errors are local, so the ratio
converted / stock names the layer that adds error, if any. Printed worst ratio first; --json keeps every row.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(TESTS), str(TESTS.parent)]  # the real models' builders (tests/), bench.vaes (the repository)

from tconv3d.nn.modules import Activation  # noqa: E402
from tconv3d.testing import rel_l2  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _float64(value):
    if torch.is_tensor(value) and value.is_floating_point():
        return value.double()
    if isinstance(value, (tuple, list)):
        return type(value)(_float64(item) for item in value)
    if isinstance(value, dict):
        return {key: _float64(item) for key, item in value.items()}
    return value


def first_calls(model, run) -> dict[str, tuple]:
    """name -> (args, kwargs, output) of each module's first call in run(model), for the modules whose output is a
    floating tensor."""
    calls, handles = {}, []

    def hook(name):
        def record(module, args, kwargs, output):
            if name not in calls and torch.is_tensor(output) and output.is_floating_point():
                calls[name] = (args, kwargs, output)

        return record

    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_hook(hook(name), with_kwargs=True))
    try:
        with torch.no_grad():
            run(model)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def layer_errors(stock, converted, run, dtype) -> list[dict]:
    """Rows {name, module, stock, converted, ratio} over the leaf modules both models call: each side's output in
    `dtype` against stock's module in float64 on that side's own inputs. `stock` and `converted` hold the same
    parameters (float32); run(model) runs a model on its input, cast to `dtype` inside where it needs to be."""
    reference = copy.deepcopy(stock).double()
    leaves = {name for name, module in stock.named_modules() if name and not any(module.children())}
    sides = {
        "stock": first_calls(copy.deepcopy(stock).to(dtype), run),
        "converted": first_calls(copy.deepcopy(converted).to(dtype), run),
    }
    rows = []
    for name in sorted(leaves & sides["stock"].keys() & sides["converted"].keys()):
        ours = converted.get_submodule(name)
        if isinstance(ours, torch.nn.Identity):
            continue  # an activation convert fused into the norm before it
        row = {"name": name, "module": type(ours).__name__}
        for side, calls in sides.items():
            args, kwargs, output = calls[name]
            fused = getattr(ours, "activation", None) if side == "converted" else None
            fused = None if fused == "prelu" else fused  # its FusedPReLU, hooked above, applied itself
            try:
                with torch.no_grad():
                    exact = reference.get_submodule(name)(*_float64(args), **_float64(kwargs))
                    if fused:  # the norm's own activation (MAISI's norm adapter has a SiLU only)
                        get = getattr(ours, "fused_activation", None)
                        exact = (get() if get is not None else Activation(fused)).applied(exact)
                row[side] = rel_l2(output, exact) if exact.shape == output.shape else None
            except (RuntimeError, TypeError, NotImplementedError) as error:
                row[side], row["error"] = None, f"{type(error).__name__}: {error}"[:200]
        if row["stock"] and row["converted"] is not None:
            row["ratio"] = row["converted"] / row["stock"]
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="layer_errors.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="monai_densenet121", help="a tests/test_integrations.py CUDA_MODELS name")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES)
    parser.add_argument("--size", type=int, default=0, help="the input's D, H and W (default: the test's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    import interpreter_fidelity
    from real_models import stock_and_converted
    from test_integrations import CUDA_MODELS, _monai_nets

    interpreter_fidelity.install()  # under TRITON_INTERPRET=1 on a CPU: bf16 rounded as the GPU rounds it

    build, shape, run = CUDA_MODELS[args.model]
    build = _monai_nets()[build] if isinstance(build, str) else build
    if args.size:
        shape = (*shape[:2], *(args.size,) * (len(shape) - 2))
    stock, converted = (model.to(args.device).eval() for model in stock_and_converted(build))
    torch.manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    x = torch.randn(shape, device=args.device).to(dtype)
    run = run or (lambda model, x: model(x))
    rows = layer_errors(stock, converted, lambda model: run(model, x), dtype)
    rated = sorted((row for row in rows if "ratio" in row), key=lambda row: -row["ratio"])
    print(f"{args.model} {args.dtype} on {args.device}, input {list(shape)}: {len(rows)} layers, {len(rated)} rated")
    print(f"{'module':40} {'type':24} {'stock':>9} {'tconv3d':>9} {'ratio':>6}")
    for row in rated[:25]:
        print(f"{row['name'][-40:]:40} {row['module'][:24]:24} {row['stock']:9.2e} {row['converted']:9.2e} "
              f"{row['ratio']:6.2f}")  # fmt: skip
    by_type = {}
    for row in rated:
        by_type.setdefault(row["module"], []).append(row["ratio"])
    for module, ratios in sorted(by_type.items()):
        print(f"{module}: {len(ratios)} layers, ratio median {statistics.median(ratios):.2f}, max {max(ratios):.2f}")
    for row in rows:
        if "error" in row:
            print(f"not rated: {row['name']} ({row['module']}): {row['error']}")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
