"""The video VAEs of diffusers with random weights: what tests/test_integrations.py converts and `python -m
bench.vae_decode` measures. `scale` multiplies the channel widths of a small config (1: the test size); 0 is
diffusers' default config, the released model's size. Also MONAI's autoencoders of 3-D volumes
(VOLUME_AUTOENCODERS: MAISI's, the CT generator's, and the 3-D latent diffusion tutorial's AutoencoderKL), which
bench.vae_decode decodes the same way, latent upscalers (LATENT_UPSCALERS: Kandinsky 6 SR's), whose decode is
the upscaled latent, and video VAEs the real-model tests build apart (MORE_VAES: Kandinsky 5's KVAE)."""

import torch

LATENT_CHANNELS = {
    "wan": 16, "cogvideox": 4, "mochi": 4, "hunyuan_video": 4, "ltx_video": 8, "hunyuan_video15": 4, "ltx2": 8,
    "cosmos": 4, "easyanimate": 4, "hunyuan_image_refiner": 4, "wan22": 4,
}  # fmt: skip

# Latents the default configs decode to 17 frames of 256 x 256 (Mochi: 19; it compresses time 6x): N, C, T, H, W.
DEFAULT_LATENTS = {
    "wan": (1, 16, 5, 32, 32), "cogvideox": (1, 16, 5, 32, 32), "mochi": (1, 12, 4, 32, 32),
    "hunyuan_video": (1, 16, 5, 32, 32), "ltx_video": (1, 128, 3, 8, 8), "hunyuan_video15": (1, 32, 5, 16, 16),
    "ltx2": (1, 128, 3, 8, 8), "cosmos": (1, 16, 3, 32, 32), "easyanimate": (1, 16, 5, 32, 32),
    "hunyuan_image_refiner": (1, 32, 17, 16, 16), "wan22": (1, 48, 5, 16, 16),
}  # fmt: skip
CLASSES = {
    "wan": "AutoencoderKLWan", "cogvideox": "AutoencoderKLCogVideoX", "mochi": "AutoencoderKLMochi",
    "hunyuan_video": "AutoencoderKLHunyuanVideo", "ltx_video": "AutoencoderKLLTXVideo",
    "hunyuan_video15": "AutoencoderKLHunyuanVideo15", "ltx2": "AutoencoderKLLTX2Video",
    "cosmos": "AutoencoderKLCosmos", "easyanimate": "AutoencoderKLMagvit",
    "hunyuan_image_refiner": "AutoencoderKLHunyuanImageRefiner", "wan22": "AutoencoderKLWan",
}  # fmt: skip
# Wan 2.2's VAE (TI2V-5B's) is diffusers' AutoencoderKLWan in another config: residual down and up blocks with
# space-to-depth and depth-to-space shortcuts (AvgDown3D, DupUp3D), patches of 2 in space, 16x in space overall.
WAN22 = {"is_residual": True, "in_channels": 12, "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16}


# MONAI's autoencoders of volumes (N, C, D, H, W): latent channels, the latent the released config decodes (MAISI's:
# a 256^3 CT volume from 64^3; MONAI's 3-D latent diffusion tutorial's AutoencoderKL: a 160 x 224 x 160 BraTS
# volume from 40 x 56 x 40), and the dtype it runs in (MAISI's norms answer float16 with norm_float16, as its
# bundle configures them; stock MAISI cannot run bfloat16 weights without autocast).
VOLUME_AUTOENCODERS = {
    "maisi": (4, (1, 4, 64, 64, 64), torch.float16),
    "monai_autoencoderkl": (3, (1, 3, 40, 56, 40), torch.bfloat16),
}

# Latent upscalers, measured as a decode whose output is the latent upscaled (`decode(z)`): latent channels, the
# latent the released widths upscale (Kandinsky 6 SR's 4x: 64-channel K-VAE latents, 5 x 16 x 16 -> 5 x 64 x 64),
# and the dtype.
LATENT_UPSCALERS = {"kandinsky6_upscaler": (64, (1, 64, 5, 16, 16), torch.bfloat16)}

# Video VAEs kept out of LATENT_CHANNELS, which the real-model tests parametrize over (these have tests of their
# own): Kandinsky 5's KVAE (cached causal convs over segments of frames): latent channels, the latent the default
# config decodes to 17 frames of 256 x 256, and the dtype.
MORE_VAES = {"kvae": (16, (1, 16, 5, 32, 32), torch.bfloat16)}


class UpscalerDecode(torch.nn.Module):
    """A latent upscaler bank's `scale`x upscaler as a VAE's decode: `decode(z)` is the upscaled latent."""

    def __init__(self, bank: torch.nn.Module, scale: int):
        super().__init__()
        self.bank, self.scale = bank, scale

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.bank(z, self.scale).sample


def build_vae(name: str, scale: int = 1, seed: int = 0, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """`dtype`: what the model will run in, where its config depends on it (MAISI's norm_float16)."""
    if name in VOLUME_AUTOENCODERS:
        return _build_volume_autoencoder(name, scale, seed, dtype)
    if name in LATENT_UPSCALERS:
        return _build_latent_upscaler(scale, seed)
    import diffusers

    torch.manual_seed(seed)
    if name == "kvae":  # released: 128 channels, (1, 2, 4, 8) a level, 2 res blocks; its GroupNorms take 32 groups
        if scale == 0:
            return diffusers.AutoencoderKLKVAEVideo()
        return diffusers.AutoencoderKLKVAEVideo(ch=32 * scale, ch_mult=(1, 1, 1, 1), num_res_blocks=1,
                                                z_channels=MORE_VAES["kvae"][0])  # fmt: skip
    if name == "wan22":  # released: base 160, decoder base 256, 48 latent channels
        widths = {"base_dim": 160, "decoder_base_dim": 256, "z_dim": 48} if scale == 0 else {
            "base_dim": 8 * scale, "decoder_base_dim": 12 * scale, "z_dim": 4, "dim_mult": [1, 2, 2, 2],
            "num_res_blocks": 1}  # fmt: skip
        z = widths["z_dim"]
        return diffusers.AutoencoderKLWan(**widths, **WAN22, latents_mean=[0.0] * z, latents_std=[1.0] * z)
    if scale == 0 and name in CLASSES:
        return getattr(diffusers, CLASSES[name])()
    if name == "wan":
        return diffusers.AutoencoderKLWan(
            base_dim=3 * scale, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, True, True],
        )  # fmt: skip
    if name == "cogvideox":
        return diffusers.AutoencoderKLCogVideoX(
            block_out_channels=(8 * scale,) * 4, latent_channels=4, layers_per_block=1, norm_num_groups=2,
            temporal_compression_ratio=4, down_block_types=("CogVideoXDownBlock3D",) * 4,
            up_block_types=("CogVideoXUpBlock3D",) * 4,
        )  # fmt: skip
    if name == "mochi":
        return diffusers.AutoencoderKLMochi(
            out_channels=3, latent_channels=4, encoder_block_out_channels=(32 * scale,) * 4,
            decoder_block_out_channels=(32 * scale,) * 4, layers_per_block=(1, 1, 1, 1, 1),
        )  # fmt: skip
    if name == "hunyuan_video":
        return diffusers.AutoencoderKLHunyuanVideo(
            in_channels=3, out_channels=3, latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 4,
            up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(8 * scale,) * 4, layers_per_block=1,
            norm_num_groups=4, spatial_compression_ratio=8, temporal_compression_ratio=4,
            mid_block_add_attention=True,
        )  # fmt: skip
    if name == "ltx_video":  # one block of each generation: 0.9.0's strided conv, 0.9.5's space-to-depth
        return diffusers.AutoencoderKLLTXVideo(
            in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8 * scale,) + (16 * scale,) * 3,
            decoder_block_out_channels=(8 * scale,) * 4, layers_per_block=(1,) * 5, decoder_layers_per_block=(1,) * 5,
            spatio_temporal_scaling=(True, True, False, False),
            decoder_spatio_temporal_scaling=(True, True, False, False), decoder_inject_noise=(False,) * 5,
            down_block_types=("LTXVideoDownBlock3D", "LTXVideo095DownBlock3D") + ("LTXVideoDownBlock3D",) * 2,
            downsample_type=("conv", "spatiotemporal", "conv", "conv"),
            upsample_residual=(True, False, False, False), upsample_factor=(2, 1, 1, 1), timestep_conditioning=False,
            patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False,
        )  # fmt: skip
    if name == "ltx2":  # LTX-2: 8x in space (2x patches), 4x in time here (32x and 8x released)
        return diffusers.AutoencoderKLLTX2Video(
            latent_channels=8, block_out_channels=(8 * scale, 16 * scale, 32 * scale, 32 * scale),
            decoder_block_out_channels=(8 * scale, 16 * scale, 32 * scale), layers_per_block=(1,) * 5,
            decoder_layers_per_block=(1,) * 4, spatio_temporal_scaling=(True, True, True, False),
            downsample_type=("spatial", "spatiotemporal", "temporal", "spatial"),
            upsample_type=("spatiotemporal", "spatial", "temporal"), patch_size=2, decoder_causal=False,
        )  # fmt: skip
    if name == "hunyuan_video15":  # HunyuanVideo 1.5: 8x in space here (16x released), 4x in time
        return diffusers.AutoencoderKLHunyuanVideo15(
            latent_channels=4, block_out_channels=(8 * scale,) + (16 * scale,) * 3, layers_per_block=1,
            spatial_compression_ratio=8,
        )  # fmt: skip
    if name == "cosmos":  # Cosmos-1.0's tokenizer: Haar patches of 4, 8x in space and time, as released
        return diffusers.AutoencoderKLCosmos(
            latent_channels=4, encoder_block_out_channels=(8 * scale,) + (16 * scale,) * 3,
            decode_block_out_channels=(16 * scale,) * 4, attention_resolutions=(8,), resolution=32, num_layers=1,
            latents_mean=None, latents_std=None,
        )  # fmt: skip
    if name == "easyanimate":  # EasyAnimate's MagVit VAE: 8x in space, 4x in time, as released
        return diffusers.AutoencoderKLMagvit(
            latent_channels=4, block_out_channels=[8 * scale] + [16 * scale] * 3, layers_per_block=1,
            norm_num_groups=4,
        )  # fmt: skip
    if name == "hunyuan_image_refiner":  # HunyuanImage 2.1's refiner: 8x in space here (16x released), frames kept
        return diffusers.AutoencoderKLHunyuanImageRefiner(
            latent_channels=4, block_out_channels=(8 * scale,) + (16 * scale,) * 3, layers_per_block=1,
            spatial_compression_ratio=8,
        )  # fmt: skip
    raise ValueError(f"unknown VAE {name!r}; known: {', '.join(LATENT_CHANNELS)}")


def _build_volume_autoencoder(name: str, scale: int, seed: int, dtype: torch.dtype | None) -> torch.nn.Module:
    torch.manual_seed(seed)
    if name == "monai_autoencoderkl":  # the 3-D LDM tutorial's: channels 32, 64, 64, attention at the last level
        from monai.networks.nets import AutoencoderKL

        return AutoencoderKL(
            spatial_dims=3, in_channels=1, out_channels=1, channels=(32, 64, 64) if scale == 0 else (8 * scale,) * 3,
            latent_channels=3, num_res_blocks=1, norm_num_groups=16 if scale == 0 else 4,
            attention_levels=(False, False, True),
        )  # fmt: skip
    from monai.apps.generation.maisi.networks.autoencoderkl_maisi import AutoencoderKlMaisi

    # The released MAISI autoencoder's shape (64, 128, 256 channels, two res blocks a level, no attention), split
    # into 8 slabs along H as MONAI's bundle runs its inference; smaller widths at scale >= 1.
    widths = (64, 128, 256) if scale == 0 else (8 * scale, 16 * scale, 16 * scale)
    return AutoencoderKlMaisi(
        spatial_dims=3, in_channels=1, out_channels=1, latent_channels=4, num_channels=widths,
        num_res_blocks=(2, 2, 2) if scale == 0 else (1, 1, 1), norm_num_groups=32 if scale == 0 else 4,
        norm_eps=1e-6, attention_levels=(False, False, False), with_encoder_nonlocal_attn=False,
        with_decoder_nonlocal_attn=False, norm_float16=dtype == torch.float16, num_splits=8 if scale == 0 else 2,
        dim_split=1,
    )  # fmt: skip


def _build_latent_upscaler(scale: int, seed: int) -> torch.nn.Module:
    """Kandinsky 6 SR's 4x latent upscaler (the bank holding only it): released widths 2048, 1024, 512 and 5, 3, 3
    residual blocks at scale 0; (32, 16, 8) x scale wide with one block a stage otherwise."""
    from diffusers.models.latent_upscaler.latent_upscaler_kandinsky6_sr import Kandinsky6SRLatentUpscalerBank

    torch.manual_seed(seed)
    if scale == 0:
        return UpscalerDecode(Kandinsky6SRLatentUpscalerBank(scales=(4,)), 4)
    bank = Kandinsky6SRLatentUpscalerBank(
        in_channels=LATENT_UPSCALERS["kandinsky6_upscaler"][0], stage_channels=(32 * scale, 16 * scale, 8 * scale),
        num_pre_blocks=1, num_mid_blocks=1, num_post_blocks=1, scales=(4,),
    )  # fmt: skip
    return UpscalerDecode(bank, 4)
