"""Tiny random-weight SD3 / FLUX pipelines, built offline from configs (tests, CI, benchmarks).

They are real diffusers pipelines (``StableDiffusion3Pipeline`` / ``FluxPipeline``) with the same
component layout and schedulers as SD3.5 / FLUX.1-dev, but under 0.1 M parameters per model, so every
code path (prompt encoding, latent packing, guidance embedding, dynamic shift, VAE decode, LoRA,
save / load) runs on a CPU in milliseconds. Nothing is downloaded: the tokenizers are built from
open_clip's bundled CLIP BPE merges, and the weights are random (seeded).

Key sizes (see ``TINY_SIZES``):

- VAE scale factor 2 (``block_out_channels=(8, 16)``): a 64x64 image is a 32x32 latent.
- SD3:  16 latent channels, patch 2 -> height / width must be multiples of 4, at most 128
  (``pos_embed_max_size=32`` patches); default 64x64.
- FLUX: 4 latent channels packed 2x2 into 16 transformer channels -> multiples of 4 as well, no
  upper bound; the FLUX pipeline's default is 256x256 (its fixed ``default_sample_size`` 128 x 2),
  so pass ``height`` / ``width`` (32 or 64) for speed.
- Text: CLIP vocab 1000 (77 tokens), T5 d_model 32. SD3 pooled = 32 + 32 = 64, joint = 32
  (CLIP hidden 8 + 16 = 24, zero-padded to T5's 32 as in the real model); FLUX pooled 32, joint 32.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import os
import re
from collections.abc import Callable
from typing import Literal

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderTiny,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from diffusers.utils import logging as diffusers_logging
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

TinyKind = Literal["sd3", "flux"]
TINY_KINDS: tuple[str, ...] = ("sd3", "flux")

# CLIP BPE vocabulary: 256 byte symbols, the same 256 with "</w>", the first merges, 2 specials.
# Truncating CLIP's ranked merge list keeps a valid BPE (each merge only uses earlier symbols).
CLIP_VOCAB_SIZE = 1000
CLIP_MAX_LENGTH = 77  # what SD3 / FLUX pipelines pad CLIP prompts to (tokenizer.model_max_length)
T5_MAX_LENGTH = 512  # FLUX's max_sequence_length; SD3 uses 256

TINY_SIZES: dict[str, dict[str, int]] = {
    "sd3": {"latent_channels": 16, "vae_scale_factor": 2, "resolution_multiple": 4, "default_resolution": 64,
            "pooled_dim": 64, "joint_dim": 32},
    "flux": {"latent_channels": 4, "vae_scale_factor": 2, "resolution_multiple": 4, "default_resolution": 256,
             "pooled_dim": 32, "joint_dim": 32},
}


# --------------------------------------------------------------------------- tokenizers


def _open_clip_bpe_path() -> str:
    # Locate the file without importing open_clip (its import pulls in torchvision and takes seconds).
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("open_clip_torch is needed for the tiny CLIP tokenizer (its bundled BPE merges)")
    return os.path.join(spec.submodule_search_locations[0], "bpe_simple_vocab_16e6.txt.gz")


@functools.cache
def _clip_bpe(vocab_size: int = CLIP_VOCAB_SIZE) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(vocab tokens in id order, merges) of CLIP's BPE cut to ``vocab_size`` (cached: read once)."""
    num_merges = vocab_size - 512 - 2
    if num_merges < 0:
        raise ValueError(f"CLIP vocab_size must be >= 514, got {vocab_size}")
    with gzip.open(_open_clip_bpe_path(), "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    merges = tuple(tuple(line.split()) for line in lines[1 : 1 + num_merges])  # line 0: "#version" header
    byte_symbols = list(bytes_to_unicode().values())  # same order as open_clip / OpenAI CLIP
    vocab = byte_symbols + [s + "</w>" for s in byte_symbols]
    vocab += ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    return tuple(vocab), merges


def tiny_clip_tokenizer(vocab_size: int = CLIP_VOCAB_SIZE) -> CLIPTokenizer:
    """A real CLIP BPE tokenizer (lower-casing, ``</w>`` suffixes) with a truncated vocabulary."""
    vocab, merges = _clip_bpe(vocab_size)
    return CLIPTokenizer(
        vocab={tok: i for i, tok in enumerate(vocab)},
        merges=list(merges),
        model_max_length=CLIP_MAX_LENGTH,
    )


@functools.cache
def _t5_unigram_vocab() -> tuple[tuple[str, float], ...]:
    """(piece, log-prob) pairs for a small T5-style SentencePiece Unigram vocabulary.

    Specials first (T5 layout: <pad>=0, </s>=1, <unk>=2), then single characters with and without the
    word-start marker, then whole words taken from the CLIP merges. Longer pieces score higher, so
    known words are one token and anything else falls back to characters (never <unk> for ASCII).
    """
    chars = [chr(c) for c in range(33, 127)]  # printable ASCII except space
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    pieces += [("▁" + c, -8.0) for c in chars] + [(c, -9.0) for c in chars]
    vocab, _ = _clip_bpe()
    words = [t[: -len("</w>")] for t in vocab[512:] if re.fullmatch(r"[a-z]{2,}</w>", t)]
    pieces += [("▁" + w, -4.0 - i * 1e-3) for i, w in enumerate(dict.fromkeys(words))]
    return tuple(pieces)


def tiny_t5_tokenizer() -> T5Tokenizer:
    """A T5 tokenizer (Unigram + Metaspace, ``</s>`` appended) over a small generated vocabulary."""
    return T5Tokenizer(vocab=list(_t5_unigram_vocab()), extra_ids=0, model_max_length=T5_MAX_LENGTH)


# --------------------------------------------------------------------------- models


def _seeded(seed: int, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    # Each component gets its own seed inside a forked RNG: weights depend only on (seed, component),
    # not on build order, and the caller's global RNG state is left untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def _clip_config(tokenizer: CLIPTokenizer, hidden_size: int, projection_dim: int) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=2,  # SD3 reads the penultimate layer's hidden states
        num_attention_heads=2,
        max_position_embeddings=CLIP_MAX_LENGTH,
        hidden_act="quick_gelu",
        projection_dim=projection_dim,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,  # pooling takes the first EOS position
        pad_token_id=tokenizer.pad_token_id,
    )


def _t5_encoder(tokenizer: T5Tokenizer) -> T5EncoderModel:
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",  # T5 v1.1, as SD3 / FLUX use
        tie_word_embeddings=False,
        is_encoder_decoder=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return T5EncoderModel(config)


def _vae(latent_channels: int, scaling_factor: float, shift_factor: float) -> AutoencoderKL:
    # Two blocks -> one downsampling -> vae_scale_factor 2. No quant convs, as in the SD3 / FLUX VAEs.
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=8,
        sample_size=64,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def _tiny_autoencoder(latent_channels: int) -> AutoencoderTiny:
    """A TAESD-style VAE (no GroupNorm): the latents' statistics reach the image, so image-level rewards such
    as brightness respond to the policy. The output bias starts images mid-grey."""
    vae = AutoencoderTiny(
        latent_channels=latent_channels,
        encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        num_encoder_blocks=(1, 1),
        num_decoder_blocks=(1, 1),
        scaling_factor=1.0,
        shift_factor=0.0,
    )
    last = [m for m in vae.decoder.modules() if isinstance(m, torch.nn.Conv2d)][-1]
    with torch.no_grad():
        last.bias.fill_(0.5)  # the decoder's output lies in [0, 1] (decode maps it to [-1, 1])
    return vae


def _sd3_components(seed: int, vae: str = "kl") -> dict[str, object]:
    tok, tok_2, tok_3 = tiny_clip_tokenizer(), tiny_clip_tokenizer(), tiny_t5_tokenizer()
    s = seed * 16  # component offsets below stay < 16, so seeds never collide across pipelines
    return {
        # SD3.5-medium layout in miniature: qk RMS-norm, dual attention in the first block,
        # caption_projection_dim = heads * head_dim, pooled = the two CLIP projections concatenated.
        "transformer": _seeded(s + 0, lambda: SD3Transformer2DModel(
            sample_size=32,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=32,
            caption_projection_dim=32,
            pooled_projection_dim=64,
            pos_embed_max_size=32,  # latents up to 64x64 -> images up to 128x128
            qk_norm="rms_norm",
            dual_attention_layers=(0,),
        )),
        "vae": _seeded(s + 1, lambda: _vae(16, scaling_factor=1.5305, shift_factor=0.0609)  # SD3.5's factors
                       if vae == "kl" else _tiny_autoencoder(16)),
        "text_encoder": _seeded(s + 2, lambda: CLIPTextModelWithProjection(_clip_config(tok, 8, 32))),
        "text_encoder_2": _seeded(s + 3, lambda: CLIPTextModelWithProjection(_clip_config(tok_2, 16, 32))),
        "text_encoder_3": _seeded(s + 4, lambda: _t5_encoder(tok_3)),
        "tokenizer": tok,
        "tokenizer_2": tok_2,
        "tokenizer_3": tok_3,
        "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
    }


def _flux_components(seed: int, vae: str = "kl") -> dict[str, object]:
    tok, tok_2 = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    s = seed * 16
    return {
        # FLUX.1-dev layout in miniature: guidance embedding, RoPE axes summing to the head dim,
        # pooled = CLIP's pooled output (hidden size 32), joint = T5's d_model.
        "transformer": _seeded(s + 0, lambda: FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,  # 4 latent channels x 2x2 packing
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(4, 4, 8),
        )),
        "vae": _seeded(s + 1, lambda: _vae(4, scaling_factor=0.3611, shift_factor=0.1159)  # FLUX's factors
                       if vae == "kl" else _tiny_autoencoder(4)),
        "text_encoder": _seeded(s + 2, lambda: CLIPTextModel(_clip_config(tok, 32, 32))),
        "text_encoder_2": _seeded(s + 4, lambda: _t5_encoder(tok_2)),
        "tokenizer": tok,
        "tokenizer_2": tok_2,
        # FLUX.1-dev's scheduler config: the shift depends on the image token count.
        "scheduler": FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000,
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        ),
    }


def build_tiny_pipeline(
    kind: TinyKind, seed: int = 0, dtype: torch.dtype = torch.float32, vae: Literal["kl", "tiny"] = "kl"
) -> StableDiffusion3Pipeline | FluxPipeline:
    """A tiny random-weight SD3 or FLUX pipeline on CPU, in eval mode; same seed -> same weights.

    vae: ``kl`` — an AutoencoderKL with the real model's scaling/shift factors (default); ``tiny`` — a
    TAESD-style AutoencoderTiny without normalisation layers, on which image-level rewards (brightness)
    respond to the policy: the CPU learning tests and the README's main job use it.
    """
    if vae not in ("kl", "tiny"):
        raise ValueError(f"tiny pipeline vae must be 'kl' or 'tiny', got {vae!r}")
    if kind == "sd3":
        pipe = StableDiffusion3Pipeline(**_sd3_components(seed, vae))
    elif kind == "flux":
        pipe = FluxPipeline(**_flux_components(seed, vae))
    else:
        raise ValueError(f"unknown tiny pipeline kind {kind!r}; expected one of {TINY_KINDS}")
    if dtype != torch.float32:
        # diffusers 0.42 logs "modules that should be kept in float32: []" on every ModelMixin.to(dtype),
        # even when there are none; silence that one spurious warning.
        verbosity = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()
        try:
            pipe.to(dtype=dtype)
        finally:
            diffusers_logging.set_verbosity(verbosity)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()  # models built from configs start in train mode
    pipe.set_progress_bar_config(disable=True)
    return pipe
