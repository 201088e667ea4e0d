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
import os
import subprocess
import sys
import time

import pytest
import torch
from real_models import (
    MATCH,
    assert_all_on_tconv3d,
    assert_same_gradients,
    perturbed,
    saved_for_backward,
    stock_and_converted,
)  # fmt: skip
from test_monai import (
    MONAI_NETS,
    _densenet121,
    _diffusion_unets,
    _efficientnets,
    _generative_autoencoders,
    _monai_nets,
    _spade_networks,
    _vnet,
    autoencode,
    autoencode_in_autocast,
    denoise,
    spade_autoencode,
    spade_denoise,
)  # fmt: skip
from torch import nn

import tconv3d
from bench.vaes import LATENT_CHANNELS, build_vae
from tconv3d.nn.convert import is_converted
from tconv3d.nn.video_vaes import NORM_SILU_BLOCKS, class_name
from tconv3d.testing import rel_l2

diffusers = pytest.importorskip("diffusers")


VAES = {name: functools.partial(build_vae, name) for name in LATENT_CHANNELS}
RMS_NORMED = ("wan", "hunyuan_video15", "ltx_video", "ltx2", "hunyuan_image_refiner")


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


# Convolutions a model's own code calls outside any conv module, which stay on torch: Cosmos's Haar wavelet
# transforms: (F.conv3d calls in its patcher, F.conv_transpose3d calls in its unpatcher), 2-tap filters.
FUNCTIONAL_CONVS = {"cosmos": (28, 28)}


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
    functional, functional_transposed = FUNCTIONAL_CONVS.get(name, (0, 0))
    if name == "easyanimate":  # its causal conv ran once per output frame: one op a call now
        assert before.aten_conv3d_calls - functional > after.tconv3d_calls
    else:
        assert before.aten_conv3d_calls - functional == after.tconv3d_calls
    assert_all_on_tconv3d(after, functional=functional)
    assert after.aten_conv_transpose3d_calls == functional_transposed
    assert after.totals["aten_convs_outside_layers"] == functional + functional_transposed
    if name in RMS_NORMED:  # their RMS norms on tconv3d, each with the SiLU that follows it
        assert after.norm_calls > 0
        fused = [m for m in converted.modules() if class_name(type(m)) in NORM_SILU_BLOCKS]
        names = [NORM_SILU_BLOCKS[class_name(type(m))][1] for m in fused]
        assert fused and all(type(getattr(m, a)) is nn.Identity for m, a in zip(fused, names, strict=True))
    # The copies convert removed: every stock VAE pads or concatenates in front of its convolutions (EasyAnimate's
    # convs inside their own forward, into the frame windows each runs its conv on: as many concatenations).
    if name == "easyanimate":
        assert before.totals["concats"] > after.totals["concats"] and before.totals["pads"] > after.totals["pads"] == 0
    else:
        assert sum(layer.pad_copies + layer.concat_copies for layer in before.layers) > 0


@pytest.mark.parametrize("name", ["wan", "cogvideox", "ltx_video", "ltx2"])
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
    stock_bytes, ours = (saved_for_backward(model.train(), encode_decode, x) for model in (stock, converted))
    assert 0 < ours <= stock_bytes, (ours, stock_bytes)


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


@pytest.mark.parametrize("name", VAES)
def test_compile_adds_no_graph_breaks(name, aten_path):
    stock, converted = stock_and_converted(VAES[name])
    z = torch.randn(1, LATENT_CHANNELS[name], 2, 4, 4)
    decode = lambda model: lambda z: model.decode(z).sample  # noqa: E731
    torch._dynamo.reset()
    stock_breaks = torch._dynamo.explain(decode(stock))(z).graph_break_count
    torch._dynamo.reset()
    explained = torch._dynamo.explain(decode(converted))(z)
    assert explained.graph_break_count <= stock_breaks
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


# The layers that read the model's own inputs (the clip, the latent): the only places a layout copy may stay.
# Cosmos's input edge is its first projection's spatial conv, after the Haar patcher (torch's, NCDHW).
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
    x = x[:, :, :21]  # two segments
    for model in (stock, converted):
        encode_decode(model.train(), x).square().mean().backward()
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


def allegro():
    """Allegro's VAE (AutoencoderKLAllegro), small: 2-D layers on the frames, temporal conv layers between them,
    4x in time (a strided temporal conv layer down, an upsampling one up per level that has them)."""
    torch.manual_seed(0)
    return diffusers.AutoencoderKLAllegro(block_out_channels=(8, 16, 16, 16), norm_num_groups=4, layers_per_block=1)


def allegro_run(model, x):
    """Its encoder then decoder: diffusers' encode and decode raise without tiling, whose tiles are 24 frames of
    at least 128 x 128 (its overlaps are fixed at 120 and 80 pixels)."""
    return model.decoder(model.encoder(x)[:, : model.config.latent_channels])


def test_allegro_frames_and_temporal_convs_in_channels_last(aten_path):
    """Allegro's temporal conv layers on tconv3d: every Conv3d one op, every GroupNorm (with the SiLU after it) one
    tconv3d pass, no activation or norm input in another layout (its 2-D layers' weights channels_last, so the
    frames stay NHWC and their video views channels_last_3d), the repeated end frames one concatenation a stage
    where diffusers makes two (its norms' statistics count them, so they stay); the video and the gradients as
    stock's."""
    x = torch.randn(1, 3, 8, 32, 32)
    stock, converted, before, after = converted_and_audited(allegro, x, allegro_run)
    with torch.no_grad():
        assert allegro_run(converted, x).is_contiguous(memory_format=torch.channels_last_3d)
    assert before.aten_conv3d_calls == after.tconv3d_calls > 0
    assert_all_on_tconv3d(after)
    assert after.totals["layout_copies"] == after.norm_layout_copies == 0 and after.norm_calls > 0
    assert 2 * after.concats == before.concats > 0
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
    stock_bytes, ours = (saved_for_backward(model.train(train), run, x) for model in (stock, converted))
    assert 0 < ours <= stock_bytes, (ours, stock_bytes)


@pytest.mark.parametrize("name", ["kandinsky6_sr", "vidtok", "allegro"])
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
    }[name]
    stock, converted = stock_and_converted(build)
    x = torch.randn(shape)
    with torch.no_grad():
        assert rel_l2(run(converted, x), run(stock, x)) < MATCH


@pytest.mark.parametrize("name", ["kandinsky6_sr", "vidtok", "allegro"])
def test_more_vaes_compile_without_new_graph_breaks(name, aten_path):
    """As test_compile_adds_no_graph_breaks, for the VAEs built here (their adapters' forwards traced whole)."""
    build, run, x = {
        "kandinsky6_sr": (kandinsky6_sr, lambda model, z: model.decode(z).sample, torch.randn(1, 4, 5, 4, 4)),
        "vidtok": (functools.partial(vidtok, tiling=False), vidtok_run, torch.randn(1, 3, 9, 16, 16)),
        "allegro": (allegro, allegro_run, torch.randn(1, 3, 8, 16, 16)),
    }[name]
    stock, converted = stock_and_converted(build)
    breaks = []
    for model in (stock, converted):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(functools.partial(run, model.eval()))(x)
        breaks.append(explained.graph_break_count)
    assert breaks[1] <= breaks[0]
    assert any("tconv3d.conv3d" in str(node.target) for g in explained.graphs for node in g.graph.nodes)


INPUT_EDGES = {"encoder.conv_in", "decoder.conv_in", "encoder.conv_in.conv_s"}
# Encoders that run once per chunk of frames: their input edge takes one layout copy a chunk.
CHUNKED_ENCODERS = {"wan", "easyanimate"}


@pytest.mark.parametrize("name", sorted(VAES))
def test_vae_activations_stay_channels_last(name, aten_path):
    """After convert, only the model's input edges reach a tconv3d op in another layout (once per encoder or
    decoder forward: Wan's and EasyAnimate's encoders run once per chunk of frames), no norm gets one, and no pad
    or concatenation copy feeds a convolution."""
    _, converted = stock_and_converted(VAES[name])
    report = tconv3d.nn.audit(converted, torch.randn(1, 3, 9, 32, 32), run=encode_decode, verbose=False)
    copied = {layer.name: layer for layer in report.layers if layer.layout_copies}
    assert set(copied) <= INPUT_EDGES, report.table()
    assert all(layer.layout_copies <= layer.calls for layer in copied.values())
    assert report.totals["layout_copies"] <= (3 if name in CHUNKED_ENCODERS else 2), report.table()
    assert report.norm_layout_copies == 0
    assert report.totals["pad_copies_into_convs"] == report.totals["concat_copies_into_convs"] == 0
    if name not in CHUNKED_ENCODERS:  # those concatenate their chunks' latents in front of quant_conv (model code)
        assert report.totals["upstream_copies_into_convs"] == 0, report.table()


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


@pytest.mark.parametrize("stride", [(2, 2, 2), (1, 2, 2), (2, 1, 1)])
def test_ltx_depth_to_space_writes_channels_last(stride):
    """LTX-Video's upsampler shuffle, done into a channels_last_3d result, equals diffusers' permute + flatten."""
    from tconv3d.nn.video_vaes import _depth_to_space

    b, c, t, h, w = 2, 3, 2, 3, 4
    x = torch.randn(b, c * stride[0] * stride[1] * stride[2], t, h, w).contiguous(memory_format=torch.channels_last_3d)
    expected = x.reshape(b, -1, *stride, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4).flatten(6, 7).flatten(4, 5)
    expected = expected.flatten(2, 3)
    out = _depth_to_space(x, stride)
    assert torch.equal(out, expected) and out.is_contiguous(memory_format=torch.channels_last_3d)


def test_wan_frame_interleave_writes_channels_last():
    """WanResample's temporal upsampling interleave, done into a channels_last_3d result, equals diffusers' reshape
    + stack + reshape."""
    from tconv3d.nn.video_vaes import _interleave_frames

    b, c, t, h, w = 2, 3, 4, 3, 5
    x = torch.randn(b, 2 * c, t, h, w).contiguous(memory_format=torch.channels_last_3d)
    expected = x.reshape(b, 2, c, t, h, w)
    expected = torch.stack((expected[:, 0], expected[:, 1]), 3).reshape(b, c, t * 2, h, w)
    out = _interleave_frames(x)
    assert torch.equal(out, expected) and out.is_contiguous(memory_format=torch.channels_last_3d)


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
CUDA_MODELS = {
    **{f"vae_{name}": (build, (1, 3, 5, 32, 32), encode_decode) for name, build in VAES.items()},
    "vae_kandinsky6_sr": (kandinsky6_sr, (1, 3, 21, 32, 32), encode_decode),  # two segments
    "vae_vidtok": (vidtok, (1, 3, 17, 32, 32), vidtok_run),
    "vae_allegro": (allegro, (1, 3, 8, 32, 32), allegro_run),
    **{f"monai_{name}": (name, (1, 1, *(max(32, size),) * 3), None) for name, size in MONAI_NETS.items()},
    "monai_densenet121": (_densenet121, (1, 1, 32, 32, 32), None),
    **{f"monai_{name}": (build, (2, 1, 32, 32, 32), None) for name, build in _efficientnets().items()},
    "monai_autoencoderkl": (_generative_autoencoders()["autoencoderkl"], (1, 1, 32, 32, 32), autoencode),
    "monai_maisi": (_generative_autoencoders()["maisi"], (1, 1, 32, 32, 32), autoencode_in_autocast),
    **{f"monai_diffusion_{name}": (build, (2, 4, 16, 16, 16), denoise) for name, build in _diffusion_unets().items()},
    "monai_vnet": (_vnet, (1, 1, 32, 32, 32), None),
    "monai_spade_autoencoder": (_spade_networks()["autoencoder"], (1, 1, 32, 32, 32), spade_autoencode),
    "monai_spade_diffusion_unet": (_spade_networks()["diffusion_unet"], (2, 4, 16, 16, 16), spade_denoise),
}


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
