"""TCONV3D_INDUCTOR_KERNELS=1: under torch.compile the ops hand their Triton launches to Inductor (ops.py,
kernels/launch.traced), so its generated code launches tconv3d's kernels itself.

Inductor cannot generate CUDA code without a GPU, so the checks stop at what it receives and what it would
compile, in a process without the interpreter (kernels compile for sm_90; launchers are recorders,
inspect.compile.stubbed_launches): AOTAutograd's forward and backward graphs of a few layers hold their kernels
and no tconv3d op, no copy of an input or of a weight (a kernel's output buffers are the only tensors the
functional kernel wrapper clones, and Inductor reuses those in place); run as they are, the graphs launch the same
kernels, grids and arguments as eager does; Inductor's copy of each kernel's source (with the helpers it calls)
compiles to the same PTX as the kernel itself; what the path cannot express stays one op call."""

import pytest
from test_static_compile import CUOBJDUMP, compile_script

from tconv3d import settings as tconv3d_settings

pytestmark = pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton wheel ships no NVIDIA toolchain")

SCRIPT = r"""
import dataclasses, importlib.util, json, operator, os, re, sys, tempfile
os.environ["TCONV3D_INDUCTOR_KERNELS"] = "1"
import torch
from torch._functorch.aot_autograd import aot_module_simplified
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code
import tconv3d
from tconv3d import settings
from tconv3d.inspect.compile import compile_only, stubbed_launches
from tconv3d.tune import choice

settings.CPU_BACKEND = "triton"  # CPU tensors take the kernels' path; their launches stop at the recorder
# The tiles an H100 would run (its table, else the nearest key or its heuristic), on the kernels this path takes.
choice._select = lambda direction, geom, dtype, device, run: dataclasses.replace(
    choice.choose(direction, geom, dtype, "NVIDIA H100 80GB HBM3", 132, 90)[0], tma_box_w=0, gluon=0
)
cl = dict(dtype=torch.bfloat16, memory_format=torch.channels_last_3d)


def layers(x, w, b, w2, w_dw, scale, shift, frames, w_out, w_in):
    y = torch.ops.tconv3d.conv3d(x, w, b, [1, 1, 1], [1, 1, 1], [1, 1, 1], 1)
    y, _, _ = torch.ops.tconv3d.group_norm(y, scale, shift, 8, 1e-5, "silu")
    y = torch.ops.tconv3d.rms_norm(y, scale, shift, 1e-12, "silu", True)
    y = torch.ops.tconv3d.conv3d(y, w2, None, [2, 2, 2], [1, 1, 1], [1, 1, 1], 1)  # strided: a live-tap table
    y = torch.ops.tconv3d.conv3d(y, w_dw, None, [1, 1, 1], [1, 1, 1], [1, 1, 1], 32)  # depthwise
    if frames is not None:  # frames_before: the kernels address it from the input; stays one op
        y = torch.ops.tconv3d.conv3d(y, w_dw, None, [1, 1, 1], [0, 1, 1], [1, 1, 1], 32, "zeros", frames)
    # to 3 channels and from them: the small-channel forms (forward W-tap columns, packed input gradient, out-tap
    # rows; packed forward, W-tap input gradient, packed weight gradient)
    y = torch.ops.tconv3d.conv3d(y, w_out, None, [1, 1, 1], [1, 1, 1], [1, 1, 1], 1)
    return torch.ops.tconv3d.conv3d(y, w_in, None, [1, 1, 1], [1, 1, 1], [1, 1, 1], 1)


def inputs(with_frames):
    x = torch.randn(1, 64, 4, 16, 16).to(**cl).requires_grad_()
    w = torch.randn(64, 64, 3, 3, 3).to(**cl).requires_grad_()
    b = torch.randn(64, dtype=torch.bfloat16).requires_grad_()
    w2 = torch.randn(32, 64, 3, 3, 3).to(**cl).requires_grad_()
    w_dw = torch.randn(32, 1, 3, 3, 3).to(**cl).requires_grad_()
    # trained, as a norm's affine parameters are: Inductor drops the launches of gradients nobody reads (the RMS
    # norm's sums of its weight and bias gradients), which eager runs
    scale, shift = (torch.randn(64, dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    frames = torch.randn(1, 32, 2, 8, 8).to(**cl) if with_frames else None
    w_out = torch.randn(3, 32, 3, 3, 3).to(**cl).requires_grad_()
    w_in = torch.randn(16, 3, 3, 3, 3).to(**cl).requires_grad_()
    return x, w, b, w2, w_dw, scale, shift, frames, w_out, w_in


def tensor(value):
    return ("tensor", str(value.dtype), list(value.shape), list(value.stride()))


def plain(value):  # what a launch argument says, addresses left out
    if isinstance(value, torch.Tensor):
        return tensor(value)
    if type(value).__name__ == "LazyDict" or callable(value):
        return None
    return value if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__


def step(fn, args, record):
    del record[:]
    y = fn(*args)
    y.float().sum().backward()
    return [(name, [plain(v) for v in launched[:3]], [plain(v) for v in launched[9:]]) for name, launched in record]


def without_bias_sums(launches):
    # Eager computes a layer's bias gradient in its backward's plan (split_k.channel_sums: the sums, then their
    # sum_splits); the compiled graph holds torch's sum there, which Inductor reduces itself.
    kept, after_sums = [], False
    for entry in launches:
        if entry[0] == "_channel_sums_kernel" or (after_sums and entry[0] == "_sum_splits_kernel"):
            after_sums = entry[0] == "_channel_sums_kernel"
            continue
        after_sums = False
        kept.append(entry)
    return kept


def ptx_code(ptx):  # the instructions, without the source lines and files they came from
    lines = [line.split("//")[0].rstrip() for line in ptx.split(".section\t.debug")[0].splitlines()]
    return [line for line in lines if line.strip() and not re.match(r"\s*\.(loc|file)\b", line)]


out = {}
for with_frames in (False, True):
    graphs = []

    def capture(gm, example_inputs):
        def keep(graph, _inputs):
            graphs.append(graph)
            return graph  # run as traced: the kernel wrappers launch the kernels (onto the recorder here)

        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

    record = []
    args = inputs(with_frames)
    with stubbed_launches(90, record):
        compiled = step(torch.compile(layers, backend=capture, fullgraph=True), args, record)
        eager = step(layers, args, record)
    nodes = [n for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    wrappers = [n for n in nodes if "triton_kernel_wrapper" in str(n.target)]
    cloned = []  # wrappers cloning a tensor that is not a buffer made for them: (names, what made them)
    views = ("view", "unsqueeze", "permute", "slice", "select", "as_strided", "squeeze", "alias")

    def base(node):  # through views to the tensor they view, and a kernel's output to the tensor it wrote into
        while node.op == "call_function":
            if node.target is operator.getitem and "triton_kernel_wrapper" in str(node.args[0].target):
                node = node.args[0].kwargs["kwargs"][node.args[1]]  # (a norm's one table of coefficients)
            elif str(node.target).split(".")[1:2] and str(node.target).split(".")[1] in views:
                node = node.args[0]
            else:
                break
        return node

    for n in wrappers:
        made = [base(n.kwargs["kwargs"][name]) for name in n.kwargs["tensors_to_clone"]]
        if not all(m.op == "call_function" and "empty" in str(m.target) for m in made):
            cloned.append([n.kwargs["tensors_to_clone"], [str(m.target) for m in made]])
    kernels = {}  # name and small-channel form -> (the kernel, its launch options, a wrapper node launching it)
    for n in wrappers:
        entry = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])  # launch options make it an Autotuner
        kernel, options = (entry.fn, entry.configs[0].__dict__) if hasattr(entry, "configs") else (entry, {})
        options = {k: options[k] for k in ("num_warps", "num_stages") if options.get(k) is not None}
        form = "".join(f" {k}" for k in ("PACK_TAPS", "W_TAPS") if n.kwargs["kwargs"].get(k))
        kernels.setdefault(kernel.__name__ + form, (kernel, options, n))
    # Copies in the graph: only of the norms' per-channel statistics and constants, never of a layer's tensors.
    copy_ops = ("clone", "copy", "copy_", "_to_copy", "contiguous", "lift_fresh_copy")
    copies = [(str(n.target), n.meta["val"].numel()) for n in nodes
              if str(n.target).split(".")[1:2] in [[op] for op in copy_ops] or "scatter" in str(n.target)]  # fmt: skip
    out[str(with_frames)] = {
        "large_copies": [c for c in copies if c[1] > 256],
        "copies": len(copies),
        "ops": sorted({str(n.target) for n in nodes if "tconv3d" in str(n.target)}),
        "targets": sorted({str(n.target) for n in nodes}),
        "kernels": sorted({name.split()[0] for name in kernels}),
        "forms": sorted(kernels),
        "cloned": cloned,
        "same_launches": compiled == without_bias_sums(eager),
        "launched": [name for name, _, _ in compiled],
        "eager_launched": [name for name, _, _ in without_bias_sums(eager)],
        "bias_sums": sum(name == "_channel_sums_kernel" for name, _, _ in eager),
    }
    if with_frames:
        continue
    # Inductor's copy of each kernel (its source and the helpers it calls, as the generated code holds it)
    # compiles to the kernel's own PTX.
    same_ptx = {}
    folder = tempfile.mkdtemp()
    for label, (kernel, options, node) in kernels.items():
        name = kernel.__name__
        source = user_defined_triton_kernel_transitive_closure_source_code(kernel)
        path = os.path.join(folder, label.replace(" ", "_") + ".py")
        with open(path, "w") as f:
            f.write("import triton\nimport triton.language as tl\n\n@triton.jit\n" + source)
        spec = importlib.util.spec_from_file_location("inductor_copy_" + label.replace(" ", "_"), path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        copy = getattr(module, name)
        def meta(v):  # a graph tensor as a meta tensor: what compiling needs of it
            v = v.meta["val"]
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")

        kwargs = {k: meta(v) if isinstance(v, torch.fx.Node) else v for k, v in node.kwargs["kwargs"].items()}
        kwargs |= {arg: None for arg in kernel.arg_names if arg not in kwargs}  # the graph leaves None arguments out
        grid = node.kwargs["grid"][0]
        ptx = []
        for compiled in (kernel, copy):
            launches = []
            with compile_only(90, launches):
                compiled[grid](**kwargs, **options)
            ptx.append(launches[0][3].asm["ptx"])
        same_ptx[label] = ptx_code(ptx[0]) == ptx_code(ptx[1])
    out["same_ptx"] = same_ptx
print(json.dumps(out))
"""

OPAQUE = """
import json, os, sys
os.environ["TCONV3D_INDUCTOR_KERNELS"] = sys.argv[1]
os.environ["TCONV3D_KERNELS"] = sys.argv[2]
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.functional_tensor import dispatch_functionalize
import tconv3d
from tconv3d import settings
from tconv3d.inspect.compile import stubbed_launches

settings.CPU_BACKEND = "triton"
cl = dict(dtype=torch.bfloat16, memory_format=torch.channels_last_3d)
x, w = torch.randn(1, 64, 4, 16, 16).to(**cl), torch.randn(64, 64, 3, 3, 3).to(**cl)
conv = lambda x, w: torch.ops.tconv3d.conv3d(x, w, None, [1, 1, 1], [1, 1, 1], [1, 1, 1], 1)
with stubbed_launches(90, []):
    graph = make_fx(dispatch_functionalize(conv), tracing_mode="fake")(x, w)

    class Conv(torch.nn.Module):
        def forward(self, x, w):
            return conv(x, w)

    exported = torch.export.export(Conv(), (x, w)).graph  # torch.export keeps the op whole, setting or not
    # conv_transpose3d with its bias: the input-gradient kernel adds it (HAS_BIAS), no add after it
    up = lambda x, w, b: tconv3d.conv_transpose3d(x, w, b, stride=2)
    b = torch.randn(32, dtype=torch.bfloat16)
    transposed = make_fx(dispatch_functionalize(up), tracing_mode="fake")(x, w[:, :32], b)
targets = sorted({str(n.target) for n in graph.graph.nodes if n.op == "call_function"})
wrappers = [n for n in transposed.graph.nodes if "triton_kernel_wrapper" in str(n.target)]
print(json.dumps({
    "targets": targets, "explained": tconv3d.explain(x, w, padding=1)["fwd"].get("inductor"),
    "exported": sorted({str(n.target) for n in exported.nodes if n.op == "call_function"}),
    "transposed": sorted({str(n.target) for n in transposed.graph.nodes if n.op == "call_function"}),
    "has_bias": [n.kwargs["kwargs"].get("HAS_BIAS") for n in wrappers],
}))
"""


def test_inductor_receives_the_kernels_and_launches_them_as_eager_does():
    result = compile_script(SCRIPT)
    plain = result["False"]
    assert plain["ops"] == [], plain["ops"]  # every op handed over its kernels
    assert set(plain["kernels"]) == {
        "_conv3d_fwd_kernel", "_conv3d_dgrad_kernel", "_conv3d_wgrad_kernel", "_sum_splits_kernel",
        "_channel_reduce_kernel", "_fold_kernel", "_affine_kernel", "_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel",
        "_depthwise_fwd_kernel", "_depthwise_dgrad_kernel", "_depthwise_wgrad_kernel",
        "_conv3d_wgrad_out_pairs_kernel",
    }, plain["kernels"]  # fmt: skip
    # the small-channel forms, each compared as Inductor's copy compiles it
    for form in ("_conv3d_fwd_kernel W_TAPS", "_conv3d_dgrad_kernel W_TAPS", "_conv3d_fwd_kernel PACK_TAPS",
                 "_conv3d_dgrad_kernel PACK_TAPS", "_conv3d_wgrad_kernel PACK_TAPS"):  # fmt: skip
        assert form in plain["forms"] and form in result["same_ptx"], plain["forms"]
    assert plain["cloned"] == [], plain["cloned"]  # inputs, weights and activations are never cloned
    assert plain["copies"] and plain["large_copies"] == [], plain["large_copies"]  # the smallest layer tensor: 864
    assert plain["same_launches"], (plain["launched"], plain["eager_launched"])
    assert plain["bias_sums"] == 1  # the first layer's bias gradient, in eager's backward plan (not compiled)
    assert len(plain["launched"]) >= 12, plain["launched"]  # 4 layers forward, their gradients, the split sums
    assert result["same_ptx"] and all(result["same_ptx"].values()), result["same_ptx"]

    framed = result["True"]
    # The layer reading frames_before stays whole in the forward and the weight gradient (its input gradient, of
    # the concatenation, reads no second source).
    assert framed["ops"] == ["tconv3d.conv3d.default", "tconv3d.conv3d_weight_grad.default"], framed["ops"]
    # (its launches' arguments hold the distance between two tensors' addresses, which differs from run to run)
    assert framed["launched"] == framed["eager_launched"], (framed["launched"], framed["eager_launched"])


@pytest.mark.parametrize(
    "setting, kernels, traced",
    [("1", "auto", True), ("0", "auto", False), ("1", "tma", False)],
    ids=["on", "off_by_default", "tma_stays_an_op"],
)
def test_what_stays_one_op(setting, kernels, traced):
    """Without the setting every op stays whole; with it, a launch on TMA descriptors too (wrap_triton would take
    the descriptors as constants, blind to the kernel's writes)."""
    script = f"import sys; sys.argv = ['', {setting!r}, {kernels!r}]\n" + OPAQUE
    result = compile_script(script)
    targets, explained = result["targets"], result["explained"]
    assert result["exported"] == ["tconv3d.conv3d.default"], result["exported"]
    assert ("tconv3d.conv3d.default" not in targets) == traced, targets
    assert any("triton_kernel_wrapper" in t for t in targets) == traced, targets
    transposed = result["transposed"]
    assert not any(".add" in t for t in transposed), transposed
    if traced:  # one input-gradient launch, the bias its epilogue's
        assert result["has_bias"] == [True] and "tconv3d.conv3d_input_grad.default" not in transposed, result
    else:
        assert "tconv3d.conv3d_input_grad.default" in transposed, transposed
    if setting == "0":
        assert explained is None  # explain reports the path only where it is on
    else:
        assert explained.startswith("its kernels" if traced else "op call: TMA"), explained


@pytest.mark.skipif(not tconv3d_settings.INTERPRET, reason="the interpreter's case; test_gpu.py has the GPU's")
def test_the_interpreter_keeps_ops_whole(monkeypatch):
    """Under the interpreter (this suite on CPU) the setting changes nothing: the interpreter runs the kernels,
    which Inductor cannot; compiled, the ops stay calls and compute what eager does; explain says why."""
    import torch

    import tconv3d

    monkeypatch.setattr(tconv3d.settings, "INDUCTOR_KERNELS", True)
    x = torch.randn(1, 8, 3, 5, 5).contiguous(memory_format=torch.channels_last_3d)
    w = torch.randn(8, 8, 3, 3, 3).contiguous(memory_format=torch.channels_last_3d)
    plan = tconv3d.explain(x, w, padding=1)
    assert all(plan[d]["inductor"].startswith("op call: the interpreter") for d in ("fwd", "dgrad", "wgrad")), plan

    def layer(x):
        return torch.ops.tconv3d.group_norm(tconv3d.conv3d(x, w, padding=1), None, None, 2, 1e-5, "silu")[0]

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), layer(x))


def test_cache_keys_carry_the_choice_state(monkeypatch, tmp_path):
    """With the setting, Inductor's cache keys (AOTAutograd's include FX graph cache's) hash what tconv3d's choices
    depend on: the variant setting, first-use tuning, the tuning tables' files. Without it a graph compiled under
    TCONV3D_KERNELS=auto (a TMA launch left an op call) came back from AOTAutograd's cache when the same process
    compiled the same model under TCONV3D_KERNELS=pointer (test_gpu.py on the H200). A post-grad pass of the
    user's own is left in place, with a warning."""
    import torch
    from torch._inductor import codecache
    from torch._inductor import config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from tconv3d import ops

    # Inductor's own patch, not monkeypatch's: pytest (9.2) restores a module attribute it did not find in the
    # module's __dict__ by deleting it, and a deleted Inductor setting reads "does not exist" to every later compile
    # in the process (test_scale's compiled checkpointing failed after this file on the same worker).
    before = inductor_config.post_grad_custom_post_pass
    with inductor_config.patch(post_grad_custom_post_pass=None):
        monkeypatch.setattr(ops, "_choice_pass", None)
        monkeypatch.setattr(tconv3d_settings, "INDUCTOR_KERNELS", True)
        monkeypatch.setattr(tconv3d_settings, "CONFIG_DIR", tmp_path)
        graph = torch.fx.symbolic_trace(lambda x: x * 2)
        example = [torch.randn(3)]

        def key():
            return codecache.compiled_fx_graph_hash(graph, example, {}, [])[0]

        unset = key()
        ops.keep_choices_in_cache_keys()
        carrier = inductor_config.post_grad_custom_post_pass
        assert isinstance(carrier, CustomGraphPass) and carrier(graph.graph) is None
        auto = key()
        assert auto != unset and key() == auto  # the same state, the same key
        monkeypatch.setattr(tconv3d_settings, "KERNELS", "pointer")
        pointer = key()
        assert pointer != auto
        (tmp_path / "NVIDIA_H200.json").write_text('{"entries": {}}')  # a table appears (first-use tuning writes one)
        assert key() != pointer
        ops.keep_choices_in_cache_keys()  # once
        assert inductor_config.post_grad_custom_post_pass is carrier

        mine = carrier.__class__()
        inductor_config.post_grad_custom_post_pass = mine
        monkeypatch.setattr(ops, "_choice_pass", None)
        with pytest.warns(UserWarning, match="post_grad_custom_post_pass of your own"):
            ops.keep_choices_in_cache_keys()
        assert inductor_config.post_grad_custom_post_pass is mine
    assert inductor_config.post_grad_custom_post_pass is before  # put back, and still a setting
