"""Random runs of whole converted models against their stock selves: the video VAEs of the real-model tests
(diffusers' Wan, Wan 2.2, CogVideoX, Mochi, HunyuanVideo and 1.5, LTX-Video and LTX-2, Cosmos, EasyAnimate,
HunyuanImage 2.1's refiner, Kandinsky 5's and 6's, Qwen-Image's, Allegro's, VidTok's, MiniMax-H3's encoder) and
MONAI's networks (its UNets, UNETR and SwinUNETR, VNet, MedNeXt, SegResNetDS, HighResNet, EfficientNet, FlexibleUNet,
DenseNet121, its diffusion UNet and AutoencoderKL, MAISI's autoencoder, SPADE's; its ResNet and SE-ResNeXt,
SegResNetDS2, UNet++, AHNet, RegUNet, LocalNet, GlobalNet, ViTAutoEnc, ControlNet, Classifier and GAN discriminators,
a tuple or list output's tensors compared as one), on inputs drawn at random:
batch, frames and sizes that the test configs' fixed shapes never take (odd frame counts, chunks that do not divide
the clip, sizes that halve to odd or to one voxel), inference (under torch.no_grad(), or torch.inference_mode(): then
half the time by models built inside it, their weights inference tensors) and a training step (output, input and
parameter gradients), diffusers' tiled encode and decode. Shapes are drawn from those each stock model takes (its clip
lengths, sizes and batch, as probed: FRAMES, MONAI_SIZES); where the stock model still refuses an input, the draw is
skipped. The models are kept from draw to draw, so a training step follows inference in inference mode as a user's
validation pass does.

fuzz.py draws the kernels' problems; this draws the adapters' (tconv3d.nn): their pads, caches, chunking,
resampling and shortcuts, as the models call them. The convolutions run through aten inside tconv3d's ops (the
`aten_path` of the real-model tests), so a draw costs what the stock model does.

    python tests/fuzz_models.py --seconds 300 [--seed 0] [--models wan,monai_unet,...] [--dtypes fp16,autocast_fp16]
    python tests/fuzz_models.py --compile inductor [--seconds 900] [--models ...] [--history]
    python tests/fuzz_models.py --func [--compile aot_eager] [--seconds 300] [--models ...]
    python tests/fuzz_models.py --fx [--seconds 300] [--models ...]
    python tests/fuzz_models.py --hooks [--compile aot_eager] [--seconds 300] [--models ...]
    python tests/fuzz_models.py --replay '<the JSON line a failure printed>'

A sixth of the draws run the models in bf16 (their weights rounded, the input too), a sixth in float32 under bf16
autocast (torch.autocast: mixed-precision training and inference), a twelfth in fp16 (diffusers' usual VAE dtype) and
a twelfth under fp16 autocast (CUDA's classic AMP); `--dtypes` draws from a subset. A draw passes where the converted
model's result has stock's dtypes and is within 1e-4 of stock's (relative L2, float32; the parameter gradients
concatenated), or else no more than 10x as far from the float64 stock model's as stock's own float32 result is (tiny
volumes make a model ill-conditioned: a norm over two voxels); in bf16, fp16 or autocast, no more than 4x as far from
it as stock's own result in the same precision. Stock's own distance is one sample of a rounding: where ours lands
farther, stock runs again on inputs rounded otherwise (each element times 1 + eps N(0, 1)), each convolution's output
rounded otherwise too, and its farthest landing bounds ours too, the draw printed and counted apart as
"ill-conditioned" (such a draw scatters stock by 20x, a well-conditioned one by 2x; a fault costing precision alone
can hide in that scatter, so read them). A training step (or a vmap_grad draw) whose gradients fail, its output
within bounds (a kink moves gradients, not values), with a ReLU's input on the other side of zero than stock's
(within a rounding of it: that voxel takes the other slope, and the gradients move by ~1e-3-1e-2; MONAI's
AttentionUnet has a million such inputs a step; a ReLU fused into its norm watched at the slot it leaves), or a max
pooling's window whose maximum is another voxel than stock's (a near tie: the gradient goes to the other one), is
counted apart, as "kinks"; any other failure is
drawn again, the same case with other random inputs, and one that does not come back is counted apart, as "once". But
a result farther from float64 than the answer's own size (relative L2 above 1) and 100x stock's farthest landing
fails as "far from float64:", kinks or not, once or not: no rounding or kink explains it. Its line says how many
inputs of RMS norms over a single channel took the other side of zero than stock's, if any: such a norm answers its
input's sign times its weight, so a voxel a rounding from zero moves an output by twice the weight (Wan's test config
halves 3 channels to 1 in its decoder's upsamplers; a bf16 decode then lands 4x stock's distance from float64 on one
draw's inputs). A draw that passes is then audited (tconv3d.nn.audit, as the case runs the model): every convolution
on tconv3d, activations channels_last_3d from the first layer to the last (a layout copy at the input edges alone,
none into a norm, no pad, concatenation or upstream copy into a convolution: the real-model tests'
assert_stays_channels_last), or it fails as "layout:" with the audit's table. VidTok's layouts are not audited (its
own code permutes its activations between 2-D and 1-D blocks), nor MAISI's where its own slabs ran (a size its
num_splits does not divide: their concatenations are stock's); MAISI's reference is stock in float32 (its norms
answer float32 whatever their input). Where a VAE's latent frames are one voxel (8 x 8 pixels), or a MONAI network's
lowest level (MedNeXt at 16^3), the audit is left out: a (B, C, 1, 1, 1) tensor is as contiguous in one layout as in
the other, torch's ops (interpolate, cat, elementwise) then answer NCDHW, and the layers after it get a layout copy
of a few voxels.

With --compile BACKEND (aot_eager, inductor), the converted model runs under torch.compile (traced anew each draw,
the input's sizes symbolic: dynamic=True) and is held to stock's eager results as above; instead of the audit, its
graph breaks are counted: more than stock's own (traced by dynamo alone, backend "eager") fail as "graph breaks:"
with their reasons. What this adds to the eager draws: the ops' fake implementations against their kernels (shapes,
dtypes, strides; Inductor asserts an extern kernel's strides), their autograd registration under AOTAutograd,
dynamic shapes through tconv3d.nn's adapters. Where the compiled converted model raises, stock runs compiled the
same way, and a draw it raises on too is skipped (torch's own: Inductor's value ranges fail HunyuanVideo's training
step at dynamic shapes, stock's as ours). Inductor on this CPU compiles a VAE's training step in 1-3 minutes, and
with symbolic sizes a large one may take far longer (HunyuanVideo 1.5 at 17 x 48 x 48: past 15 minutes in its
index simplification): a draw past --draw-seconds (600) is stopped and counted apart as "slow". With --history,
the draws share one compiled run, traced as torch.compile's default traces (sizes static until a draw changes
them: automatic dynamic), so each draw's graphs follow from the draws before it, as a user's compiled model meets
one shape after another (a fault found so: KVAE's decode after Wan 2.2's, a stride dynamo stood in for a size);
graph breaks and stock's compiled runs are left to the draws traced anew, and a failure's line lists the draws
since the last failure, which --replay runs first.

With --func, each draw runs in eval mode and the converted model under a torch.func transform, one sample a call
over the batch: vmap (outputs) and vmap of grad (outputs and per-sample input gradients), in turn; with --compile
too, the transform compiled whole (torch.compile of vmap). Autocast draws run in float32 (under vmap torch's
autocast leaves stock's ops alone), and the diffusion UNets are not drawn (their runs give each sample a timestep
by its place in the batch). Stock runs the batch as it is (in eval mode a sample's
results are its rows) and is held as above; where the converted model raises, stock runs under the same transform,
and a draw it raises on too is skipped (torch's own: SDPA's CPU flash kernel has no double backward). Layouts are
not audited (under vmap the adapters keep torch's, NCDHW), nor graph breaks counted.

With --fx, the MONAI networks run as model(x) are drawn, and the converted model runs as its torch.fx graph
(torch.fx.symbolic_trace of it as it is, training or eval, traced each draw; what fx's fuse, FX quantization and
torchvision's feature extraction run): tconv3d's layers and the blocks convert adapts are call_module nodes of the
graph, a network's own adapter (MONAI's UNet) traced into. It is held to stock's eager results as above. Where the
converted model does not trace or its graph raises, stock is traced the same way, and a draw whose stock does not
trace is skipped (the networks whose own code branches on sizes: SegResNetDS, the registration networks, ...).
Layouts are the eager draws' (the graph calls the same modules).

With --hooks, each draw runs stock and converted under the memory hooks diffusers and accelerate add to a model's
layers after convert, in turn: diffusers' layerwise casting (the Conv, ConvTranspose and Linear weights kept float8,
cast to the draw's dtype inside each call), accelerate's cpu_offload (each layer's weights on the meta device but
inside its call), diffusers' group offloading by blocks, and by layers to disk (after tconv3d.nn.shardable, which
safetensors needs), each replacing a hooked module's forward on the instance. Draws run in inference (a training
step becomes an eval one). A draw is held to stock's hooked results as above, its float64 reference the unhooked
stock model with the float8-rounded weights, and audited: the adapters make the calls of hooked layers whose work
they take (tconv3d.nn.hooks), every convolution on tconv3d.

Prints one JSON line per failure, a reproducer; exits 1 if any failed twice."""

import interpreter_without_cuda  # noqa: F401  (first: TRITON_INTERPRET before tconv3d defines its kernels)

# isort: split

import argparse
import atexit
import collections
import contextlib
import copy
import functools
import json
import logging
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from real_models import (
    CHUNKED_ENCODERS,
    ILL_CONDITIONED,
    INPUT_EDGES,
    MATCH,
    OWN_PAD_COPIES,
    assert_all_on_tconv3d,
    assert_stays_channels_last,
)

import tconv3d
from tconv3d import settings
from tconv3d.testing import rel_l2

# "autocast": float32 weights and input, run under torch.autocast(dtype=torch.bfloat16), as mixed-precision
# training and inference run (held to bf16's rule); "autocast_fp16" under fp16 autocast (CUDA's classic AMP)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "autocast": torch.float32,
          "autocast_fp16": torch.float32}  # fmt: skip
AUTOCAST = {"autocast": torch.bfloat16, "autocast_fp16": torch.float16}
# bf16: how much farther from float64 than stock's own bf16 a draw may be. Both sit ~1e-2 from it, their bf16
# roundings, so the ratio stays near 1 (0.04-3.6 over 144 bf16 draws, all but 3 below 2.5) where fp32's
# scatters; 5.2 once, where Wan's test config normalizes a single channel (its RMS norm is then the sign of x, and
# a voxel near zero rounds to the other side): "once", as it passes on other inputs. fp16 and autocast draws are
# held to it too (fp16: stock ~1e-3 from float64; 81 fp16 draws, none past it).
BF16_OFF = 4
WOBBLES = 2  # stock runs on inputs rounded otherwise, where ours lands farther than the above (wobbled_off)
APART = ("once: ", "kinks: ", "ill-conditioned: ", "slow: ")  # printed and counted apart, not failures
# what a line's count of kinks(..., activations=True) and of kinks(..., activations=False) says
KINKS = "activation or one-channel norm inputs across zero or pooling maxima moved"
STEPS = "inputs of one-channel norms across zero"
# A result no rounding explains: farther from float64 than the answer's own size and FAR_RATIO times stock's farthest
# landing. It fails even with kinks or on one draw's inputs alone (a kink moves a gradient by 1e-3-1e-1; one
# voxel at exactly 0 before a one-channel RMS norm, F.normalize's 1 / eps there, moved one by 1e9: run c5).
FAR, FAR_RATIO, FAR_OFF = 1.0, 100, "far from float64: "
# Failures no kink or other inputs explain: raising where stock did not, another shape or dtype. (Until 2026-12-06 a
# raise was counted apart as "kinks" where the eager step had any: AHNet compiled in training, run 995018.)
UNEXCUSED = ("raised where stock did not", "shapes ", "dtypes ")

# A VAE's input is (B, 3, T, H, W) with H and W multiples of its spatial unit (its compression, or what its
# encoder's patching needs), 8 unless listed.
SPATIAL_UNIT = {"cosmos": 32, "wan22": 32, "ltx2": 16, "hunyuan_video15": 16, "hunyuan_image_refiner": 16}
# The clip lengths a VAE takes where it refuses others (its temporal compression's rules, probed over 1 to 17),
# and a VAE's least height and width where its downsamplers refuse smaller. A drawn shape stock refuses tests
# nothing (the draw is skipped): before these rules, MiniMax-H3's ran one time in ten (H and W at least 32).
FRAME_CHOICES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 16, 17)
FRAMES = {"ltx_video": lambda t: t % 4 in (1, 2), "ltx2": lambda t: t % 4 == 1, "hunyuan_video15": lambda t: t % 4 == 1,
          "easyanimate": lambda t: t % 4 == 1, "kvae_video": lambda t: t == 1 or t >= 5,
          "kandinsky6_sr": lambda t: t == 1 or t >= 5, "allegro": lambda t: t in (3, 4, 6, 8, 12, 16)}  # fmt: skip
LEAST_SIZE = {"minimax_h3": 32}
# HunyuanVideo 1.5's attention mask broadcasts one clip's (diffusers 0.42: SDPA refuses a batch of two)
ONE_CLIP = ("hunyuan_video15",)
# Tiles run_model sets three units wide, two apart. Kandinsky 6 SR has no enable_tiling; HunyuanImage 2.1's refiner
# refuses tiles that are not a multiple of 32 pixels (its DC-AE rearrange: an edge tile of 16). LTX-2 refuses an
# edge tile of one unit (its latent one voxel, its reflect padding) and takes tiled draws an even number of units.
UNTILED, EVEN_TILES = ("kandinsky6_sr", "hunyuan_image_refiner"), ("ltx2",)
# VAEs that diffusers' encode / decode and enable_tiling do not run as the others: their own run, never tiled
OWN_RUNS = ("allegro", "vidtok", "minimax_h3")
# Models whose own code hands convolutions another layout, which convert leaves (their convolutions on tconv3d
# audited, not their layouts): VidTok's encoder and decoder run their 2-D and 1-D blocks on permuted copies
# ((B*T, C, H, W), (B*H*W, C, T)) and give its temporal resamplers a (B, C, T, H, W) view of (B, T, C, H, W) memory.
OWN_LAYOUTS = ("vidtok",)
# Models whose own forward concatenates features right in front of a convolution (upstream copies, as the chunked
# encoders' frames): UNet++'s nested skip pathways, 2 to 4 earlier features (docs/models.md)
OWN_CONCATENATIONS = ("monai_basic_unetplusplus",)
# Hooks that hook containers whole (diffusers' group offloading by blocks: MONAI UNet's levels), which the adapters
# call as they are, so that the hooks run (tconv3d.nn.hooks): a level's SkipConnection concatenates as MONAI's does,
# an upstream copy in front of its up path's convolution
WHOLE_BLOCK_HOOKS = ("group_blocks",)
MONAI = ("unet", "checkpoint_unet", "attention_unet", "dynunet", "basic_unet", "autoencoderkl", "diffusion_unet",
         "unetr", "swin_unetr", "swin_unetr_v2", "vnet", "maisi", "spade_autoencoder", "spade_diffusion_unet",
         "mednext", "segresnet_ds", "highresnet", "efficientnet_b0", "flexible_unet", "densenet121",
         # test_integrations' other MONAI networks (classifiers, registration, GAN discriminators, UNet++, AHNet)
         # but VQ-VAE: its codebook's nearest code flips on a rounding, and the output with it
         *(OTHER_MONAI := ("resnet18", "seresnext50", "segresnet_ds2", "basic_unetplusplus", "ahnet", "regunet",
                           "localnet", "globalnet", "patch_discriminator", "multiscale_patch_discriminator",
                           "vit_autoenc", "classifier", "discriminator", "controlnet", "dints")))  # fmt: skip
# A MONAI network's input sizes a dimension where stock refuses others (probed over 4 to 48, each dimension alone):
# UNETR's ViT image size, SwinUNETR's windows and five halvings, VNet's, MedNeXt's and FlexibleUNet's halvings; the
# UNets' two stride-2 levels (MONAI's UNet also takes 4k + 3, its up convolutions' output padding); BasicUNet's four
# poolings, DenseNet121's and EfficientNet's least sizes; MAISI's, one list a dimension (H, split in two slabs, at
# least 24; W not 10 or 11, where its split divides by a split size of 0). Else 8 to 40 a dimension; 4 to 32 in steps
# of 4 for the diffusion UNets (4 channels in, sizes that halve twice: its skip connections'). A drawn size stock
# refuses tests nothing (the draw is skipped): before these, DynUNet's and AttentionUNet's draws ran one time in fifty.
# The other networks' (probed 2026-12-06 over 4 to 48, AHNet's H and W over 100 to 199, D over 24 to 69): their
# fixed image sizes (GlobalNet, ControlNet's condition, ViTAutoEnc's patches, the Classifier's), halvings
# (SegResNetDS2, RegUNet, LocalNet; DiNTS's stem and depth, multiples of 4), the discriminators' least sizes;
# ResNet's and SE-ResNeXt's take any.
EVERY = range(8, 41)
MONAI_SIZES = {"unetr": (32,), "swin_unetr": (32, 64), "swin_unetr_v2": (32, 64), "vnet": (16, 32, 48),
               "mednext": (16, 32, 48), "flexible_unet": (32, 64), "segresnet_ds": (8, 16, 24, 32, 40),
               "unet": (unet := [n for n in EVERY if n % 4 in (0, 3)]), "checkpoint_unet": unet,
               "attention_unet": range(8, 41, 4), "dynunet": range(8, 41, 4), "basic_unet": range(16, 41),
               "densenet121": range(29, 45), "efficientnet_b0": range(32, 45),
               "maisi": (EVERY, range(24, 41), [n for n in EVERY if n not in (10, 11)]),
               "segresnet_ds2": (8, 16, 24, 32, 40), "regunet": (8, 16, 24, 32, 40), "localnet": (8, 16, 24, 32, 40),
               "basic_unetplusplus": range(16, 41), "patch_discriminator": range(24, 41),
               "multiscale_patch_discriminator": range(32, 41), "vit_autoenc": range(32, 41),
               "classifier": range(13, 17), "discriminator": range(13, 17), "globalnet": (32,), "controlnet": (16,),
               "dints": range(8, 41, 4),
               "ahnet": ((127, 128), (127, 128), (32, 33, 64, 65))}  # fmt: skip
# A MONAI network's input channels, 1 unless listed: the registration networks' fixed and moving images
IN_CHANNELS = {"regunet": 2, "localnet": 2, "globalnet": 2}
# Networks whose bottleneck's instance norm refuses a single voxel: some dimension must be larger than this
ONE_VOXEL_BELOW = {"basic_unet": 31, "basic_unetplusplus": 31, "swin_unetr": 32, "swin_unetr_v2": 32}
# Networks whose bottleneck is one voxel at every size drawn (32x down): their BatchNorm trains on two clips
TRAIN_TWO = ("efficientnet_b0", "densenet121", "resnet18", "seresnext50", "classifier", "discriminator")
DIFFUSION_UNETS = ("monai_diffusion_unet", "monai_spade_diffusion_unet")
# --hooks: the memory hooks diffusers and accelerate add to a model's layers, each replacing a layer's forward on the
# instance: "layerwise" (diffusers' layerwise casting: Conv, ConvTranspose and Linear weights kept float8, cast to
# the draw's dtype for each call), "offload" (accelerate's cpu_offload, what enable_sequential_cpu_offload runs:
# each layer's weights on the meta device but inside its call, the execution device here the CPU), "group_blocks"
# and "group_layers" (diffusers' group offloading by blocks, whose hooks wrap the blocks of ModuleLists and
# Sequentials or the model alone, and by layers). Both offload to disk: between calls a group's weights are empty
# tensors, so an adapter that skipped a hooked module's call and read its weights would compute with garbage, where
# offloading to memory on the CPU (onloading to the same device) moves nothing and would hide it. Disk takes
# contiguous tensors alone: tconv3d.nn.shardable first (a no-op on stock).
HOOKS = ("layerwise", "offload", "group_blocks", "group_layers")
FLOAT8 = torch.float8_e4m3fn


def builders() -> dict:
    from test_integrations import (
        VAES,
        _densenet121,
        _diffusion_unets,
        _efficientnets,
        _generative_autoencoders,
        _monai_nets,
        _more_monai_nets,
        _other_monai_nets,
        _spade_networks,
        _vnet,
        allegro,
        kandinsky6_sr,
        kvae_video,
        minimax_h3,
        qwenimage,
        vidtok,
    )

    # the diffusion UNet with cross-attention and resblock_updown (its up res blocks' sub-pixel conv1)
    monai = (_monai_nets() | _generative_autoencoders() | _efficientnets()
             | {name: build for name, (build, _) in _more_monai_nets().items()}
             | {name: build for name, (build, _, _) in _other_monai_nets().items()}
             | {f"spade_{name}": build for name, build in _spade_networks().items()}
             | {"diffusion_unet": _diffusion_unets()["cross_attention"], "vnet": _vnet,
                "densenet121": _densenet121})  # fmt: skip
    return {**VAES, "kvae_video": kvae_video, "kandinsky6_sr": kandinsky6_sr, "qwenimage": qwenimage,
            "allegro": allegro, "vidtok": vidtok, "minimax_h3": minimax_h3,  # VidTok: tiled, frames cached a chunk
            **{f"monai_{name}": monai[name] for name in MONAI}}  # fmt: skip


def own_run(name: str):
    """How the real-model tests run a model that is not run as a diffusers VAE or as model(x); else None."""
    import test_integrations as t

    runs = {"monai_autoencoderkl": t.autoencode, "monai_maisi": t.autoencode, "monai_diffusion_unet": t.denoise,
            "monai_spade_autoencoder": t.spade_autoencode, "monai_spade_diffusion_unet": t.spade_denoise,
            "allegro": t.allegro_run, "vidtok": t.vidtok_run, "minimax_h3": t.encode}  # fmt: skip
    return runs.get(name)


# fp16 draws are rarer: torch's CPU conv3d in fp16 is its slow_conv3d where the CPU lacks AVX512-FP16 (oneDNN's
# fp16), some 600x its fp32 time (MONAI VNet at 2 x 32 x 16 x 32: 44 s a forward), stock's and the aten path's alike
DRAWN_DTYPES = ("fp32",) * 6 + ("bf16", "bf16", "autocast", "autocast", "fp16", "autocast_fp16")


def draw(rng: random.Random, names: list[str], dtypes: tuple[str, ...] = DRAWN_DTYPES) -> dict:
    """A case: model, input shape, mode ("eval": under torch.no_grad(); "inference": torch.inference_mode(), with
    "inference_built" the models built inside it; "train"), tiling and dtype (one of `dtypes`)."""
    name = rng.choice(names)
    mode = rng.choice(["eval", "inference", "train"])
    dtype = rng.choice(dtypes)
    built = {"inference_built": True} if mode == "inference" and rng.random() < 0.5 else {}
    if name in DIFFUSION_UNETS:  # 4 channels in, sizes that halve twice (its skip connections' sizes)
        return {"model": name, "shape": [rng.choice([1, 2]), 4, *(4 * rng.randint(2, 8) for _ in range(3))],
                "mode": mode, "tiling": False, "dtype": dtype, **built}  # fmt: skip
    if name.startswith("monai_"):
        net = name.removeprefix("monai_")
        sizes = MONAI_SIZES.get(net, EVERY)
        per_dim = (sizes,) * 3 if isinstance(sizes[0], int) else sizes
        while True:
            spatial = [rng.choice(choices) for choices in per_dim]
            if max(spatial) > ONE_VOXEL_BELOW.get(net, 0):
                break
        batch = 2 if mode == "train" and net in TRAIN_TWO else rng.choice([1, 2])
        return {"model": name, "shape": [batch, IN_CHANNELS.get(net, 1), *spatial],
                "mode": mode, "tiling": False, "dtype": dtype, **built}  # fmt: skip
    unit, least = SPATIAL_UNIT.get(name, 8), LEAST_SIZE.get(name, 0)
    frames = rng.choice([t for t in FRAME_CHOICES if FRAMES.get(name, bool)(t)])
    tiling = name not in OWN_RUNS + UNTILED and rng.random() < 0.15
    step = 2 if tiling and name in EVEN_TILES else 1
    units = [[k for k in range(step, most + 1, step) if unit * k >= least] for most in (4, 5)]
    height, width = (unit * rng.choice(choices) for choices in units)
    shape = [1 if name in ONE_CLIP else rng.choice([1, 1, 2]), 3, frames, height, width]
    return {"model": name, "shape": shape, "mode": mode, "tiling": tiling, "dtype": dtype, **built}


def under_func(case: dict, seed: int) -> dict:
    """A draw made a torch.func one (--func): in eval mode (built outside inference mode), "vmap" or "vmap_grad"
    by the seed's parity, float32 for autocast: under vmap torch's autocast leaves stock's own ops alone (a Conv3d
    answers float32), so stock run batched is no reference for a vmapped autocast run."""
    case = {key: value for key, value in case.items() if key != "inference_built"}
    dtype = "fp32" if case.get("dtype") in AUTOCAST else case.get("dtype", "fp32")
    return {**case, "mode": "eval", "dtype": dtype, "func": ("vmap", "vmap_grad")[seed % 2]}


def under_hooks(case: dict, seed: int) -> dict:
    """A draw made a hooked one (--hooks): HOOKS[seed % len(HOOKS)] added to stock and converted alike (after
    convert, as diffusers' and accelerate's users add them to a converted model), in inference (a training step
    becomes an eval one: float8 weights take no gradient, and offloaded ones are meta or empty between calls), the
    models built outside inference mode."""
    case = {key: value for key, value in case.items() if key != "inference_built"}
    mode = "eval" if case["mode"] == "train" else case["mode"]
    return {**case, "mode": mode, "hooks": HOOKS[seed % len(HOOKS)]}


def add_hooks(model, hooks: str, dtype: str) -> None:
    """`hooks` (one of HOOKS) added to `model`, as a user adds them: diffusers' enable_layerwise_casting where the
    model has it (its classes' own skipped patterns), else diffusers.hooks.apply_layerwise_casting (MONAI's);
    accelerate.cpu_offload onto the CPU; diffusers.hooks.apply_group_offloading onto the CPU, by blocks or by
    layers, to a temporary folder (removed at exit)."""
    if hooks == "layerwise":
        compute = DTYPES[dtype]
        if hasattr(model, "enable_layerwise_casting"):
            model.enable_layerwise_casting(storage_dtype=FLOAT8, compute_dtype=compute)
        else:
            from diffusers.hooks import apply_layerwise_casting

            apply_layerwise_casting(model, storage_dtype=FLOAT8, compute_dtype=compute)
    elif hooks == "offload":
        import accelerate

        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    elif hooks in ("group_blocks", "group_layers"):
        from diffusers.hooks import apply_group_offloading

        folder = tempfile.mkdtemp(prefix="fuzz_models_group_")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        blocks = {"offload_type": "block_level", "num_blocks_per_group": 1}
        kind = blocks if hooks == "group_blocks" else {"offload_type": "leaf_level"}
        tconv3d.nn.shardable(model)
        apply_group_offloading(model, torch.device("cpu"), offload_to_disk_path=folder, **kind)
    else:
        raise ValueError(f"unknown hooks {hooks!r}; known: {', '.join(HOOKS)}")


def grad_mode(case: dict):
    """The context an inference case runs in: torch.inference_mode() or torch.no_grad()."""
    return torch.inference_mode() if case["mode"] == "inference" else torch.no_grad()


def precision(case: dict):
    """The context a case's models run in: autocast to AUTOCAST's dtype for an autocast case, else none."""
    dtype = AUTOCAST.get(case.get("dtype"))
    return torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()


def run_model(model, x, case: dict):
    if (run := own_run(case["model"])) is not None:  # an autoencoder's reconstruction from its latent mean, ...
        return run(model, x)
    if case["model"].startswith("monai_"):
        return per_sample_flat(model(x))
    if case["tiling"]:
        unit = SPATIAL_UNIT.get(case["model"], 8)
        try:  # tiles of three units a unit apart, where the VAE takes tile sizes (latent tiles two voxels apart)
            model.enable_tiling(
                tile_sample_min_height=3 * unit, tile_sample_min_width=3 * unit,
                tile_sample_stride_height=2 * unit, tile_sample_stride_width=2 * unit,
            )  # fmt: skip
        except TypeError:
            model.enable_tiling()
    try:
        return model.decode(model.encode(x).latent_dist.mode()).sample
    finally:
        if case["tiling"]:
            model.disable_tiling()


def per_sample_flat(out) -> torch.Tensor:
    """A network's output as one tensor of its batch's rows: each sample's parts of a tuple or list
    (discriminators' features, ViTAutoEnc's hidden states) flattened and concatenated; a tensor as it is."""
    if isinstance(out, torch.Tensor):
        return out
    return torch.cat([per_sample_flat(part).flatten(1) for part in out], dim=1)


def fx_traced(model, x, case: dict):
    """run_model through the model's torch.fx graph (--fx): torch.fx.symbolic_trace of the model as it is now
    (training or eval), run on x; its call_module nodes call the model's own modules."""
    return per_sample_flat(torch.fx.symbolic_trace(model)(x))


def compiled(backend: str, history: bool = False):
    """run_model compiled with `backend`, the input's sizes symbolic from the first trace (dynamic=True: the
    adapters' arithmetic on sizes they cannot see), traced anew (dynamo reset): a draw's failure replays alone,
    not only after the draws before it. With `history`, one compiled run_model for every draw until
    `forget_history` (as a user's compiled model meets one shape after another): traced as torch.compile's default
    does (dynamic=None), each input size static until a draw changes it (automatic dynamic), each draw's graphs
    guarded by and specialized after the draws before it."""
    if history and backend in _HISTORY:
        return _HISTORY[backend]
    forget_history()  # a reset ends any history too
    for limit in ("recompile_limit", "cache_size_limit"):  # a draw's graphs: encode, decode, tiles, breaks
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    run = torch.compile(run_model, backend=backend, dynamic=None if history else True)
    if history:
        _HISTORY[backend] = run
    return run


_HISTORY = {}  # backend: the compiled run_model that every draw with "history" shares


def forget_history() -> None:
    """The next draw with "history" starts from a fresh dynamo (no graphs, no sizes seen)."""
    _HISTORY.clear()
    torch._dynamo.reset()


def results(model, x, case: dict, grad, run=run_model, transformed: bool = False):
    """The output, and in "train" mode the input's gradient and the parameters' (concatenated) along `grad` (a
    tensor, or what makes one of the output's shape); and the gradient taken. `run` runs the model. A case with
    "func" runs in eval mode: with "vmap_grad" its results are the output and the input's gradient, and
    `transformed` runs the model under the case's torch.func transform, one sample a call (`per_sample`)."""
    if "func" in case:
        model.eval()
        if transformed:
            return per_sample(model, x, case, grad)
        if case["func"] == "vmap":
            with torch.no_grad(), precision(case):
                return [run(model, x, case)], None
        x = x.detach().requires_grad_()
        with precision(case):
            out = run(model, x, case)
        grad = grad if isinstance(grad, torch.Tensor) else grad(out.shape)
        (x_grad,) = torch.autograd.grad(out, x, grad.to(out.dtype))
        return [out.detach(), x_grad], grad
    if case["mode"] != "train":
        with grad_mode(case), precision(case):
            return [run(model.eval(), x, case)], None
    model.zero_grad()
    x = x.detach().requires_grad_()
    with precision(case):
        out = run(model.train(), x, case)
    grad = grad if isinstance(grad, torch.Tensor) else grad(out.shape)
    out.backward(grad.to(out.dtype))
    model.eval()
    params = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return [out.detach(), x.grad, params], grad


def per_sample(model, x, case: dict, grad) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """results() of an eval-mode model under case["func"], one sample a call over x's batch: "vmap" its outputs
    (torch.func.vmap, no_grad), "vmap_grad" its outputs and each sample's input gradient of sum(output * grad)
    (vmap of torch.func.grad, the output as its aux: per-sample gradients). With "compile", the transformed
    function compiled whole (torch.compile of vmap), traced anew. In eval mode a sample's results are the batch's
    rows, so stock run on the whole batch is the reference."""

    def output(sample):
        return run_model(model, sample[None], case)[0]

    def loss(sample, g):
        out = output(sample)
        return (out * g).sum(), out

    if case["func"] == "vmap":
        transform, args = torch.func.vmap(output), (x,)
    else:
        transform, args = torch.func.vmap(torch.func.grad(loss, has_aux=True)), (x, grad)
    if "compile" in case:
        torch._dynamo.reset()
        transform = torch.compile(transform, backend=case["compile"], dynamic=True)
    with precision(case):
        if case["func"] == "vmap":
            with torch.no_grad():
                return [transform(*args)], None
        x_grad, out = transform(*args)
    return [out.detach(), x_grad], grad


class StockRefuses(Exception):
    """Stock refuses what a draw adds to it (its hooks): the draw is skipped, as one whose input stock refuses."""


class Models:
    """Stock and converted models, built once a name (seeded as the real-model tests build them) and given back
    as built every draw: a training step moves BatchNorm's running statistics, and one that stock started and
    refused part-way moved stock's alone. A hooked draw's (--hooks) are built apart, hooked after convert, and
    with them `plain`: stock without hooks, its weights as the hooks keep them (float8-rounded), the reference's
    model (float64 has no place in hooks that cast to the draw's dtype)."""

    def __init__(self):
        self.builders, self.built = builders(), {}

    def __call__(self, name: str, dtype: str = "fp32", inference_built: bool = False, hooks: str | None = None):
        return self._built(name, dtype, inference_built, hooks)

    def of(self, case: dict):
        """(stock, converted) for `case`."""
        return self._built(*_key(case))

    def plain(self, case: dict):
        """`case`'s stock model without its hooks (stock itself for a case without), as `of(case)` built it: its
        state as the draw left it, not loaded again."""
        return self.built[_key(case)][3]

    def _built(self, name: str, dtype: str, inference_built: bool, hooks: str | None):
        key = (name, dtype, inference_built, hooks)
        # inside torch.inference_mode(): the weights inference tensors, written in place only there
        building = torch.inference_mode() if inference_built else contextlib.nullcontext()
        if key not in self.built:
            # the fp32 model's weights, rounded in bf16: built anew from the same seed, as a model that has run
            # may hold tensors of its graph (EasyAnimate's kept frames after a training step) that no deepcopy takes
            with building:
                torch.manual_seed(0)
                stock = self.builders[name]().eval().to(DTYPES[dtype])
                converted = tconv3d.nn.convert(copy.deepcopy(stock))
                state = copy.deepcopy(stock.state_dict())
            plain = stock
            if hooks is not None:
                plain = copy.deepcopy(stock)
                try:
                    add_hooks(stock, hooks, dtype)
                except Exception as error:  # diffusers' own: a module stock holds twice (DynUNet's), hooked twice
                    self.built[key] = error
                else:
                    add_hooks(converted, hooks, dtype)
                    kept = dict(stock.named_parameters())
                    for param_name, param in plain.named_parameters():  # the weights the hooks keep float8
                        if kept[param_name].dtype == FLOAT8:
                            param.data = kept[param_name].data.to(param.dtype)
            if key not in self.built:
                self.built[key] = (stock, converted, state, plain)
        if isinstance(self.built[key], Exception):
            raise StockRefuses(f"stock {name} refuses {hooks} hooks: {self.built[key]}")
        stock, converted, state, _ = self.built[key]
        for model in (stock, converted):
            if hooks not in ("offload", "group_blocks", "group_layers"):  # weights meta or empty outside their calls
                with building:
                    model.load_state_dict(state)
            # EasyAnimate clears its causal convs' kept frames after an encode or decode, so one that raised
            # part-way (an input stock refuses) left frames of its size that made stock refuse every later draw
            if hasattr(model, "_clear_conv_cache"):
                model._clear_conv_cache()
        return stock, converted


def _key(case: dict) -> tuple:
    """The key of `case`'s models in Models.built: name, dtype, whether built in inference mode, hooks."""
    return case["model"], case.get("dtype", "fp32"), case.get("inference_built", False), case.get("hooks")


# Modules whose output jumps or turns where their input crosses a boundary: piecewise-linear activations (at zero; a
# Hardtanh, a ReLU6 at both bounds) and max pooling (where a window's maximum changes hands). Their value is
# continuous, their gradient is not: kinks of a training step.
KINKED = (torch.nn.ReLU, torch.nn.LeakyReLU, torch.nn.PReLU, torch.nn.ReLU6, torch.nn.Hardtanh, torch.nn.MaxPool3d)


def _norm_dim(module) -> int | None:
    """The dimension an RMS norm normalizes (diffusers' channel-first RMS_norms, PerChannelRMSNorm, Kandinsky's;
    the last one for diffusers' and torch's RMSNorm), None for any other module."""
    if "rms" not in type(module).__name__.lower():
        return None
    if hasattr(module, "channel_dim"):
        return module.channel_dim
    if hasattr(module, "channel_first"):
        return 1 if module.channel_first else -1
    return -1 if type(module).__name__ == "RMSNorm" else 1


def _steps(module, args) -> bool:
    """Whether the module's output jumps where its input crosses zero: an RMS norm over a single value (the test
    configs' narrowest layers: Wan's upsamplers halve 3 channels to 1) is its input's sign times the weight, and a
    rounding that takes a voxel near zero to the other side moves the output by twice the weight, in any mode."""
    dim = _norm_dim(module)
    return dim is not None and bool(args) and isinstance(args[0], torch.Tensor) and args[0].shape[dim] == 1


def _input(case: dict, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(case["shape"], generator=generator).to(DTYPES[case.get("dtype", "fp32")])


def _decisions(module, args) -> torch.Tensor:
    """The branch a piecewise module took at each input: an activation's or a one-channel norm's side of zero, a
    Hardtanh's (a ReLU6's) piece of three (below, between or above its bounds), a max pooling's argmax (which voxel of
    each window its gradient goes to)."""
    if isinstance(module, torch.nn.MaxPool3d):
        return torch.nn.functional.max_pool3d(
            args[0], module.kernel_size, module.stride, module.padding, module.dilation, module.ceil_mode,
            return_indices=True,
        )[1]  # fmt: skip
    if isinstance(module, torch.nn.Hardtanh):
        return (args[0] > module.min_val).to(torch.int8) + (args[0] > module.max_val).to(torch.int8)
    return args[0] > 0


def _slope(module) -> float | None:
    """A leaky ReLU's slope below zero, a PReLU's smallest (None for other modules): where it is negative, the
    activation's output is positive on both sides of zero."""
    if isinstance(module, torch.nn.LeakyReLU):
        return module.negative_slope
    if isinstance(module, torch.nn.PReLU):
        return float(module.weight.min())
    return None


def check(case: dict, models: Models, seed: int) -> str | None:
    """None if the case passes or stock refuses its input ("skipped"), else what failed: "kinks: ..." where a
    training step's or a per-sample gradient's ("vmap_grad") piecewise-linear activations took another side of zero
    than stock's (or its max poolings another voxel) and the output is within bounds (or a one-channel norm's input
    crossed zero too), "once: ..." where the same case on other inputs (seed + 2^31) passes (with the count of
    one-channel norms' inputs across zero: kinks), "ill-conditioned: ..." where ours lies within stock's own scatter
    on inputs rounded otherwise (wobbled_off; with that count too and, for a gradient, its kinks: _crossings). A
    raise stock does not make, another shape or dtype (UNEXCUSED) fails as it is. A case with "compile" (a
    torch.compile backend) runs the converted model compiled."""
    found = {}
    problem = _check(case, models, seed, found)
    # a kink moves a gradient, not the output (continuous there); a one-channel norm's step moves both
    gradient = case["mode"] == "train" or case.get("func") == "vmap_grad"
    if problem is not None and problem.startswith("ill-conditioned: "):  # ours off by a norm's sign or a kink?
        return problem.replace(": ", f": {_crossings(case, models, seed, gradient)}; ", 1)
    if problem in (None, "skipped") or problem.startswith(("layout: ", "graph breaks: ", FAR_OFF, *UNEXCUSED)):
        return problem
    flips = kinks(case, models, seed, activations=True) if gradient else 0
    if flips and (not found.get("output") or kinks(case, models, seed, activations=False)):
        return f"kinks: {flips} {KINKS}; " + problem
    again = _check(case, models, seed + 2**31)
    if again not in (None, "skipped"):
        return problem
    steps = kinks(case, models, seed, activations=False)
    return "once: " + (f"{steps} {STEPS}; " if steps else "") + problem


def _crossings(case: dict, models: Models, seed: int, gradient: bool) -> str:
    """What an ill-conditioned draw's reader asks first: how many inputs of one-channel norms crossed zero and, for
    a gradient (a training step, vmap_grad), how many activation inputs or pooling maxima too (kinks()), or why
    those cannot be counted."""
    try:
        return f"{kinks(case, models, seed, activations=gradient)} {KINKS if gradient else STEPS}"
    except ValueError as error:  # a fused slope below zero
        return f"kinks not counted ({error})"
    except _Slow:  # the draw's time ran out (_timed): the verdict stands without its count
        return "kinks not counted (the draw's time ran out)"


def kinks(case: dict, models: Models, seed: int, activations: bool) -> int:
    """How many inputs of the models' steps (one-channel RMS norms: _steps) have another sign in the converted model
    than in stock, in the case's forward; with `activations` also those of the piecewise-linear activations, and how
    many max pooling windows another maximum (kinks of a training step's gradient: their value is continuous).

    Modules pair up by their names in stock. Where convert fused an activation into the norm before it, the slot the
    activation leaves (an nn.Identity; a FusedPReLU) takes the activation's output, whose sign is its input's for a
    ReLU, a leaky ReLU and a PReLU of positive weight: it stands for the activation. A fused slope below zero (a
    trained PReLU's) leaves no sign to read there: ValueError, rather than a count that misses its kinks."""
    stock, converted = models.of(case)
    watched = {name: module for name, module in stock.named_modules()
               if _norm_dim(module) is not None or (activations and isinstance(module, KINKED))}  # fmt: skip
    slots = dict(converted.named_modules())
    for name, module in watched.items():
        fused = name in slots and type(slots[name]) is not type(module)
        if fused and ((slope := _slope(module)) or 0.0) < 0:
            raise ValueError(
                f"kinks(): {name}, a {type(module).__name__} of slope {slope} below zero, is "
                "fused into the norm before it; its slot's output has one sign on both sides of zero"
            )
    inputs = []
    for model in (stock, converted):
        seen = collections.defaultdict(list)  # a module's decisions, a call each

        def record(module, args, out, name, seen=seen):
            kind = watched[name]
            if _norm_dim(kind) is None or _steps(kind, args):
                seen[name].append(_decisions(kind, args))

        handles = [module.register_forward_hook(functools.partial(record, name=name))
                   for name, module in model.named_modules() if name in watched]  # fmt: skip
        try:
            with grad_mode(case), precision(case):
                run_model(model.train(case["mode"] == "train"), _input(case, torch.Generator().manual_seed(seed)), case)
        finally:
            model.eval()
            for handle in handles:
                handle.remove()
        inputs.append(seen)
    stock_seen, converted_seen = inputs
    return sum(int((a != b).sum()) for name, calls in stock_seen.items() if len(calls) == len(converted_seen[name])
               for a, b in zip(calls, converted_seen[name], strict=True) if a.shape == b.shape)  # fmt: skip


def _check(case: dict, models: Models, seed: int, found: dict | None = None) -> str | None:
    """None if the case passes or stock refuses its input ("skipped"), else what failed; `found["output"]`: whether
    the output itself lies beyond the bound (not only gradients)."""
    try:
        stock, converted = models.of(case)
    except StockRefuses:
        return "skipped"
    generator = torch.Generator().manual_seed(seed)
    x = _input(case, generator)
    try:
        expected, grad = results(stock, x, case, lambda shape: torch.randn(shape, generator=generator))
    except Exception:
        return "skipped"
    transformed = "func" in case  # per_sample compiles the transform itself
    run = compiled(case["compile"], case.get("history", False)) if "compile" in case and not transformed else run_model
    run = fx_traced if case.get("fx") else run
    breaks = _graph_breaks()
    try:
        ours, _ = results(converted, x, case, grad, run=run, transformed=transformed)
    except Exception:
        problem = "raised where stock did not:\n" + traceback.format_exc()
        if transformed:  # torch's own (SDPA's CPU flash kernel has no double backward): stock's too?
            try:
                results(stock, x, case, grad, transformed=True)
            except Exception:
                return "skipped"
        elif "compile" in case and not case.get("history"):  # torch's own (Inductor's value ranges): stock's too?
            try:
                results(stock, x, case, grad, run=compiled(case["compile"]))
            except Exception:
                return "skipped"
        elif case.get("fx"):  # a network whose own code fx does not trace: stock's too?
            try:
                results(stock, x, case, grad, run=fx_traced)
            except Exception:
                return "skipped"
        return problem
    breaks = _graph_breaks() - breaks
    if [t.shape for t in ours] != [t.shape for t in expected]:
        return f"shapes {[tuple(t.shape) for t in ours]} against stock's {[tuple(t.shape) for t in expected]}"
    if [t.dtype for t in ours] != [t.dtype for t in expected]:
        return f"dtypes {[t.dtype for t in ours]} against stock's {[t.dtype for t in expected]}"
    errors = [rel_l2(a, b) for a, b in zip(ours, expected, strict=True)]
    if max(errors) >= MATCH:
        exact = reference(models.plain(case), x, case, grad)
        ours_off = [rel_l2(a.double(), b) for a, b in zip(ours, exact, strict=True)]
        stock_off = [rel_l2(a.double(), b) for a, b in zip(expected, exact, strict=True)]
        bound = ILL_CONDITIONED if case.get("dtype", "fp32") == "fp32" else BF16_OFF
        if any(o > max(bound * s, 1e-5) for o, s in zip(ours_off, stock_off, strict=True)):
            wobbled = wobbled_off(models.plain(case), x, case, grad, exact, seed)
            names = ("output", "input gradient", "parameter gradients")
            problem = "; ".join(f"{n}: {e:.2e} from stock, from float64 {o:.2e} (stock {s:.2e}, {w:.2e} on inputs "
                                "rounded otherwise)" for n, e, o, s, w in zip(names, errors, ours_off, stock_off,
                                                                              wobbled, strict=False))  # fmt: skip
            offs = list(zip(ours_off, stock_off, wobbled, strict=True))
            beyond = [o > max(bound * s, bound * w, 1e-5) for o, s, w in offs]  # output, gradients
            if found is not None:
                found["output"] = beyond[0]
            if any(o > max(FAR, FAR_RATIO * s, FAR_RATIO * w) for o, s, w in offs):
                return FAR_OFF + problem
            if any(beyond):
                return problem
            return "ill-conditioned: " + problem
    if transformed or case.get("fx"):  # under vmap the adapters keep torch's layouts (NCDHW); fx: the eager draws'
        return None
    if "compile" in case:  # the eager draws audit the layouts; stock traced alone would end a history
        return None if case.get("history") else graph_breaks(case, stock, x, grad, breaks)
    return layout(case, converted, x)


def reference(stock, x, case: dict, grad) -> list[torch.Tensor]:
    """Stock's results in float64 (its state now: BatchNorm's; no autocast), or in float32 where its own code
    refuses float64 (MAISI's norms answer float32 whatever their input: the next convolution's float64 bias
    refuses it), a reference a bf16 draw's roundings (~1e-2) still dwarf; an fp32 draw reaches it only where ours
    is 1e-4 off stock."""
    for module in stock.modules():  # tensors a training step left in module state (VidTok's kept frames), in
        for name, value in list(vars(module).items()):  # its graph: deepcopy refuses them
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                setattr(module, name, value.detach())
    try:
        return results(copy.deepcopy(stock).double(), x.double(), {**case, "dtype": "fp64"}, grad)[0]
    except RuntimeError:
        return results(copy.deepcopy(stock).float(), x.float(), {**case, "dtype": "fp32"}, grad)[0]


def _graph_breaks() -> collections.Counter:
    return collections.Counter(torch._dynamo.utils.counters["graph_break"])


# The breaks the hooks of --hooks make, stock's and ours: a layerwise-cast layer's module.to() (Module._apply builds
# Parameters, which dynamo refuses; tconv3d's layers run their whole _apply outside the graph), the hook classes'
# own disabled methods (accelerate's AlignDevicesHook._onload_weights, its SequentialHook's where a module is hooked
# twice: DynUNet's), accelerate's call of torch.compiler.disable, diffusers' group offloading's disabled onload_ and
# offload_. Their count follows the frames around each hooked call and their recompiles, not tconv3d's ops, so
# hooked draws compare the other breaks.
HOOK_BREAKS = re.compile(
    r"Attempted to use `torch\.nn\.Parameter\(\)` constructor"
    r"|Skip inlining `torch\.compiler\.disable\(\)`d function\n  Explanation: Skip inlining function "
    r"<function (_KeptWeightFormat\._apply|ModuleGroup\.\w+) "
    r"|Skip calling `torch\.compiler\.disable\(\)`d function\n  Explanation: Skip calling function `<function \w*Hook\."
    r"|Attempted to call function marked as skipped\n  Explanation: Dynamo developers have intentionally marked that "
    r"the function `disable` in file"
)


def graph_breaks(case: dict, stock, x, grad, breaks: collections.Counter) -> str | None:
    """None if the converted model's compiled run (whose graph breaks, by reason, were `breaks`) broke its
    graph no more often than stock's does, traced by dynamo alone; else the reasons. A hooked draw's (--hooks)
    leave out the hooks' casts (HOOK_BREAKS). Where stock does not trace (dynamo's own assertion: HunyuanImage
    2.1's refiner under layerwise casting and autocast, "Guard failed on the same frame it was created"), there is
    nothing to compare: None."""

    def counted(breaks: collections.Counter) -> collections.Counter:
        if not case.get("hooks"):
            return breaks
        return collections.Counter({reason: n for reason, n in breaks.items() if not HOOK_BREAKS.match(reason)})

    breaks = counted(breaks)
    if not breaks.total():
        return None
    run = compiled("eager")
    stock_breaks = _graph_breaks()
    try:
        results(stock, x, case, grad, run=run)
    except Exception:
        return None
    stock_breaks = counted(_graph_breaks() - stock_breaks)
    if breaks.total() <= stock_breaks.total():
        return None
    reasons = [f"{count}x {reason.splitlines()[0]}" for reason, count in (breaks - stock_breaks).items()]
    return f"graph breaks: {breaks.total()} against stock's {stock_breaks.total()}: " + "; ".join(reasons)


def wobbled_off(stock, x, case: dict, grad, exact: list[torch.Tensor], seed: int) -> list[float]:
    """Stock's distances from the float64 results `exact` (one a result) on inputs rounded otherwise: x times 1 +
    eps N(0, 1), rounded to x's dtype (most elements an ulp off), and each convolution's output the same way; the
    most over WOBBLES such runs. Where a model
    is ill-conditioned at a draw's shape (HunyuanVideo's test config at 8 x 8 pixels: group norms over four nearly
    equal voxels), stock's own distance scatters over an order of magnitude from one rounding to the next (5.6e-5,
    then 1.2e-3, 5.9e-5 and 5.3e-4 on the same draw), and its first is no bound. A fault is not hidden by it
    where the model is well conditioned (a one-channel RMS norm's gradient: ours 8e-3 off, stock's within 8e-6 on
    every rounding)."""
    generator = torch.Generator().manual_seed(seed + 2**32)
    eps = torch.finfo(AUTOCAST.get(case.get("dtype"), x.dtype)).eps

    def rounded_otherwise(t: torch.Tensor) -> torch.Tensor:
        return (t.float() * (1 + eps * torch.randn(t.shape, generator=generator))).to(t.dtype)

    # Each convolution's output too, as another summation order rounds it: from a latent of one voxel in H and W,
    # HunyuanVideo's decode (its borders replicated) is exactly constant in space, on any input; rounded inputs
    # leave it so, and only per-voxel roundings inside show how far that decode moves from float64 (1e-1 on a
    # 1e-7 wobble of its convs' outputs, where a 2 x 2 latent's moves 1e-6: tests/test_fuzz_models.py).
    hooks = [module.register_forward_hook(lambda module, args, out: rounded_otherwise(out))
             for module in stock.modules() if isinstance(module, CONVS)]  # fmt: skip
    wobbles = []
    try:
        for _ in range(WOBBLES):
            ran, _ = results(stock, rounded_otherwise(x), case, grad)
            wobbles.append([rel_l2(a.double(), b) for a, b in zip(ran, exact, strict=True)])
    finally:
        for hook in hooks:
            hook.remove()
    return [max(column) for column in zip(*wobbles, strict=True)]


CONVS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)


def layout(case: dict, converted, x) -> str | None:
    """None if the converted model's forward (as the case runs it: training mode, tiles) runs every convolution
    on tconv3d and keeps its activations channels_last_3d (real_models.assert_stays_channels_last: a layout copy
    at the input edges alone, none into a norm, no pad, concatenation or upstream copy into a convolution), else
    the layers that broke it and the audit's table."""
    name = case["model"]
    latents = []  # a VAE's latents (or latent tiles): the encoder's outputs, the decoder's inputs; and a MONAI
    # network's convolutions' inputs (its levels)
    hooks = [module.register_forward_hook(lambda module, args, out: latents.append(out))
             for module in (getattr(converted, "encoder", None),) if module is not None]  # fmt: skip
    hooks += [module.register_forward_pre_hook(lambda module, args: latents.append(args[0]))
              for module in (getattr(converted, "decoder", None),) if module is not None]  # fmt: skip
    if name.startswith("monai_"):
        hooks += [module.register_forward_pre_hook(lambda module, args: latents.append(args[0]))
                  for module in converted.modules() if isinstance(module, CONVS)]  # fmt: skip
    try:
        with torch.inference_mode() if case["mode"] == "inference" else contextlib.nullcontext(), precision(case):
            report = tconv3d.nn.audit(converted.train(case["mode"] == "train"), x,
                                      run=lambda model, x: run_model(model, x, case), verbose=False)  # fmt: skip
    finally:
        converted.eval()
        for hook in hooks:
            hook.remove()
    if any(isinstance(z, torch.Tensor) and z.shape[-2:] == (1, 1) for z in latents):
        return None  # frames of one voxel have no layout (see the module's docstring)
    if name == "monai_maisi" and any(layer.calls > 1 for layer in report.layers):  # each conv runs once a pass
        return None  # but where MAISI's own slabs ran (tconv3d.nn.monai_nets.maisi_convolution): stock's copies
    try:
        assert_all_on_tconv3d(report, every_layer_called=False)
        edges = None if name.startswith("monai_") or name in OWN_RUNS else INPUT_EDGES
        if name not in OWN_LAYOUTS:
            upstream = name in CHUNKED_ENCODERS or name in OWN_CONCATENATIONS or case.get("hooks") in WHOLE_BLOCK_HOOKS
            assert_stays_channels_last(report, input_edges=edges, upstream_copies=upstream,
                                       own_pad_copies=OWN_PAD_COPIES.get(name))  # fmt: skip
    except AssertionError:
        keys = ("layout_copies", "pad_copies", "concat_copies", "upstream_copies", "own_copies")
        copies = [f"{layer.name} ({layer.calls} calls): " + ", ".join(f"{getattr(layer, k)} {k}" for k in keys)
                  for layer in report.layers if any(getattr(layer, k) for k in keys)]  # fmt: skip
        off = [f"{layer.name}: {layer.reason or 'aten'}" for layer in report.layers
               if not layer.converted or layer.tconv3d_calls < layer.calls]  # fmt: skip
        return (f"layout: {report.norm_layout_copies} norm layout copies; " + "; ".join(off + copies)
                + f"\n{report.table()}")  # fmt: skip
    return None


class _Slow(BaseException):  # not an Exception: the checks' own handlers (stock refusing a draw) let it through
    pass


def _timed(seconds: int, case: dict, models: Models, seed: int) -> str | None:
    """check(case, models, seed), or "slow: ..." where it took more than `seconds` (SIGALRM, where it exists)."""
    if not hasattr(signal, "SIGALRM"):
        return check(case, models, seed)

    def stop(signum, frame):
        raise _Slow

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        return check(case, models, seed)
    except _Slow:
        forget_history()  # a compile stopped part-way
        return f"slow: stopped after {seconds} s"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0, help="first draw's seed; draws take seed, seed + 1, ...")
    parser.add_argument("--models", help="comma-separated (default: all)")
    parser.add_argument("--dtypes", help=f"comma-separated, drawn from alike (default: {','.join(DRAWN_DTYPES)})")
    parser.add_argument("--replay", help="one failure's JSON line")
    parser.add_argument("--compile", metavar="BACKEND", help="run the converted models under torch.compile "
                        "(aot_eager, inductor) against stock's eager results")  # fmt: skip
    parser.add_argument("--draw-seconds", type=int, default=600, help="a draw that takes longer is stopped and "
                        "counted apart as slow (Inductor's symbolic sizes: a large VAE, 15 minutes)")  # fmt: skip
    parser.add_argument("--func", action="store_true", help="run the converted models under torch.func, one "
                        "sample a call: vmap and vmap of grad (per-sample input gradients), in turn; with "
                        "--compile, the transform compiled")  # fmt: skip
    parser.add_argument("--fx", action="store_true", help="run the converted MONAI networks as their torch.fx graphs "
                        "(symbolic_trace), a draw stock does not trace skipped")  # fmt: skip
    parser.add_argument("--hooks", action="store_true", help="add diffusers' layerwise casting, accelerate's "
                        "cpu_offload and diffusers' group offloading (by blocks; by layers to disk), in turn, to stock "
                        "and converted models alike (inference draws)")  # fmt: skip
    parser.add_argument("--history", action="store_true", help="with --compile: one compiled run for all draws "
                        "(torch.compile's automatic dynamic shapes), until a failure; a failure's line lists the "
                        "draws before it, which --replay runs first")  # fmt: skip
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    settings.CPU_BACKEND = "aten"
    models = Models()
    if args.history and not args.compile:
        parser.error("--history needs --compile")
    if args.history and args.func:
        parser.error("--history does not take --func (each transform is compiled anew)")
    if args.fx and (args.compile or args.func):
        parser.error("--fx takes neither --compile nor --func")
    if args.hooks and (args.func or args.fx):
        parser.error("--hooks takes neither --func nor --fx")
    if args.replay:
        line = json.loads(args.replay)
        for seed, case in line.get("history", []):  # the compiled run's draws before it, their results aside
            _timed(args.draw_seconds, case, models, seed)
        problem = check(line["case"], models, line["seed"])
        print(problem or "passes")
        return int(problem not in (None, "skipped") and not problem.startswith(APART))
    names = args.models.split(",") if args.models else list(models.builders)
    if args.func:  # their runs give each sample its own timestep, by its place in the batch: not one a call
        names = [name for name in names if name not in DIFFUSION_UNETS]
    if args.fx:  # the networks run as model(x)
        names = [name for name in names if name.startswith("monai_") and own_run(name) is None]
    unknown = sorted(set(names) - set(models.builders))
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(models.builders)}")
    dtypes = tuple(args.dtypes.split(",")) if args.dtypes else DRAWN_DTYPES
    if not set(dtypes) <= set(DTYPES):
        parser.error(f"unknown dtypes {sorted(set(dtypes) - set(DTYPES))}; known: {', '.join(DTYPES)}")
    end, seed = time.monotonic() + args.seconds, args.seed
    ran = failed = once = kinked = scattered = slow = skipped = 0
    history = []  # with --history, the draws since the last failure: [seed, case]
    while time.monotonic() < end:
        case = draw(random.Random(seed), names, dtypes)
        if args.func:
            case = under_func(case, seed)
        if args.hooks:
            case = under_hooks(case, seed)
        if args.compile:
            case["compile"] = args.compile
        if args.history:
            case["history"] = True
        if args.fx:
            case["fx"] = True
        problem = _timed(args.draw_seconds, case, models, seed)
        if problem == "skipped":
            skipped += 1
        else:
            ran += 1
            if problem is not None:
                once += problem.startswith("once: ")
                slow += problem.startswith("slow: ")
                kinked += problem.startswith("kinks: ")
                scattered += problem.startswith("ill-conditioned: ")
                failed += not problem.startswith(APART)
                line = {"seed": seed, "case": case, "problem": problem}
                print(json.dumps({**line, "history": history} if args.history else line), flush=True)
        if args.history and problem not in (None, "skipped"):
            history = []
            forget_history()
        elif args.history and problem is None:
            history.append([seed, case])
        seed += 1
    print(
        f"fuzz_models: {ran} draws, {failed} failed, {kinked} at kinks (one-channel norms, ReLU, max pooling), "
        f"{once} once (not on other inputs), {scattered} ill-conditioned (within stock's scatter), {slow} slow, "
        f"{skipped} refused by stock, "
        f"seeds {args.seed}..{seed - 1}"
    )
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main())
