"""Real models, as users convert them: the video VAEs of diffusers (Wan, CogVideoX, Mochi, HunyuanVideo, LTX-Video)
and MONAI's 3D UNets, small configs with random weights on CPU. Converted outputs match the stock models,
`audit` finds every convolution on tconv3d with no pad or concatenation copy feeding it, torch.compile traces
them with no new graph breaks, cached chunk-by-chunk decoding and state_dicts agree with the stock models.

Needs the `integrations` extra (pip install ".[integrations]"); skipped without it.
"""

import copy
import functools
import inspect
import logging
import math
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from real_models import (
    CHUNKED_ENCODERS,
    INPUT_EDGES,
    MATCH,
    OWN_PAD_COPIES,
    assert_all_on_tconv3d,
    assert_gradients_as_near_float64,
    assert_keeps_no_more_than_stock,
    assert_same_gradients,
    assert_stays_channels_last,
    explained_without_new_graph_breaks,
    perturbed,
    stock_and_converted,
)  # fmt: skip
from torch import nn

import tconv3d
from bench.vaes import LATENT_CHANNELS, build_vae
from tconv3d.kernels.tensors import format_strides
from tconv3d.nn.convert import is_converted
from tconv3d.nn.hooks import hooked
from tconv3d.nn.video_vaes import NORM_SILU_BLOCKS, class_name
from tconv3d.testing import rel_l2

diffusers = pytest.importorskip("diffusers")


VAES = {name: functools.partial(build_vae, name) for name in LATENT_CHANNELS}
RMS_NORMED = ("wan", "wan22", "hunyuan_video15", "ltx_video", "ltx2", "hunyuan_image_refiner")


def encode_decode(model, x):
    return model.decode(model.encode(x).latent_dist.mode()).sample


def converted_and_audited(build, x, run=encode_decode):
    """Stock and converted models of `build`, the converted one checked to match stock's run(model, x), and both
    models' audits of that run."""
    stock, converted = stock_and_converted(build)
    with torch.no_grad():
        assert rel_l2(run(converted, x), run(stock, x)) < MATCH
    before = tconv3d.nn.audit(stock, x, run=run, verbose=False)
    after = tconv3d.nn.audit(converted, x, run=run, verbose=False)
    return stock, converted, before, after


# Convolutions a model's own code calls outside any conv module: Cosmos's Haar wavelet transforms, (F.conv3d calls
# in its patcher, F.conv_transpose3d calls in its unpatcher, tconv3d calls for both: one a level and direction).
FUNCTIONAL_CONVS = {"cosmos": (28, 28, 4)}


@pytest.mark.parametrize("name", VAES)
def test_vae_matches_stock_and_audit_finds_every_conv_fused(name, aten_path):
    stock, converted = stock_and_converted(VAES[name])
    x = torch.randn(1, 3, 9, 32, 32)
    with torch.no_grad():
        expected, out = encode_decode(stock, x), encode_decode(converted, x)
    assert rel_l2(out, expected) < MATCH
    before = tconv3d.nn.audit(stock, x, run=encode_decode, verbose=False)
    after = tconv3d.nn.audit(converted, x, run=encode_decode, verbose=False)
    assert len(after.layers) == len(before.layers) > 0
    functional, functional_transposed, functional_ours = FUNCTIONAL_CONVS.get(name, (0, 0, 0))
    assert before.totals["aten_convs_outside_layers"] == functional + functional_transposed
    # Wan's and CogVideoX's resamplers ran a 2-D conv on the frames as a batch: one tconv3d conv over the video now
    stock_convs = before.aten_conv3d_calls + before.aten_frame_conv_calls - functional + functional_ours
    assert (before.aten_frame_conv_calls > 0) == (name in ("wan", "wan22", "cogvideox"))
    if name == "easyanimate":  # its causal conv ran once per output frame: one op a call now
        assert stock_convs > after.tconv3d_calls
    else:
        assert stock_convs == after.tconv3d_calls
    assert_all_on_tconv3d(after)
    assert after.aten_frame_conv_calls == after.aten_conv_transpose3d_calls == 0
    assert after.totals["aten_convs_outside_layers"] == 0
    if name in RMS_NORMED:  # their RMS norms on tconv3d, each with the SiLU that follows it
        assert after.norm_calls > 0
        fused = [m for m in converted.modules() if class_name(type(m)) in NORM_SILU_BLOCKS]
        names = [NORM_SILU_BLOCKS[class_name(type(m))][1] for m in fused]
        assert fused and all(type(getattr(m, a)) is nn.Identity for m, a in zip(fused, names, strict=True))
    # The copies convert removed: every stock VAE pads or concatenates in front of its convolutions (EasyAnimate's
    # convs inside their own forward, into the frame windows each runs its conv on: as many concatenations).
    # The pads left are the upsamplers' own copies (tconv3d's frames in front of their sub-pixel convs' input).
    if name == "easyanimate":
        own = after.totals["tconv3d_copies_into_convs"]
        assert before.totals["concats"] > after.totals["concats"] and before.totals["pads"] > after.totals["pads"] - own
        assert after.totals["pads"] == own
    else:
        assert sum(layer.pad_copies + layer.concat_copies for layer in before.layers) > 0


@pytest.mark.parametrize("name", ["wan", "wan22", "cogvideox", "ltx_video", "ltx2"])
def test_vae_gradients_match_stock(name, aten_path):
    """Training through the cached frames (Wan, CogVideoX), the repeated edge frames and space-to-depth (LTX-Video,
    LTX-2) and the RMS norms: the parameter gradients of encode + decode match the stock model's."""
    stock, converted = stock_and_converted(VAES[name])
    x = torch.randn(1, 3, 9, 16, 16)
    for model in (stock, converted):
        encode_decode(model, x).square().mean().backward()
    assert_same_gradients(stock, converted)


@pytest.mark.parametrize("name", sorted(VAES))
def test_vae_training_keeps_no_more_than_stock(name, aten_path):
    """Leaner: for a training step's backward, a converted VAE (encode + decode) keeps no more than stock's
    autograd does (no padded or concatenated copies saved; the fused norms keep their statistics, not their
    intermediates)."""
    stock, converted = stock_and_converted(VAES[name])
    x = torch.randn(1, 3, 9, 16, 16)
    assert_keeps_no_more_than_stock(stock.train(), converted.train(), encode_decode, x)


@pytest.mark.parametrize("name", VAES)
def test_vae_through_the_triton_interpreter(name):
    """The kernels themselves (Triton interpreter on CPU): second source and per-dimension modes in real layers."""
    if tconv3d.CPU_BACKEND != "triton":
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1, set by conftest without CUDA)")
    stock, converted = stock_and_converted(VAES[name])
    x = torch.randn(1, 3, 5, 16, 16)
    with torch.no_grad():
        assert rel_l2(encode_decode(converted, x), encode_decode(stock, x)) < MATCH


@pytest.mark.parametrize("name", VAES)
def test_state_dicts_load_both_ways(name, aten_path):
    stock, converted = stock_and_converted(VAES[name])
    assert list(stock.state_dict()) == list(converted.state_dict())
    other = build_vae(name, seed=1).eval()
    converted.load_state_dict(other.state_dict())
    stock.load_state_dict(converted.state_dict())
    x = torch.randn(1, 3, 5, 16, 16)
    with torch.no_grad():
        assert rel_l2(encode_decode(converted, x), encode_decode(other, x)) < MATCH
        assert rel_l2(encode_decode(stock, x), encode_decode(other, x)) < MATCH


def layerwise_cast(model: nn.Module) -> nn.Module:
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    return model


@pytest.mark.parametrize("name", VAES)
def test_vaes_under_diffusers_layerwise_casting(name, aten_path):
    """diffusers' layerwise casting (`enable_layerwise_casting`: each Conv3d's, Conv2d's and Linear's weight kept
    in float8 and cast for each call by a hook that replaces the forward on the instance), added after convert.
    The adapters read the weights of layers whose call they skip (a causal conv wrapper's conv, Wan's attention
    projections, HunyuanVideo's upsampler conv), met float8 weights and raised on 9 of the 11 VAEs. Where such a
    layer is hooked (hooks.hooked) they make its call now: outputs as stock's under the same casting, another state
    dict loaded too (EasyAnimate's upsampler computes its sub-pixel weight from a fresh cast each call), every
    convolution on tconv3d (the resamplers' 2-D frame convs too: FrameConv2d runs them inside its call), no pad or
    concatenation copy into a conv, the weights kept float8."""
    stock, converted = stock_and_converted(VAES[name])
    for model in (stock, converted):
        layerwise_cast(model)
    x = torch.randn(1, 3, 9, 32, 32)
    with torch.no_grad():
        assert rel_l2(encode_decode(converted, x), encode_decode(stock, x)) < MATCH
        other = build_vae(name, seed=1).state_dict()
        for model in (stock, converted):
            model.load_state_dict(other)
        assert rel_l2(encode_decode(converted, x), encode_decode(stock, x)) < MATCH
    report = tconv3d.nn.audit(converted, x, run=encode_decode, verbose=False)
    assert_all_on_tconv3d(report)
    assert report.aten_frame_conv_calls == report.aten_conv_transpose3d_calls == 0
    hooked_convs = [m for m in converted.modules() if isinstance(m, nn.Conv3d) and "forward" in m.__dict__]
    assert hooked_convs and all(conv.weight.dtype == torch.float8_e4m3fn for conv in hooked_convs)


def test_layerwise_casts_in_a_compiled_model_stay_out_of_its_graphs(aten_path, caplog):
    """torch.compile over a layerwise-cast converted model: each hooked layer's casts (module.to(), twice a call)
    break the graph, stock's as ours. tconv3d's layers keep their weight layout in `_apply`, after Module._apply,
    which dynamo resumed after its break; the resumed frame, guarded on the weight's shape and dtype, recompiled
    for each layer and past dynamo's recompile limit (8) warned and gave up on it (MONAI's GlobalNet, 9 convs;
    the fuzzer's --hooks --compile draws). It runs outside the graph now: no such frame, no warning, answers as
    the model run eagerly."""
    pytest.importorskip("diffusers")
    from diffusers.hooks import apply_layerwise_casting

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Conv3d(c, c + 1, 3, padding=1) for c in range(2, 12)))
    converted = tconv3d.nn.convert(copy.deepcopy(model))
    apply_layerwise_casting(converted, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    x = torch.randn(1, 2, 4, 6, 6)
    with torch.no_grad():
        eager = converted(x)
        torch._dynamo.reset()
        with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
            compiled = torch.compile(converted, backend="eager")(x)
        torch._dynamo.reset()
    assert rel_l2(compiled, eager) < MATCH
    assert not [r for r in caplog.records if "recompile_limit" in r.getMessage() and "_apply" in r.getMessage()]


def _offloaded(model: nn.Module, how: str, device: torch.device, folder=None) -> nn.Module:
    """`model` (on the CPU) offloaded `how` onto `device`: accelerate's cpu_offload (diffusers'
    enable_sequential_cpu_offload), or diffusers' group offloading by layers or by blocks, to disk in `folder` where
    given, on a side stream (pinned CPU copies) where `device` is a GPU."""
    if how == "accelerate":
        import accelerate

        accelerate.cpu_offload(model, execution_device=device)
    else:
        kind = {"group_layers": "leaf_level", "group_blocks": "block_level"}[how]
        blocks = {"num_blocks_per_group": 1} if kind == "block_level" else {}
        disk = {"offload_to_disk_path": str(folder)} if folder is not None else {}
        model.enable_group_offload(device, offload_type=kind, use_stream=device.type == "cuda", **blocks, **disk)
    return model


@pytest.mark.parametrize("name", ["wan", "wan22"])
def test_vaes_under_diffusers_block_level_group_offloading(name, aten_path, tmp_path):
    """diffusers' group offloading by blocks (`enable_group_offload(offload_type="block_level")`), added after
    convert: in Wan's VAEs (the others are one group, hooked at the top) hooks replace the forward of the encoder,
    the decoder and their blocks (not of the layers), and move a group's weights onto the device inside its first
    module's call. The adapters of hooked blocks run inside those calls and their parents call them: outputs as
    stock's offloaded the same way, every convolution on tconv3d, no pad or concatenation copy into one. Offloaded
    to disk (after `shardable`, which it needs): between calls a group's weights are empty tensors, so a call an
    adapter skipped would compute with garbage, where offloading to memory on the CPU would move nothing."""
    stock, converted = stock_and_converted(VAES[name])
    tconv3d.nn.shardable(converted)
    for model, folder in ((stock, "stock"), (converted, "converted")):
        _offloaded(model, "group_blocks", torch.device("cpu"), tmp_path / folder)
    assert hooked(converted.decoder) and all(hooked(block) for block in converted.encoder.down_blocks)
    x = torch.randn(1, 3, 9, 32, 32)
    with torch.no_grad():
        for _ in range(2):  # the second call's weights read back from disk
            assert rel_l2(encode_decode(converted, x), encode_decode(stock, x)) < MATCH
    report = tconv3d.nn.audit(converted, x, run=encode_decode, verbose=False)
    assert_all_on_tconv3d(report)
    assert report.aten_frame_conv_calls == report.aten_conv_transpose3d_calls == 0


def test_group_offloading_to_disk_takes_a_shardable_vae(tmp_path, aten_path):
    """diffusers' group offloading to disk (`offload_to_disk_path`) saves each group's weights with safetensors,
    which refuses a tensor that is not contiguous: a converted VAE's channels_last_3d weights raise there.
    `tconv3d.nn.shardable` keeps them contiguous (each call lays its weight out inside the op, as it would the
    weight loaded back from disk anyway): outputs as stock's offloaded the same way, every convolution on tconv3d,
    the activations channels_last_3d throughout. Wan's attention block, its projections hooked, ran diffusers'
    forward, whose projections with contiguous weights answered NCHW: a layout copy into the next norm (the model
    fuzzer's --hooks draws); it calls them on channels_last views now."""
    stock, converted = stock_and_converted(VAES["wan"])
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="non contiguous"):
        _offloaded(copy.deepcopy(converted), "group_layers", cpu, tmp_path / "channels_last")
    tconv3d.nn.shardable(converted)
    _offloaded(stock, "group_layers", cpu, tmp_path / "stock")
    _offloaded(converted, "group_layers", cpu, tmp_path / "converted")
    x = torch.randn(1, 3, 9, 32, 32)
    with torch.no_grad():
        assert rel_l2(encode_decode(converted, x), encode_decode(stock, x)) < MATCH
    report = tconv3d.nn.audit(converted, x, run=encode_decode, verbose=False)
    assert_all_on_tconv3d(report)
    assert_stays_channels_last(report, upstream_copies=True)  # Wan encodes in chunks: CHUNKED_ENCODERS


def test_a_vae_under_accelerates_disk_offload(tmp_path, aten_path):
    """accelerate's disk_offload writes each weight to a numpy memmap (by its values, whatever its strides) and
    loads it back contiguous inside the layer's call: a converted VAE takes it as it is, each call laying its
    weights out again. Outputs as stock's, every convolution on tconv3d, the weights back on meta after the call."""
    accelerate = pytest.importorskip("accelerate")
    stock, converted = stock_and_converted(VAES["cogvideox"])
    accelerate.disk_offload(converted, str(tmp_path), execution_device=torch.device("cpu"))
    x = torch.randn(1, 3, 9, 32, 32)
    with torch.no_grad():
        assert rel_l2(encode_decode(converted, x), encode_decode(stock, x)) < MATCH
    assert_all_on_tconv3d(tconv3d.nn.audit(converted, x, run=encode_decode, verbose=False))
    assert all(p.device.type == "meta" for m in converted.modules() if isinstance(m, nn.Conv3d) for p in m.parameters())


@pytest.mark.parametrize("name", VAES)
def test_vaes_under_accelerates_sequential_offload(name, aten_path):
    """accelerate's cpu_offload (what diffusers' enable_sequential_cpu_offload runs), added after convert: every
    layer's weights live on the meta device but inside its call, where its hook moves them onto the execution
    device. The adapters read weights of layers whose call they skip, met meta tensors and raised on 10 of the 11
    VAEs ("weight is on meta but input is on cpu"); they make those calls now (hooks.hooked). Here the execution
    device is the CPU: outputs as stock's, every convolution on tconv3d, the weights back on meta after the call."""
    accelerate = pytest.importorskip("accelerate")
    stock, converted = stock_and_converted(VAES[name])
    accelerate.cpu_offload(converted, execution_device=torch.device("cpu"))
    x = torch.randn(1, 3, 9, 32, 32)
    with torch.no_grad():
        assert rel_l2(encode_decode(converted, x), encode_decode(stock, x)) < MATCH
    report = tconv3d.nn.audit(converted, x, run=encode_decode, verbose=False)
    assert_all_on_tconv3d(report)
    assert report.aten_frame_conv_calls == report.aten_conv_transpose3d_calls == 0
    assert all(p.device.type == "meta" for m in converted.modules() if isinstance(m, nn.Conv3d) for p in m.parameters())


@pytest.mark.parametrize("name", ["kvae_video", "unet", "attention_unet"])
def test_more_models_under_accelerates_sequential_offload(name, aten_path):
    """The same for the adapters past the VAEs of LATENT_CHANNELS: KVAE's cached causal conv hands its conv (an
    adapted class of diffusers', its own forward) the convolution, through the conv's call now (the adapted
    forward takes it: convert.adapted_class); MONAI's instance norm with the PReLU after it fused reads the PReLU's
    weight, which accelerate onloads in the PReLU's call: the norm leaves a hooked PReLU to apply itself. Both
    raised ("weight is on meta", "activation_weight is on meta")."""
    accelerate = pytest.importorskip("accelerate")
    if name == "kvae_video":
        build, x, run = kvae_video, torch.randn(1, 3, 9, 32, 32), encode_decode
    else:
        build, x, run = _monai_nets()[name], torch.randn(1, 1, *(MONAI_NETS[name],) * 3), lambda model, x: model(x)
    stock, converted = stock_and_converted(build)
    accelerate.cpu_offload(converted, execution_device=torch.device("cpu"))
    with torch.no_grad():
        assert rel_l2(run(converted, x), run(stock, x)) < MATCH
    assert_all_on_tconv3d(tconv3d.nn.audit(converted, x, run=run, verbose=False))


def _handing_blocks() -> dict:
    """(build, input) of the blocks whose adapters call a child with keyword arguments of tconv3d's (hooks.hand)
    where the child's own call runs accelerate's hooks: Cosmos's upsampler (upsampled=factors), EasyAnimate's
    downsampler and MiniMax-H3's (bottom_right=), MONAI BasicUNet's up block at an odd skip size (output_size=).
    HunyuanVideo's and EasyAnimate's upsamplers hand theirs (upsampled_by=, upsampled=) to a causal conv whose
    inner conv, hooked, makes them upsample first instead."""
    from diffusers.models.autoencoders import autoencoder_kl_cosmos as cosmos
    from diffusers.models.autoencoders import autoencoder_kl_magvit as magvit
    from diffusers.models.autoencoders import autoencoder_kl_minimax_h3 as minimax

    video = torch.randn(1, 4, 5, 6, 8)
    return {
        "cosmos": (lambda: cosmos.CosmosUpsample3d(4, spatial_upsample=True, temporal_upsample=True), video),
        "easyanimate_down": (lambda: magvit.EasyAnimateDownsampler3D(4, 6), video),
        "minimax_down": (lambda: minimax.MiniMaxH3VideoDownsample3d(4, 6), video),
        "monai_up_cat": (_MonaiUpCat, (torch.randn(1, 8, 3, 4, 5), torch.randn(1, 4, 7, 9, 10))),
    }


class _MonaiUpCat(nn.Module):
    def __init__(self):
        super().__init__()
        from monai.networks.nets.basic_unet import UpCat

        self.up = UpCat(3, 8, 4, 6, act="relu", norm="instance", bias=True)

    def forward(self, inputs):
        return self.up(*inputs)


@pytest.mark.parametrize("name", ["cosmos", "easyanimate_down", "minimax_down", "monai_up_cat"])
def test_keyword_arguments_handed_to_offloaded_layers_compile_without_graph_breaks(name, aten_path):
    """Adapters hand a child's call keyword arguments of tconv3d's: factors, an output size, a border. Under
    accelerate's offloading that call runs its hooks, whose send_to_device asks hasattr(item, "to") of each item of
    a tuple or list, and under torch.compile those ints are symbolic in the hooks' frame: dynamo cannot trace it and
    broke the graph there (Cosmos's upsampler: the model fuzzer's --hooks --compile draws). They travel as one
    object now (hooks.hand): no such break, the compiled block answering as the eager one (a block of its own: the
    causal convs keep frames from call to call) and as stock."""
    pytest.importorskip("accelerate")
    pytest.importorskip("diffusers")
    pytest.importorskip("monai")
    build, x = _handing_blocks()[name]
    torch.manual_seed(0)
    stock = build().eval()
    eager, compiled = (tconv3d.nn.convert(copy.deepcopy(stock)) for _ in range(2))
    for model in (eager, compiled):
        _offloaded(model, "accelerate", torch.device("cpu"))
    with torch.no_grad():
        expected, y = stock(x), eager(x)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        y_compiled = torch.compile(compiled, backend="eager", dynamic=True)(x)
        torch._dynamo.reset()
    breaks = [reason.splitlines()[0] for reason in torch._dynamo.utils.counters["graph_break"]]
    assert not [reason for reason in breaks if "hasattr" in reason], breaks
    assert torch.equal(y_compiled, y) and rel_l2(y, expected) < MATCH


@pytest.mark.parametrize("name", ["wan", "cogvideox", "hunyuan_video"])
def test_hooks_added_before_convert_leave_their_layers_by_name(name, aten_path, caplog):
    """Hooks that replace a layer's forward on the instance (diffusers', accelerate's) keep calling the class's
    forward they found, which convert's class swap cannot reach: each layer so hooked (a wrapper whose conv is) is
    left as it is and named with the reason, and the model answers as stock's (Wan's raised: its attention's
    adapter read a float8 weight)."""
    torch.manual_seed(0)
    stock = layerwise_cast(VAES[name]().eval())
    torch.manual_seed(0)
    model = layerwise_cast(VAES[name]().eval())
    with caplog.at_level(logging.WARNING, logger="tconv3d"):
        tconv3d.nn.convert(model)
    assert "its forward is replaced on the instance" in caplog.text and "convert first, then add them" in caplog.text
    hooked_convs = [m for m in model.modules() if isinstance(m, nn.Conv3d) and "forward" in m.__dict__]
    assert hooked_convs and not any(is_converted(m) for m in hooked_convs)
    x = torch.randn(1, 3, 9, 32, 32)
    with torch.no_grad():
        assert rel_l2(encode_decode(model, x), encode_decode(stock, x)) < MATCH


def test_weight_norm_hooks_on_wrapped_convs_train_as_stock(aten_path):
    """torch.nn.utils.weight_norm (the hook-based one) on the conv inside CogVideoX's causal conv wrappers: its
    pre-hook computes the weight for each call of the conv, which the wrapper's adapter skipped, reading the weight
    the last call left (and its graph: the second training step raised "Trying to backward through the graph a
    second time"). The convolution is made through the conv's call now: three SGD steps as stock's."""

    def build():
        torch.manual_seed(0)
        model = VAES["cogvideox"]()
        for module in list(model.modules()):
            if type(module).__name__ == "CogVideoXCausalConv3d":
                torch.nn.utils.weight_norm(module.conv)
        return model

    stock, converted = build(), tconv3d.nn.convert(build())
    x = torch.randn(1, 3, 5, 16, 16)
    for model in (stock, converted):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            optimizer.zero_grad()
            encode_decode(model, x).square().mean().backward()
            optimizer.step()
    with torch.no_grad():
        assert rel_l2(encode_decode(converted, x), encode_decode(stock, x)) < MATCH


def _lora(model: nn.Module, names: list[str]) -> nn.Module:
    """peft.get_peft_model of `model` with LoRA layers on its convolutions of `names`, rank 2, B not zero (peft's
    default B is zero, which would make a skipped LoRA layer look right)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=names, init_lora_weights=False))


def _lora_targets(model: nn.Module) -> list[str]:
    """The convolutions of `model` peft's LoRA takes, by name: exact torch classes and CogVideoX's CogVideoXSafeConv3d
    (peft builds its own layers as `type(layer)(in, rank, kernel, stride, padding, ...)`, which the constructors of
    Wan's, Cosmos's and EasyAnimate's causal convs refuse, stock and converted alike), groups of 1."""
    takes = (nn.Conv3d, nn.Conv2d, "CogVideoXSafeConv3d")
    return [name for name, m in model.named_modules()
            if (type(m) in takes or type(m).__name__ in takes) and m.groups == 1]  # fmt: skip


def _lora_models() -> dict:
    """(build, input shape, run) of the models the LoRA tests train."""
    return {
        "cogvideox": (VAES["cogvideox"], (1, 3, 5, 16, 16), encode_decode),
        "ltx_video": (VAES["ltx_video"], (1, 3, 9, 16, 16), encode_decode),
        "wan": (VAES["wan"], (1, 3, 5, 16, 16), encode_decode),
        "maisi": (_generative_autoencoders()["maisi"], (1, 1, 24, 24, 24), autoencode),
        "unet": (_monai_nets()["unet"], (1, 1, 16, 16, 16), lambda model, x: model(x)),
    }


@pytest.mark.parametrize("name", ["cogvideox", "ltx_video", "maisi"])
def test_lora_layers_added_before_convert_train_as_stock(name, aten_path, caplog):
    """peft's LoRA layers on every convolution, then convert: every 3-D convolution, the LoRA layers' own included,
    on tconv3d, gradients as the stock model's with the same LoRA layers. A block whose adapter calls its
    convolution with its own padding or cached frames (the causal convs, MAISI's split convolution) runs its
    library's forward, named in convert's log (MAISI's raised: it reached past the LoRA layer); CogVideoX's
    resamplers call their LoRA'd Conv2d on the frames, torch's conv2d. Merged after training (merge_and_unload), a
    second convert takes all of them over: no pad or concatenation copies."""
    build, shape, run = _lora_models()[name]
    torch.manual_seed(0)
    stock = build().eval()
    stock = _lora(stock, _lora_targets(stock))
    model = copy.deepcopy(stock)
    with caplog.at_level(logging.WARNING, logger="tconv3d"):
        tconv3d.nn.convert(model)
    assert "that adds to its call (a LoRA layer, peft's)" in caplog.text or name == "maisi"
    x = torch.randn(shape)
    for m in (stock, model):
        run(m, x).square().mean().backward()
    assert_same_gradients(stock, model)
    report = tconv3d.nn.audit(model, x, run=run, verbose=False)
    assert all(layer.converted for layer in report.layers) and report.aten_conv3d_calls == 0
    assert sum("lora_A" in layer.name and layer.tconv3d_calls > 0 for layer in report.layers) > 2
    with torch.no_grad():
        expected = run(model, x)
        plain = tconv3d.nn.convert(model.merge_and_unload())
        assert rel_l2(run(plain, x), expected) < MATCH
    assert_all_on_tconv3d(tconv3d.nn.audit(plain, x, run=run, verbose=False))


@pytest.mark.parametrize("name", ["wan", "unet"])
def test_lora_layers_added_after_convert_train_as_stock(name, aten_path):
    """convert, then peft's LoRA layers: outputs and gradients as the stock model's with the same LoRA layers. Wan's
    attention block read its projections' weights, which were the LoRA layers' base weights: it answered without
    them, silently. It calls the LoRA layers now."""
    build, shape, run = _lora_models()[name]
    stock, converted = stock_and_converted(build)
    names = _lora_targets(stock)
    assert name != "wan" or any(".to_qkv" in name for name in names)
    stock, converted = _lora(stock, names), _lora(converted, names)
    converted.load_state_dict(stock.state_dict())
    x = torch.randn(shape)
    for m in (stock, converted):
        run(m, x).square().mean().backward()
    assert_same_gradients(stock, converted)
    assert all(p.grad is not None for key, p in converted.named_parameters() if "lora_" in key)


def test_dora_layers_train_as_stock_on_shardable_weights(aten_path):
    """DoRA (peft's use_dora) views its LoRA convs' weights as matrices, which a channels_last_3d weight refuses
    (peft's RuntimeError, stock's too in that layout): added before convert, with tconv3d.nn.shardable after
    (contiguous weights), a MONAI UNet trains as stock's with the same DoRA layers."""
    peft = pytest.importorskip("peft")
    build, shape, run = _lora_models()["unet"]
    torch.manual_seed(0)
    stock = build()
    torch.manual_seed(1)
    config = peft.LoraConfig(r=2, target_modules=_lora_targets(stock), use_dora=True, init_lora_weights=False)
    stock = peft.get_peft_model(stock, config)
    model = tconv3d.nn.convert(copy.deepcopy(stock))
    x = torch.randn(shape)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        run(model, x)
    tconv3d.nn.shardable(model)
    for m in (stock, model):
        run(m, x).square().mean().backward()
    assert_same_gradients(stock, model)
    assert tconv3d.nn.audit(model, x, run=run, verbose=False).aten_conv3d_calls == 0


@pytest.mark.parametrize("name", ["cogvideox", "ltx_video", "maisi"])
def test_lora_layers_added_after_convert_into_blocks_it_calls_into_are_refused_by_name(name, aten_path):
    """convert, then peft's LoRA layers on convolutions whose block's adapter calls them with its own padding or
    cached frames (their `convolve`), which the LoRA layer has not: a TypeError naming the layer and what to do
    (it was an AttributeError: 'Conv3d' object has no attribute 'padding', or 'convolve')."""
    build, shape, run = _lora_models()[name]
    stock, converted = stock_and_converted(build)
    converted = _lora(converted, _lora_targets(stock))
    match = r"conv is a Conv3d standing in .* LoRA layer .* before convert"
    with pytest.raises(TypeError, match=match), torch.no_grad():
        run(converted, torch.randn(shape))


@pytest.mark.parametrize("name", VAES)
def test_compile_adds_no_graph_breaks(name, aten_path):
    stock, converted = stock_and_converted(VAES[name])
    z = torch.randn(1, LATENT_CHANNELS[name], 2, 4, 4)
    explained = explained_without_new_graph_breaks(lambda model, z: model.decode(z).sample, stock, converted, z)
    assert any("tconv3d.conv3d" in str(node.target) for g in explained.graphs for node in g.graph.nodes)


def test_compiled_decoder_matches_eager(aten_path):
    _, converted = stock_and_converted(VAES["hunyuan_video"])
    z = torch.randn(1, 4, 2, 4, 4)
    with torch.no_grad():
        expected = converted.decode(z).sample
        torch._dynamo.reset()
        compiled = torch.compile(lambda z: converted.decode(z).sample, fullgraph=True, backend="aot_eager")
        assert rel_l2(compiled(z), expected) < MATCH


def test_cogvideox_chunked_encode_and_decode_with_conv_cache(aten_path):
    """CogVideoX encodes 8 frames at a time and decodes 2 latent frames at a time, handing each causal conv the
    previous batch's last frames (conv_cache), which tconv3d reads in place."""
    stock, converted = stock_and_converted(VAES["cogvideox"])
    x = torch.randn(1, 3, 17, 16, 16)
    with torch.no_grad():
        latents = stock.encode(x).latent_dist.mode()
        assert latents.shape[2] > stock.num_latent_frames_batch_size  # several decode batches
        assert rel_l2(converted.encode(x).latent_dist.mode(), latents) < MATCH
        assert rel_l2(converted.decode(latents).sample, stock.decode(latents).sample) < MATCH
    report = tconv3d.nn.audit(converted, latents, run=lambda m, z: m.decode(z), verbose=False)
    assert_all_on_tconv3d(report, every_layer_called=False)


def test_wan_frame_by_frame_decode_reads_cache_in_place(aten_path):
    """Wan decodes one latent frame at a time, each causal conv getting the last 2 frames before it as cache_x:
    tconv3d takes them as the op's frames_before instead of concatenating."""
    stock, converted = stock_and_converted(VAES["wan"])
    z = torch.randn(1, 16, 4, 4, 4)
    with torch.no_grad():
        assert rel_l2(converted.decode(z).sample, stock.decode(z).sample) < MATCH
    calls = []

    def spy(module, args, kwargs):
        calls.append(kwargs.get("cache_x", args[1] if len(args) > 1 else None) is not None)

    handles = [m.register_forward_pre_hook(spy, with_kwargs=True) for m in converted.modules()
               if type(m).__name__ == "WanCausalConv3d"]  # fmt: skip
    report = tconv3d.nn.audit(converted, z, run=lambda m, z: m.decode(z), verbose=False)
    for handle in handles:
        handle.remove()
    assert any(calls)  # cached calls happened
    assert_all_on_tconv3d(report, every_layer_called=False)


def test_cogvideox_safe_conv_needs_no_chunks(aten_path):
    """CogVideoXSafeConv3d splits time into overlapping chunks above 2 GiB for cuDNN; the converted layer runs the
    whole clip as one op (tconv3d's kernels index with int64). With the stock threshold lowered to 2 KiB,
    the stock layer chunks, and both agree."""
    from diffusers.models.autoencoders import autoencoder_kl_cogvideox as cog

    source = inspect.getsource(cog.CogVideoXSafeConv3d.forward)
    assert "if memory_count > 2:" in source and "int(memory_count / 2)" in source
    namespace = dict(vars(cog))
    # 2 GiB -> 2 KiB: this 19 KB clip goes in 5 chunks.
    lowered = source.replace("memory_count > 2:", "memory_count > 2e-6:")
    lowered = lowered.replace("memory_count / 2)", "memory_count / 2e-6)")
    lowered = lowered.replace("super().forward(", "nn.Conv3d.forward(self, ")  # exec'd code has no class cell
    exec(compile(inspect.cleandoc("\n" + lowered), cog.__file__, "exec"), namespace)

    class ChunkingSafeConv3d(cog.CogVideoXSafeConv3d):
        forward = namespace["forward"]

    torch.manual_seed(0)
    stock = ChunkingSafeConv3d(4, 6, 3)
    converted = tconv3d.nn.convert(copy.deepcopy(cog.CogVideoXSafeConv3d(4, 6, 3)))
    converted.load_state_dict(stock.state_dict())
    x = torch.randn(1, 4, 12, 10, 10)
    with torch.no_grad():
        expected, out = stock(x), converted(x)
    assert rel_l2(out, expected) < MATCH
    chunked = tconv3d.nn.audit(stock, x, verbose=False)
    assert chunked.aten_conv3d_calls > 1 and chunked.concats > 0  # the stock layer did split this clip
    whole = tconv3d.nn.audit(converted, x, verbose=False)
    assert whole.tconv3d_calls == 1 and whole.concats == 0


def test_rebase_runs_unknown_subclasses_on_tconv3d(aten_path, caplog):
    class Doubled(nn.Conv3d):
        def forward(self, x):
            return super().forward(x) * 2

    torch.manual_seed(0)
    model = nn.Sequential(Doubled(3, 4, 3, padding=1))
    x = torch.randn(1, 3, 3, 5, 5)
    expected = model(x).detach()
    with caplog.at_level(logging.WARNING, logger="tconv3d"):
        tconv3d.nn.convert(model)
    assert "subclasses='rebase'" in caplog.text and type(model[0]) is Doubled
    tconv3d.nn.convert(model, subclasses="rebase")
    assert isinstance(model[0], Doubled) and isinstance(model[0], tconv3d.nn.Conv3d)
    report = tconv3d.nn.audit(model, x, verbose=False)
    assert report.tconv3d_calls == 1 and report.aten_conv3d_calls == 0
    assert rel_l2(model(x), expected) < MATCH
    with pytest.raises(ValueError, match="subclasses must be one of"):
        tconv3d.nn.convert(model, subclasses="always")


def test_subclasses_without_a_forward_of_their_own_are_taken_over(aten_path, caplog):
    """An nn.Conv3d subclass that adds only a constructor runs nn.Conv3d's forward: torchvision's video ResNets
    (r3d_18, mc3_18, r2plus1d_18) are built of two such (Conv3DSimple, Conv3DNoTemporal), and convert left all their
    convolutions but the stem's on aten. Such a layer is taken over as nn.Conv3d is, its class kept; a subclass
    with its own forward or _conv_forward (which nn.Conv3d's forward calls) is still left alone."""

    class Simple(nn.Conv3d):  # torchvision's Conv3DSimple, in short
        def __init__(self, in_planes, out_planes, stride=1, padding=1):
            super().__init__(in_planes, out_planes, (3, 3, 3), stride, padding, bias=False)

    class Doubled(nn.Conv3d):
        def _conv_forward(self, input, weight, bias):
            return super()._conv_forward(input, weight, bias) * 2

    class Below(Simple):  # a forward-less subclass of one
        pass

    torch.manual_seed(0)
    stock = nn.Sequential(Simple(3, 8), nn.BatchNorm3d(8), nn.ReLU(), Below(8, 4, stride=2), Doubled(4, 4, 1)).eval()
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    assert isinstance(converted[0], Simple) and isinstance(converted[0], tconv3d.nn.Conv3d)
    assert isinstance(converted[3], Below) and isinstance(converted[3], tconv3d.nn.Conv3d)
    assert type(converted[4]) is Doubled
    x = torch.randn(2, 3, 5, 6, 7)
    report = tconv3d.nn.audit(converted, x, verbose=False)
    assert report.tconv3d_calls == 2 and report.aten_conv3d_calls == 1
    with torch.no_grad():
        assert rel_l2(converted(x), stock(x)) < MATCH
    with caplog.at_level(logging.WARNING, logger="tconv3d"):
        tconv3d.nn.convert(copy.deepcopy(stock))
    assert "Doubled, a subclass of nn.Conv3d whose own forward may differ" in caplog.text
    assert "Simple" not in caplog.text and "Below" not in caplog.text


def test_audit_prints_a_table_and_names_what_stays_on_aten(aten_path, capsys):
    class Doubled(nn.Conv3d):  # a subclass: convert leaves it by default
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(nn.Conv3d(3, 4, 3, padding=1), Doubled(4, 4, 3, padding=1))
    tconv3d.nn.convert(model)
    report = tconv3d.nn.audit(model, torch.randn(1, 3, 3, 5, 5))
    printed = capsys.readouterr().out
    assert "subclass of nn.Conv3d" in printed and "totals:" in printed
    assert [layer.converted for layer in report.layers] == [True, False]
    assert report.tconv3d_calls == 1 and report.aten_conv3d_calls == 1


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_audit_sees_as_much_in_inference_mode(grad_mode, autocast, aten_path):
    """Under torch.inference_mode() a composite op reaches the audit's dispatch mode whole (aten.conv3d, F.pad's
    aten.pad, einsum) where torch.no_grad() decomposes it first. Until 2026-12-06 the audit counted no aten
    convolution there (a layer left on aten looked never called), and under autocast an einsum of a float32 and a
    bf16 operand raised (its decomposition ran below autocast: MONAI's GlobalNet, in the model fuzzer)."""

    class Doubled(nn.Conv3d):  # a subclass: convert leaves it on aten; its own pad copy
        def forward(self, x):
            return super().forward(F.pad(x, (1,) * 6)) * 2

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.weights = torch.randn(4)  # a plain attribute: float32 whatever the activations' dtype

        def forward(self, x):
            return torch.einsum("ncdhw,c->ndhw", x, self.weights)

    model = tconv3d.nn.convert(nn.Sequential(nn.Conv3d(3, 4, 3, padding=1), Doubled(4, 4, 3), Head()))
    x = torch.randn(1, 3, 3, 5, 5)
    with grad_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        expected = model(x)
        report = tconv3d.nn.audit(model, x, verbose=False)
    assert expected.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert report.tconv3d_calls == 1 and report.aten_conv3d_calls == 1, report.table()
    assert [(layer.calls, layer.pad_copies) for layer in report.layers] == [(1, 0), (1, 1)], report.table()


def test_audit_keeps_autocast_off_where_the_model_turns_it_off(aten_path):
    """The audit decomposes a composite op in inference mode under the keys its caller had: a model that runs an
    einsum with autocast off (float32) and multiplies the result by a float32 matrix ran under the audit's
    starting keys until 2026-12-06, so its einsum came out bf16 and the matmul raised on the mixed dtypes."""

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.weights, self.matrix = torch.randn(4), torch.randn(5, 3)

        def forward(self, x):
            with torch.autocast("cpu", enabled=False):
                return torch.mm(torch.einsum("ncdhw,c->nw", x.float(), self.weights), self.matrix)

    model = tconv3d.nn.convert(nn.Sequential(nn.Conv3d(3, 4, 3, padding=1), Head()))
    x = torch.randn(1, 3, 3, 5, 5)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x).dtype == torch.float32
        report = tconv3d.nn.audit(model, x, verbose=False)
    assert report.tconv3d_calls == 1, report.table()


@pytest.mark.parametrize("source", ["channels_after", "frames_before"])
@pytest.mark.parametrize("made", ["pad", "cat", "layout"])
def test_audit_sees_what_feeds_a_second_source(source, made, aten_path):
    """A copy (F.pad, torch.cat) or another layout in a conv's second source (a skip connection read in place, cached
    frames in front) counts as it does in its input: MONAI's BasicUNet padded its upsampled features by nothing
    (a copy all the same) into channels_after, unseen until the audit looked there."""
    cl = torch.channels_last_3d
    conv = tconv3d.nn.Conv3d(8 if source == "channels_after" else 4, 4, 3, padding=1)
    x = torch.randn(1, 4, 3, 5, 5).contiguous(memory_format=cl)
    extra = torch.randn(1, 4, 3 if source == "channels_after" else 2, 5, 5).contiguous(memory_format=cl)

    def run(model, x):
        second = {
            "pad": lambda: F.pad(extra, (0, 0, 0, 0, 0, 0), mode="replicate"),
            "cat": lambda: torch.cat([extra[:, :, :1], extra[:, :, 1:]], dim=2),
            "layout": lambda: extra.contiguous(),
        }[made]()
        if source == "channels_after":
            return model(x, channels_after=second)
        return model.convolve(x, (0, 0, 1, 1, 1, 1), frames_before=second)

    report = tconv3d.nn.audit(conv, x, run=run, verbose=False)
    (layer,) = report.layers
    assert layer.calls == layer.tconv3d_calls == 1
    assert (layer.upstream_copies, layer.layout_copies) == ((0, 1) if made == "layout" else (1, 0))


@pytest.mark.parametrize(
    "kernel, stride, downsampler",
    [
        (3, 1, False),
        ((3, 3, 1), (2, 1, 2), False),
        (3, 2, True),
        (3, 2, "replicate"),
        ((1, 3, 3), 1, False),
        ((2, 3, 3), (2, 1, 1), False),
    ],
)
def test_easyanimate_causal_conv_over_chunks(kernel, stride, downsampler, aten_path):
    """EasyAnimate's causal conv (and its downsampler's F.pad, whatever the conv's padding_mode) as one strided op
    a call, over a clip in chunks: the first call replicate-pads, later ones read the frames kept from the call
    before; a 1-frame chunk, a chunk shorter than the frames kept, kernel 1 in time (diffusers keeps all of a
    call's frames then) and stride 2 (it keeps one frame fewer); outputs and the kept frames against diffusers'."""
    magvit = pytest.importorskip("diffusers.models.autoencoders.autoencoder_kl_magvit")
    torch.manual_seed(0)
    if downsampler:
        build = lambda: magvit.EasyAnimateDownsampler3D(4, 6, stride=(2, 2, 2))  # noqa: E731
    else:
        build = lambda: magvit.EasyAnimateCausalConv3d(4, 6, kernel_size=kernel, stride=stride)  # noqa: E731
    stock = nn.Sequential(build())
    if downsampler == "replicate":  # a conv that pads nothing in a mode of its own: F.pad's zeros stay the border
        stock[0].conv.padding_mode = "replicate"
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    assert is_converted(converted[0])
    conv = (lambda m: m[0].conv) if downsampler else (lambda m: m[0])
    strided = downsampler or stride != 1  # a later 1-frame chunk leaves diffusers' strided windows empty
    for frames in (1, 4, 2, 4) if strided else (1, 5, 1, 4):
        x = torch.randn(1, 4, frames, 7, 6)
        with torch.no_grad():
            expected, out = stock(x), converted(x.contiguous(memory_format=torch.channels_last_3d))
        assert out.shape == expected.shape and rel_l2(out, expected) < MATCH, frames
        if not downsampler:  # the downsampler's are kept unpadded here, padded by diffusers
            assert torch.equal(conv(converted).prev_features, conv(stock).prev_features)


@pytest.mark.parametrize("block", ["easyanimate", "cosmos", "vidtok"])
def test_a_causal_blocks_clip_of_no_frames_is_refused_by_name(block, aten_path):
    """A causal block's first chunk repeats its first frame in front: a clip of no frames has none. Stock's blocks
    raise from inside torch (a pad of an empty input, a split of -1 frames); the converted ones raised an expand's
    error about sizes; now a ValueError that names the empty clip."""
    if block == "easyanimate":
        from diffusers.models.autoencoders.autoencoder_kl_magvit import EasyAnimateCausalConv3d as Block

        stock, channels = Block(4, 6, kernel_size=3), 4
    elif block == "cosmos":
        from diffusers.models.autoencoders.autoencoder_kl_cosmos import CosmosPatchEmbed3d as Block

        stock, channels = Block(2, "haar"), 3
    else:
        from diffusers.models.autoencoders.autoencoder_vidtok import VidTokCausalConv3d as Block

        stock, channels = Block(4, 8, 3), 4
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    assert is_converted(converted)
    x = torch.randn(1, channels, 0, 6, 6).contiguous(memory_format=torch.channels_last_3d)
    with pytest.raises(RuntimeError):
        stock(x)
    with pytest.raises(ValueError, match=r"input \(1, \d+, 0, 6, 6\) has no frames"):
        converted(x)


@pytest.mark.parametrize("patch_size", [2, 4])
@pytest.mark.parametrize("size", [(9, 8, 6), (6, 7, 5), (2, 3, 3)], ids=["even", "odd", "small"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cosmos_haar_transforms_in_one_op_a_level(patch_size, size, dtype, device):
    """Cosmos's Haar patcher and unpatcher (per level 14 depthwise 2-tap F.conv3d or F.conv_transpose3d calls, a
    reflect F.pad, a concatenation or chunks and sums) as one tconv3d conv (transposed: the inverse) a level, the
    repeated first frames read in front, the reflect pad inside: values as diffusers' in float64 (odd sizes read
    the reflected border), channels_last_3d results, no aten convolution, pad or concatenation; the unpatcher's
    input gradient (the decoder's last layer, trained) as diffusers'. Through the kernels (the interpreter on CPU)."""
    from helpers import OpNames

    from tconv3d.testing import TOLERANCE

    cosmos = pytest.importorskip("diffusers.models.autoencoders.autoencoder_kl_cosmos")
    for stock in (cosmos.CosmosPatchEmbed3d(patch_size, "haar"), cosmos.CosmosUnpatcher3d(patch_size, "haar")):
        converted = tconv3d.nn.convert(copy.deepcopy(stock)).to(device)
        assert is_converted(converted)
        patcher = isinstance(stock, cosmos.CosmosPatchEmbed3d)
        channels = 3 if patcher else 3 * 8 ** int(math.log2(patch_size))
        x = torch.randn(2, channels, *size).to(device, dtype).contiguous(memory_format=torch.channels_last_3d)
        x64 = x.double().requires_grad_()
        with OpNames() as ops:
            out = converted(x.requires_grad_())
        copies = ("aten.convolution", "aten.cat", "aten.constant_pad", "aten.reflection_pad", "aten.repeat")
        assert not [op for op in ops.names if op.startswith(copies)], ops.names
        expected = stock.to(device, torch.float64)(x64)
        # channels_last_3d (the unpatcher's drops its first frames, a view as diffusers': all strides but the batch's)
        ndhwc = torch.empty(out.shape, memory_format=torch.channels_last_3d).stride()
        assert out.shape == expected.shape and out.stride()[1:] == ndhwc[1:]
        assert rel_l2(out, expected) < TOLERANCE[dtype]
        grad = torch.randn_like(out)
        (ours,), (theirs,) = torch.autograd.grad(out, x, grad), torch.autograd.grad(expected, x64, grad.double())
        assert ours.is_contiguous(memory_format=torch.channels_last_3d) and rel_l2(ours, theirs) < TOLERANCE[dtype]


def test_cosmos_rearrange_patches_stay_diffusers(aten_path):
    """The "rearrange" patch method (a reshuffle, no convolution) is diffusers' code after convert."""
    cosmos = pytest.importorskip("diffusers.models.autoencoders.autoencoder_kl_cosmos")
    x = torch.randn(1, 3, 9, 8, 8)
    stock = cosmos.CosmosPatchEmbed3d(4, "rearrange")
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    assert is_converted(converted) and torch.equal(converted(x), stock(x))


@pytest.mark.parametrize("size", [(9, 8, 6), (8, 8, 6), (2, 4, 4), (1, 8, 4)], ids=["odd_t", "even_t", "two", "one"])
@pytest.mark.parametrize("space, time", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("left_alone", [False, True], ids=["converted", "conv1_left_alone"])
def test_cosmos_downsampler_without_its_copies(size, space, time, left_alone, aten_path):
    """Cosmos's downsampler with its pad and first-frame concatenation inside its convs' ops and its pools reading
    the input (a conv that convert left alone keeps diffusers' path for its half): against diffusers' on odd and
    even frame counts, two frames and one, each half alone (diffusers' fails on odd H or W itself)."""
    cosmos = pytest.importorskip("diffusers.models.autoencoders.autoencoder_kl_cosmos")
    torch.manual_seed(0)
    stock = nn.Sequential(cosmos.CosmosDownsample3d(4, spatial_downsample=space, temporal_downsample=time))
    converted = copy.deepcopy(stock)
    tconv3d.nn.convert(converted, filter=lambda name, module: not (left_alone and name.endswith("conv1")))
    x = torch.randn(1, 4, *size).contiguous(memory_format=torch.channels_last_3d)
    with torch.no_grad():
        expected, out = stock(x), converted(x)
    assert out.shape == expected.shape and rel_l2(out, expected) < MATCH
    report = tconv3d.nn.audit(converted, x, verbose=False)
    copies = report.totals["upstream_copies_into_convs"]
    assert copies == int(space and left_alone), report.table()


def minimax_h3(
    padding_mode: str = "reflect", clip_length: int = 17, token_drop: int = 3, levels=(8, 16, 16, 16, 16, 16)
):
    """MiniMax-H3's VAE, small: its video encoder's causal convs (reflect in space, zeros in front in time), strided
    downsamplers padded after H and W, per-frame GroupNorms; its decoder is a ViT (no 3-D convolution)."""
    torch.manual_seed(0)
    return diffusers.AutoencoderKLMiniMaxH3(
        latent_channels=4, block_out_channels=levels, layers_per_block=1, norm_num_groups=4,
        spatial_padding_mode=padding_mode, decoder_num_layers=1, decoder_num_attention_heads=2,
        decoder_attention_head_dim=8, clip_length=clip_length, token_drop=token_drop, latents_mean=(0.0,) * 4,
        latents_std=(1.0,) * 4,
    )  # fmt: skip


def encode(model, x):
    return model.encode(x).latent_dist.mode()


def silu_calls(model, x) -> int:
    """The SiLUs encode(model, x) runs outside tconv3d's ops (a fused one runs inside its norm's op)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += func in (torch.ops.aten.silu.default, torch.ops.aten.silu_.default)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count():
        encode(model, x)
    return Count.calls


@pytest.mark.parametrize("padding_mode", ["reflect", "replicate", "constant"])
def test_minimax_h3_encoder_without_its_pads_and_layout_copies(padding_mode, aten_path):
    """MiniMax-H3's encoder (a 17-frame clip, its own length): every conv on tconv3d with its reflect (or other)
    padding in space and zero frames in front inside the op, the downsamplers' pad after H and W too; the
    per-frame GroupNorms on the frames' view with their SiLU fused, no layout copy into a norm; the latents and
    the encoder's parameter gradients match the stock model's."""
    stock, converted = stock_and_converted(functools.partial(minimax_h3, padding_mode))
    x = torch.randn(1, 3, 17, 32, 32)
    with torch.no_grad():
        assert rel_l2(encode(converted, x), encode(stock, x)) < MATCH
    before = tconv3d.nn.audit(stock, x, run=encode, verbose=False)
    after = tconv3d.nn.audit(converted, x, run=encode, verbose=False)
    assert before.aten_conv3d_calls == after.tconv3d_calls > 0
    assert_all_on_tconv3d(after, every_layer_called=False)  # post_quant_conv is the decoder's
    assert sum(layer.pad_copies for layer in before.layers) > 0 and after.totals["pads"] == 0, after.table()
    assert after.norm_calls > 0 and after.norm_layout_copies == 0
    assert {layer.name for layer in after.layers if layer.layout_copies} <= INPUT_EDGES, after.table()
    assert_stays_channels_last(after)
    assert silu_calls(stock, x) > 0 and silu_calls(converted, x) == 0  # each fused into its norm
    for model in (stock, converted):
        encode(model.train(), x).square().mean().backward()
    assert_same_gradients(stock, converted)


def test_minimax_h3_encoder_through_the_triton_interpreter():
    """The kernels themselves (Triton interpreter on CPU): reflect in space and zeros in front in time per
    dimension, the downsamplers' one-sided reflect after H and W at stride 2, per-frame norms with the SiLU."""
    if tconv3d.CPU_BACKEND != "triton":
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1, set by conftest without CUDA)")
    stock, converted = stock_and_converted(functools.partial(minimax_h3, clip_length=9, token_drop=1))
    x = torch.randn(1, 3, 9, 32, 32)
    with torch.no_grad():
        assert rel_l2(encode(converted, x), encode(stock, x)) < MATCH


def kvae_video(ch_mult=(1, 1, 1, 1)):
    """Kandinsky 5's video VAE (AutoencoderKLKVAEVideo), small: causal convs that cache the last frames of each
    segment of 16 frames for the next (its GroupNorms take 32 groups: 32 channels)."""
    torch.manual_seed(0)
    return diffusers.AutoencoderKLKVAEVideo(ch=32, ch_mult=ch_mult, num_res_blocks=1, z_channels=4)


def test_kvae_video_convs_in_one_op_each_with_their_cached_frames(aten_path):
    """Kandinsky 5's VAE over three segments of frames (41 in all: the caches carried from one to the next, at
    stride 2 in time in the encoder): every conv on tconv3d, a cached conv one op where diffusers runs two convs
    and concatenates, its replicate padding in space and the cached (or repeated first) frames in front inside the
    op, no pad or concatenation copy into a conv; the pixel (un)shuffles' means and repeats pooled and interpolated
    on the channels_last_3d activation, so only the input edge takes a layout copy and no norm one, and the spatial
    norms' first-segment latent is resized without a concatenation (no copy upstream of a conv); the video and
    the parameter gradients match the stock model's."""
    x = torch.randn(1, 3, 41, 32, 32)
    stock, converted, before, after = converted_and_audited(kvae_video, x)
    assert before.aten_conv3d_calls > after.tconv3d_calls == sum(layer.calls for layer in after.layers) > 0
    assert_all_on_tconv3d(after)
    assert sum(layer.pad_copies + layer.concat_copies for layer in before.layers) > 0
    assert {layer.name for layer in after.layers if layer.layout_copies} <= INPUT_EDGES, after.table()
    assert after.norm_layout_copies == 0
    assert after.totals["upstream_copies_into_convs"] == 0 < before.totals["upstream_copies_into_convs"]
    assert_stays_channels_last(after, own_pad_copies=OWN_PAD_COPIES["kvae_video"])
    x = x[:, :, :21]  # two segments
    for model in (stock, converted):
        encode_decode(model.train(), x).square().mean().backward()
    assert_same_gradients(stock, converted)


def test_kvae_video_through_the_triton_interpreter():
    """The kernels themselves: replicate in space, the cached frames of the first segment read in front of the
    second's, a strided temporal conv (two levels: each layer kind of the VAE)."""
    if tconv3d.CPU_BACKEND != "triton":
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1, set by conftest without CUDA)")
    stock, converted = stock_and_converted(functools.partial(kvae_video, (1, 1)))
    x = torch.randn(1, 3, 21, 8, 8)  # a segment of 17 frames, then 4
    with torch.no_grad():
        assert rel_l2(encode_decode(converted, x), encode_decode(stock, x)) < MATCH


def kandinsky6_sr(channels=(8, 16, 16, 16)):
    """Kandinsky 6's SR VAE (Kandinsky6SRVAE), small: causal convs that cache frames across segments of 16 frames,
    zeros in space, 4x in time (one strided temporal conv a downsampling level), 8x in space."""
    torch.manual_seed(0)
    return diffusers.Kandinsky6SRVAE(
        latent_channels=4, encoder_block_out_channels=channels, decoder_block_out_channels=channels,
        layers_per_block=1,
    )  # fmt: skip


def test_kandinsky6_sr_convs_in_one_op_each_with_their_cached_frames(aten_path):
    """Kandinsky 6's SR VAE over three segments (41 frames: the caches carried from one to the next, none left at
    the stride-2 conv; a decode whose last segment is too short to fill them, so they keep frames from before it):
    every conv on tconv3d (its SafeConv3d a plain one, its cached causal
    conv one op with its zero padding in space and the cached or repeated frames in front), its RMS norms on
    tconv3d, the latent's resizing, the pixel-unshuffle mean and the frame repeats on the channels_last_3d
    activation: no pad or concatenation copy into a conv, a layout copy at the input edge only; the video and the
    parameter gradients match the stock model's."""
    x = torch.randn(1, 3, 41, 32, 32)
    stock, converted, before, after = converted_and_audited(kandinsky6_sr, x)
    z = torch.randn(1, 4, 10, 4, 4)  # segments of 5, 4 and 1 latent frames: the last too short to fill the caches
    with torch.no_grad():
        assert rel_l2(converted.decode(z).sample, stock.decode(z).sample) < MATCH
    assert before.aten_conv3d_calls > after.tconv3d_calls == sum(layer.calls for layer in after.layers) > 0
    assert before.totals["converted"] == 0  # an nn.Conv3d subclass each: convert leaves them alone unadapted
    assert_all_on_tconv3d(after)
    assert before.totals["upstream_copies_into_convs"] > 0 and after.totals["upstream_copies_into_convs"] == 0
    assert {layer.name for layer in after.layers if layer.layout_copies} <= INPUT_EDGES, after.table()
    assert after.norm_calls > 0 and after.norm_layout_copies == 0
    assert_stays_channels_last(after)
    x = x[:, :, :21]  # two segments
    for model in (stock, converted):
        encode_decode(model.train(), x).square().mean().backward()
    assert_same_gradients(stock, converted)


def kandinsky6_upscalers(widths=(16, 16, 8)):
    """Kandinsky 6's latent upscaler bank (Kandinsky6SRLatentUpscalerBank), small: a 2x and a 4x upscaler of K-VAE
    latents, 3x3x3 convs repeating the edge frames along time, RMS norms modulated by 1x1x1 convs of the latent."""
    from diffusers.models.latent_upscaler.latent_upscaler_kandinsky6_sr import Kandinsky6SRLatentUpscalerBank

    torch.manual_seed(0)
    return Kandinsky6SRLatentUpscalerBank(
        in_channels=4, stage_channels=widths, num_pre_blocks=1, num_mid_blocks=1, num_post_blocks=1,
        num_x2_adapter_blocks=1,
    )  # fmt: skip


def upscale(scale):
    return lambda model, latents: model(latents, scale).sample


@pytest.mark.parametrize("scale", [2, 4])
def test_kandinsky6_latent_upscalers_on_tconv3d_without_copies(scale, aten_path):
    """Kandinsky 6's latent upscalers (Kandinsky 6 SR's pipeline runs them on K-VAE latents): their 3x3x3 convs, an
    nn.Conv3d subclass that F.pads the edge frames along time, one op each with both paddings inside; the RMS norms
    on tconv3d; each modulated norm's 1x1x1 convs on the latent itself, broadcast over the features (a 1x1x1 conv
    commutes with nearest resizing), where stock resizes the latent to full size first; the 2x upsampling in the
    activation's layout. Every conv on tconv3d, no pad and no layout copy into any; the upscaled latents, the
    latents' and the parameters' gradients as stock's, no more kept for the backward."""
    stock, converted = stock_and_converted(kandinsky6_upscalers)
    run = upscale(scale)
    x = torch.randn(1, 4, 3, 4, 4)
    with torch.no_grad():
        out = run(converted, x)
        assert rel_l2(out, run(stock, x)) < MATCH
    assert out.shape[-2:] == (4 * scale, 4 * scale) and out.is_contiguous(memory_format=torch.channels_last_3d)
    before = tconv3d.nn.audit(stock, x, run=run, verbose=False)
    after = tconv3d.nn.audit(converted, x, run=run, verbose=False)
    assert before.totals["converted"] < before.totals["layers"]  # its convs: an nn.Conv3d subclass, left alone
    assert after.totals["converted"] == after.totals["layers"]
    assert_all_on_tconv3d(after, every_layer_called=False)  # the bank's other upscaler and the unused head idle
    assert before.totals["pad_copies_into_convs"] > 0
    assert after.totals["layout_copies"] == after.totals["upstream_copies_into_convs"] == 0, after.table()
    assert after.norm_calls > 0 and after.norm_layout_copies == 0
    assert_stays_channels_last(after, input_edges=None)
    assert_keeps_no_more_than_stock(stock.train(), converted.train(), run, x)
    grads = []
    for model in (stock, converted):
        latents = x.clone().requires_grad_()
        run(model, latents).square().mean().backward()
        grads.append(latents.grad)
    assert rel_l2(grads[1], grads[0]) < MATCH
    assert_same_gradients(stock, converted)


@pytest.mark.parametrize("zq_size", [(3, 4, 4), (3, 2, 4), (3, 3, 3)], ids=["2x", "4x_2x", "resized"])
def test_kandinsky6_modulated_norm_broadcasts_whole_factors_only(zq_size, aten_path):
    """The upscalers' modulated norm on its own: a latent smaller by whole factors gives the features' product and
    sum over a broadcast (no resized latent); any other size resizes it as stock does. Stock's values, gradients
    of the features and the latent, and the features' layout."""
    from diffusers.models.latent_upscaler.latent_upscaler_kandinsky6_sr import Kandinsky6SRLatentUpscalerModulatedNorm

    torch.manual_seed(0)
    stock = Kandinsky6SRLatentUpscalerModulatedNorm(8, 4)
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    features = torch.randn(2, 8, 3, 8, 8).contiguous(memory_format=torch.channels_last_3d)
    latent = torch.randn(2, 4, *zq_size).contiguous(memory_format=torch.channels_last_3d)
    models = (stock, converted)
    inputs = {model: (features.clone().requires_grad_(), latent.clone().requires_grad_()) for model in models}
    outputs = {model: model(*inputs[model]) for model in models}
    assert rel_l2(outputs[converted], outputs[stock]) < MATCH
    assert outputs[converted].is_contiguous(memory_format=torch.channels_last_3d)
    grad = torch.randn_like(outputs[stock])
    for model in models:
        outputs[model].backward(grad)
    for ours, theirs in zip(inputs[converted], inputs[stock], strict=True):
        assert rel_l2(ours.grad, theirs.grad) < MATCH
    assert_same_gradients(stock, converted)


@pytest.mark.parametrize("name", ["kandinsky6_sr", "kvae_video"])
def test_resampler_means_run_in_bf16_on_cpu(name, aten_path):
    """Kandinsky 6's and KVAE's downsamplers average pixels and frames; torch's avg_pool3d has no bfloat16 CPU
    kernel, where diffusers' own means run: the adapters' block means do too, as near an fp32 reference as stock."""
    stock, converted = stock_and_converted(kandinsky6_sr if name == "kandinsky6_sr" else kvae_video)
    x = torch.randn(1, 3, 9, 32, 32)
    with torch.no_grad():
        reference = encode_decode(stock, x)
        stock_error = rel_l2(encode_decode(stock.bfloat16(), x.bfloat16()), reference)
        ours_error = rel_l2(encode_decode(converted.bfloat16(), x.bfloat16()), reference)
    assert ours_error < 1.5 * stock_error + 2e-3, (ours_error, stock_error)


SHORT_SEGMENTS = ([5, 1, 1, 3], [1, 2, 1, 6], [2, 2, 3])


@pytest.mark.parametrize(
    ("kernel", "stride", "segments"),
    [(3, 1, SHORT_SEGMENTS), ((2, 1, 1), 1, SHORT_SEGMENTS), ((2, 1, 1), 2, ([5, 2, 4], [3, 6]))],
)
def test_kandinsky6_sr_causal_conv_over_segments_of_any_length(kernel, stride, segments, aten_path):
    """The cached causal conv called segment by segment with one cache, segments shorter than its window among
    them (the cache then keeps frames from before the segment, as diffusers' does): each segment's output and
    the gradients as diffusers', segment lengths diffusers' own module cannot take left out. At stride 2 the
    segments are odd, then even, as the VAE's (others leave diffusers' preallocated output a window short, and it
    broadcasts a frame into two)."""
    from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import Kandinsky6SRCausalConv3d

    torch.manual_seed(0)
    stock = Kandinsky6SRCausalConv3d(4, 8, kernel, stride=(stride, 1, 1))
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    assert is_converted(converted)
    checked = 0
    for lengths in segments:
        x = torch.randn(2, 4, sum(lengths), 5, 6)
        ours_in = x.clone().contiguous(memory_format=torch.channels_last_3d).requires_grad_()
        theirs_in = x.clone().requires_grad_()
        ours_cache, theirs_cache = stock.make_cache(), stock.make_cache()
        ours, theirs = [], []
        try:
            for a, b in zip(ours_in.split(lengths, 2), theirs_in.split(lengths, 2), strict=True):
                theirs.append(stock(b, theirs_cache))
                ours.append(converted(a, ours_cache))
        except RuntimeError:  # a window diffusers' preallocated output does not match
            continue
        for o, t in zip(ours, theirs, strict=True):
            assert o.shape == t.shape and (t.numel() == 0 or rel_l2(o, t) < MATCH)
        grads = [torch.randn_like(t) for t in theirs]
        torch.autograd.backward(ours, grads)
        torch.autograd.backward(theirs, grads)
        assert rel_l2(ours_in.grad, theirs_in.grad) < MATCH
        checked += 1
    assert checked


def vidtok(tiling=True):
    """VidTok (AutoencoderVidTok), small: causal convs with a cache of frames per chunk when tiled, 4x in time."""
    torch.manual_seed(0)
    model = diffusers.AutoencoderVidTok(ch=8, ch_mult=[1, 2, 2], num_res_blocks=1, z_channels=4)
    if tiling:
        model.enable_tiling()
    return model


def vidtok_run(model, x):
    return model(x, sample_posterior=False).sample


def test_vidtok_causal_convs_in_one_op_each(aten_path):
    """VidTok's encode + decode in chunks of frames (tiled: each causal conv reads the previous chunk's frames, the
    decoder's trimmed by cache_offset): every conv on tconv3d with its repeated or cached frames in front and its
    padding in space inside the op, none of the 120 pad and concatenation copies stock makes into its convs; the
    video and the parameter gradients match stock's."""
    x = torch.randn(1, 3, 17, 32, 32)
    stock, converted, before, after = converted_and_audited(vidtok, x, vidtok_run)
    assert before.aten_conv3d_calls == after.tconv3d_calls > 0
    assert_all_on_tconv3d(after)
    assert sum(layer.pad_copies + layer.concat_copies for layer in before.layers) > 0
    for model in (stock, converted):
        vidtok_run(model.train(), x[:, :, :9]).square().mean().backward()
    assert_same_gradients(stock, converted)


@pytest.mark.parametrize("pad_mode", ["constant", "replicate"])
@pytest.mark.parametrize(("kernel", "stride"), [(3, 1), (3, (2, 1, 1)), ((1, 3, 3), 1)])
def test_vidtok_causal_conv_over_chunks(pad_mode, kernel, stride, aten_path):
    """VidTok's causal conv over chunks with one module's cache, chunks shorter than its time padding and
    cache_offset trims among them: each chunk's output and the gradients as diffusers'."""
    from diffusers.models.autoencoders.autoencoder_vidtok import VidTokCausalConv3d

    torch.manual_seed(0)
    stock = VidTokCausalConv3d(4, 8, kernel, stride=stride, pad_mode=pad_mode)
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    assert is_converted(converted)
    # at stride 2 in time its padding is one frame: a chunk of one frame is shorter than the window (stock raises)
    lengths, offsets = ([5, 1, 1, 2, 4] if stride == 1 else [5, 2, 3, 2, 4]), [0, 0, 1, 0, 2]
    x = torch.randn(2, 4, sum(lengths), 5, 6)
    ours_in = x.clone().contiguous(memory_format=torch.channels_last_3d).requires_grad_()
    theirs_in = x.clone().requires_grad_()
    ours, theirs = [], []
    for i, (a, b) in enumerate(zip(ours_in.split(lengths, 2), theirs_in.split(lengths, 2), strict=True)):
        for model in (stock, converted):
            model.is_first_chunk, model.cache_offset = i == 0, offsets[i]
        theirs.append(stock(b))
        ours.append(converted(a))
    for o, t in zip(ours, theirs, strict=True):
        assert o.shape == t.shape and rel_l2(o, t) < MATCH
    grads = [torch.randn_like(t) for t in theirs]
    torch.autograd.backward(ours, grads)
    torch.autograd.backward(theirs, grads)
    assert rel_l2(ours_in.grad, theirs_in.grad) < MATCH


def qwenimage():
    """Qwen-Image's VAE (AutoencoderKLQwenImage), small: Wan 2.1's code under class names of its own, which its
    pipelines run on images as videos of one frame."""
    torch.manual_seed(0)
    return diffusers.AutoencoderKLQwenImage(
        base_dim=12, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True]
    )


@pytest.mark.parametrize("frames", [1, 5])
def test_qwenimage_vae_as_wans(frames, aten_path):
    """Qwen-Image's VAE takes Wan's adapters by its own class names: on an image (one frame, each causal conv's
    two frames of zeros in front of it) and on a clip, every convolution one tconv3d op (its resamplers' 2-D convs
    on the frames one op over the video), its RMS norms tconv3d's with the SiLU fused, no pad or layout copy into a
    convolution, the output and a training step's gradients as stock's."""
    x = torch.randn(1, 3, frames, 24, 32)
    stock, converted, before, after = converted_and_audited(qwenimage, x)
    assert before.aten_frame_conv_calls > 0 and before.totals["pads"] > 0
    assert after.tconv3d_calls == before.aten_conv3d_calls + before.aten_frame_conv_calls
    assert_all_on_tconv3d(after, every_layer_called=frames > 1)  # an image: no time_conv runs
    assert after.aten_frame_conv_calls == 0 and after.totals["pads"] == 0
    assert_stays_channels_last(after, upstream_copies=True)  # a clip's latents: Wan's chunks concatenated
    fused = [m for m in converted.modules() if class_name(type(m)) in NORM_SILU_BLOCKS]
    assert fused and all(type(m.nonlinearity) is nn.Identity for m in fused) and after.norm_calls > 0
    for model in (stock, converted):
        encode_decode(model.train(), x).square().mean().backward()
    assert_same_gradients(stock, converted)


def allegro():
    """Allegro's VAE (AutoencoderKLAllegro), small: 2-D layers on the frames, temporal conv layers between them,
    4x in time (a strided temporal conv layer down, an upsampling one up per level that has them)."""
    torch.manual_seed(0)
    return diffusers.AutoencoderKLAllegro(block_out_channels=(8, 16, 16, 16), norm_num_groups=4, layers_per_block=1)


def allegro_run(model, x):
    """Its encoder then decoder: diffusers' encode and decode raise without tiling, whose tiles are 24 frames of
    at least 128 x 128 (its overlaps are fixed at 120 and 80 pixels)."""
    return model.decoder(model.encoder(x)[:, : model.config.latent_channels])


@pytest.mark.parametrize("frames", [8, 4])
def test_allegro_frames_and_temporal_convs_in_channels_last(frames, aten_path):
    """Allegro's temporal conv layers on tconv3d: every Conv3d one op, every GroupNorm (with the SiLU after it) one
    tconv3d pass, no activation or norm input in another layout (its 2-D layers' weights channels_last, so the
    frames stay NHWC and their video views channels_last_3d), the repeated end frames one concatenation a stage
    where diffusers makes two (its norms' statistics count them, so they stay); the video and the gradients as
    stock's. Four frames make latents of one frame, whose video view had degenerate strides: the repeated frames'
    concatenation answered NCDHW into 10 norms until 2026-12-03 (the model fuzzer's). Their gradients are left
    to the model fuzzer, which holds them to float64 against stock's own distance: over a latent of one frame's
    4 x 4 voxels the GroupNorms' gradients land 6e-6-5e-5 from float64 in stock's float32 alone, ours as far, and a
    CI input took the two 1e-4 apart."""
    x = torch.randn(1, 3, frames, 32, 32)
    stock, converted, before, after = converted_and_audited(allegro, x, allegro_run)
    with torch.no_grad():
        assert allegro_run(converted, x).is_contiguous(memory_format=torch.channels_last_3d)
    assert before.aten_conv3d_calls == after.tconv3d_calls > 0
    assert_all_on_tconv3d(after)
    assert after.totals["layout_copies"] == after.norm_layout_copies == 0 and after.norm_calls > 0
    assert_stays_channels_last(after, input_edges=None)
    assert 2 * after.concats == before.concats > 0
    if frames == 4:
        return
    for model in (stock, converted):  # eval: the temporal layers' Dropout(0.1) would draw different masks
        allegro_run(model, x).square().mean().backward()
    assert_same_gradients(stock, converted)


@pytest.mark.parametrize("kind", ["plain", "down_sample", "up_sample"])
def test_allegro_temporal_conv_layer(kind, aten_path):
    """One temporal conv layer of each kind on (B*T, C, H, W) frames, channels_last or not: outputs, input and
    parameter gradients as diffusers'."""
    from diffusers.models.autoencoders.autoencoder_kl_allegro import AllegroTemporalConvLayer

    torch.manual_seed(0)
    flags = {} if kind == "plain" else {kind: True, "stride": 3}
    stock = AllegroTemporalConvLayer(8, 8, norm_num_groups=4, **flags).eval()
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    assert is_converted(converted)
    for memory_format in (torch.channels_last, torch.contiguous_format):
        x = torch.randn(2 * 6, 8, 5, 7).contiguous(memory_format=memory_format)
        ours_in, theirs_in = x.clone().requires_grad_(), x.clone().requires_grad_()
        ours, theirs = converted(ours_in, batch_size=2), stock(theirs_in, batch_size=2)
        assert ours.shape == theirs.shape and rel_l2(ours, theirs) < MATCH
        grad = torch.randn_like(theirs)
        ours.backward(grad)
        theirs.backward(grad)
        assert rel_l2(ours_in.grad, theirs_in.grad) < MATCH
    assert_same_gradients(stock, converted)


@pytest.mark.parametrize("name", ["kandinsky6_sr", "vidtok", "allegro"])
def test_more_vaes_training_keep_no_more_than_stock(name, aten_path):
    """Leaner, as test_vae_training_keeps_no_more_than_stock for the VAEs built here (Allegro in eval mode: its
    Dropout(0.1) layers would draw different masks; what autograd keeps is the same)."""
    build, run, shape = {
        "kandinsky6_sr": (kandinsky6_sr, encode_decode, (1, 3, 9, 32, 32)),
        "vidtok": (vidtok, vidtok_run, (1, 3, 9, 16, 16)),
        "allegro": (allegro, allegro_run, (1, 3, 8, 16, 16)),
    }[name]
    stock, converted = stock_and_converted(build)
    x = torch.randn(*shape)
    train = name != "allegro"
    assert_keeps_no_more_than_stock(stock.train(train), converted.train(train), run, x)


@pytest.mark.parametrize("name", ["kandinsky6_sr", "vidtok", "allegro", "kandinsky6_upscalers"])
def test_more_vaes_through_the_triton_interpreter(name):
    """The kernels themselves. Kandinsky 6's SR VAE: zeros in space with the first frame repeated in front, the
    first segment's cached frames read in front of the second's, the strided temporal conv, the 1x1x1 convs of the
    resized latent. VidTok: the repeated first frame and the chunk before's frames in front, the encoder's strided
    time convs. Allegro: its temporal convs of (3, 1, 1), the strided (2, 3, 3) down and the (1, 3, 3) up, the norms
    on the frames' channels_last_3d views."""
    if tconv3d.CPU_BACKEND != "triton":
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1, set by conftest without CUDA)")
    build, run, shape = {
        "kandinsky6_sr": (functools.partial(kandinsky6_sr, (4, 8, 8)), encode_decode, (1, 3, 21, 8, 8)),  # 17 + 4
        "vidtok": (vidtok, vidtok_run, (1, 3, 9, 16, 16)),
        "allegro": (allegro, allegro_run, (1, 3, 8, 16, 16)),
        "kandinsky6_upscalers": (functools.partial(kandinsky6_upscalers, (8, 8, 4)), upscale(4), (1, 4, 2, 2, 2)),
    }[name]
    stock, converted = stock_and_converted(build)
    x = torch.randn(shape)
    with torch.no_grad():
        assert rel_l2(run(converted, x), run(stock, x)) < MATCH


@pytest.mark.parametrize("name", ["kandinsky6_sr", "vidtok", "allegro", "kandinsky6_upscalers"])
def test_more_vaes_compile_without_new_graph_breaks(name, aten_path):
    """As test_compile_adds_no_graph_breaks, for the VAEs built here (their adapters' forwards traced whole)."""
    build, run, x = {
        "kandinsky6_sr": (kandinsky6_sr, lambda model, z: model.decode(z).sample, torch.randn(1, 4, 5, 4, 4)),
        "vidtok": (functools.partial(vidtok, tiling=False), vidtok_run, torch.randn(1, 3, 9, 16, 16)),
        "allegro": (allegro, allegro_run, torch.randn(1, 3, 8, 16, 16)),
        "kandinsky6_upscalers": (kandinsky6_upscalers, upscale(4), torch.randn(1, 4, 3, 4, 4)),
    }[name]
    stock, converted = stock_and_converted(build)
    explained = explained_without_new_graph_breaks(run, stock, converted, x)
    assert any("tconv3d.conv3d" in str(node.target) for g in explained.graphs for node in g.graph.nodes)


@pytest.mark.parametrize("name", sorted(VAES))
def test_vae_activations_stay_channels_last(name, aten_path):
    """After convert, only the model's input edges reach a tconv3d op in another layout (once per encoder or
    decoder forward: Wan's and EasyAnimate's encoders run once per chunk of frames), no norm gets one, and no pad
    or concatenation copy feeds a convolution."""
    _, converted = stock_and_converted(VAES[name])
    report = tconv3d.nn.audit(converted, torch.randn(1, 3, 9, 32, 32), run=encode_decode, verbose=False)
    assert_stays_channels_last(
        report, upstream_copies=name in CHUNKED_ENCODERS, own_pad_copies=OWN_PAD_COPIES.get(name)
    )
    assert report.totals["layout_copies"] <= (3 if name in CHUNKED_ENCODERS else 2), report.table()


def _frame_models():
    """diffusers' video models of 2-D frame layers with temporal Conv3d layers between them (the frames viewed as
    (B, C, T, H, W)): Stable Video Diffusion's temporal-decoder VAE and UNet, and the text-to-video UNet3D."""
    context = torch.linspace(-1, 1, 48).view(1, 3, 16)
    return {
        "svd_vae": (
            lambda: diffusers.AutoencoderKLTemporalDecoder(
                block_out_channels=(32, 64), layers_per_block=1, latent_channels=4,
                down_block_types=("DownEncoderBlock2D",) * 2,
            ),
            lambda m, x: m.decode(m.encode(x).latent_dist.mode(), num_frames=len(x)).sample,
            (4, 3, 32, 32),
        ),
        "svd_unet": (
            lambda: diffusers.UNetSpatioTemporalConditionModel(
                block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=16, num_attention_heads=(2, 4),
                down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
                up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"), in_channels=8,
                out_channels=4, addition_time_embed_dim=8, projection_class_embeddings_input_dim=24,
            ),
            lambda m, x: m(x, 10, encoder_hidden_states=context[:, :1], added_time_ids=context[:, 0, :3]).sample,
            (1, 4, 8, 16, 16),
        ),
        "unet3d": (
            lambda: diffusers.UNet3DConditionModel(
                block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=16, attention_head_dim=8,
                down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
                up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), norm_num_groups=8,
            ),
            lambda m, x: m(x, 10, encoder_hidden_states=context).sample,
            (1, 4, 3, 8, 8),
        ),
    }  # fmt: skip


@pytest.mark.parametrize("name", ["svd_vae", "svd_unet", "unet3d"])
def test_diffusers_frame_models_temporal_convs_on_tconv3d(name, aten_path):
    """Their temporal convolutions are plain nn.Conv3d: every one on tconv3d, no pad or concatenation copy into
    one, none receiving another layout (the GroupNorm before each makes the frames' permuted view
    channels_last_3d; the norm's own copy of that view is torch's too); outputs and gradients as stock's (the
    zero-initialised output layers of the UNets made nonzero)."""
    build, run, shape = _frame_models()[name]
    stock, converted = stock_and_converted(perturbed(build))
    x = torch.randn(shape)
    with torch.no_grad():
        assert rel_l2(run(converted, x), run(stock, x)) < MATCH
    report = tconv3d.nn.audit(converted, x, run=run, verbose=False)
    assert_all_on_tconv3d(report)
    assert report.totals["layout_copies"] == report.totals["upstream_copies_into_convs"] == 0, report.table()
    for model in (stock, converted):  # in eval: UNet3D's dropout masks follow the memory layout (bernoulli_)
        run(model, x).square().mean().backward()
    assert_same_gradients(stock, converted)


def _video_transformers():
    """diffusers' video diffusion transformers, whose one convolution is a Conv3d patch embedding (kernel = stride)
    of the latent: Wan's (Wan 2.x, SkyReels-V2, ChronoEdit alike) and HunyuanVideo's. Each: build, run(model, x),
    the latent's shape, the patch embedding's name."""
    context, pooled, t = (
        torch.linspace(-1, 1, 80).view(1, 5, 16),
        torch.linspace(-1, 1, 8).view(1, 8),
        torch.tensor([10]),
    )
    return {
        "wan": (
            lambda: diffusers.WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32,
            ),
            lambda m, x: m(x, t, context).sample,
            (1, 4, 3, 8, 12),
            "patch_embedding",
        ),
        "hunyuan_video": (
            lambda: diffusers.HunyuanVideoTransformer3DModel(
                in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
                num_single_layers=1, num_refiner_layers=1, patch_size=2, guidance_embeds=False, text_embed_dim=16,
                pooled_projection_dim=8, rope_axes_dim=(4, 6, 6),
            ),
            lambda m, x: m(x, t, context, torch.ones(1, 5, dtype=torch.bool), pooled).sample,
            (1, 4, 3, 8, 12),
            "x_embedder.proj",
        ),
    }  # fmt: skip


def copied_bytes(model, run, x) -> int:
    """The bytes run(model, x) writes by copying tensors (clone, copy_, contiguous) outside tconv3d's ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        written = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.clone.default, torch.ops.aten.copy_.default):
                Copies.written += out.numel() * out.element_size()
            return out

    with torch.no_grad(), Copies():
        run(model, x)
    return Copies.written


@pytest.mark.parametrize("sizes", [((3, 6, 6), (5, 10, 12)), ((2, 4, 8), (4, 8, 8))], ids=["padded", "whole"])
def test_framepack_history_patch_embeddings_pad_inside_their_convs(sizes, aten_path):
    """HunyuanVideo FramePack's history patch embeddings: the 2x and 4x clean latents, replicate-padded to whole
    patches by F.pad in diffusers (a copy even where they are whole), are padded inside their patch convs' ops: no
    pad copy, every conv's call counted by the audit, the tokens (contiguous as they are) and the gradients of the
    latents and parameters as stock's."""
    framepack = pytest.importorskip("diffusers.models.transformers.transformer_hunyuan_video_framepack")
    torch.manual_seed(0)
    stock = framepack.HunyuanVideoHistoryPatchEmbed(4, 16)
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    small, large = sizes
    latents = (torch.randn(1, 4, *small), torch.randn(1, 4, *small), torch.randn(1, 4, *large))

    def run(model, x):
        return model(x, *latents[1:])

    inputs = {model: [x.clone().requires_grad_() for x in latents] for model in (stock, converted)}
    outputs = {model: model(*inputs[model]) for model in inputs}
    for ours, theirs in zip(outputs[converted], outputs[stock], strict=True):
        assert ours.shape == theirs.shape and ours.is_contiguous() and rel_l2(ours, theirs) < MATCH
    for model in inputs:
        weights = [torch.linspace(-1, 1, tokens.shape[1]).view(1, -1, 1) for tokens in outputs[model]]
        sum((tokens * w).sum() for tokens, w in zip(outputs[model], weights, strict=True)).backward()
    for ours, theirs in zip(inputs[converted], inputs[stock], strict=True):
        assert rel_l2(ours.grad, theirs.grad) < MATCH
    assert_same_gradients(stock, converted)
    before = tconv3d.nn.audit(stock, latents[0], run=run, verbose=False)
    after = tconv3d.nn.audit(converted, latents[0], run=run, verbose=False)
    assert_all_on_tconv3d(after)
    assert before.totals["pads"] == 2  # diffusers' F.pad copies the latent even where it pads nothing
    assert after.totals["pads"] == after.totals["pad_copies_into_convs"] == 0


@pytest.mark.parametrize("name", ["wan", "hunyuan_video"])
def test_video_transformers_patch_embeddings_on_tconv3d(name, aten_path):
    """A converted video transformer's patch embedding runs on tconv3d and writes its tokens channels_last_3d: the
    (B, C, T, H, W) -> (B, T H W, C) flatten and transpose that follows is then contiguous as it is. Wan's
    `.contiguous()` of it, a copy of every token (at 720p, 81 frames, 14B: 0.8 GB in bf16), copies nothing; the
    latent's layout copy into the convolution (16 channels where the tokens have 1,536 to 5,120) is what it costs.
    Outputs and parameter gradients as stock's."""
    build, run, shape, embedding = _video_transformers()[name]
    stock, converted = stock_and_converted(build)
    x = torch.randn(shape)
    tokens = []
    hook = converted.get_submodule(embedding).register_forward_hook(lambda m, args, out: tokens.append(out))
    with torch.no_grad():
        assert rel_l2(run(converted, x), run(stock, x)) < MATCH
    hook.remove()
    assert tokens[0].flatten(2).transpose(1, 2).is_contiguous()
    report = tconv3d.nn.audit(converted, x, run=run, verbose=False)
    assert_all_on_tconv3d(report)
    assert [layer.name for layer in report.layers] == [embedding]
    assert report.totals["layout_copies"] == 1  # the latent's, inside the op
    if name == "wan":
        assert copied_bytes(converted, run, x) == copied_bytes(stock, run, x) - tokens[0].numel() * 4
    for model in (stock, converted):
        run(model, x).square().mean().backward()
    assert_same_gradients(stock, converted)


@pytest.mark.parametrize("stride", [(2, 2, 2), (1, 2, 2), (2, 1, 1), (3, 2, 1)])
@pytest.mark.parametrize("frames", [1, 2])
def test_ltx_depth_to_space_writes_channels_last(stride, frames):
    """LTX-Video's upsampler shuffle, done into a channels_last_3d result, equals diffusers' permute + flatten;
    with the first s0 - 1 frames dropped (the causal upsampler's) too, the result dense at a batch of two (a
    frame slice of the whole shuffle is not: the norms after it would lay it out again)."""
    from tconv3d.nn.video_vaes import _depth_to_space

    b, c, h, w = 2, 3, 3, 4
    x = torch.randn(b, c * math.prod(stride), frames, h, w).contiguous(memory_format=torch.channels_last_3d)
    expected = x.reshape(b, -1, *stride, frames, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4).flatten(6, 7).flatten(4, 5)
    for drop in sorted({0, stride[0] - 1}):
        out = _depth_to_space(x, stride, drop)
        assert torch.equal(out, expected.flatten(2, 3)[:, :, drop:])
        assert out.is_contiguous(memory_format=torch.channels_last_3d)


@pytest.mark.parametrize("stride", [(2, 2, 2), (1, 2, 2), (3, 1, 2)])
@pytest.mark.parametrize("frames", [1, 3])
def test_ltx_depth_to_space_gradients_channels_last(stride, frames):
    """Its backward, with the first s0 - 1 frames dropped (LTX-Video's causal upsampler) and without: the
    gradient as autograd's through diffusers' permute + flatten, written channels_last_3d (autograd's reshape
    backward answers NCDHW); its jvp as the forward's."""
    from tconv3d.nn.video_vaes import _depth_to_space

    b, c, h, w = 2, 3, 3, 4
    for drop in {0, stride[0] - 1}:
        x = torch.randn(b, c * math.prod(stride), frames, h, w, dtype=torch.float64)
        x = x.contiguous(memory_format=torch.channels_last_3d)
        ours_in, theirs_in = x.clone().requires_grad_(), x.clone().requires_grad_()
        shuffled = theirs_in.reshape(b, -1, *stride, frames, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
        theirs = shuffled.flatten(6, 7).flatten(4, 5).flatten(2, 3)[:, :, drop:]
        assert_rearranges_as_autograd(
            lambda t, drop=drop: _depth_to_space(t, stride, drop), x, ours_in, theirs_in, theirs
        )


@pytest.mark.parametrize("stride", [(2, 2, 2), (1, 2, 2), (3, 1, 2)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_ltx_space_to_depth_gradients_channels_last(stride, with_residual):
    """LTX-Video's downsampler space-to-depth (plus its channel-mean residual, in one pass): values as diffusers'
    permute + flatten, gradients as autograd's through them but channels_last_3d (autograd's view backward answered
    NCDHW), and its jvp as the forward's."""
    from tconv3d.nn.video_vaes import _space_to_depth

    b, c, t, h, w = 2, 3, 2, 3, 2
    x = torch.randn(b, c, t * stride[0], h * stride[1], w * stride[2], dtype=torch.float64)
    x = x.contiguous(memory_format=torch.channels_last_3d)
    residual = torch.randn(b, c * math.prod(stride), t, h, w, dtype=torch.float64) if with_residual else None
    ours_in, theirs_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    rearranged = theirs_in.reshape(b, c, t, stride[0], h, stride[1], w, stride[2]).permute(0, 1, 3, 5, 7, 2, 4, 6)
    theirs = rearranged.flatten(1, 4) + (0 if residual is None else residual)
    assert_rearranges_as_autograd(lambda t: _space_to_depth(t, stride, residual), x, ours_in, theirs_in, theirs,
                                  tangent_of=lambda t: _space_to_depth(t, stride))  # fmt: skip


def test_ltx_space_to_depth_with_its_residual_compiles_for_training():
    """Compiled, the downsampler's space-to-depth plus its residual is plain ops (autograd's backward): until
    2026-12-03 they added into the result's view with `out=`, which records no gradient, so a compiled training
    step of LTX-2's or LTX-Video's downsampler raised where stock trains (found by the model fuzzer's compiled LTX-2
    draws). Values and both gradients as eager's."""
    from tconv3d.nn.video_vaes import _space_to_depth

    stride = (2, 2, 2)
    x = torch.randn(2, 3, 4, 6, 4, dtype=torch.float64).contiguous(memory_format=torch.channels_last_3d)
    residual = torch.randn(2, 24, 2, 3, 2, dtype=torch.float64)
    runs = []
    for run in (_space_to_depth, torch.compile(_space_to_depth, backend="aot_eager", fullgraph=True)):
        ours_x, ours_residual = x.clone().requires_grad_(), residual.clone().requires_grad_()
        out = run(ours_x, stride, ours_residual)
        out.backward(torch.arange(out.numel(), dtype=out.dtype).view(out.shape))
        runs.append((out.detach(), ours_x.grad, ours_residual.grad))
    torch._dynamo.reset()
    for eager, compiled in zip(*runs, strict=True):
        assert torch.equal(eager, compiled)


def assert_rearranges_as_autograd(rearrange, x, ours_in, theirs_in, theirs, tangent_of=None):
    """rearrange(ours_in) equals `theirs` (autograd's reference from theirs_in), in channels_last_3d order (a frame
    slice of such a tensor where frames are dropped); so does its input gradient for an NCDHW output gradient (as a
    loss's may come), laid out channels_last_3d; and its forward-mode tangent is tangent_of(tangent) (default: the
    rearrangement of the tangent)."""
    from tconv3d.nn.modules import layout_of

    ours = rearrange(ours_in)
    assert torch.equal(ours, theirs) and layout_of(ours) == torch.channels_last_3d
    grad = torch.randn_like(theirs)
    ours.backward(grad)
    theirs.backward(grad)
    assert torch.equal(ours_in.grad, theirs_in.grad)
    assert ours_in.grad.is_contiguous(memory_format=torch.channels_last_3d)
    tangent = torch.randn_like(x)
    with torch.autograd.forward_ad.dual_level():
        jvp = torch.autograd.forward_ad.unpack_dual(rearrange(torch.autograd.forward_ad.make_dual(x, tangent))).tangent
    assert torch.equal(jvp, (tangent_of or rearrange)(tangent))


@pytest.mark.parametrize("factor_t", [1, 2])
@pytest.mark.parametrize("in_channels, out_channels", [(8, 8), (8, 4), (4, 8)])
def test_wan22_shortcuts_write_channels_last(factor_t, in_channels, out_channels, aten_path):
    """Wan 2.2's residual blocks' shortcuts: AvgDown3D (space-to-depth, then a mean over channel groups) and DupUp3D
    (channels repeated, then depth-to-space; a first chunk's first frames dropped) as diffusers' in values and
    gradients, with channels_last_3d results written without diffusers' NCDHW copies."""
    wan = pytest.importorskip("diffusers.models.autoencoders.autoencoder_kl_wan")
    cases = [(wan.AvgDown3D(in_channels, out_channels, factor_t, 2), 5, {})]
    if out_channels * 4 * factor_t % in_channels == 0:
        cases += [(wan.DupUp3D(in_channels, out_channels, factor_t, 2), 3, {"first_chunk": first}) for first in (0, 1)]
    for stock, frames, kwargs in cases:
        converted = tconv3d.nn.convert(copy.deepcopy(stock))
        assert is_converted(converted)
        x = torch.randn(2, in_channels, frames, 4, 6).contiguous(memory_format=torch.channels_last_3d)
        ours_in, theirs_in = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, expected = converted(ours_in, **kwargs), stock(theirs_in, **kwargs)
        ndhwc = torch.empty(out.shape, memory_format=torch.channels_last_3d).stride()
        assert out.shape == expected.shape and out.stride()[1:] == ndhwc[1:] and rel_l2(out, expected) < 1e-6
        for layout in (torch.channels_last_3d, torch.contiguous_format):  # the gradient as it may arrive
            ours_in.grad = theirs_in.grad = None
            grad = torch.randn(out.shape).contiguous(memory_format=layout)
            out.backward(grad, retain_graph=True)
            expected.backward(grad, retain_graph=True)
            assert rel_l2(ours_in.grad, theirs_in.grad) < 1e-6
            assert ours_in.grad.is_contiguous(memory_format=torch.channels_last_3d), type(stock).__name__
        tangent = torch.randn_like(x)
        with torch.autograd.forward_ad.dual_level():
            duals = [m(torch.autograd.forward_ad.make_dual(x, tangent), **kwargs) for m in (converted, stock)]
            ours, theirs = (torch.autograd.forward_ad.unpack_dual(d).tangent for d in duals)
            assert rel_l2(ours, theirs) < 1e-6


def test_wan_frame_interleave_writes_channels_last():
    """WanResample's temporal upsampling interleave, done into a channels_last_3d result, equals diffusers' reshape
    + stack + reshape, and so do its gradient (written channels_last_3d, whatever the layout of the gradient it is
    handed; diffusers' answers NCDHW) and its forward-mode derivative."""
    from tconv3d.nn.video_vaes import _interleave_frames

    def stock(x):
        b, c2, t, h, w = x.shape
        x = x.reshape(b, 2, c2 // 2, t, h, w)
        return torch.stack((x[:, 0], x[:, 1]), 3).reshape(b, c2 // 2, t * 2, h, w)

    x = torch.randn(2, 6, 4, 3, 5, dtype=torch.float64).contiguous(memory_format=torch.channels_last_3d)
    out = _interleave_frames(x)
    assert torch.equal(out, stock(x)) and out.is_contiguous(memory_format=torch.channels_last_3d)
    for layout in (torch.channels_last_3d, torch.contiguous_format):
        grad = torch.randn(out.shape, dtype=x.dtype).contiguous(memory_format=layout)
        ours = torch.autograd.grad(_interleave_frames(x.requires_grad_()), x, grad)[0]
        assert torch.equal(ours, torch.autograd.grad(stock(x), x, grad)[0])
        assert ours.is_contiguous(memory_format=torch.channels_last_3d)
    tangent = torch.randn_like(x)
    assert torch.equal(torch.func.jvp(_interleave_frames, (x,), (tangent,))[1], stock(tangent))
    with torch.autograd.forward_ad.dual_level():  # the Function's own jvp
        dual = _interleave_frames(torch.autograd.forward_ad.make_dual(x.detach(), tangent))
        assert torch.equal(torch.autograd.forward_ad.unpack_dual(dual).tangent, stock(tangent))
    assert torch.autograd.gradcheck(_interleave_frames, (x[:1, :, :2, :2, :2],))


@pytest.mark.parametrize("temporal", [True, False], ids=["space_and_time", "space"])
@pytest.mark.parametrize(("cin", "cout"), [(16, 16), (8, 16), (6, 6), (16, 8)])
@pytest.mark.parametrize("frames", [1, 2, 5])
def test_hunyuan_video15_resampling_in_channels_last(temporal, cin, cout, frames, aten_path):
    """HunyuanVideo 1.5's upsample and downsample (depth-to-space, space-to-depth, the shortcut repeated or averaged
    over channels, the first frame in space only), and HunyuanImage 2.1's refiner's (every frame as that first
    frame), written into one channels_last_3d result from views, against diffusers' modules: outputs, input
    gradients and parameter gradients, with channel counts that do not split into the 4 spatial positions (6:
    diffusers then repeats before it rearranges). Shapes diffusers' own modules cannot take are left out."""
    from diffusers.models.autoencoders import autoencoder_kl_hunyuanimage_refiner as refiner
    from diffusers.models.autoencoders import autoencoder_kl_hunyuanvideo15 as hv15

    for cls, flag, size in (
        (hv15.HunyuanVideo15Upsample, "add_temporal_upsample", (3, 5)),
        (hv15.HunyuanVideo15Downsample, "add_temporal_downsample", (6, 4)),
        (refiner.HunyuanImageRefinerUpsampleDCAE, "add_temporal_upsample", (3, 5)),
        (refiner.HunyuanImageRefinerDownsampleDCAE, "add_temporal_downsample", (6, 4)),
    ):
        torch.manual_seed(0)
        try:
            stock = cls(cin, cout, **{flag: temporal}).eval()
        except AssertionError:  # the refiner's downsample asserts its output channels split into its factor
            continue
        converted = tconv3d.nn.convert(copy.deepcopy(stock))
        assert is_converted(converted)
        x = torch.randn(2, cin, frames, *size)
        try:
            stock(x)
        except RuntimeError:  # channels or frames diffusers cannot regroup (1 + 2k frames to downsample in time)
            continue
        ours_in = x.clone().contiguous(memory_format=torch.channels_last_3d).requires_grad_()
        theirs_in = x.clone().requires_grad_()
        ours, theirs = converted(ours_in), stock(theirs_in)
        assert ours.shape == theirs.shape
        assert ours.is_contiguous(memory_format=torch.channels_last_3d)
        assert rel_l2(ours, theirs) < MATCH, cls.__name__
        grad = torch.randn_like(theirs)
        ours.backward(grad)
        theirs.backward(grad)
        assert rel_l2(ours_in.grad, theirs_in.grad) < MATCH, cls.__name__
        assert_same_gradients(stock, converted)
        if temporal or cin % 4 == 0:  # paired by views (else diffusers' repeat first, and autograd's backward)
            assert ours_in.grad.is_contiguous(memory_format=torch.channels_last_3d), cls.__name__
            tangent = torch.randn_like(x)
            with torch.autograd.forward_ad.dual_level():  # the rearrangement's jvp: the forward on the tangents
                dual = converted(torch.autograd.forward_ad.make_dual(x, tangent))
                ours_jvp = torch.autograd.forward_ad.unpack_dual(dual).tangent
            _, theirs_jvp = torch.func.jvp(stock, (x,), (tangent,))
            assert rel_l2(ours_jvp, theirs_jvp) < MATCH, cls.__name__


def convert_norm_and_compare(stock, x, call=lambda norm, x: norm(x)):
    """The converted norm: one tconv3d norm call on x with no layout copy, a channels_last_3d output, input and
    parameter gradients as the stock module's."""
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    assert is_converted(converted)
    report = tconv3d.nn.audit(converted, x, run=call, verbose=False)
    assert report.norm_calls == 1 and report.norm_layout_copies == 0
    ours_in, theirs_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, theirs = call(converted, ours_in), call(stock, theirs_in)
    assert rel_l2(ours, theirs) < MATCH and ours.is_contiguous(memory_format=torch.channels_last_3d)
    grad = torch.randn_like(theirs)
    ours.backward(grad)
    theirs.backward(grad)
    assert rel_l2(ours_in.grad, theirs_in.grad) < MATCH
    if any(True for _ in stock.parameters()):
        assert_same_gradients(stock, converted)
    return converted


@pytest.mark.parametrize(
    "cls_name", ["autoencoder_kl_wan.WanRMS_norm", "autoencoder_kl_hunyuanvideo15.HunyuanVideo15RMS_norm"]
)
def test_rms_norms_run_on_tconv3d(cls_name, aten_path):
    """Wan's (and Qwen-Image's, the same class) and HunyuanVideo 1.5's RMS_norm on 5-D activations: one rms_norm op,
    against diffusers' module in fp32 (with a bias), and in the dtype diffusers returns (fp32 for a bf16 input with
    fp32 parameters, as under autocast; bf16 for a bf16 model); 4-D inputs (the attention blocks' per-frame norm)
    run diffusers' forward."""
    import importlib

    module_name, name = cls_name.split(".")
    cls = getattr(importlib.import_module(f"diffusers.models.autoencoders.{module_name}"), name)
    torch.manual_seed(0)
    stock = cls(24, images=False, bias=True)
    with torch.no_grad():
        stock.gamma.copy_(torch.randn_like(stock.gamma))
        stock.bias.copy_(torch.randn_like(stock.bias))
    x = torch.randn(2, 24, 3, 4, 5).contiguous(memory_format=torch.channels_last_3d)
    converted = convert_norm_and_compare(stock, x)
    with torch.no_grad():
        assert converted(x.bfloat16()).dtype == stock(x.bfloat16()).dtype == torch.float32
        assert copy.deepcopy(converted).bfloat16()(x.bfloat16()).dtype == torch.bfloat16
    frames = cls(24)  # images=True: the attention blocks' norm over (B*T, C, H, W)
    converted_frames = tconv3d.nn.convert(copy.deepcopy(frames))
    flat = torch.randn(6, 24, 4, 5)
    with torch.no_grad():
        assert torch.equal(converted_frames(flat), frames(flat))


# Residual blocks, and how a norm of theirs is built and called outside a 5-D video (where diffusers' forward runs)
FUSED_BLOCKS = {
    "autoencoder_kl_wan.WanResidualBlock": (lambda cls: cls(8), (6, 8, 4, 5)),  # images=True: per frame
    "autoencoder_kl_hunyuanvideo15.HunyuanVideo15ResnetBlock": (lambda cls: cls(8), (6, 8, 4, 5)),
    "autoencoder_kl_ltx.LTXVideoResnetBlock3d": (lambda cls: cls(8, eps=1e-8), (2, 7, 8)),  # a transformer's
    "autoencoder_kl_ltx2.LTX2VideoResnetBlock3d": (lambda cls: cls(), (6, 8, 4, 5)),
}


@pytest.mark.parametrize("cls_name", FUSED_BLOCKS)
def test_residual_blocks_fuse_their_silu_into_the_rms_norms(cls_name, aten_path):
    """A residual block whose SiLU only follows its two RMS norms runs each norm and its SiLU as one rms_norm pass
    (the block's nonlinearity becomes nn.Identity), with the stock block's outputs and gradients; a fused norm given
    an input that is not a 5-D video (diffusers' forward) still applies the SiLU. With a scale_shift_table
    (timestep conditioning between norm and SiLU), nothing is fused."""
    import importlib

    module_name, name = cls_name.split(".")
    cls = getattr(importlib.import_module(f"diffusers.models.autoencoders.{module_name}"), name)
    torch.manual_seed(0)
    stock = cls(8, 16).eval()
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    assert type(converted.nonlinearity) is nn.Identity
    assert converted.norm1.activation == converted.norm2.activation == "silu"
    x = torch.randn(2, 8, 3, 6, 5).contiguous(memory_format=torch.channels_last_3d)
    ours_in, theirs_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, theirs = converted(ours_in), stock(theirs_in)
    assert rel_l2(ours, theirs) < MATCH
    grad = torch.randn_like(theirs)
    ours.backward(grad)
    theirs.backward(grad)
    assert rel_l2(ours_in.grad, theirs_in.grad) < MATCH
    assert_same_gradients(stock, converted)
    report = tconv3d.nn.audit(converted, x, verbose=False)
    assert report.norm_calls == 2 and report.norm_layout_copies == 0
    build_norm, other_shape = FUSED_BLOCKS[cls_name]
    norm = build_norm(type(stock.norm1))
    fused = tconv3d.nn.convert(copy.deepcopy(norm))
    fused.activation = "silu"
    other = torch.randn(other_shape)
    with torch.no_grad():
        assert torch.equal(fused(other), torch.nn.functional.silu(norm(other)))
    if "timestep_conditioning" in inspect.signature(cls).parameters:
        conditioned = tconv3d.nn.convert(cls(8, 16, timestep_conditioning=True))
        assert type(conditioned.nonlinearity) is nn.SiLU and conditioned.norm1.activation is None


@pytest.mark.parametrize("cls_name", ["normalization.RMSNorm", "autoencoders.autoencoder_kl_ltx2.PerChannelRMSNorm"])
def test_ltx_rms_norms_run_on_tconv3d(cls_name, aten_path):
    """LTX-Video's RMSNorm (diffusers' generic one, called on channels moved last) and LTX-2's PerChannelRMSNorm:
    x * rsqrt(mean(x^2) + eps) over the channels in one rms_norm op on 5-D videos, against diffusers' modules
    (weight and bias included), gradients included, in the dtypes diffusers returns; a transformer's 3-D input
    runs diffusers' forward."""
    import importlib

    module_name, name = cls_name.rsplit(".", 1)
    cls = getattr(importlib.import_module(f"diffusers.models.{module_name}"), name)
    torch.manual_seed(0)
    last_dim = name == "RMSNorm"
    stock = cls(24, eps=1e-6, bias=True) if last_dim else cls(eps=1e-6)
    if last_dim:
        with torch.no_grad():
            stock.weight.copy_(torch.randn_like(stock.weight))
            stock.bias.copy_(torch.randn_like(stock.bias))
    video = torch.randn(2, 24, 3, 4, 5).contiguous(memory_format=torch.channels_last_3d)
    call = (lambda norm, x: norm(x.movedim(1, -1)).movedim(-1, 1)) if last_dim else (lambda norm, x: norm(x))
    converted = convert_norm_and_compare(stock, video, call)
    with torch.no_grad():
        for model_dtype, x_dtype in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)):
            theirs = call(copy.deepcopy(stock).to(model_dtype), video.to(x_dtype))
            ours = call(copy.deepcopy(converted).to(model_dtype), video.to(x_dtype))
            assert ours.dtype == theirs.dtype and rel_l2(ours.float(), theirs.float()) < 1e-2
        if last_dim:
            tokens = torch.randn(2, 7, 24)
            assert torch.equal(converted(tokens), stock(tokens))
            plain = cls(24, eps=1e-6, elementwise_affine=False)
            assert tconv3d.nn.convert(copy.deepcopy(plain))(video.bfloat16().movedim(1, -1)).dtype == torch.bfloat16


WHOLE_MODELS = """
import sys, torch
from tconv3d.nn.convert import is_converted
from tconv3d.nn.video_vaes import NORM_SILU_BLOCKS, class_name
x = torch.load(sys.argv[1])
outputs = {}
for path in sys.argv[3:]:
    model = torch.load(path, weights_only=False)
    with torch.no_grad():
        decoded = model.decode(model.encode(x).latent_dist.mode()).sample
    outputs[path] = (sum(map(is_converted, model.modules())), decoded)
torch.save(outputs, sys.argv[2])
"""


def test_whole_converted_vaes_load_in_fresh_process(aten_path, tmp_path):
    """torch.save of a whole converted VAE (its adapted classes are made at run time) loads, converted, in a
    process that has not converted anything."""
    x = torch.randn(1, 3, 5, 16, 16)
    torch.save(x, tmp_path / "x.pt")
    expected = {}
    for name, build in VAES.items():
        _, converted = stock_and_converted(build)
        path = str(tmp_path / f"{name}.pt")
        torch.save(converted, path)
        with torch.no_grad():
            expected[path] = (sum(map(is_converted, converted.modules())), encode_decode(converted, x))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the aten path there too
    run = subprocess.run(
        [sys.executable, "-c", WHOLE_MODELS, tmp_path / "x.pt", tmp_path / "out.pt", *expected],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    loaded = torch.load(tmp_path / "out.pt")
    for path, (count, output) in expected.items():
        assert loaded[path][0] == count > 0, path
        assert rel_l2(loaded[path][1], output) < MATCH, path


# name: (builder, or a MONAI_NETS name; input shape; what to run)


def monai_nets():
    """monai.networks.nets, imported when a builder runs (the tests skip without MONAI)."""
    return pytest.importorskip("monai.networks.nets")


def _monai_nets():
    nets = monai_nets()

    def transformer(build):  # MONAI's UNETR and SwinUNETR need einops
        return lambda: pytest.importorskip("einops") and build()

    return {
        "unet": lambda: nets.UNet(3, 1, 2, channels=(4, 8, 16), strides=(2, 2), num_res_units=2),
        # each level's down path, subblock and up path in an ActivationCheckpointWrapper (not in monai.networks.nets)
        "checkpoint_unet": lambda: (
            getattr(nets.unet, "CheckpointUNet", None) or pytest.skip("this MONAI has no CheckpointUNet")
        )(3, 1, 2, channels=(4, 8, 16), strides=(2, 2), num_res_units=2),
        "attention_unet": lambda: nets.AttentionUnet(3, 1, 2, channels=(4, 8, 16), strides=(2, 2)),
        "dynunet": lambda: nets.DynUNet(3, 1, 2, kernel_size=[3, 3, 3], strides=[1, 2, 2], upsample_kernel_size=[2, 2]),
        "unetr": transformer(
            lambda: nets.UNETR(1, 2, (32, 32, 32), feature_size=4, hidden_size=48, mlp_dim=96, num_heads=4)
        ),
        # one Swin block a stage (MONAI's default: two, the second's window shifted; neither holds a convolution)
        "swin_unetr": transformer(
            lambda: nets.SwinUNETR(in_channels=1, out_channels=2, feature_size=12, depths=(1, 1, 1, 1))
        ),
        # a residual conv block in front of each Swin stage, whose input MONAI made NCDHW (the adapter: as it is)
        "swin_unetr_v2": transformer(
            lambda: nets.SwinUNETR(in_channels=1, out_channels=2, feature_size=12, depths=(1, 1, 1, 1), use_v2=True)
        ),
        "basic_unet": lambda: nets.BasicUNet(3, 1, 2, features=(4, 4, 8, 8, 16, 4)),
    }


# The input each MONAI network takes: its ViT's image size (UNETR); five halvings that leave the bottleneck's
# instance norm more than one voxel (SwinUNETR).
MONAI_NETS = {
    "unet": 16,
    "checkpoint_unet": 16,
    "attention_unet": 16,
    "dynunet": 16,
    "unetr": 32,
    "swin_unetr": 64,
    "swin_unetr_v2": 64,
    "basic_unet": 32,
}
# Skip-connection concatenations that feed a convolution (MONAI UNet: a transposed one) in a forward, stock: each
# becomes that convolution's channels_after once converted (monai_nets).
MONAI_SKIP_CONCATS = {
    "unet": 2,
    "checkpoint_unet": 2,
    "attention_unet": 2,
    "dynunet": 2,
    "unetr": 8,
    "swin_unetr": 10,
    "swin_unetr_v2": 10,
    "basic_unet": 8,
}


@pytest.mark.parametrize("name", [name for name in MONAI_NETS if name != "swin_unetr"])
def test_monai_unets(name, aten_path):
    """Outputs, every convolution on tconv3d, and gradients against stock. SwinUNETR's v2 stands for both (its
    blocks are v1's, with a residual block in front of each stage; v1 is in the other tests: 30 s of CI here)."""
    stock, converted = stock_and_converted(_monai_nets()[name])
    x = torch.randn(1, 1, *(MONAI_NETS[name],) * 3)
    with torch.no_grad():
        assert rel_l2(converted(x), stock(x)) < MATCH
    report = tconv3d.nn.audit(converted, x, verbose=False)
    assert_all_on_tconv3d(report)
    assert report.aten_conv_transpose3d_calls == 0
    assert any(layer.kind == "ConvTranspose3d" for layer in report.layers)
    for model in (stock, converted):
        model(x).square().mean().backward()
    assert_same_gradients(stock, converted)


@pytest.mark.parametrize("name", MONAI_NETS)
def test_monai_activations_stay_channels_last(name, aten_path):
    """No layout copy but the input's, norms included. UNETR's: its proj_feat made an NCDHW copy of each of the
    four ViT states its decoder reads (4 layout copies stock); the adapter leaves the permuted view. No skip
    connection's concatenation feeds a convolution or transposed convolution."""
    stock, converted = stock_and_converted(_monai_nets()[name])
    x = torch.randn(1, 1, *(MONAI_NETS[name],) * 3)
    report = tconv3d.nn.audit(converted, x, verbose=False)
    assert report.norm_calls > 0
    assert_stays_channels_last(report, input_edges=None)
    stock_copies = tconv3d.nn.audit(stock, x, verbose=False).totals["upstream_copies_into_convs"]
    assert stock_copies == MONAI_SKIP_CONCATS[name]


@pytest.mark.parametrize("name", MONAI_NETS)
def test_monai_training_keeps_no_more_than_stock(name, aten_path):
    """Leaner: a converted MONAI network keeps no more for its backward than stock's autograd does."""
    stock, converted = stock_and_converted(_monai_nets()[name])
    x = torch.randn(1, 1, *(MONAI_NETS[name],) * 3)
    assert_keeps_no_more_than_stock(stock.train(), converted.train(), lambda m, x: m(x), x)


@pytest.mark.parametrize("name", ["unet", "checkpoint_unet", "attention_unet", "dynunet", "basic_unet"])
def test_monai_compile_adds_no_graph_breaks(name, aten_path):
    """torch.compile traces a converted MONAI network (its skip connections read in place by the adapters) with
    no more graph breaks than stock, the tconv3d ops in the graph, and the compiled training step (aot_eager)
    matches eager: outputs and parameter gradients."""
    stock, converted = stock_and_converted(_monai_nets()[name])
    x = torch.randn(1, 1, *(MONAI_NETS[name],) * 3)
    explained = explained_without_new_graph_breaks(lambda model, x: model(x), stock, converted, x)
    # with the ops of subgraphs too (a checkpointed region is one: CheckpointUNet's levels)
    graphs = [m for g in explained.graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule)]
    targets = {str(node.target) for g in graphs for node in g.graph.nodes}
    assert any("tconv3d.conv3d" in t for t in targets), targets
    eager = copy.deepcopy(converted)
    torch._dynamo.reset()
    compiled = torch.compile(converted, backend="aot_eager")
    for model in (eager, compiled):
        model(x).square().mean().backward()
    assert rel_l2(compiled(x), eager(x)) < MATCH
    assert_same_gradients(eager, converted)


def test_monai_checkpoint_unet_compiles_with_dynamic_shapes(aten_path):
    """CheckpointUNet (checkpoints nested in checkpoints: MONAI's wrappers inside the adapter's levels) traced with
    dynamic=True, where Dynamo makes a float read from an object a symbolic input: the norms' fused PReLU once
    handed the op such a slope, and the trace failed inside the nested checkpoints (model fuzz run 68). The
    compiled training step matches eager."""
    _, converted = stock_and_converted(_monai_nets()["checkpoint_unet"])
    x = torch.randn(1, 1, 16, 16, 16).contiguous(memory_format=torch.channels_last_3d)
    eager = copy.deepcopy(converted)
    torch._dynamo.reset()
    compiled = torch.compile(converted, backend="aot_eager", dynamic=True)
    outputs = [model(x) for model in (eager, compiled)]
    for output in outputs:
        output.square().mean().backward()
    assert rel_l2(outputs[1], outputs[0]) < MATCH
    assert_same_gradients(eager, converted)


@pytest.mark.parametrize("upsample", ["deconv", "nontrainable"])
def test_monai_basic_unet_pads_odd_sizes_without_a_copy(upsample, aten_path):
    """BasicUNet at odd sizes (the 2x max pooling drops a plane, and each up block replicate-pads its upsampled
    features back to the encoder's size: F.pad, a copy of them whole): its transposed conv writes the extra plane
    (output_size) and the plane before it is copied over it, so no pad runs and no copy feeds a convolution; the
    output and every gradient as stock's, in a training step. Another upsampling keeps MONAI's pad."""
    from monai.networks import nets

    build = lambda: nets.BasicUNet(3, 1, 2, features=(4, 4, 8, 8, 16, 4), upsample=upsample)  # noqa: E731
    stock, converted = stock_and_converted(build)
    x = torch.randn(1, 1, 35, 38, 45)  # odd before each of the four poolings in one dim or another
    with torch.no_grad():
        assert rel_l2(converted(x), stock(x)) < MATCH
    report = tconv3d.nn.audit(converted, x, verbose=False)
    assert_all_on_tconv3d(report)
    assert tconv3d.nn.audit(stock, x, verbose=False).totals["pads"] > 0
    if upsample == "deconv":
        assert report.totals["pads"] == 0, report.table()
        assert_stays_channels_last(report, input_edges=None)
    inputs = {model: x.clone().requires_grad_() for model in (stock, converted)}
    for model, input in inputs.items():
        model.train()(input).square().mean().backward()
    assert rel_l2(inputs[converted].grad, inputs[stock].grad) < MATCH
    assert_same_gradients(stock, converted)


def test_monai_densenet_keeps_channels_last(aten_path):
    """MONAI's DenseNet121 (3-D): its transitions' AvgPool3d (torch's CPU kernel answers NCDHW) swapped for
    tconv3d.nn.AvgPool3d, so no dense layer's concatenation, and none of its 120 convolutions, gets another layout
    (38 layout copies before); the output as stock's."""
    from monai.networks import nets

    stock, converted = stock_and_converted(lambda: nets.DenseNet121(spatial_dims=3, in_channels=1, out_channels=2))
    x = torch.randn(1, 1, 32, 32, 32).contiguous(memory_format=torch.channels_last_3d)
    with torch.no_grad():
        assert rel_l2(converted(x), stock(x)) < MATCH
    report = tconv3d.nn.audit(converted, x, verbose=False)
    assert_all_on_tconv3d(report)
    assert report.totals["layout_copies"] == 0


def _generative_autoencoders():
    def maisi():
        return pytest.importorskip("monai.apps.generation.maisi.networks.autoencoderkl_maisi").AutoencoderKlMaisi

    small = dict(spatial_dims=3, in_channels=1, out_channels=1, latent_channels=4, norm_num_groups=4)
    return {
        # attention at the lowest level: at batch 1 its output's strides were not channels_last_3d to torch
        "autoencoderkl": lambda: monai_nets().AutoencoderKL(
            channels=(8, 16, 16), num_res_blocks=1, attention_levels=(False, False, True), **small
        ),
        "maisi": lambda: maisi()(
            num_channels=(8, 16, 16),
            num_res_blocks=(1, 1, 1),
            attention_levels=(False, False, False),
            num_splits=2,
            dim_split=1,
            **small,
        ),
    }


def seeded_runs(models, run) -> list:
    """run(model) for each model under the same seed, without gradients: a forward that samples (a VAE's latent)
    draws the same numbers for each."""
    outputs = []
    for model in models:
        torch.manual_seed(5)
        with torch.no_grad():
            outputs.append(run(model))
    return outputs


def _spade_networks():
    small = dict(spatial_dims=3, label_nc=3, norm_num_groups=4)
    return {
        "autoencoder": perturbed(
            lambda: monai_nets().SPADEAutoencoderKL(
                in_channels=1, out_channels=1, channels=(8, 16), latent_channels=4, num_res_blocks=(1, 1),
                attention_levels=(False, False), **small,
            )
        ),
        "diffusion_unet": perturbed(
            lambda: monai_nets().SPADEDiffusionModelUNet(
                in_channels=4, out_channels=4, channels=(8, 16, 16), attention_levels=(False, False, True),
                num_res_blocks=1, num_head_channels=8, **small,
            )
        ),
    }  # fmt: skip


def spade_autoencode(model, x):
    """A SPADE autoencoder's reconstruction from its latent mean, its segmentation map made from x (3 labels)."""
    return model.decode(model.encode(x)[0], torch.cat([x, 0.5 * x, -x], dim=1).sigmoid())


def spade_denoise(model, x):
    """A SPADE diffusion UNet's prediction (`denoise`'s timesteps), its segmentation map made from x."""
    return model(x, torch.arange(len(x), device=x.device) * 100 + 10, seg=x[:, :3].sigmoid())


@pytest.mark.parametrize("name", ["autoencoder", "diffusion_unet"])
def test_monai_spade_networks_keep_channels_last(name, aten_path):
    """MONAI's SPADE networks (semantic synthesis: each norm modulated by convolutions of the segmentation map):
    SPADE made its norm's input `.contiguous()` (NCDHW) and each norm's convolutions took a layout copy of the
    interpolated map (an NCDHW user input); the diffusion UNet's up blocks concatenate their skip connections for
    the res block's SPADE norm and shortcut. Converted: the map laid out channels_last_3d once as it enters, the
    skip connections read in place, no layout copy and no copy upstream of a convolution; outputs (sampled, for
    the autoencoder: stock's draws under one seed), gradients as stock's, no more kept for the backward."""
    stock, converted = stock_and_converted(_spade_networks()[name])
    if name == "autoencoder":
        x, seg = torch.randn(1, 1, 16, 16, 16), torch.rand(1, 3, 16, 16, 16)
        run = lambda model, x: model(x, seg)[0]  # noqa: E731
    else:
        x, seg = torch.randn(2, 4, 16, 16, 16), torch.rand(2, 3, 16, 16, 16)
        run = lambda model, x: model(x, torch.tensor([10, 500]), seg=seg)  # noqa: E731
    x = x.contiguous(memory_format=torch.channels_last_3d)
    assert rel_l2(*seeded_runs((converted, stock), lambda model: run(model, x))) < MATCH
    before = tconv3d.nn.audit(stock, x, run=run, verbose=False)
    after = tconv3d.nn.audit(converted, x, run=run, verbose=False)
    assert_all_on_tconv3d(after, every_layer_called=False)
    assert before.totals["layout_copies"] + before.totals["upstream_copies_into_convs"] > 0
    assert after.totals["layout_copies"] == after.totals["upstream_copies_into_convs"] == 0, after.table()
    assert after.norm_calls > 0 and after.norm_layout_copies == 0
    assert_stays_channels_last(after, input_edges=None)
    assert_keeps_no_more_than_stock(stock.train(), converted.train(), run, x)
    for model in (stock, converted):
        torch.manual_seed(5)
        run(model, x).square().mean().backward()
    assert_same_gradients(stock, converted)


def autoencode(model, x):
    """A MONAI AutoencoderKL's reconstruction from its latent mean (forward samples the latent)."""
    return model.decode(model.encode(x)[0])


def autoencode_in_autocast(model, x):
    """`autoencode` under autocast for a half input: MAISI's norms answer float32 for one, which only autocast's
    next convolution takes (its bundle runs it under autocast)."""
    with torch.autocast(x.device.type, dtype=x.dtype, enabled=x.dtype != torch.float32):
        return autoencode(model, x)


@pytest.mark.parametrize("name", ["autoencoderkl", "maisi"])
def test_monai_generative_autoencoders_keep_channels_last(name, aten_path):
    """MONAI's AutoencoderKL and MAISI's AutoencoderKlMaisi (3-D latent diffusion's autoencoders): the
    downsamplers' F.pad inside their strided convolutions, the res blocks' norms with their SiLU in one pass, MAISI's
    split convolutions one op each (no slabs or concatenation) and its norms on tconv3d, no NCDHW copy of a block's
    output (MAISI's convert_to_tensor) or of the attention's output at batch 1: no layout copy and no copy upstream
    of a convolution; outputs and gradients as stock's."""
    stock, converted = stock_and_converted(_generative_autoencoders()[name])
    x = torch.randn(1, 1, 32, 32, 32)
    with torch.no_grad():
        assert rel_l2(autoencode(converted, x), autoencode(stock, x)) < MATCH
    before = tconv3d.nn.audit(stock, x, run=autoencode, verbose=False)
    after = tconv3d.nn.audit(converted, x, run=autoencode, verbose=False)
    assert_all_on_tconv3d(after, every_layer_called=False)
    assert all(layer.calls == 1 for layer in after.layers)  # MAISI's split convolutions one op each
    assert before.totals["upstream_copies_into_convs"] > 0 or before.totals["layout_copies"] > 0
    assert after.totals["upstream_copies_into_convs"] == after.totals["layout_copies"] == 0, after.table()
    assert after.norm_calls > 0 and after.norm_layout_copies == 0
    assert_stays_channels_last(after, input_edges=None)
    blocks = [m for m in converted.modules() if type(m).__name__.endswith("ResBlock")]
    assert blocks and all(b.norm1.activation == b.norm2.activation == "silu" for b in blocks)
    for model in (stock, converted):
        autoencode(model.train(), x).square().mean().backward()
    assert_same_gradients(stock, converted)
    assert_keeps_no_more_than_stock(stock, converted, autoencode, x)
    assert rel_l2(*seeded_runs((stock, converted), lambda model: model(x)[0])) < MATCH  # sampled as stock

    if name == "maisi":  # a downsampler whose split convolution is left to MAISI pads as MAISI does
        kept = tconv3d.nn.convert(copy.deepcopy(stock), filter=lambda name, module: name != "encoder.blocks.2.conv")
        assert not kept.encoder.blocks[2].pads_inside and kept.encoder.blocks[4].pads_inside
        with torch.no_grad():
            assert rel_l2(autoencode(kept.eval(), x), autoencode(stock.eval(), x)) < MATCH


def _maisi_split_blocks():
    maisi = pytest.importorskip("monai.apps.generation.maisi.networks.autoencoderkl_maisi")

    def conv(kernel):
        return lambda **splits: maisi.MaisiConvolution(
            spatial_dims=3, in_channels=2, out_channels=3, strides=1, kernel_size=kernel, padding=kernel // 2,
            conv_only=True, **splits,
        )  # fmt: skip

    return {
        "conv3": conv(3),
        "conv1": conv(1),
        "down": lambda **splits: maisi.MaisiDownsample(spatial_dims=3, in_channels=2, **splits),
        "up": lambda **splits: maisi.MaisiUpsample(3, 2, use_convtranspose=False, **splits),
        "up_transposed": lambda **splits: maisi.MaisiUpsample(3, 2, use_convtranspose=True, **splits),
    }


@pytest.mark.parametrize("kind", ["conv3", "conv1", "down", "up", "up_transposed"])
def test_monai_maisi_split_convolutions_as_maisis(kind, aten_path):
    """MAISI's split convolutions at every length of the split dimension up to 17, 2 to 4 slabs, each dimension
    split: converted, MAISI's values and shapes (where it raises, converted raises), one op where its slabs make up
    the convolution's output, MAISI's slabs where they do not: its trim drops rows where num_splits does not divide
    the length (a padding-1 conv of 33 rows answers 32), and a slab shorter than its overlap wraps around. One op
    of such a length answered the convolution's rows (a whole MAISI at 13 x 33 x 8 was 4% off stock's)."""
    one_op = {}
    for splits, dim in ((2, 0), (3, 1), (4, 2)):
        stock = _maisi_split_blocks()[kind](num_splits=splits, dim_split=dim, print_info=False)
        converted = tconv3d.nn.convert(copy.deepcopy(stock))
        for length in range(1, 18):
            shape = [1, 2, 5, 6, 7]
            shape[2 + dim] = length
            x = torch.randn(shape)
            with torch.no_grad():
                try:
                    expected = stock(x)
                except Exception as error:  # MAISI's modulo by a slab of no rows, a slab of no rows (tconv3d's
                    with pytest.raises((type(error), ValueError)):  # own ValueError says so)
                        converted(x)
                    continue
                report = tconv3d.nn.audit(converted, x, verbose=False)
                out = converted(x)
            assert out.shape == expected.shape and rel_l2(out, expected) < MATCH, (splits, dim, length)
            one_op[splits, length] = report.tconv3d_calls == 1
    # one op where the slabs (of the upsampled rows, for the interpolating upsampler) have as many rows as each
    # other and at least their overlap (3; 4 at stride 2); the downsampler's depend on its padded length's phase
    overlap, scale = {"up": (3, 2), "up_transposed": (4, 1)}.get(kind, (3, 1))
    for (splits, length), ran in one_op.items():
        if kind != "down" and scale * length >= overlap * splits:
            assert ran == (scale * length % splits == 0), (splits, length)
    assert any(one_op.values()) and not all(one_op.values())


def test_monai_maisi_at_sizes_its_slabs_trim(aten_path):
    """A whole MAISI autoencoder at a size its 2 slabs do not divide (33 rows): converted, its reconstruction and a
    training step's gradients as stock's."""
    stock, converted = stock_and_converted(_generative_autoencoders()["maisi"])
    x = torch.randn(2, 1, 13, 33, 8)
    with torch.no_grad():
        assert rel_l2(autoencode(converted, x), autoencode(stock, x)) < MATCH
    for model in (stock, converted):
        autoencode(model.train(), x).square().mean().backward()
    assert_same_gradients(stock, converted)


def test_monai_maisi_blocks_through_the_triton_interpreter():
    """The kernels themselves: MAISI's downsampler (its padding inside the strided conv), a res block with a 1x1
    shortcut (its norms and their SiLU on tconv3d's GroupNorm kernels); a norm with norm_float16 answers float16
    as MAISI's does."""
    if tconv3d.CPU_BACKEND != "triton":
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1, set by conftest without CUDA)")
    maisi = pytest.importorskip("monai.apps.generation.maisi.networks.autoencoderkl_maisi")
    splits = dict(num_splits=2, dim_split=0, print_info=False)
    stock, converted = stock_and_converted(
        lambda: nn.Sequential(maisi.MaisiDownsample(3, 4, **splits), maisi.MaisiResBlock(3, 4, 2, 1e-6, 8, **splits))
    )
    x = torch.randn(2, 4, 12, 8, 8)
    with torch.no_grad():
        assert rel_l2(converted(x), stock(x)) < MATCH
    stock, converted = stock_and_converted(lambda: maisi.MaisiGroupNorm3D(2, 8, 1e-6, norm_float16=True))
    x = torch.randn(2, 8, 4, 6, 6).contiguous(memory_format=torch.channels_last_3d)
    with torch.no_grad():
        ours, theirs = converted(x), stock(x)
    assert ours.dtype == theirs.dtype == torch.float16 and rel_l2(ours, theirs) < 1e-3  # float16 rounding


def _diffusion_unets():
    def maisi():
        return pytest.importorskip("monai.apps.generation.maisi.networks.diffusion_model_unet_maisi")

    small = dict(spatial_dims=3, in_channels=4, out_channels=4, num_res_blocks=1, norm_num_groups=4)
    small["num_head_channels"] = 8
    return {
        "self_attention": perturbed(
            lambda: monai_nets().DiffusionModelUNet(
                channels=(8, 16, 16), attention_levels=(False, False, True), **small
            )
        ),
        "cross_attention": perturbed(
            lambda: monai_nets().DiffusionModelUNet(
                channels=(8, 16, 16), attention_levels=(False, True, True), with_conditioning=True,
                cross_attention_dim=6, resblock_updown=True, **small,
            )
        ),
        "maisi": perturbed(
            lambda: maisi().DiffusionModelUNetMaisi(
                num_channels=(8, 16, 16), attention_levels=(False, False, True), **small
            )
        ),
    }  # fmt: skip


def denoise(model, x):
    """A diffusion UNet's prediction at a timestep per sample (with a context for cross-attention)."""
    timesteps = torch.arange(len(x), device=x.device) * 100 + 10
    if getattr(model, "with_conditioning", False):
        context = torch.linspace(-1, 1, len(x) * 18, dtype=x.dtype, device=x.device).view(len(x), 3, 6)
        return model(x, timesteps, context=context)
    return model(x, timesteps)


@pytest.mark.parametrize("name", ["self_attention", "cross_attention", "maisi"])
def test_monai_diffusion_unets_keep_channels_last(name, aten_path):
    """MONAI's DiffusionModelUNet (and MAISI's, of the same blocks): its attention blocks made each attention's
    output `.contiguous()` (NCDHW) and its SpatialTransformer permuted its tokens back with `.contiguous()`, so the
    next norm and convolution took layout copies; converted, none (the input is NDHWC), the res blocks' norms with
    their SiLU in one pass; the up blocks' skip connections (each concatenated for a res block's GroupNorm and its
    1x1x1 shortcut) read in place by both. Outputs and gradients as stock's, at batch 1 and 2."""
    stock, converted = stock_and_converted(_diffusion_unets()[name])
    for batch in (1, 2):
        x = torch.randn(batch, 4, 16, 16, 16).contiguous(memory_format=torch.channels_last_3d)
        with torch.no_grad():
            assert rel_l2(denoise(converted, x), denoise(stock, x)) < MATCH
    before = tconv3d.nn.audit(stock, x, run=denoise, verbose=False)
    after = tconv3d.nn.audit(converted, x, run=denoise, verbose=False)
    assert_all_on_tconv3d(after, every_layer_called=False)
    assert after.totals["layout_copies"] == after.norm_layout_copies == 0 < after.norm_calls, after.table()
    assert after.totals["upstream_copies_into_convs"] == 0 < before.totals["upstream_copies_into_convs"]
    assert_stays_channels_last(after, input_edges=None)
    blocks = [m for m in converted.modules() if type(m).__name__ == "DiffusionUNetResnetBlock"]
    assert blocks and all(b.norm1.activation == b.norm2.activation == "silu" for b in blocks)
    for model in (stock, converted):
        denoise(model.train(), x).square().mean().backward()
    assert_same_gradients(stock, converted)
    assert_keeps_no_more_than_stock(stock, converted, denoise, x)


def test_monai_diffusion_unet_compiles_without_new_graph_breaks(aten_path):
    """torch.compile traces a converted diffusion UNet (cross-attention, res block up/downsampling: each of its
    adapters) with no more graph breaks than stock, the tconv3d ops in the graph (compiled runs of converted
    networks against eager: test_monai_compile_adds_no_graph_breaks)."""
    stock, converted = stock_and_converted(_diffusion_unets()["cross_attention"])
    x = torch.randn(2, 4, 16, 16, 16)
    explained = explained_without_new_graph_breaks(denoise, stock, converted, x)
    targets = {str(node.target) for g in explained.graphs for node in g.graph.nodes}
    assert any("tconv3d.conv3d" in t for t in targets), targets


def test_monai_voxelmorph_reads_its_skip_connections_in_place(aten_path):
    """MONAI's VoxelMorph: its backbone's levels concatenate each skip connection in front of the up path's
    convolution (3 copies in the default 4-level net): converted, that convolution reads it in place; only the
    moving and fixed images' concatenation at the input is left (model code). The warped image, the displacement
    field (integrated: diffeomorphic) and the gradients as stock's; with a hook on the backbone's levels it runs as
    MONAI does, with the same result."""
    stock, converted = stock_and_converted(monai_nets().VoxelMorph)
    moving, fixed = torch.rand(2, 1, 16, 16, 16), torch.rand(2, 1, 16, 16, 16)

    def run(model, x):
        warped, ddf = model(x, fixed)
        return torch.cat([warped.flatten(), ddf.flatten()])

    with torch.no_grad():
        expected = run(stock, moving)
        assert rel_l2(run(converted, moving), expected) < MATCH
    before = tconv3d.nn.audit(stock, moving, run=run, verbose=False)
    after = tconv3d.nn.audit(converted, moving, run=run, verbose=False)
    assert_all_on_tconv3d(after)
    assert before.totals["upstream_copies_into_convs"] == 4 and after.totals["upstream_copies_into_convs"] == 1
    for model in (stock, converted):
        run(model.train(), moving).square().mean().backward()
    assert_same_gradients(stock, converted)
    converted.backbone.net.register_forward_hook(lambda module, args, output: None)
    with torch.no_grad():
        assert rel_l2(run(converted.eval(), moving), expected) < MATCH


def _vnet():
    """MONAI's VNet without dropout (its two lowest-resolution up levels' is 0.5 whatever the arguments)."""
    net = monai_nets().VNet(3, 1, 2, dropout_prob_down=None, dropout_prob_up=(None, 0.0))
    for module in net.modules():
        if isinstance(module, nn.Dropout3d):
            module.p = 0.0
    return net


def test_monai_vnet_adds_its_skip_connections_in_place(aten_path):
    """MONAI's VNet: each up level concatenates its upsampled features with the skip connection, convolves the
    concatenation (5x5x5) and adds it back as the residual (4 concatenations into convolutions). Converted, the
    first convolution reads the skip in place and the residual adds each source to its own channels: no
    concatenation into a convolution, the outputs and gradients as stock's, no more kept for the backward, no graph
    break under torch.compile; with a hook on an up level's LUConvs it runs as MONAI does, with the same result."""
    stock, converted = stock_and_converted(_vnet)
    x = torch.randn(1, 1, 16, 32, 32)  # the lowest level's batch norm over 4 voxels in training
    with torch.no_grad():
        expected = stock(x)
        assert rel_l2(converted(x), expected) < MATCH
    before = tconv3d.nn.audit(stock, x, verbose=False)
    after = tconv3d.nn.audit(converted, x, verbose=False)
    assert_all_on_tconv3d(after)
    assert before.totals["upstream_copies_into_convs"] == 4 and after.totals["upstream_copies_into_convs"] == 0
    assert_keeps_no_more_than_stock(stock.train(), converted.train(), lambda m, x: m(x), x)
    for model in (stock, converted):
        model(x).square().mean().backward()
    assert_same_gradients(stock, converted)
    stock.eval(), converted.eval()  # the training steps moved both networks' batch-norm statistics alike
    torch._dynamo.reset()
    assert torch._dynamo.explain(converted)(x).graph_break_count == 0  # as stock: the residual traced whole
    converted.up_tr256.ops.register_forward_hook(lambda module, args, output: None)
    with torch.no_grad():
        assert rel_l2(converted(x), stock(x)) < MATCH


def _efficientnets():
    return {
        "efficientnet_b0": lambda: monai_nets().EfficientNetBN(
            "efficientnet-b0", pretrained=False, spatial_dims=3, in_channels=1, num_classes=2
        ),
        "flexible_unet": lambda: monai_nets().FlexibleUNet(1, 2, "efficientnet-b0", pretrained=False, spatial_dims=3),
    }


@pytest.mark.parametrize("name", ["efficientnet_b0", "flexible_unet"])
def test_monai_efficientnet_pads_inside_its_convs(name, aten_path):
    """MONAI's EfficientNet pads for TensorFlow's "same" with a ConstantPad3d module in front of its convolutions
    (asymmetric at stride 2, fixed for its image_size): converted, each convolution pads inside its op (the
    padders nn.Identity), no copy upstream of a convolution (17 pads in EfficientNet-B0 stock; FlexibleUNet's
    encoder is one, and its decoder's UpCat reads the skip features in place); outputs and gradients as stock's.
    A convolution the filter leaves on torch keeps its padder."""
    stock, converted = stock_and_converted(_efficientnets()[name])
    x = torch.randn(1, 1, 32, 32, 32)
    with torch.no_grad():
        assert rel_l2(converted(x), stock(x)) < MATCH
    before = tconv3d.nn.audit(stock, x, verbose=False)
    after = tconv3d.nn.audit(converted, x, verbose=False)
    assert_all_on_tconv3d(after, every_layer_called=False)
    assert before.totals["upstream_copies_into_convs"] >= 17
    assert after.totals["upstream_copies_into_convs"] == 0
    strided = [m for m in converted.modules() if isinstance(m, tconv3d.nn.Conv3d) and m.stride != (1, 1, 1)]
    assert strided and all(len(m.padding) == 6 and m.padding[::2] != m.padding[1::2] for m in strided)
    for model in (stock, converted):  # eval: training's batch norms over 2 x 1 voxels at the head amplify rounding
        model(x).square().mean().backward()
    assert_same_gradients(stock, converted)

    kept = tconv3d.nn.convert(copy.deepcopy(stock), filter=lambda qualified, module: qualified[-10:] != "_conv_stem")
    owner = next(module for module in kept.modules() if hasattr(module, "_conv_stem_padding"))
    assert type(owner._conv_stem) is torch.nn.Conv3d and type(owner._conv_stem_padding) is torch.nn.ConstantPad3d
    with torch.no_grad():
        assert rel_l2(kept(x), stock(x)) < MATCH


def test_monai_efficientnet_block_through_the_triton_interpreter():
    """The kernels themselves on the padding a same-padder gives: an MBConvBlock's strided depthwise conv padded
    (0, 1) per dimension inside the op, its 1x1 convs and squeeze-excitation; outputs and input gradient."""
    if tconv3d.CPU_BACKEND != "triton":
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1, set by conftest without CUDA)")
    from monai.networks.nets.efficientnet import MBConvBlock

    build = lambda: MBConvBlock(3, 4, 8, 3, 2, image_size=[6, 6, 6], expand_ratio=2, se_ratio=0.25)  # noqa: E731
    stock, converted = stock_and_converted(build)
    assert converted._depthwise_conv.padding == (0, 1, 0, 1, 0, 1)
    x = torch.randn(2, 4, 6, 6, 6)
    grads = []
    for model in (stock, converted):
        leaf = x.clone().requires_grad_()
        out = model(leaf)
        out.square().mean().backward()
        grads.append((out, leaf.grad))
    assert rel_l2(grads[1][0], grads[0][0]) < MATCH
    assert rel_l2(grads[1][1], grads[0][1]) < MATCH


def _more_monai_nets():
    """MONAI segmentation networks with nothing of their own for convert to adapt: (builder, input size)."""
    nets = monai_nets()
    return {
        # MedNeXt (MONAI >= 1.4): depthwise convs (kernel 7 by default), depthwise transposed convs up, inverted
        # bottlenecks, residual connections (as its S / B / M / L variants build it), the up blocks' front pad
        "mednext": (lambda: nets.MedNeXt(3, 8, 1, 2, kernel_size=3, use_residual_connection=True,
                                          blocks_down=(1, 1, 1, 1), blocks_bottleneck=1, blocks_up=(1, 1, 1, 1)), 32),
        "segresnet_ds": (lambda: nets.SegResNetDS(3, init_filters=8, in_channels=1, out_channels=2), 32),
        "highresnet": (lambda: nets.HighResNet(3, 1, 2), 24),
    }  # fmt: skip


@pytest.mark.parametrize("name", ["mednext", "vnet"])
def test_monai_networks_under_vmap(name, aten_path):
    """torch.func.vmap over a converted network, one volume a call, answers as over stock, and so does torch.func's
    grad (MONAI's UNets, DynUNet, BasicUNet, UNETR, SegResNetDS and HighResNet did already). Until 2026-12-03
    MedNeXt's up blocks wrote their padded sum with out= and VNet's up levels ran a ctx-style autograd.Function,
    both of which torch.func refuses."""
    if name == "mednext" and not hasattr(monai_nets(), "MedNeXt"):
        pytest.skip("this MONAI has no MedNeXt")
    build, size = (_vnet, 16) if name == "vnet" else _more_monai_nets()["mednext"]
    stock, converted = stock_and_converted(build)
    x = torch.randn(2, 1, size, size, size)
    answers = []
    for model in (stock, converted):
        with torch.no_grad():
            out = torch.func.vmap(lambda volume, model=model: model(volume[None])[0])(x)
        grad = torch.func.grad(lambda volume, model=model: model(volume).square().mean())(x)
        answers.append((out, grad))
    (out, grad), (ours, our_grad) = answers
    assert rel_l2(ours, out) < MATCH and rel_l2(our_grad, grad) < MATCH


# The video VAEs under torch.func.vmap: (builder, run, clip (C, T, H, W)); clips of lengths and sizes each takes
VMAPPED_VAES = {
    **{name: (build, encode_decode, (3, 9, 32, 32)) for name, build in VAES.items()},
    "qwenimage": (qwenimage, encode_decode, (3, 9, 16, 16)),
    "kvae_video": (kvae_video, encode_decode, (3, 9, 16, 16)),
    "kandinsky6_sr": (kandinsky6_sr, encode_decode, (3, 9, 32, 32)),
    "allegro": (allegro, allegro_run, (3, 8, 16, 16)),
    "vidtok": (vidtok, vidtok_run, (3, 9, 16, 16)),
    "minimax_h3": (minimax_h3, encode, (3, 5, 32, 32)),
}


@pytest.mark.parametrize("name", sorted(VMAPPED_VAES))
def test_video_vaes_under_vmap(name, aten_path):
    """torch.func.vmap over a converted video VAE, one clip a call, answers as stock run clip by clip (stock Mochi,
    KVAE and Kandinsky 6 SR raise under vmap themselves). Until 2026-12-03 twelve of them raised: their adapters'
    rearrangements and kept frames wrote into tensors made inside the call, which vmap does not batch, and cloned
    or queried channels_last_3d, which vmap refuses; the cached causal convs ran autograd Functions on tensors that
    vmap does not wrap (a first segment's repeated frames)."""
    build, run, clip = VMAPPED_VAES[name]
    stock, converted = stock_and_converted(build)
    x = torch.randn(2, *clip)
    with torch.no_grad():
        expected = torch.cat([run(stock, sample[None]) for sample in x])
        out = torch.func.vmap(lambda sample: run(converted, sample[None])[0])(x)
    assert rel_l2(out, expected) < MATCH


@pytest.mark.parametrize("name", ["wan", "cogvideox", "ltx2", "hunyuan_video15", "allegro"])
def test_video_vaes_per_sample_gradients(name, aten_path):
    """torch.func.vmap of torch.func.grad over a converted video VAE (per-sample gradients of a loss of one clip)
    answers as stock's gradients clip by clip: the adapters' plain-op branches under both transforms at once."""
    build, run, clip = VMAPPED_VAES[name]
    stock, converted = stock_and_converted(build)
    x = torch.randn(2, *clip[:2], 16, 16)
    expected = torch.cat([torch.func.grad(lambda c: run(stock, c).square().mean())(sample[None]) for sample in x])
    out = torch.func.vmap(torch.func.grad(lambda sample: run(converted, sample[None]).square().mean()))(x)
    assert rel_l2(out, expected) < MATCH


def test_monai_diffusion_unet_per_sample_gradients(aten_path):
    """torch.func.vmap of grad over a converted MONAI DiffusionModelUNet, a timestep a sample, answers as stock's
    gradients sample by sample. Until 2026-12-04 it raised: the group norms that read an up block's skip
    concatenation in place (channels_after) recompute their forward in torch ops when their backward is
    differentiated, and that concatenation was laid out channels_last_3d inside vmap (found by fuzz_models --func)."""
    stock, converted = stock_and_converted(_diffusion_unets()["self_attention"])
    x, timesteps = torch.randn(2, 4, 8, 12, 8), torch.tensor([10, 110])

    def loss(model):
        return lambda sample, t: model(sample[None], t[None]).square().mean()

    expected = torch.stack([torch.func.grad(loss(stock))(sample, t) for sample, t in zip(x, timesteps, strict=True)])
    assert rel_l2(torch.func.vmap(torch.func.grad(loss(converted)))(x, timesteps), expected) < MATCH


@pytest.mark.parametrize("name, per_sample_grad", [("wan", False), ("cogvideox", False), ("cogvideox", True),
                                                   ("unet", True), ("attention_unet", True)])  # fmt: skip
def test_compiled_vmap_over_converted_models(name, per_sample_grad, aten_path):
    """torch.compile(fullgraph=True) of torch.func.vmap over a converted model (and of vmap of grad: per-sample
    gradients) answers as stock run sample by sample. Until 2026-12-04 each raised while dynamo traced it, where
    stock's compiles: dynamo traces the transforms over fake tensors wrapped as eager wraps them, and the adapters
    took their compiled branches, which write into tensors made inside the call (a concatenation, a nearest
    repeat) and lay out or query channels_last_3d, all of which vmap refuses. AttentionUnet's raised at run time
    (a torch fault, docs/upstream.md) until the aten path gave torch's convolutions NCDHW weights there."""
    if name in ("unet", "attention_unet"):
        build, run, clip = _monai_nets()[name], lambda model, x: model(x), (1, 16, 16, 16)
    else:
        build, run, clip = VMAPPED_VAES[name]
        clip = (clip[0], 5, 16, 16)
    stock, converted = stock_and_converted(build)
    x = torch.randn(2, *clip)
    if per_sample_grad:
        expected = torch.cat([torch.func.grad(lambda c: run(stock, c).square().mean())(sample[None]) for sample in x])
        transformed = torch.func.vmap(torch.func.grad(lambda sample: run(converted, sample[None]).square().mean()))
        out = torch.compile(transformed, backend="aot_eager", fullgraph=True)(x)
    else:
        with torch.no_grad():
            expected = torch.cat([run(stock, sample[None]) for sample in x])
            transformed = torch.func.vmap(lambda sample: run(converted, sample[None])[0])
            out = torch.compile(transformed, backend="aot_eager", fullgraph=True)(x)
    assert rel_l2(out, expected) < MATCH


@pytest.mark.parametrize("name", ["mednext", "segresnet_ds", "highresnet"])
def test_more_monai_networks(name, aten_path):
    """Outputs and gradients as stock's, every convolution on tconv3d, no layout copy but the input's (norms'
    included), no pad or concatenation copy into a convolution (no pad at all: MedNeXt's up blocks', HighResNet's
    residual channels'), and no more kept for the backward than stock."""
    if name == "mednext" and not hasattr(monai_nets(), "MedNeXt"):
        pytest.skip("this MONAI has no MedNeXt")
    build, size = _more_monai_nets()[name]
    stock, converted = stock_and_converted(build)
    x = torch.randn(1, 1, size, size, size)
    with torch.no_grad():
        assert rel_l2(converted(x), stock(x)) < MATCH
    report = tconv3d.nn.audit(converted, x, verbose=False)
    assert_all_on_tconv3d(report)
    assert report.aten_conv_transpose3d_calls == 0
    assert report.totals["layout_copies"] <= 1 and report.norm_layout_copies == 0, report.table()
    copies = ("pad_copies_into_convs", "concat_copies_into_convs", "upstream_copies_into_convs")
    assert not any(report.totals[key] for key in copies), report.table()
    # MedNeXt's up blocks' front pads (of the output and the residual) written with their sum; HighResNet's zero
    # channels for its residual: the input added into its channels of the conv path's output
    assert tconv3d.nn.audit(stock, x, verbose=False).pads == {"mednext": 8, "highresnet": 2}.get(name, 0)
    assert report.pads == 0
    for model in (stock, converted):
        model(x).square().mean().backward()
    assert_same_gradients(stock, converted)
    assert_keeps_no_more_than_stock(stock.train(), converted.train(), lambda m, x: m(x), x)


def _flat(out) -> torch.Tensor:
    """A network's output, or the tensors of its tuples and lists (discriminators' features, a VQ-VAE's loss), as
    one."""
    if isinstance(out, torch.Tensor):
        return out.flatten()
    return torch.cat([_flat(part) for part in out])


def _other_monai_nets():
    """MONAI's 3-D classifiers, registration networks, GAN discriminators and generators, and the segmentation
    networks _more_monai_nets leaves: (builder, input shape, (the concatenations MONAI's own forward makes right in
    front of a convolution, those it makes anywhere)). Each takes a list or tuple's tensors as its output (_flat)."""
    nets = monai_nets()

    class Controlled(nn.Module):  # ControlNet's timestep and condition as buffers: the float64 copy casts them
        def __init__(self):
            super().__init__()
            self.net = perturbed(lambda: nets.ControlNet(  # its zero-initialised output convs drawn at random
                3, 1, num_res_blocks=1, channels=(8, 8), attention_levels=(False, False), norm_num_groups=8,
                conditioning_embedding_num_channels=(8,)))()  # fmt: skip
            self.register_buffer("timesteps", torch.tensor([10]))
            self.register_buffer("condition", torch.randn(1, 1, 16, 16, 16))

        def forward(self, x):
            return self.net(x, self.timesteps, self.condition)

    vqvae = dict(channels=(8, 16), num_res_layers=1, num_res_channels=(8, 16), num_embeddings=16, embedding_dim=8,
                 downsample_parameters=((2, 4, 1, 1),) * 2, upsample_parameters=((2, 4, 1, 1, 0),) * 2)  # fmt: skip
    return {
        # 3-D ResNets (MedicalNet's), BatchNorm + ReLU fused, a max pool; SE-ResNeXt: 32 groups, squeeze-excitation
        "resnet18": (lambda: nets.resnet18(spatial_dims=3, n_input_channels=1, num_classes=2),
                     (1, 1, 48, 48, 48), (0, 0)),
        "seresnext50": (lambda: nets.SEResNeXt50(spatial_dims=3, in_channels=1, num_classes=2, layers=(1, 1, 1, 1)),
                        (2, 1, 32, 32, 32), (0, 0)),
        "segresnet_ds2": (lambda: nets.SegResNetDS2(3, init_filters=8, in_channels=1, out_channels=2),
                          (1, 1, 32, 32, 32), (0, 0)),
        # UNet++: its nested skip pathways concatenate 2 to 4 earlier features in its own forward (6 copies), which
        # UpCat's convolution reads as its input with the upsampled features after them in place (10 concatenations
        # and 10 pads of stock's gone); docs/models.md
        "basic_unetplusplus": (lambda: nets.BasicUNetPlusPlus(3, 1, 2, features=(4, 4, 8, 8, 16, 4)),
                               (1, 1, 32, 32, 32), (6, 6)),
        # AHNet: dense blocks (each layer's concatenation in front of its norm, as DenseNet's: 15, with the pyramid's
        # and the final block's), a pyramid pooling module's max pools and transposed convs up (128 in H and W)
        "ahnet": (lambda: nets.AHNet(layers=(1, 1, 1, 1), spatial_dims=3, in_channels=1, out_channels=2),
                  (1, 1, 128, 128, 32), (0, 17)),
        # registration: the fixed and moving images as two channels in
        "regunet": (lambda: nets.RegUNet(3, 2, 4, 3, out_channels=3), (1, 2, 32, 32, 32), (0, 0)),
        "localnet": (lambda: nets.LocalNet(3, 2, 4, extract_levels=(0, 1, 2, 3), out_channels=3),
                     (1, 2, 32, 32, 32), (0, 0)),
        "globalnet": (lambda: nets.GlobalNet([32, 32, 32], 3, 2, 4, 3), (1, 2, 32, 32, 32), (0, 0)),
        "vqvae": (lambda: nets.VQVAE(3, 1, 1, **vqvae), (1, 1, 16, 16, 16), (0, 0)),
        # the discriminators of MONAI's generative training (kernel 4, stride 2, BatchNorm + LeakyReLU fused)
        "patch_discriminator": (lambda: nets.PatchDiscriminator(3, 8, 1, num_layers_d=3), (1, 1, 32, 32, 32), (0, 0)),
        "multiscale_patch_discriminator": (lambda: nets.MultiScalePatchDiscriminator(2, 2, 3, 8, 1, minimum_size_im=32),
                                           (2, 1, 32, 32, 32), (0, 0)),
        "vit_autoenc": (lambda: nets.ViTAutoEnc(1, 32, 16, hidden_size=48, mlp_dim=96, num_layers=1, num_heads=4),
                        (1, 1, 32, 32, 32), (0, 0)),
        "classifier": (lambda: nets.Classifier((1, 16, 16, 16), 3, (4, 8), (2, 2)), (2, 1, 16, 16, 16), (0, 0)),
        "discriminator": (lambda: nets.Discriminator((1, 16, 16, 16), (4, 8), (2, 2)), (2, 1, 16, 16, 16), (0, 0)),
        "controlnet": (Controlled, (1, 1, 16, 16, 16), (0, 0)),
        # DiNTS, Auto3DSeg's searched network, in its search space: each cell's mixed op sums a 3x3x3 and the three
        # P3D convolutions ((3,3,1), (3,1,3), (1,3,3)); trilinear resampling between its depths
        "dints": (lambda: nets.DiNTS(nets.TopologySearch(channel_mul=0.25, num_blocks=2, num_depths=2, spatial_dims=3),
                                     in_channels=1, num_classes=2), (1, 1, 16, 16, 16), (0, 2)),
    }  # fmt: skip


OTHER_MONAI_NETS = ("resnet18", "seresnext50", "segresnet_ds2", "basic_unetplusplus", "ahnet", "regunet", "localnet",
                    "globalnet", "vqvae", "patch_discriminator", "multiscale_patch_discriminator", "vit_autoenc",
                    "classifier", "discriminator", "controlnet", "dints")  # fmt: skip


@pytest.mark.parametrize("name", OTHER_MONAI_NETS)
def test_other_monai_networks(name, aten_path):
    """MONAI's classification, registration and generative networks, UNet++, AHNet and DiNTS: outputs and gradients as
    stock's, every convolution on tconv3d, no layout copy of a channels_last_3d input (AHNet's final block got one
    until its pyramid pooling's adapter, _PSP), no pad or concatenation copy into a
    convolution but those MONAI's own forward makes (UNet++'s), no new graph break, and no more kept for the
    backward than stock (but GlobalNet's: below). Gradients in eval mode, as near float64 as stock's (kinks:
    ILL_CONDITIONED)."""
    build, shape, (own_copies, concatenations) = _other_monai_nets()[name]
    stock, converted = stock_and_converted(build)
    x = torch.randn(shape).contiguous(memory_format=torch.channels_last_3d)
    with torch.no_grad():
        assert rel_l2(_flat(converted(x)), _flat(stock(x))) < MATCH
    report = tconv3d.nn.audit(converted, x, verbose=False)
    assert_all_on_tconv3d(report)
    assert report.totals["layout_copies"] == report.norm_layout_copies == 0, report.table()
    assert report.totals["upstream_copies_into_convs"] == own_copies, report.table()
    assert report.concats == concatenations, report.table()
    assert not report.totals["pad_copies_into_convs"] and not report.totals["concat_copies_into_convs"], report.table()
    if name in ("globalnet", "vqvae"):  # no float64 copy runs: a float32 grid kept as a plain attribute, a codebook
        for model in (stock, converted):
            _flat(model(x)).square().mean().backward()
        assert_same_gradients(stock, converted)
    else:
        assert_gradients_as_near_float64(stock, converted, lambda model, x: _flat(model(x)), x)
    with torch.no_grad():
        explained_without_new_graph_breaks(lambda model, x: model(x), stock, converted, x)
    if name != "globalnet":  # its affine head flattens the deepest features by reshape: of channels_last_3d, a copy
        assert_keeps_no_more_than_stock(stock.train(), converted.train(), lambda m, x: _flat(m(x)), x)


# torchvision's video classifiers: builder name -> input shape. S3D and MViT need 16 frames at 224^2 to reach their
# last pooling.
TORCHVISION_VIDEO = {
    "r3d_18": (2, 3, 8, 32, 32),
    "mc3_18": (2, 3, 8, 32, 32),
    "r2plus1d_18": (2, 3, 8, 32, 32),
    "s3d": (1, 3, 16, 224, 224),
    "swin3d_t": (1, 3, 8, 64, 64),
    "mvit_v1_b": (1, 3, 16, 224, 224),
    "mvit_v2_s": (1, 3, 16, 224, 224),
}


class _TokensPool(nn.Module):
    """A double of torchvision's MViT attention pool (torchvision is not on CI's machines), written from its
    behaviour: forward(tokens (B, heads, 1 + T*H*W, C) or (B, 1 + T*H*W, C), thw) pools the tokens less the first,
    NCDHW-contiguous, by `pool` and returns them after the first, normed, with the pooled (T, H, W). convert knows
    it by torchvision's module and class name."""

    def __init__(self, pool, norm, norm_before_pool=False):
        super().__init__()
        self.pool, self.norm_act, self.norm_before_pool = pool, norm, norm_before_pool

    def forward(self, x, thw):
        tokens = x.unsqueeze(1) if x.dim() == 3 else x
        batch, heads, _, channels = tokens.shape
        grid = tokens[:, :, 1:].transpose(2, 3).reshape(batch * heads, channels, *thw).contiguous()
        if self.norm_before_pool:
            grid = self.norm_act(grid)
        grid = self.pool(grid)
        out = torch.cat((tokens[:, :, :1], grid.reshape(batch, heads, channels, -1).transpose(2, 3)), dim=2)
        if not self.norm_before_pool:
            out = self.norm_act(out)
        return (out.squeeze(1) if x.dim() == 3 else out), tuple(grid.shape[2:])


_TokensPool.__module__, _TokensPool.__qualname__ = "torchvision.models.video.mvit", "Pool"


class _TokensAttentionPools(nn.Module):
    """MViT's q, k and v of one projection, (B, heads, tokens, head_dim) views split from (B, tokens, 3, heads,
    head_dim), each pooled by a depthwise Conv3d (q strided in H and W, as MViT's stage transitions)."""

    def __init__(self, head_dim=8, heads=2):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = nn.Linear(heads * head_dim, 3 * heads * head_dim)
        pools = [nn.Conv3d(head_dim, head_dim, 3, (1, stride, stride), 1, groups=head_dim, bias=False)
                 for stride in (2, 1, 1)]  # fmt: skip
        self.pools = nn.ModuleList(_TokensPool(pool, nn.LayerNorm(head_dim)) for pool in pools)

    def forward(self, x, thw):
        batch, length, _ = x.shape
        qkv = self.qkv(x).reshape(batch, length, 3, self.heads, self.head_dim).transpose(1, 3).unbind(dim=2)
        return torch.cat([pool(t, thw)[0].flatten(1) for pool, t in zip(self.pools, qkv, strict=True)], dim=1)


@pytest.mark.parametrize("batch", [1, 2])
def test_mvit_attention_pools_read_their_tokens_in_place(batch):
    """MViT's attention pools wrote their tokens NCDHW for the pooling conv, which the converted conv copied
    channels_last_3d again (36 of mvit_v1_b's 36 convolutions, 48 of mvit_v2_s's 49, took a layout copy). The
    tokens less the class token are that input in channels_last_3d's order: the conv reads their view (a batch of
    one: no copy at all; of two, one NDHWC-ordered copy, the heads lying between batch entries). On tconv3d's
    depthwise kernels, outputs and gradients as stock's to float64's rounding; norm_before_pool as torchvision's."""
    torch.manual_seed(0)
    stock = _TokensAttentionPools()
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    assert all(type(pool).tconv3d_adapter.__name__ == "_MViTPool" for pool in converted.pools)
    thw = (2, 4, 6)
    x = torch.randn(batch, 1 + math.prod(thw), 16, requires_grad=True)
    grids, projections = [], []
    converted.pools[1].pool.register_forward_pre_hook(lambda module, args: grids.append(args[0]))
    converted.qkv.register_forward_hook(lambda module, args, out: projections.append(out))
    report = tconv3d.nn.audit(converted, x, thw, verbose=False)
    assert report.tconv3d_calls == 3 and sum(layer.layout_copies for layer in report.layers) == 0, report.table()
    exact = copy.deepcopy(stock).double()
    outputs = [model(x.double() if model is exact else x, thw) for model in (stock, converted, exact)]
    assert rel_l2(outputs[1], outputs[2]) < 1e-5
    grads = [torch.autograd.grad(out.square().sum(), [x, *model.parameters()])
             for out, model in zip(outputs, (stock, converted, exact), strict=True)]  # fmt: skip
    assert rel_l2(torch.cat([g.flatten() for g in grads[1]]), torch.cat([g.flatten() for g in grads[2]])) < 1e-5
    in_place = grids[-1].untyped_storage().data_ptr() == projections[-1].untyped_storage().data_ptr()
    assert grids[-1].stride(1) == 1 and in_place == (batch == 1)
    before = _TokensPool(nn.Conv3d(8, 8, 3, 1, 1, groups=8), nn.BatchNorm3d(8).eval(), norm_before_pool=True)
    tokens = torch.randn(batch, 2, 1 + math.prod(thw), 8)
    with torch.no_grad():
        assert rel_l2(tconv3d.nn.convert(copy.deepcopy(before))(tokens, thw)[0], before(tokens, thw)[0]) < 1e-5


@pytest.mark.parametrize("name", TORCHVISION_VIDEO)
def test_torchvision_video_models(name, aten_path):
    """torchvision's video classifiers converted (torchvision is not on CI's machines, where PyPI's wheel does not
    load beside torch's CPU build: run in a venv of torch 2.14.1 and torchvision 0.29.1). Every convolution on
    tconv3d: the video ResNets' Conv3DSimple and Conv3DNoTemporal, nn.Conv3d subclasses of a constructor alone, were
    left on aten (16 of r3d_18's 20 convolutions) until convert took such subclasses over. No layout copy (MViT's
    attention pools read their tokens in place: torchvision_nets._MViTPool), no pad or concatenation copy made
    inside a layer; outputs as stock's, gradients in training (batch statistics) as near float64 as stock's;
    torchvision's create_feature_extractor (torch.fx) of the converted model gives stock's features (for MViT those
    differ from its forward's, stock's alike: the trace keeps some of its sizes as constants)."""
    video = pytest.importorskip("torchvision.models.video")
    from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

    stock, converted = stock_and_converted(lambda: getattr(video, name)(num_classes=10))
    x = torch.randn(TORCHVISION_VIDEO[name]).contiguous(memory_format=torch.channels_last_3d)
    with torch.no_grad():
        assert rel_l2(converted(x), stock(x)) < MATCH
    report = tconv3d.nn.audit(copy.deepcopy(converted), x, verbose=False)
    assert_all_on_tconv3d(report)
    assert report.totals["layout_copies"] == report.norm_layout_copies == 0, report.table()
    # the stock graph's nodes of its stages (its nested layers are named otherwise: a converted conv is one node)
    stages = [node for node in get_graph_node_names(stock)[1] if "." not in node][-3:]
    with torch.no_grad():
        features = [create_feature_extractor(model, return_nodes=stages)(x) for model in (stock, converted.eval())]
    assert all(rel_l2(features[1][node], features[0][node]) < MATCH for node in stages), stages
    assert_gradients_as_near_float64(stock.train(), converted.train(), lambda model, x: model(x), x)


def test_ahnet_in_two_dimensions_runs_as_stock(aten_path):
    """A 2-D AHNet (no Conv3d: nothing of it converted) keeps stock's forward, its pyramid pooling's adapter
    (monai_nets._PSP, for the 3-D network's layout) included: it raised on the 4-D activation until 2026-12-06."""
    stock, converted = stock_and_converted(
        lambda: monai_nets().AHNet(layers=(1, 1, 1, 1), spatial_dims=2, in_channels=1, out_channels=2)
    )
    x = torch.randn(1, 1, 128, 128)
    with torch.no_grad():
        assert torch.equal(converted(x), stock(x))


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_mednext_compiles_whole(grad, aten_path):
    """MedNeXt's up blocks write their padded sum in place: under torch.no_grad() that was torch.add(out=) a slice of
    the padded output, where dynamo breaks its graph (one break an up block, until 2026-12-03: the model fuzzer's
    compiled draws); traced, it is an in-place copy and add. Compiled (aot_eager) as eager."""
    if not hasattr(monai_nets(), "MedNeXt"):
        pytest.skip("this MONAI has no MedNeXt")
    stock, converted = stock_and_converted(_more_monai_nets()["mednext"][0])
    x = torch.randn(1, 1, 16, 16, 32)
    with torch.set_grad_enabled(grad):
        explained_without_new_graph_breaks(lambda model, x: model(x), stock, converted, x)
        torch._dynamo.reset()
        expected = converted(x)
        assert rel_l2(torch.compile(converted, backend="aot_eager")(x), expected) < MATCH


@pytest.mark.parametrize("name", ["var_autoencoder", "segresnet_vae"])
def test_monai_networks_that_flatten_by_view(name, aten_path):
    """VarAutoEncoder's encoder and SegResNetVAE's VAE loss (in training) flatten an activation with
    `.view(batch, -1)`, which a channels_last_3d tensor refuses: converted, that activation reaches them NCDHW (a
    hook on the module that makes it), so both run, with stock's outputs, loss and gradients."""
    from monai.networks import nets

    build = {
        "var_autoencoder": lambda: nets.VarAutoEncoder(
            spatial_dims=3, in_shape=(1, 16, 16, 16), out_channels=1, latent_size=4, channels=(4, 8), strides=(2, 2)
        ),
        "segresnet_vae": lambda: nets.SegResNetVAE(  # SiLU: its default ReLU flips on fp32 rounding in this loss
            input_image_size=(16, 16, 16), spatial_dims=3, init_filters=8, in_channels=1, out_channels=2, act="swish"
        ),
    }[name]
    stock, converted = stock_and_converted(build)
    assert is_converted(converted)
    x = torch.randn(2, 1, 16, 16, 16)
    outputs = []
    for model in (stock, converted):
        torch.manual_seed(1)  # both sample their latent with torch.randn_like
        outputs.append(model.train()(x))
    for ours, theirs in zip(outputs[1], outputs[0], strict=True):
        assert rel_l2(ours, theirs) < MATCH
    for out in outputs:
        (out[0].square().mean() + out[1].mean()).backward()
    assert_same_gradients(stock, converted)


def test_monai_checkpoint_unet_still_recomputes(aten_path):
    """Converted, CheckpointUNet keeps MONAI's activation checkpointing: each level's up path (its transposed conv
    reading the skip connection in place) runs again in the backward, as stock's does."""
    stock, converted = stock_and_converted(_monai_nets()["checkpoint_unet"])
    x = torch.randn(1, 1, 16, 16, 16)
    for model in (stock, converted):
        ups = [m for m in model.modules() if isinstance(m, torch.nn.ConvTranspose3d)]
        calls = []
        for up in ups:
            up.register_forward_hook(lambda module, args, out, calls=calls: calls.append(module))
        model(x).square().mean().backward()
        assert len(ups) == 2 and len(calls) == 2 * len(ups), (type(ups[0]), len(calls))
    assert_same_gradients(stock, converted)


@pytest.mark.parametrize("name", ["unet", "checkpoint_unet", "attention_unet", "dynunet", "basic_unet"])
def test_monai_adapters_keep_hooks_on_the_blocks_they_take_apart(name, aten_path):
    """A forward hook on every module but the convolutions (MONAI's SkipConnection, the up blocks' conv blocks, its
    Convolution Sequentials, whose calls the adapters would skip to hand a convolution its second source): in the
    converted net each fires in stock's order with stock's output (that level then concatenates, as stock does);
    with the hooks removed the skip connections are read in place again."""
    stock, converted = stock_and_converted(_monai_nets()[name])
    x = torch.randn(1, 1, *(MONAI_NETS[name],) * 3)
    seen, handles = {}, []
    for label, model in (("stock", stock), ("converted", converted)):
        calls = seen[label] = []
        for module_name, module in model.named_modules():
            if module_name and not isinstance(module, (nn.Conv3d, nn.ConvTranspose3d)):
                hook = lambda m, args, out, n=module_name, calls=calls: calls.append((n, out))  # noqa: E731
                handles.append(module.register_forward_hook(hook))
        with torch.no_grad():
            model(x)
    assert [n for n, _ in seen["converted"]] == [n for n, _ in seen["stock"]]
    fused = _fused_spans(converted)  # these output what stock's activation after them outputs
    stock_outputs = dict(seen["stock"])
    for (n, got), (_, want) in zip(seen["converted"], seen["stock"], strict=True):
        want = stock_outputs[fused[n]] if n in fused else want
        if isinstance(want, torch.Tensor):
            assert got.shape == want.shape and rel_l2(got, want) < MATCH, n
    for handle in handles:
        handle.remove()
    report = tconv3d.nn.audit(converted, x, verbose=False)
    assert report.totals["concat_copies_into_convs"] == report.totals["upstream_copies_into_convs"] == 0


def _fused_spans(model: nn.Module) -> dict:
    """{name: the name of its activation's slot} of each norm convert fused an activation into and of the modules
    between it and that slot (MONAI's dropouts, which the fused activation moved in front of): each outputs what
    stock's activation did. The slot: an nn.Identity, a fused PReLU's FusedPReLU (unless hooked: then the PReLU
    applies itself in its call, and the norm outputs what stock's norm does)."""
    from tconv3d.nn.modules import FusedPReLU

    spans = {}
    for parent_name, parent in model.named_modules():
        if not isinstance(parent, nn.Sequential):
            continue
        names = [f"{parent_name}.{name}" if parent_name else name for name, _ in parent.named_children()]
        children = list(parent.children())
        for i, module in enumerate(children):
            if getattr(module, "activation", None):
                slot = next(j for j in range(i + 1, len(children)) if type(children[j]) in (nn.Identity, FusedPReLU))
                if not (type(children[slot]) is FusedPReLU and hooked(children[slot])):
                    spans.update(dict.fromkeys(names[i:slot], names[slot]))
    return spans


@pytest.mark.parametrize("res_block", [False, True], ids=["basic", "residual"])
def test_dynunet_blocks_fuse_their_leaky_relu_into_the_norms(res_block, aten_path, monkeypatch):
    """MONAI's DynUNet blocks call their norms and LeakyReLU in code: converted, each norm the LeakyReLU follows
    directly runs it in its pass (a basic block's two, a residual block's first: its second comes after the sum
    with the residual), the decoder's blocks too (basic ones either way, their first conv reading the skip
    connection in place). Training, output and gradients are stock's; with a hook on a block's LeakyReLU, that
    block calls it again."""
    from monai.networks import nets

    torch.manual_seed(0)
    stock = nets.DynUNet(3, 1, 2, kernel_size=[3, 3, 3], strides=[1, 2, 2], upsample_kernel_size=[2, 2],
                         res_block=res_block).train()  # fmt: skip
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    fused = []
    normalized = tconv3d.nn.InstanceNorm3d.normalized
    monkeypatch.setattr(tconv3d.nn.InstanceNorm3d, "normalized",
                        lambda self, x, act: fused.append(act.name) or normalized(self, x, act))  # fmt: skip
    blocks = [m for m in converted.modules() if type(m).__name__ in ("UnetBasicBlock", "UnetResBlock")]
    each = [1 if type(block).__name__ == "UnetResBlock" else 2 for block in blocks]
    x = torch.randn(2, 1, 16, 16, 16)
    grad = torch.randn(2, 2, 16, 16, 16)
    y = converted(x)
    assert fused.count("leaky_relu") == sum(each) and len(blocks) == 5 and each.count(1) == (3 if res_block else 0)
    assert rel_l2(y, stock(x)) < MATCH and y.is_contiguous(memory_format=torch.channels_last_3d)
    y.backward(grad), stock(x).backward(grad)
    assert_same_gradients(stock, converted)
    fused.clear()
    handle = blocks[0].lrelu.register_forward_hook(lambda *_: None)
    converted(x)
    assert fused.count("leaky_relu") == sum(each[1:])
    handle.remove()


@pytest.mark.parametrize("name", ["SegResNet", "SegResNetDS"])
def test_segresnet_blocks_fuse_their_relu_into_the_norms(name, aten_path, monkeypatch):
    """MONAI's SegResNet (GroupNorm) and SegResNetDS (BatchNorm3d) residual blocks call norm, ReLU and conv twice in
    code: converted, both ReLUs of each block run in their norms' passes. Training, output and gradients are
    stock's."""
    from monai.networks import nets

    from tconv3d.nn import modules

    torch.manual_seed(0)
    stock = getattr(nets, name)(spatial_dims=3, in_channels=1, out_channels=2, init_filters=8).train()
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    fused = []
    for cls in (modules.GroupNorm, modules.BatchNorm3d):
        monkeypatch.setattr(cls, "normalized", lambda self, x, act, *rest, real=cls.normalized: fused.append(act.name)
                            or real(self, x, act, *rest))  # fmt: skip
    blocks = [m for m in converted.modules() if type(m).__name__ in ("ResBlock", "SegResBlock")]
    x = torch.randn(2, 1, 16, 16, 16)
    y = converted(x)
    # (SegResNet's head, conv_final, starts with its norm and ReLU in an nn.Sequential, which convert fuses too)
    assert fused.count("relu") == 2 * len(blocks) + (name == "SegResNet") and blocks
    assert rel_l2(y, stock(x)) < MATCH and y.is_contiguous(memory_format=torch.channels_last_3d)
    grad = torch.randn_like(y)
    y.backward(grad), stock(x).backward(grad)
    assert_same_gradients(stock, converted)


def test_monai_up_block_concatenates_for_a_conv_left_alone(aten_path):
    """A decoder block whose first conv convert left alone (here by its filter) gets the concatenation, as MONAI
    makes it, and still matches stock."""
    build = _monai_nets()["dynunet"]
    stock = build().eval()
    converted = copy.deepcopy(stock)
    tconv3d.nn.convert(converted, filter=lambda name, module: not name.endswith("conv_block.conv1.conv"))
    assert not is_converted(converted.upsamples[0].conv_block.conv1.conv)
    assert is_converted(converted.upsamples[0])
    x = torch.randn(1, 1, 16, 16, 16)
    with torch.no_grad():
        assert rel_l2(converted(x), stock(x)) < MATCH


def _densenet121():
    from monai.networks import nets

    return nets.DenseNet121(spatial_dims=3, in_channels=1, out_channels=2)


def test_vae_decode_measures_maisis_autoencoder(aten_path):
    """bench.vae_decode's MAISI rows (`--model maisi`): stock (its slabs) and converted decode the same latent to a
    volume of the same shape, each with its time, peak and breakdown; in float16 the norms answer float16
    (norm_float16, as MAISI's bundle runs), so stock runs a half model without autocast."""
    pytest.importorskip("monai")
    from bench.vae_decode import measure
    from bench.vaes import build_vae

    rows = [measure("maisi", variant, "cpu", torch.float32, 1, (1, 4, 8, 8, 8)) for variant in ("stock", "converted")]
    assert [row["output"] for row in rows] == [[1, 1, 32, 32, 32]] * 2
    assert all(row["ms"] > 0 and row["breakdown_ms"]["conv"] > 0 for row in rows)
    norms = [m for m in build_vae("maisi", 1, dtype=torch.float16).modules() if type(m).__name__ == "MaisiGroupNorm3D"]
    assert norms and all(norm.norm_float16 for norm in norms)


def last_linear(model) -> torch.nn.Linear:
    return [module for module in model.modules() if isinstance(module, torch.nn.Linear)][-1]


def classifier_features(model, x):
    """What a classifier's last nn.Linear reads (its pooled features) in a forward of `x`. Its output is a few
    logits a sample (2 for MONAI's DenseNet121 and EfficientNet here), each a bf16 rounding of its own: one logit
    landing an ulp the other way moved DenseNet121's error 0.6x-2x input by input on CPU, where every one of its
    convolutions matched stock's bf16 error (tests/interpreter_fidelity.py's rounding; bench/NOTES.md, forty-eighth
    session), so a ratio of two such sums measures the last roundings; its 1024 features moved 0.95-1.03x."""
    seen = []
    handle = last_linear(model).register_forward_hook(lambda module, args, output: seen.append(args[0]))
    try:
        model(x)
    finally:
        handle.remove()
    return seen[-1]


CUDA_MODELS = {
    **{f"vae_{name}": (build, (1, 3, 5, 32, 32), encode_decode) for name, build in VAES.items()},
    "vae_kandinsky6_sr": (kandinsky6_sr, (1, 3, 21, 32, 32), encode_decode),  # two segments
    "vae_vidtok": (vidtok, (1, 3, 17, 32, 32), vidtok_run),
    "vae_allegro": (allegro, (1, 3, 8, 32, 32), allegro_run),
    **{f"monai_{name}": (name, (1, 1, *(max(32, size),) * 3), None) for name, size in MONAI_NETS.items()},
    "monai_densenet121": (_densenet121, (1, 1, 32, 32, 32), classifier_features),
    "monai_efficientnet_b0": (_efficientnets()["efficientnet_b0"], (2, 1, 32, 32, 32), classifier_features),
    "monai_flexible_unet": (_efficientnets()["flexible_unet"], (2, 1, 32, 32, 32), None),
    "monai_autoencoderkl": (_generative_autoencoders()["autoencoderkl"], (1, 1, 32, 32, 32), autoencode),
    "monai_maisi": (_generative_autoencoders()["maisi"], (1, 1, 32, 32, 32), autoencode_in_autocast),
    **{f"monai_diffusion_{name}": (build, (2, 4, 16, 16, 16), denoise) for name, build in _diffusion_unets().items()},
    "monai_vnet": (_vnet, (1, 1, 32, 32, 32), None),
    "monai_spade_autoencoder": (_spade_networks()["autoencoder"], (1, 1, 32, 32, 32), spade_autoencode),
    "monai_spade_diffusion_unet": (_spade_networks()["diffusion_unet"], (2, 4, 16, 16, 16), spade_denoise),
}


def test_classifier_features_are_what_the_logits_are_computed_from(aten_path):
    """The CUDA test's measure for MONAI's classifiers: DenseNet121's 1024 and EfficientNet-B0's 1280 pooled
    features a sample, from which its last Linear gives the model's output."""
    pytest.importorskip("monai")
    for build, width in ((_densenet121, 1024), (_efficientnets()["efficientnet_b0"], 1280)):
        torch.manual_seed(0)
        model, x = build().eval(), torch.randn(2, 1, 32, 32, 32)
        with torch.no_grad():
            features = classifier_features(model, x)
            assert features.shape == (2, width) and torch.equal(last_linear(model)(features), model(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", CUDA_MODELS)
def test_real_models_on_cuda_match_stock(name):
    """The compiled kernels in the real models, on the GPU: each converted model's forward (a VAE's encode and
    decode) against stock on cuDNN, in fp32 with TF32 off (both exact up to summation order); in bf16, no further
    from a float32 reference than stock bf16 is, within a margin, summed over 8 inputs: one input's bf16 error is
    rounding amplified through the small random networks, and the two sides' ratio for one input ranged 0.6-2.6
    (HunyuanVideo's VAE on CPU, each of its layers as near float32 as stock's), 1.28 over 8."""
    build, shape, run = CUDA_MODELS[name]
    build = _monai_nets()[build] if isinstance(build, str) else build
    stock, converted = (m.cuda().eval() for m in stock_and_converted(build))
    run = run or (lambda model, x: model(x))
    inputs = [torch.randn(shape, device="cuda") for _ in range(8)]
    with torch.no_grad():
        references = [run(stock, x) for x in inputs]
        assert rel_l2(run(converted, inputs[0]), references[0]) < MATCH
        stock, converted = stock.bfloat16(), converted.bfloat16()
        stock_error = sum(rel_l2(run(stock, x.bfloat16()), ref) for x, ref in zip(inputs, references, strict=True))
        ours_error = sum(rel_l2(run(converted, x.bfloat16()), ref) for x, ref in zip(inputs, references, strict=True))
    assert ours_error < 1.5 * stock_error + 2e-3, (ours_error, stock_error)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("how", ["accelerate", "group_layers", "group_blocks"])
def test_offloaded_vaes_on_cuda_match_stock(how, monkeypatch):
    """Offloading with real transfers: Wan's VAE (its hooked attention, resamplers and blocks) with every weight on
    the CPU (or meta) outside its call and moved onto the GPU inside it, by accelerate or by diffusers' group
    offloading on a side stream, answers as stock offloaded the same way (fp32, TF32 off), and no weight arrives in
    another layout (a moved or pinned copy keeps the channels_last_3d strides: no per-call relayout on the GPU)."""
    pytest.importorskip("accelerate")
    from tconv3d.nn import modules

    relaid = []
    keep = modules.keep_memory_format

    def counted(weight, memory_format=modules._CL):
        relaid.append(weight.device.type == "cuda" and weight.stride() != format_strides(weight.shape, memory_format))
        keep(weight, memory_format)

    stock, converted = stock_and_converted(VAES["wan"])
    cuda = torch.device("cuda")
    for model in (stock, converted):
        _offloaded(model, how, cuda)
    monkeypatch.setattr(modules, "keep_memory_format", counted)  # (TF32 is off: conftest's autouse fixture)
    x = torch.randn(1, 3, 5, 32, 32, device=cuda)
    with torch.no_grad():
        for _ in range(2):  # the second call after the first's offload
            assert rel_l2(encode_decode(converted, x), encode_decode(stock, x)) < MATCH
    assert not any(relaid), f"{sum(relaid)} weights relaid on the GPU"


@pytest.mark.parametrize("name", ["wan", "ltx2"])
def test_decode_breakdown_times_convs_norms_and_activations(name, aten_path):
    """bench.vae_decode's breakdown of one decode: convolutions and norms in both; the SiLU modules' own time in
    stock only (convert fuses each into the norm before it, and leaves nn.Identity); the pieces cover the run."""
    from bench.vae_decode import breakdown

    stock, converted = stock_and_converted(VAES[name])
    z = torch.randn(1, LATENT_CHANNELS[name], 2, 4, 4)
    with torch.no_grad():
        parts = {}
        for label, model in (("stock", stock), ("converted", converted)):
            decode = {}

            def run(model=model, decode=decode):
                start = time.perf_counter()
                model.decode(z)
                decode["ms"] = (time.perf_counter() - start) * 1e3

            start = time.perf_counter()
            parts[label] = breakdown(model, run, "cpu")
            wall = (time.perf_counter() - start) * 1e3
            assert parts[label]["conv"] > 0 and parts[label]["norm"] > 0, parts
            # The pieces cover the decode (timed inside the run, so within the first and last marks) and no more
            # than the call; each piece is rounded to 1 us.
            rounding = 1e-3 * len(parts[label])
            assert decode["ms"] - rounding <= sum(parts[label].values()) <= wall + rounding, (parts, decode, wall)
    assert parts["stock"]["activation"] > 0 and parts["converted"]["activation"] == 0, parts


def _ncdhw_resampling_calls(model, run, x) -> int:
    """How many times a forward and backward of run(model, x) dispatch torch's 3-D nearest interpolation or an
    average pool (forward or backward): on CUDA the 3-D ones copy a channels_last_3d activation NCDHW (and the
    interpolation its result back) and answer an NCDHW gradient; CogVideoX's 1-D frame pool ran on a
    (B*H*W, C, T) copy of it."""
    from helpers import OpNames

    with OpNames() as ops:
        torch.manual_seed(5)
        run(model.train(), x).square().mean().backward()
    return sum(name.startswith(("aten.upsample_nearest3d", "aten.upsample_trilinear3d", "aten.avg_pool"))
               for name in ops.names)  # fmt: skip


RESAMPLING_MODELS = ["autoencoderkl", "diffusion_unet", "spade_autoencoder", "kvae_video", "kandinsky6_sr", "cosmos",
                     "densenet121", "cogvideox", "easyanimate", "maisi", "segresnet"]  # fmt: skip


@pytest.mark.parametrize("name", RESAMPLING_MODELS)
def test_converted_models_resample_without_torch_ncdhw_kernels(name, aten_path):
    """Nearest and trilinear upsampling, resizing and tiling average pools in the converted models, forward and
    backward, in the activation's layout (tconv3d.nn.Upsample and AvgPool3d for MONAI's nn.Upsample and
    nn.AvgPool3d: SegResNet's trilinear decoder too; the video VAEs' pixel repeats, their spatial norms' resized
    latent, Cosmos's, CogVideoX's and EasyAnimate's resamplers; SPADE's resized segmentation map; MAISI's
    trilinear upsamplers): none of torch's 3-D nearest, trilinear or average-pool kernels, which stock runs.
    Outputs as stock's."""
    build, run, x = {
        "autoencoderkl": (_generative_autoencoders()["autoencoderkl"], autoencode, torch.randn(1, 1, 16, 16, 16)),
        "diffusion_unet": (_diffusion_unets()["self_attention"], denoise, torch.randn(1, 4, 16, 16, 16)),
        "spade_autoencoder": (_spade_networks()["autoencoder"], spade_autoencode, torch.randn(1, 1, 16, 16, 16)),
        "kvae_video": (kvae_video, encode_decode, torch.randn(1, 3, 9, 16, 16)),
        "kandinsky6_sr": (kandinsky6_sr, encode_decode, torch.randn(1, 3, 9, 16, 16)),
        "cosmos": (VAES["cosmos"], encode_decode, torch.randn(1, 3, 9, 32, 32)),
        "densenet121": (_densenet121, lambda model, x: model(x), torch.randn(2, 1, 32, 32, 32)),
        "cogvideox": (VAES["cogvideox"], encode_decode, torch.randn(1, 3, 9, 32, 32)),
        "easyanimate": (VAES["easyanimate"], encode_decode, torch.randn(1, 3, 9, 32, 32)),
        "maisi": (_generative_autoencoders()["maisi"], autoencode, torch.randn(1, 1, 32, 32, 32)),
        "segresnet": (
            lambda: monai_nets().SegResNet(spatial_dims=3, init_filters=8, in_channels=1, out_channels=2),
            lambda model, x: model(x),
            torch.randn(1, 1, 16, 16, 16),
        ),
    }[name]
    stock, converted = stock_and_converted(build)
    x = x.contiguous(memory_format=torch.channels_last_3d)
    assert rel_l2(*seeded_runs((converted, stock), lambda model: run(model, x))) < MATCH
    assert _ncdhw_resampling_calls(stock, run, x) > 0
    assert _ncdhw_resampling_calls(converted, run, x) == 0


@pytest.mark.parametrize("name", ["cogvideox", "hunyuan_video15", "ltx_video", "cosmos", "hunyuan_video"])
def test_gradient_checkpointing_matches_stock(name, aten_path):
    """diffusers' `enable_gradient_checkpointing()` recomputes each block's forward in the backward: the adapters'
    Functions (the resamplers' rearrangements, the repeats, the frame slices) and their conv caches recompute to
    the same values, and the gradients agree with stock's, checkpointed too. (EasyAnimate's causal convs keep
    their frames across calls, so its recomputation sees other frames than its forward: stock and converted raise
    torch's CheckpointError alike.)"""
    stock, converted = stock_and_converted(VAES[name])
    x = torch.randn(1, 3, 9, 32, 32)
    outputs = []
    for model, input in ((stock, x), (converted, x.contiguous(memory_format=torch.channels_last_3d))):
        model.enable_gradient_checkpointing()
        torch.manual_seed(5)
        out = encode_decode(model.train(), input)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)))
        outputs.append(out.detach())
    assert rel_l2(outputs[1], outputs[0]) < MATCH
    assert_same_gradients(stock, converted)


def _gradient_layout_copies(model, run, x) -> int:
    """How many 5-D gradients a training step's backward lays out channels_last_3d from another layout (a clone
    into channels_last_3d outside tconv3d's ops): each is a copy of a gradient that arrived NCDHW."""
    from torch.utils._python_dispatch import TorchDispatchMode

    cl = torch.channels_last_3d

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.clone.default and out.dim() == 5 and out.is_contiguous(memory_format=cl):
                Copies.count += not args[0].is_contiguous(memory_format=cl)
            return out

    torch.manual_seed(5)
    out = run(model.train(), x)
    loss = torch.nn.functional.mse_loss(out, torch.randn(out.shape))  # an NCDHW target, as users hold it
    with Copies():
        loss.backward()
    return Copies.count


@pytest.mark.parametrize(
    "name",
    ["hunyuan_video", "kvae_video", "kandinsky6_sr", "autoencoderkl", "diffusion_unet", "hunyuan_video15",
     "hunyuan_image_refiner", "ltx_video", "ltx2", "cogvideox", "wan", "wan22"],
)  # fmt: skip
def test_training_gradients_stay_channels_last(name, aten_path):
    """A converted model's backward hands its convolutions channels_last_3d gradients, where autograd's backwards
    of the layers between them answered NCDHW:
    - the nearest repeats' (their expand's backward, a reduction; residual sums carried the layout up the network:
      13 of HunyuanVideo's 43 input-gradient ops, 15 of KVAE's 93 got one);
    - HunyuanVideo 1.5's and HunyuanImage 2.1's resamplers' (the slice and reshape backwards of their frame parts:
      23 and 22 copies);
    - LTX-Video's depth-to-space and space-to-depth (reshape and view backwards: 5 copies, LTX-2's 7);
    - the adapters' frame slices of activations (`frames`: a causal conv's kept frames, a first frame resampled
      apart; CogVideoX's 4 copies, 3 of them at full resolution);
    - Wan's resamplers' temporal interleave (a reshape backward) and Wan 2.2's DupUp3D shortcuts (an expand
      backward: Wan 4 copies, Wan 2.2 10).
    A conv lays out a gradient of another layout once, for both of its gradient ops. What is left: the loss's
    gradient at the output (an NCDHW target) and, in a VAE, the latent moments' (the posterior's mean is a channel
    slice of them, whose backward answers NCDHW): at most two copies, the second at the latent's size.
    HunyuanVideo 1.5's encoder adds a channel-group mean of its last features to the moments (a view and a mean,
    stock code), whose backward answers NCDHW too: two more at the latent's resolution, where the features are a
    few percent of one full-resolution activation. Wan 2.2's decoder output is unpatchified (diffusers' module
    function, a permute + contiguous) after the chunks are concatenated: its backward hands each chunk's conv_out
    an NCDHW slice of the output's gradient, 12 channels at half the output's height and width (three in this
    clip)."""
    build, run, x = {
        "ltx_video": (VAES["ltx_video"], encode_decode, torch.randn(1, 3, 9, 32, 32)),
        "ltx2": (VAES["ltx2"], encode_decode, torch.randn(1, 3, 9, 32, 32)),
        "cogvideox": (VAES["cogvideox"], encode_decode, torch.randn(1, 3, 9, 32, 32)),
        "hunyuan_video15": (VAES["hunyuan_video15"], encode_decode, torch.randn(1, 3, 9, 32, 32)),
        "hunyuan_image_refiner": (VAES["hunyuan_image_refiner"], encode_decode, torch.randn(1, 3, 9, 32, 32)),
        "hunyuan_video": (VAES["hunyuan_video"], encode_decode, torch.randn(1, 3, 9, 32, 32)),
        "kvae_video": (kvae_video, encode_decode, torch.randn(1, 3, 9, 32, 32)),
        "kandinsky6_sr": (kandinsky6_sr, encode_decode, torch.randn(1, 3, 9, 32, 32)),
        "autoencoderkl": (_generative_autoencoders()["autoencoderkl"], autoencode, torch.randn(1, 1, 16, 16, 16)),
        "diffusion_unet": (_diffusion_unets()["self_attention"], denoise, torch.randn(1, 4, 16, 16, 16)),
        "wan": (VAES["wan"], encode_decode, torch.randn(1, 3, 9, 32, 32)),
        "wan22": (VAES["wan22"], encode_decode, torch.randn(1, 3, 9, 32, 32)),
    }[name]
    _, converted = stock_and_converted(build)
    assert _gradient_layout_copies(converted, run, x) <= {"hunyuan_video15": 4, "wan22": 2 + 3}.get(name, 2)
