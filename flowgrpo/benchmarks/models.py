"""Random-weight pipelines with real-size transformers and VAEs, for benchmarks on a GPU (no download).

The transformer and VAE have SD3.5-Medium's / FLUX.1-dev's shapes; the text encoders stay tiny, so the
transformer's context and pooled projections are narrower than the real ones (a few million of ~2.5 B / 12 B
parameters) while token counts, latent sizes and every transformer block match — the cost that matters.
``num_layers`` shrinks the transformer for a CPU smoke run of the same code path.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel, SD3Transformer2DModel
from diffusers.utils import logging as diffusers_logging

from flowgrpo.tiny import build_tiny_pipeline


def _real_vae(latent_channels: int, scaling_factor: float, shift_factor: float) -> AutoencoderKL:
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512),
        layers_per_block=2,
        latent_channels=latent_channels,
        sample_size=1024,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def build_random_pipeline(
    kind: str, *, num_layers: int | None = None, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
):
    """A pipeline whose transformer and VAE have the real model's architecture, with random weights, on ``device``.

    The big modules are created (and randomly initialised) on ``device`` directly: FLUX.1-dev's 12 B parameters take
    seconds to initialise on a GPU, minutes on the host."""
    pipe = build_tiny_pipeline(kind, seed=0)
    text = pipe.transformer.config
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(0)
        if kind == "sd3":  # SD3.5-Medium
            layers = num_layers or 24
            transformer = SD3Transformer2DModel(
                sample_size=128,
                patch_size=2,
                in_channels=16,
                out_channels=16,
                num_layers=layers,
                attention_head_dim=64,
                num_attention_heads=24,
                caption_projection_dim=1536,
                joint_attention_dim=text.joint_attention_dim,
                pooled_projection_dim=text.pooled_projection_dim,
                pos_embed_max_size=384,
                qk_norm="rms_norm",
                dual_attention_layers=tuple(range(min(13, layers))),
            )
            vae = _real_vae(16, 1.5305, 0.0609)
        elif kind == "flux":  # FLUX.1-dev
            transformer = FluxTransformer2DModel(
                patch_size=1,
                in_channels=64,
                num_layers=num_layers or 19,
                num_single_layers=2 * (num_layers or 19),
                attention_head_dim=128,
                num_attention_heads=24,
                joint_attention_dim=text.joint_attention_dim,
                pooled_projection_dim=text.pooled_projection_dim,
                guidance_embeds=True,
                axes_dims_rope=(16, 56, 56),
            )
            vae = _real_vae(16, 0.3611, 0.1159)
        else:
            raise ValueError(f"kind must be 'sd3' or 'flux', got {kind!r}")
    pipe.register_modules(transformer=transformer.eval(), vae=vae.eval())
    pipe.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
    pipe.image_processor.config.vae_scale_factor = pipe.vae_scale_factor
    if hasattr(pipe, "latent_channels"):
        pipe.latent_channels = vae.config.latent_channels
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # diffusers warns on every .to(dtype) about an empty fp32 list
    try:
        pipe.to(device=device, dtype=dtype)
    finally:
        diffusers_logging.set_verbosity(verbosity)
    return pipe
