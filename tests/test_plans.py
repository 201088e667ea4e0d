"""Call plans (tconv3d/plans.py): a conv op's launches replayed without the Python that chose them.

Compiled kernels cannot run here, so the checks stop at the driver (inspect.compile.stubbed_launches: the kernels
compile for sm_90 and each launcher is a recorder), in a process without the interpreter. A layer's forward and
backward run twice (the first call compiles, the second records), then on fresh tensors at other addresses: that
call is replayed, and it must reach the driver with what the whole path gives the same tensors, launch by launch:
each tensor (or a TMA descriptor's base) named by the input whose storage it is in or by its order among the
call's allocations, with its shape, strides, offset and dtype; every int, grid and constexpr as it is. The configs
are the H100's (the persistent Gluon kernels, split-K, the pointer kernels) and the interpreter's defaults, in
16 bits and fp32, on inputs that are views at an offset, with a skip connection's channels read in place, a grouped
layer, and a weight not in channels_last_3d (cloned into it each call): the host side's copies are in the record
too, in their place among the launches. The pointer kernels' second sources (a skip connection's channels, a
causal layer's cached frames), which they reach by their distance from the input, replay with that distance
computed from the call's tensors; a distance in another class of Triton's specialisation than the recorded one
runs whole, with the kernel the whole path launches. A call that runs another op on the host side gets no plan; a
plan made before launch.forget() or under another device is not replayed; a recording takes no other thread's
launches."""

import pytest
from test_static_compile import CUOBJDUMP, compile_script

pytestmark = pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton wheel ships no NVIDIA toolchain")

SCRIPT = """
import json, torch
from torch.utils._python_dispatch import TorchDispatchMode
import tconv3d
from tconv3d import plans, settings
from tconv3d.inspect.compile import stubbed_launches
from tconv3d.kernels import launch
from tconv3d.tune import choice

assert launch.OFF is None, launch.OFF
settings.CPU_BACKEND = "triton"  # CPU tensors launch the kernels (stubbed), as CUDA tensors do
default_select = choice._select_with_source

def h100(direction, geom, dtype, device, run):
    config, _ = choice.choose(direction, geom, dtype, "NVIDIA H100 80GB HBM3", 132, 90)
    return choice.force_variant(direction, geom, dtype, config, settings.KERNELS, True), "h100"

replays = []
plan_call = plans.Plan.__call__
def counted(self, inputs):
    replays.append(1)
    return plan_call(self, inputs)
plans.Plan.__call__ = counted

def storage(t):
    return t.untyped_storage().data_ptr()

def describe(value, inputs, allocated):
    if isinstance(value, torch.Tensor):
        owner = next((f"input {i}" for i, t in enumerate(inputs) if storage(t) == storage(value)), None)
        if owner is None:
            owner = f"allocation {allocated.setdefault(storage(value), len(allocated))}"
        return [owner, list(value.shape), list(value.stride()), value.storage_offset(), str(value.dtype)]
    if isinstance(getattr(value, "base", None), torch.Tensor):
        return [type(value).__name__, describe(value.base, inputs, allocated), list(value.shape),
                list(value.strides), list(value.block_shape), repr(getattr(value, "layout", None))]
    # Triton's run hands the launcher its hook chains and the metadata made for them; the direct path, with no hook
    # set, None for each: the same launch (test_launch holds the direct path to both, hooks set and not)
    if type(value).__name__ == "LazyDict" or (type(value).__name__ == "HookChain" and not value.calls):
        return None
    if value is None or isinstance(value, (int, float, bool, str)):
        return value
    if isinstance(value, tuple) and all(isinstance(v, (int, bool)) for v in value):
        return list(value)
    return type(value).__name__

class HostCopies(TorchDispatchMode):
    # the host side's copies and fills, into the record among the launches; entered inside each conv op (a mode
    # entered outside sees the op whole), below the mode a plan's recording stacks on it
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.clone.default:  # as a plan replays it: (destination, source)
            record.append(("copy", (out, args[0])))
        elif func in (torch.ops.aten.copy_.default, torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default):
            record.append(("copy", args))
        return out

planned = tconv3d.ops._planned
def watched(*args):
    with HostCopies():
        return planned(*args)
tconv3d.ops._planned = watched

def launches(record, inputs):
    allocated = {}
    return [[name, [describe(v, inputs, allocated) for v in args]] for name, args in record]

def step(x, w, b, after, kwargs, before=None):
    # a layer's forward and backward; its tensors: the inputs, the output, its gradient, the gradients
    y = tconv3d.conv3d(x, w, b, channels_after=after, frames_before=before, **kwargs)
    g = torch.randn_like(y)
    inputs = [t for t in (x, w, b, after, before) if t is not None]
    return inputs + [y, g, *torch.autograd.grad(y, inputs, g)]

def fresh(shape, cout, dtype, bias, offset, after=0, weight_cl=True, groups=1, before=0):
    n, c, d, h, w = shape
    cl = dict(dtype=dtype, memory_format=torch.channels_last_3d)
    # the input a view at `offset` frames into a longer one: an offset into its storage
    x = torch.randn(n, c, d + offset, h, w).to(**cl)[:, :, offset:]
    wt = torch.randn(cout, (c + after) // groups, 3, 3, 3).to(dtype)
    wt = wt.to(memory_format=torch.channels_last_3d) if weight_cl else wt.contiguous()
    b = torch.randn(cout).to(dtype) if bias else None
    second = torch.randn(n, after, d, h, w).to(**cl) if after else None  # a skip connection's channels
    tensors = [x, wt, b, second]
    if before:  # a causal layer's cached frames of the previous chunk
        tensors.append(torch.randn(n, c, before, h, w).to(**cl))
    return [t.requires_grad_() if t is not None else None for t in tensors]

CASES = {
    # name: (select, input shape, Cout, dtype, bias, offset, conv kwargs, channels_after's channels, fresh's kwargs)
    "unet_320 h100": (h100, (2, 320, 8, 8, 8), 320, torch.bfloat16, False, 0, dict(padding=1), 0, {}),
    "down_s2 h100": (h100, (1, 64, 16, 16, 16), 128, torch.bfloat16, True, 2, dict(stride=2, padding=1), 0, {}),
    "skip h100": (h100, (1, 32, 8, 16, 16), 32, torch.bfloat16, True, 0, dict(padding=1), 32, {}),
    "grouped h100": (h100, (1, 256, 4, 8, 8), 256, torch.bfloat16, False, 0, dict(padding=1, groups=32), 0,
                     dict(groups=32)),
    "small default bf16": (default_select, (1, 16, 4, 8, 8), 32, torch.bfloat16, True, 1, dict(padding=1), 0, {}),
    "small default fp32": (default_select, (1, 16, 4, 8, 8), 16, torch.float32, False, 0, dict(padding=(1, 0, 1)), 0,
                           {}),
    "contiguous weight": (default_select, (1, 16, 4, 8, 8), 32, torch.bfloat16, True, 0, dict(padding=1), 0,
                          dict(weight_cl=False)),
    # the pointer kernels' second sources, addressed by their distance from the input (launch.Distance)
    "skip pointer": (default_select, (1, 16, 4, 8, 8), 32, torch.bfloat16, True, 1, dict(padding=1), 16, {}),
    "frames_before pointer": (default_select, (1, 16, 4, 8, 8), 16, torch.float16, False, 0,
                              dict(padding=(0, 0, 1, 1, 1, 1)), 0, dict(before=2)),
    # bordered by replicate (HunyuanVideo's causal layers): the input gradient written in float32 over the bordered
    # geometry, its borders folded onto the planes they read by one more launch
    "replicate h100": (h100, (1, 64, 4, 8, 8), 64, torch.bfloat16, False, 0,
                       dict(padding=(2, 0, 1, 1, 1, 1), padding_mode="replicate"), 0, {}),
}
out = {"cases": {}}
record = []
with stubbed_launches(90, record):
    for name, (select, shape, cout, dtype, bias, offset, kwargs, after, made_as) in CASES.items():
        choice._select_with_source = select
        kept = [fresh(shape, cout, dtype, bias, offset, after, **made_as) for _ in range(2)]
        for tensors in kept:  # the first call compiles, the second records
            step(*tensors[:4], kwargs, *tensors[4:])
        made = {key[1]: type(entry).__name__ if type(entry) is plans.Plan else str(entry)
                for key, entry in choice._memo.items() if key[0] is plans._PLAN}
        # the backward plan's bytes alive at its peak (each allocation made before its first step and dropped after
        # its last) against all of them at once
        for key, entry in choice._memo.items():
            if key[0] is plans._PLAN and key[1] == "backward" and type(entry) is plans.Plan:
                sizes = [torch.Size(a[0]).numel() * a[2].itemsize for a in entry.allocations]
                live = peak = 0
                for i in range(len(entry.launches)):
                    live += sum(sizes[m] for m in entry.makes[i])
                    peak = max(peak, live)
                    live -= sum(sizes[f] for f in entry.frees[i])
                out.setdefault("backward_bytes", {})[name] = [peak, sum(sizes)]
        inputs = fresh(shape, cout, dtype, bias, offset, after, **made_as)
        del record[:], replays[:]
        replayed = launches(record, step(*inputs[:4], kwargs, *inputs[4:]))
        replay_count = len(replays)
        with plans.bypassed():
            del record[:]
            whole = launches(record, step(*inputs[:4], kwargs, *inputs[4:]))
        out["cases"][name] = {"made": made, "replays": replay_count, "launches": len(whole),
                              "copies": sum(name == "copy" for name, _ in whole),
                              "same": replayed == whole, "whole": whole if replayed != whole else None,
                              "replayed": replayed if replayed != whole else None}
        choice._memo.clear()

    # The norms: a GroupNorm's and an RMS norm's forward and backward (three and four launches of the group norm's
    # kernels, its statistics among the outputs), each fused with its SiLU; a GroupNorm fused with a PReLU of one
    # weight (its backward's fourth output that weight's gradient, summed over the channels by one more launch; the
    # SiLU's backward returns None there); and trilinear upsampling's.
    choice._select_with_source = default_select
    slope = torch.full((1,), 0.2, dtype=torch.bfloat16, requires_grad=True)
    norms = {"group_norm": lambda x, w, b: tconv3d.ops.call_group_norm(x, w, b, 4, 1e-6, "silu")[0],
             "group_norm_prelu": lambda x, w, b: tconv3d.ops.call_group_norm(x, w, b, 4, 1e-6, "prelu", None, 0.01,
                                                                             slope)[0],
             "rms_norm": lambda x, w, b: tconv3d.ops.call_rms_norm(x, w, b, 1e-6, "silu", False),
             "upsample_linear": lambda x, w, b: tconv3d.ops.call_upsample_linear(x, [2, 1, 2]) + 0 * (w + b).sum()}
    for name, norm in norms.items():
        def fresh_norm():
            x = torch.randn(2, 32, 3, 5, 6).to(torch.bfloat16, memory_format=torch.channels_last_3d)[:, :, 1:]
            w, b = torch.randn(32).to(torch.bfloat16), torch.randn(32).to(torch.bfloat16)
            return [t.requires_grad_() for t in (x, w, b)]
        def norm_step(x, w, b):
            y = norm(x, w, b)
            g = torch.randn_like(y)
            return [x, w, b, y, g, *torch.autograd.grad(y, (x, w, b), g)]
        for _ in range(2):
            norm_step(*fresh_norm())
        made = {key[1]: type(entry).__name__ if type(entry) is plans.Plan else str(entry)
                for key, entry in choice._memo.items() if key[0] is plans._PLAN}
        inputs = fresh_norm()
        del record[:], replays[:]
        replayed = launches(record, norm_step(*inputs))
        replay_count = len(replays)
        with plans.bypassed():
            del record[:]
            whole = launches(record, norm_step(*inputs))
        out["cases"][name] = {"made": made, "replays": replay_count, "launches": len(whole), "copies": 0,
                              "same": replayed == whole, "whole": whole if replayed != whole else None,
                              "replayed": replayed if replayed != whole else None}
        choice._memo.clear()

    # fp32 as TF32 or not is the key's too: a plan made with TF32 off is not replayed with it on.
    choice._select_with_source = default_select
    select, shape, cout, dtype, bias, offset, kwargs, _, _ = CASES["small default fp32"]
    conv = torch.backends.cudnn.conv
    before = conv.fp32_precision
    conv.fp32_precision = "ieee"
    for _ in range(2):
        step(*fresh(shape, cout, dtype, bias, offset), kwargs)
    conv.fp32_precision = "tf32"
    inputs = fresh(shape, cout, dtype, bias, offset)
    del record[:]
    with_plans = launches(record, step(*inputs, kwargs))
    with plans.bypassed():
        del record[:]
        out["tf32_switch"] = with_plans == launches(record, step(*inputs, kwargs))
    conv.fp32_precision = before
    choice._memo.clear()

    # A broken plan is told apart: the forward's output slot pointed at its input.
    choice._select_with_source = default_select
    select, shape, cout, dtype, bias, offset, kwargs, _, _ = CASES["small default bf16"]
    for _ in range(2):
        step(*fresh(shape, cout, dtype, bias, offset), kwargs)
    plan = next(e for k, e in choice._memo.items() if k[0] is plans._PLAN and k[1] == "fwd")
    first = plan.launches[0]
    position, slot, view, descriptor = first.tensors[-1]
    first.tensors[-1] = (position, 0 if slot else 1, view, descriptor)
    inputs = fresh(shape, cout, dtype, bias, offset)
    del record[:]
    tconv3d.conv3d(*inputs[:3], **kwargs)
    broken = launches(record, [t for t in inputs if t is not None])
    with plans.bypassed():
        del record[:]
        tconv3d.conv3d(*inputs[:3], **kwargs)
    out["broken_told_apart"] = broken != launches(record, [t for t in inputs if t is not None])
    choice._memo.clear()

    # What gets no plan: an op on the host side that is not a copy (a made-up call that doubles its input), a
    # second source.
    x, w, b, _ = fresh(shape, cout, dtype, bias, offset)
    doubled = (plans._PLAN, "doubled", x.shape)
    for _ in range(3):
        with torch.no_grad():
            plans.recorded(doubled, (x,), lambda: x * 2)
    out["other_on_host"] = str(choice._memo[doubled])
    choice._memo.clear()
    # Under a dispatch mode entered outside the op (a user's), the weight's conversion reaches the recording's mode
    # as aten.contiguous, which may alias or clone: it is taken apart, and the clone replayed.
    x, w, b, _ = fresh(shape, cout, dtype, bias, offset, weight_cl=False)
    del replays[:]
    class Outer(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    with torch.no_grad(), Outer():
        for _ in range(3):
            tconv3d.conv3d(x, w, b, **kwargs)
    out["outer_mode"] = [len(replays), *(type(e).__name__ for k, e in choice._memo.items() if k[0] is plans._PLAN)]
    choice._memo.clear()
    # A second source's distance from the input in another class of Triton's specialisation than the recorded
    # one (here divisible by 16 elements, or not): that call runs whole, reaching the driver as the whole path
    # does, and the plan stays.
    x, w, b, after = fresh(shape, cout, dtype, bias, offset, after=8)
    import numpy as np
    # channels_after in memory starting 8 * (k % 2) elements into the k-th of eight slots of one buffer, each
    # slot a multiple of 16 elements long: storage offset 0 and the same 16-byte alignment (shifts of 8), so the
    # same plan key, and distances from x in both classes whatever addresses the allocator hands out (eight
    # buffers of their own fell in one class on a CI run)
    slot = (after.numel() + 64 + 15) // 16 * 16
    buffer = np.empty(8 * slot, dtype=np.uint16)
    def placed(k):
        start = k * slot + 8 * (k % 2)
        t = torch.from_numpy(buffer[start:start + after.numel()])
        t = t.view(dtype).view(after.shape[0], *after.shape[2:], after.shape[1]).permute(0, 4, 1, 2, 3)
        return t.copy_(after)
    def distance_class(second):
        return (second.data_ptr() - x.data_ptr()) // x.element_size() % 16 == 0
    placements = [placed(k) for k in range(8)]  # 16 bytes apart: distances 8 elements apart
    classes = [[t for t in placements if distance_class(t) == c] for c in (False, True)]
    recorded_as, (other, *_) = sorted(classes, key=len, reverse=True)
    from triton.compiler.compiler import CompiledKernel
    stand_in = CompiledKernel.run  # the stand-in launcher, recording which compiled kernel launched as well
    CompiledKernel.run = property(lambda k: lambda *args: record.append((k.name, (k.hash, *args))))
    with torch.no_grad():
        for second in recorded_as[:2]:
            tconv3d.conv3d(x, w, b, channels_after=second, **kwargs)
        del replays[:], record[:]
        tconv3d.conv3d(x, w, b, channels_after=other, **kwargs)
        taken = launches(record, [x, w, b, other])
        with plans.bypassed():
            del record[:]
            tconv3d.conv3d(x, w, b, channels_after=other, **kwargs)
            whole = launches(record, [x, w, b, other])
        del record[:]
        tconv3d.conv3d(x, w, b, channels_after=recorded_as[2], **kwargs)
    CompiledKernel.run = stand_in
    out["other_class"] = {"same": taken == whole, "plans": [type(e).__name__ if type(e) is plans.Plan else str(e)
                          for k, e in choice._memo.items() if k[0] is plans._PLAN], "replays": len(replays),
                          "launches": len(record)}
    choice._memo.clear()

    # A plan outlives neither launch.forget() nor the device it was made on.
    x, w, b, _ = fresh(shape, cout, dtype, bias, offset)
    args = (x, w, b, [1, 1, 1], [1] * 6, [1, 1, 1], 1)
    with torch.no_grad():
        for _ in range(2):
            torch.ops.tconv3d.conv3d(*args)
        key = plans.key("fwd", (x, w, b, None, None), ([1, 1, 1], [1] * 6, [1, 1, 1]), 1, "zeros")
        out["found"] = plans.find(key) is not None
        launch.forget()
        out["found_after_forget"] = plans.find(key) is not None
        for _ in range(2):
            torch.ops.tconv3d.conv3d(*args)
        out["found_again"] = plans.find(key) is not None
        state = launch.signature_state
        launch.signature_state = lambda: ("another device", *state()[1:])
        del replays[:]
        torch.ops.tconv3d.conv3d(*args)
        launch.signature_state = state
        out["stale"] = [len(replays), plans.find(key) is not None, str(choice._memo.get(key))]
    # A recording takes its own thread's launches only (another thread's, a DataParallel replica's, never).
    import threading
    taken = []
    with plans.bypassed(), launch.recording(taken), torch.no_grad():  # the whole path: through launch.launch
        worker = threading.Thread(target=lambda: torch.ops.tconv3d.conv3d(*args))
        worker.start()
        worker.join()
        out["thread"] = [len(taken)]
        torch.ops.tconv3d.conv3d(*args)
        out["thread"].append(len(taken) > 0)
    # Past MAX_ENTRIES entries of the memo, calls are not remembered (shapes that never repeat would fill it).
    choice._memo.clear()
    plans.MAX_ENTRIES = 0
    with torch.no_grad():
        for _ in range(3):
            torch.ops.tconv3d.conv3d(*args)
    out["full_memo"] = [type(e).__name__ for k, e in choice._memo.items() if k[0] is plans._PLAN]
    plans.MAX_ENTRIES = 16384
    # Arguments a fresh check would refuse are never a plan's: stride True where 1 was recorded.
    out["bool_key"] = plans.key("fwd", (x, w, b, None, None), ([True, 1, 1], [1] * 6, [1, 1, 1]), 1, "zeros")
print(json.dumps(out))
"""


def test_a_replayed_call_reaches_the_driver_as_the_whole_path_does():
    result = compile_script(SCRIPT)
    for name, case in result["cases"].items():
        if name in ("group_norm", "group_norm_prelu", "rms_norm", "upsample_linear"):  # forward and backward: a plan
            # each, replayed
            op = name.removesuffix("_prelu")
            assert case["made"] == {op: "Plan", f"{op}_backward": "Plan"}, (name, case["made"])
            assert case["replays"] == 2, (name, case)
            least = {"group_norm": 7, "group_norm_prelu": 8, "rms_norm": 4, "upsample_linear": 2}[name]
            assert case["launches"] >= least, (name, case)
            assert case["same"], (name, case["whole"], case["replayed"])
            continue
        # the forward and the backward (its input and weight gradients in one call: ops._gradients) each have
        # a plan, and the third step replays both
        assert case["made"] == {"fwd": "Plan", "backward": "Plan"}, (name, case["made"])
        assert case["replays"] == 2, (name, case)
        assert case["launches"] >= 3, (name, case)
        assert case["same"], (name, case["whole"], case["replayed"])
    # unet_320's input gradient is split 5 ways on the H100 (6.5 MB of fp32 partials), its weight gradient not: the
    # replayed backward drops the partials, summed, before it makes the weight gradient (5.3 MB), as the two ops did
    peak, total = result["backward_bytes"]["unet_320 h100"]
    dx, partials, dw = 2 * 320 * 512 * 2, 5 * 2 * 320 * 512 * 4, 320 * 27 * 320 * 2
    assert (peak, total) == (dx + partials, dx + partials + dw), (peak, total)
    assert result["broken_told_apart"]
    assert result["tf32_switch"]
    # the contiguous weight is cloned by the forward and the input gradient; the grouped layer's pointer kernels
    # read its weight's blocks and store its gradient's in place (kernels/grouped.py): nothing to copy
    assert result["cases"]["contiguous weight"]["copies"] == 2 and result["cases"]["grouped h100"]["copies"] == 0
    # the replicate layer's backward: its border fold one launch (kernels/fold.py), no host-side copy
    assert result["cases"]["replicate h100"]["copies"] == 0
    assert result["outer_mode"] == [1, "Plan"], result["outer_mode"]
    assert result["other_on_host"] == "the call ran aten.mul.Tensor on the host side", result["other_on_host"]
    # the pointer kernels take a second source's distance from the input, recomputed at each replay (the skip and
    # frames_before cases above); one of another class of Triton's specialisation runs whole, the plan kept
    other = result["other_class"]
    assert other["same"] and other["plans"] == ["Plan"] and other["replays"] == 2, other
    assert result["found"] and not result["found_after_forget"] and result["found_again"], result
    # another device: not replayed, dropped, and the call counts as the key's first again
    assert result["stale"] == [1, False, "called once: the next call records"], result["stale"]
    assert result["bool_key"] is None
    assert result["thread"] == [0, True], result["thread"]
    assert result["full_memo"] == [], result["full_memo"]


CUDA_CASES = {
    # name: (input shape, Cout, dtype, bias, conv kwargs, channels_after's channels): the small suite layers the
    # host bounds, a causal one, a UNet decoder's conv of a skip connection, and a fp32 one
    "unet_320": ((2, 320, 8, 8, 8), 320, "bfloat16", False, dict(padding=1), 0),
    "down_s2": ((2, 64, 32, 32, 32), 128, "bfloat16", True, dict(stride=2, padding=1), 0),
    "causal": ((1, 64, 6, 24, 24), 64, "float16", True, dict(padding=(2, 0, 1, 1, 1, 1)), 0),
    "skip": ((2, 32, 16, 16, 16), 32, "bfloat16", True, dict(padding=1), 32),
    "fp32": ((1, 32, 4, 16, 16), 32, "float32", True, dict(padding=1), 0),
    # a grouped layer, its groups run side by side (kernels/grouped.py)
    "grouped": ((2, 256, 8, 16, 16), 256, "bfloat16", False, dict(padding=1, groups=32), 0),
    # bordered by replicate (HunyuanVideo's causal layers): the input gradient's fold, a launch of the plan too
    "replicate": (
        (1, 64, 6, 24, 24),
        64,
        "bfloat16",
        False,
        dict(padding=(2, 0, 1, 1, 1, 1), padding_mode="replicate"),
        0,
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CUDA_CASES))
def test_replayed_steps_compute_what_the_whole_path_does(name, monkeypatch):
    """On a GPU: a layer's third forward and backward (replayed from the plans the second recorded) give the whole
    path's results bit for bit, and so does a CUDA graph captured from replays."""
    import torch

    import tconv3d
    from tconv3d import plans

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    shape, cout, dtype, bias, kwargs, after = CUDA_CASES[name]
    dtype = getattr(torch, dtype)

    def cl(*size):  # torch.randn takes no memory_format (H200 run 6)
        return torch.randn(*size, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last_3d)

    x = cl(*shape).requires_grad_()
    w = (cl(cout, (shape[1] + after) // kwargs.get("groups", 1), 3, 3, 3) / 30).requires_grad_()
    b = torch.randn(cout, device="cuda", dtype=dtype).requires_grad_() if bias else None
    skip = cl(shape[0], after, *shape[2:]).requires_grad_() if after else None
    leaves = [t for t in (x, w, b, skip) if t is not None]
    g = torch.randn_like(tconv3d.conv3d(x, w, b, channels_after=skip, **kwargs))

    def step(tensors=leaves):
        x, w, *rest = tensors
        b, skip = (rest.pop(0) if bias else None), (rest.pop(0) if after else None)
        y = tconv3d.conv3d(x, w, b, channels_after=skip, **kwargs)
        return [y, *torch.autograd.grad(y, tensors, g)]

    replays = []
    original = plans.Plan.__call__
    monkeypatch.setattr(plans.Plan, "__call__", lambda self, inputs: replays.append(1) or original(self, inputs))
    for _ in range(2):
        step()
    replayed = step()
    # the forward, input gradient and weight gradient, but for one a pointer kernel runs with the skip's distance
    assert len(replays) >= 2, len(replays)
    with plans.bypassed():
        whole = step()
    for got, want in zip(replayed, whole, strict=True):
        assert torch.equal(got, want)

    # The capture as PyTorch's recipe has it: fresh leaves, first used on a side stream. An autograd node keeps the
    # stream it was made on, and a leaf's gradient accumulator made on the default stream (kept alive by `replayed`'s
    # graph) pulls the legacy stream into the capture: H200 run 11, cudaErrorStreamCaptureImplicit (pytorch#164302).
    fresh = [t.detach().requires_grad_() for t in leaves]
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(fresh)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        captured = step(fresh)
    fresh[0].data.copy_(torch.randn_like(x))  # the graph reads the tensors' new values
    graph.replay()
    torch.cuda.synchronize()
    with plans.bypassed():
        want = step(fresh)
    for got, expected in zip(captured, want, strict=True):
        assert torch.equal(got, expected)
