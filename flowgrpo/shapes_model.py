"""The shapes model: a 2.8 M-parameter SD3 pipeline on the latents of a tiny autoencoder, pretrained on the shapes task.

It is a normal ``StableDiffusion3Pipeline`` (``DiffusionPipeline.from_pretrained(dir)`` opens it) built
from configs, so it runs through the same adapter, rollout, trainer and export code as SD3.5:

- VAE: an ``AutoencoderTiny`` (TAESD's architecture, 0.2 M parameters) from 32x32x3 pixels to 8x8x4 latents
  (``vae_scale_factor`` 4: a latent cell is the 4-pixel grid the shapes are drawn on), trained first by
  ``scripts/pretrain_shapes.py`` to reconstruct scenes, with noise on the latents so that the decoder forgives a
  model's small errors. Its ``scaling_factor`` / ``shift_factor`` bring the latents to zero mean, unit variance.
  Why latents rather than pixels (the previous shipped model worked on pixels through an identity autoencoder):
  16 image tokens instead of 64 make a pretraining step and a GRPO epoch cheaper, and the model trained better in
  less time (docs/shapes.md §2).
- transformer: ``SD3Transformer2DModel`` on the 8x8x4 latents, patch 2 (4x4 = 16 image tokens), 4 layers of
  4 heads x 32, RMS qk-norm (SD3.5's), caption_projection_dim = heads x head_dim = 128.
- text: two 2-layer CLIP text encoders (hidden 64, projection 64: pooled 128, joint 64 + 64 = 128) over a
  word-level BPE vocabulary of the task's 19 words, prompts padded to 16 tokens; no T5
  (``text_encoder_3=None``: SD3 then feeds ``max_sequence_length`` zero tokens, and this model was trained
  with 16 of them, so sample it with ``pipe(..., max_sequence_length=16)``; ``model.max_sequence_length``
  in the configs).
- scheduler: ``FlowMatchEulerDiscreteScheduler`` with shift 1 (no resolution shift at this size).

``shapes_vae(seed)`` and ``build_shapes_pipeline(seed, vae)`` give the random-weight starting points;
``scripts/pretrain_shapes.py`` trains them; the result ships in ``flowgrpo/assets/shapes-sd3`` and loads as
``model.pretrained: shapes-sd3``.
"""

from __future__ import annotations

import collections
import functools
import itertools

import numpy as np
import torch
from diffusers import AutoencoderTiny, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from .pipelines import SHIPPED_MODELS
from .shapes import RESOLUTION, all_specs, render, sample_scene

SHAPES_MODEL_DIR = SHIPPED_MODELS["shapes-sd3"]
TEXT_LENGTH = 16  # CLIP tokens (the longest prompt takes 10) and T5 zero tokens
LATENT_CHANNELS = 4
VAE_DOWNSAMPLE = 4  # 32x32 pixels -> 8x8 latents
LATENT_SIZE = RESOLUTION // VAE_DOWNSAMPLE
PATCH = 2


@functools.cache
def _word_bpe() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(vocab, merges) of a CLIP-style BPE in which every word of the grammar is one token.

    The merges are learned by plain BPE on the task's words, so that replaying them (as ``CLIPTokenizer``
    does, lowest rank first) reproduces each word's training segmentation: one token a word. Ties between
    equally frequent pairs go to the first pair in sorted order, so every process builds the same vocabulary
    (``tokenizers``' BPE trainer breaks ties by hash order, which differs between processes).
    """
    words = sorted({w for spec in all_specs() for w in spec.prompt.split()})
    pieces = [[*word[:-1], word[-1] + "</w>"] for word in words]
    merges: list[tuple[str, str]] = []
    while True:
        counts = collections.Counter(pair for piece in pieces for pair in itertools.pairwise(piece))
        if not counts:
            break
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        pieces = [_merge(piece, best) for piece in pieces]
    symbols = list(bytes_to_unicode().values())  # CLIP's byte alphabet, in CLIP's order
    vocab = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges]
    return tuple(dict.fromkeys(vocab)) + ("<|startoftext|>", "<|endoftext|>"), tuple(merges)


def _merge(piece: list[str], pair: tuple[str, str]) -> list[str]:
    out: list[str] = []
    for token in piece:
        if out and (out[-1], token) == pair:
            out[-1] += token
        else:
            out.append(token)
    return out


def shapes_tokenizer() -> CLIPTokenizer:
    vocab, merges = _word_bpe()
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=list(merges), model_max_length=TEXT_LENGTH)


def _text_encoder(tokenizer: CLIPTokenizer) -> CLIPTextModelWithProjection:
    return CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=TEXT_LENGTH,
            projection_dim=64,
            hidden_act="quick_gelu",
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )


def shapes_vae(seed: int = 0) -> AutoencoderTiny:
    """The untrained autoencoder: TAESD's blocks of 32 channels, two stride-2 stages each way (x4), 4 latents."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 16 + 3)
        vae = AutoencoderTiny(
            latent_channels=LATENT_CHANNELS,
            encoder_block_out_channels=(32, 32, 32),
            decoder_block_out_channels=(32, 32, 32),
            num_encoder_blocks=(1, 1, 1),
            num_decoder_blocks=(1, 1, 1),
        )
    return vae.eval()


def render_scenes(specs: list, rng: np.random.Generator) -> torch.Tensor:
    """A random layout of each spec, rendered: ``(B, 3, H, W)`` in [0, 1] (the layouts drawn from ``rng`` in order)."""
    return torch.from_numpy(np.stack([render(sample_scene(s, rng)) for s in specs])).permute(0, 3, 1, 2)


def pixels_to_latents(vae: AutoencoderTiny, images: torch.Tensor) -> torch.Tensor:
    """``(B, 3, H, W)`` images in [0, 1] -> the transformer's latents (encoded, shifted and scaled as the pipeline
    undoes them before decoding)."""
    latents = vae.encode(images * 2 - 1).latents
    return (latents - vae.config.shift_factor) * vae.config.scaling_factor


def build_shapes_pipeline(seed: int = 0, vae: AutoencoderTiny | None = None) -> StableDiffusion3Pipeline:
    """The untrained shapes pipeline (float32, CPU, eval mode) around ``vae`` (default: an untrained one); same
    seed -> same weights."""
    tokenizer, tokenizer_2 = shapes_tokenizer(), shapes_tokenizer()

    def seeded(offset: int, build):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 16 + offset)
            return build()

    transformer = seeded(
        0,
        lambda: SD3Transformer2DModel(
            sample_size=LATENT_SIZE,
            patch_size=PATCH,
            in_channels=LATENT_CHANNELS,
            out_channels=LATENT_CHANNELS,
            num_layers=4,
            attention_head_dim=32,
            num_attention_heads=4,
            joint_attention_dim=128,
            caption_projection_dim=128,
            pooled_projection_dim=128,
            pos_embed_max_size=LATENT_SIZE // PATCH,
            qk_norm="rms_norm",
        ),
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        vae=vae if vae is not None else shapes_vae(seed),
        text_encoder=seeded(1, lambda: _text_encoder(tokenizer)),
        text_encoder_2=seeded(2, lambda: _text_encoder(tokenizer_2)),
        text_encoder_3=None,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        tokenizer_3=None,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0),
    )
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
        module.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe
