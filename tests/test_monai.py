"""Real models, as users convert them: MONAI's 3-D networks (UNets, DynUNet, UNETR and SwinUNETR, BasicUNet,
AttentionUnet, VNet, DenseNet, EfficientNet, VoxelMorph, the generative autoencoders and diffusion UNets, MAISI's,
SPADE's), small configs with random weights on CPU. Converted outputs and gradients match the stock networks,
`audit` finds every convolution on tconv3d with no layout, pad or concatenation copy feeding it (the adapters of
tconv3d/nn/monai_nets.py read skip connections in place), torch.compile adds no graph breaks, and a training step
keeps no more than stock's.

Needs the `integrations` extra (pip install ".[integrations]"); skipped without MONAI.
"""

import copy
import functools

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
from torch import nn

import tconv3d
from tconv3d.nn.convert import is_converted
from tconv3d.testing import rel_l2

pytest.importorskip("monai")


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
        "swin_unetr": transformer(lambda: nets.SwinUNETR(in_channels=1, out_channels=2, feature_size=12)),
        # a residual conv block in front of each Swin stage, whose input MONAI made NCDHW (the adapter: as it is)
        "swin_unetr_v2": transformer(
            lambda: nets.SwinUNETR(in_channels=1, out_channels=2, feature_size=12, use_v2=True)
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
    assert report.norm_calls > 0 and report.norm_layout_copies == 0
    assert report.totals["layout_copies"] <= 1  # the input
    stock_copies = tconv3d.nn.audit(stock, x, verbose=False).totals["upstream_copies_into_convs"]
    assert stock_copies == MONAI_SKIP_CONCATS[name]
    assert report.totals["upstream_copies_into_convs"] == 0, report.table()


@pytest.mark.parametrize("name", MONAI_NETS)
def test_monai_training_keeps_no_more_than_stock(name, aten_path):
    """Leaner: a converted MONAI network keeps no more for its backward than stock's autograd does."""
    stock, converted = stock_and_converted(_monai_nets()[name])
    x = torch.randn(1, 1, *(MONAI_NETS[name],) * 3)
    stock_bytes, ours = (saved_for_backward(model.train(), lambda m, x: m(x), x) for model in (stock, converted))
    assert 0 < ours <= stock_bytes, (ours, stock_bytes)


@pytest.mark.parametrize("name", ["unet", "checkpoint_unet", "attention_unet", "dynunet", "basic_unet"])
def test_monai_compile_adds_no_graph_breaks(name, aten_path):
    """torch.compile traces a converted MONAI network (its skip connections read in place by the adapters) with
    no more graph breaks than stock, the tconv3d ops in the graph, and the compiled training step (aot_eager)
    matches eager: outputs and parameter gradients."""
    stock, converted = stock_and_converted(_monai_nets()[name])
    x = torch.randn(1, 1, *(MONAI_NETS[name],) * 3)
    torch._dynamo.reset()
    stock_breaks = torch._dynamo.explain(stock)(x).graph_break_count
    torch._dynamo.reset()
    explained = torch._dynamo.explain(converted)(x)
    assert explained.graph_break_count <= stock_breaks
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
    stock_bytes, ours = (saved_for_backward(model.train(), run, x) for model in (stock, converted))
    assert 0 < ours <= stock_bytes, (ours, stock_bytes)
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
    blocks = [m for m in converted.modules() if type(m).__name__.endswith("ResBlock")]
    assert blocks and all(b.norm1.activation == b.norm2.activation == "silu" for b in blocks)
    for model in (stock, converted):
        autoencode(model.train(), x).square().mean().backward()
    assert_same_gradients(stock, converted)
    stock_bytes, ours = (saved_for_backward(model, autoencode, x) for model in (stock, converted))
    assert 0 < ours <= stock_bytes, (ours, stock_bytes)  # leaner
    assert rel_l2(*seeded_runs((stock, converted), lambda model: model(x)[0])) < MATCH  # sampled as stock

    if name == "maisi":  # a downsampler whose split convolution is left to MAISI pads as MAISI does
        kept = tconv3d.nn.convert(copy.deepcopy(stock), filter=lambda name, module: name != "encoder.blocks.2.conv")
        assert not kept.encoder.blocks[2].pads_inside and kept.encoder.blocks[4].pads_inside
        with torch.no_grad():
            assert rel_l2(autoencode(kept.eval(), x), autoencode(stock.eval(), x)) < MATCH


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
        return model(x, timesteps, context=torch.linspace(-1, 1, len(x) * 18, device=x.device).view(len(x), 3, 6))
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
    blocks = [m for m in converted.modules() if type(m).__name__ == "DiffusionUNetResnetBlock"]
    assert blocks and all(b.norm1.activation == b.norm2.activation == "silu" for b in blocks)
    for model in (stock, converted):
        denoise(model.train(), x).square().mean().backward()
    assert_same_gradients(stock, converted)
    stock_bytes, ours = (saved_for_backward(model, denoise, x) for model in (stock, converted))
    assert 0 < ours <= stock_bytes, (ours, stock_bytes)  # leaner


def test_monai_diffusion_unet_compiles_without_new_graph_breaks(aten_path):
    """torch.compile traces a converted diffusion UNet (cross-attention, res block up/downsampling: each of its
    adapters) with no more graph breaks than stock, the tconv3d ops in the graph (compiled runs of converted
    networks against eager: test_monai_compile_adds_no_graph_breaks)."""
    stock, converted = stock_and_converted(_diffusion_unets()["cross_attention"])
    x = torch.randn(2, 4, 16, 16, 16)
    breaks = []
    for model in (stock, converted):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(functools.partial(denoise, model))(x)
        breaks.append(explained.graph_break_count)
    assert breaks[1] <= breaks[0]
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
    stock_bytes, ours = (saved_for_backward(model.train(), lambda m, x: m(x), x) for model in (stock, converted))
    assert 0 < ours <= stock_bytes, (ours, stock_bytes)
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
    for (n, got), (_, want) in zip(seen["converted"], seen["stock"], strict=True):
        if isinstance(want, torch.Tensor):
            assert got.shape == want.shape and rel_l2(got, want) < MATCH, n
    for handle in handles:
        handle.remove()
    report = tconv3d.nn.audit(converted, x, verbose=False)
    assert report.totals["concat_copies_into_convs"] == report.totals["upstream_copies_into_convs"] == 0


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
