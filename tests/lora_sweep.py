"""peft's LoRA layers over every model of the model fuzzer (tests/fuzz_models.py's builders), each at its first
drawn fp32 input, CPU. One line a model.

    cd tests && python lora_sweep.py before [names...]   # LoRA on stock, then convert: against stock with LoRA
    cd tests && python lora_sweep.py after [names...]    # convert, then LoRA: unmerged against merged

Targets: every convolution (nn.Conv3d and nn.Conv2d, subclasses included) of groups 1; where peft refuses one of
them (its `type(conv)(...)` constructor call: Wan's, Cosmos's, EasyAnimate's causal convs), the exact classes only.
"before" prints the output's and the worst parameter gradient's relative L2 error against the stock model with
the same LoRA layers, and what `tconv3d.nn.audit` counts (3-D convolutions left on aten, pads and concatenations).
"after" has no stock twin (peft builds its layers from the converted ones): it prints the unmerged model's error
against the same model with every LoRA layer merged into its weights (what a LoRA layer skipped or computed with
other padding changes), and the LoRA parameters left without a gradient (a skipped LoRA layer, or one the run does
not reach: a head the first output does not use). A block that refuses LoRA layers added after convert raises.
Raw results: bench/results/lora_sweep_cpu.txt."""

import copy
import logging
import os
import random
import sys
import traceback
import warnings

# The aten path, what CPU users run (the fuzzers' import would set the Triton interpreter: minutes a model)
os.environ.setdefault("TRITON_INTERPRET", "0")

import torch
from fuzz_models import builders, draw, own_run
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from test_integrations import encode_decode
from torch import nn

import tconv3d
from tconv3d.nn.video_vaes import FrameConv2d
from tconv3d.testing import rel_l2


def first_tensor(y):
    if isinstance(y, torch.Tensor):
        return y
    if isinstance(y, (tuple, list)):
        return first_tensor(y[0])
    if isinstance(y, dict):
        return first_tensor(next(iter(y.values())))
    return y.sample


def with_lora(model: nn.Module, exact: tuple) -> tuple[nn.Module, str, int]:
    """(model with LoRA layers, which targets, how many): every conv of groups 1, else those of `exact` classes."""
    for kind in ("all", "exact"):
        targets = [name for name, m in model.named_modules()
                   if (isinstance(m, (nn.Conv3d, nn.Conv2d)) if kind == "all" else type(m) in exact)
                   and m.groups == 1]  # fmt: skip
        if not targets:
            break
        torch.manual_seed(1)
        config = LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False)
        try:
            return inject_adapter_in_model(config, copy.deepcopy(model)), kind, len(targets)
        except Exception:  # peft refuses a conv class: the exact classes
            continue
    return None, "none", 0


def where(error: Exception) -> str:
    frame = traceback.extract_tb(error.__traceback__)[-2]
    return f"RAISED {type(error).__name__}: {str(error)[:110]} at {frame.filename.split('/')[-1]}:{frame.lineno}"


def before(name, build, run, x) -> str:
    torch.manual_seed(0)
    stock, kind, count = with_lora(build().eval(), (nn.Conv3d, nn.Conv2d))
    if stock is None:
        return "no convolution peft takes"
    try:
        model = tconv3d.nn.convert(copy.deepcopy(stock))
        for m in (model, stock):
            first_tensor(run(m, x)).float().square().mean().backward()
        out = rel_l2(first_tensor(run(model, x)), first_tensor(run(stock, x)))
        pairs = zip(model.named_parameters(), stock.named_parameters(), strict=True)
        grad = max((rel_l2(p.grad, q.grad) for (_, p), (_, q) in pairs if q.grad is not None and q.grad.norm() > 0),
                   default=0.0)  # fmt: skip
        report = tconv3d.nn.audit(model, x, run=run, verbose=False)
        counts = f"aten {report.aten_conv3d_calls} tconv3d {report.tconv3d_calls}"
        copies = f"pads {report.totals['pads']} concats {report.totals['concats']}"
        return f"{kind:5s} {count:3d} targets: out {out:.1e} grad {grad:.1e} {counts} {copies}"
    except Exception as error:
        return f"{kind:5s} {count:3d} targets: {where(error)}"


def after(name, build, run, x) -> str:
    torch.manual_seed(0)
    model, kind, count = with_lora(tconv3d.nn.convert(build().eval()), (tconv3d.nn.Conv3d, nn.Conv2d, FrameConv2d))
    if model is None:
        return "no convolution peft takes"
    try:
        with torch.no_grad():
            unmerged = first_tensor(run(model, x))
            merged = copy.deepcopy(model)
            for layer in merged.modules():
                if isinstance(layer, LoraLayer):
                    layer.merge()
            gap = rel_l2(unmerged, first_tensor(run(merged, x)))
        first_tensor(run(model, x)).float().square().mean().backward()
        unreached = [key for key, p in model.named_parameters() if "lora_" in key and p.grad is None]
        return f"{kind:5s} {count:3d} targets: unmerged-vs-merged {gap:.1e}, no grad {len(unreached)} {unreached[:2]}"
    except Exception as error:
        return f"{kind:5s} {count:3d} targets: {where(error)}"


def main():
    warnings.filterwarnings("ignore")
    logging.getLogger("tconv3d").setLevel(logging.ERROR)
    order, names = sys.argv[1], sys.argv[2:]
    sweep = {"before": before, "after": after}[order]
    for name, build in builders().items():
        if names and not any(wanted in name for wanted in names):
            continue
        x = torch.randn(draw(random.Random(0), [name], ("fp32",))["shape"])
        run = own_run(name)
        if run is None:
            run = encode_decode if hasattr(build(), "decode") and name != "monai_autoencoderkl" else lambda m, x: m(x)
        print(f"{name:36s} {sweep(name, build, run, x)}", flush=True)


if __name__ == "__main__":
    main()
