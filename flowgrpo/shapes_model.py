"""The shapes model: a 2.4 M-parameter SD3 pipeline in pixel space, pretrained on the shapes task.

It is a normal ``StableDiffusion3Pipeline`` (``DiffusionPipeline.from_pretrained(dir)`` opens it) built
from configs, so it runs through the same adapter, rollout, trainer and export code as SD3.5:

- transformer: ``SD3Transformer2DModel`` on 32x32x3 "latents" = pixels, patch 4 (8x8 = 64 image tokens),
  4 layers of 4 heads x 32, RMS qk-norm (SD3.5's), caption_projection_dim = heads x head_dim = 128.
- text: two 2-layer CLIP text encoders (hidden 64, projection 64: pooled 128, joint 64 + 64 = 128) over a
  word-level BPE vocabulary of the task's 19 words, prompts padded to 16 tokens; no T5
  (``text_encoder_3=None``: SD3 then feeds ``max_sequence_length`` zero tokens, and this model was trained
  with 16 of them, so sample it with ``pipe(..., max_sequence_length=16)``; ``model.max_sequence_length``
  in the configs).
- VAE: an ``AutoencoderTiny`` set to the identity (scale factor 1, no training): ``encode`` returns the
  image in [-1, 1]; ``decode`` is TAESD's soft clamp ``3 tanh(x / 3)``, so the training targets are
  ``pixels_to_latents(image) = 3 atanh(image / 3)`` and decoding returns the image exactly.
- scheduler: ``FlowMatchEulerDiscreteScheduler`` with shift 1 (no resolution shift at 32x32).

``build_shapes_pipeline(seed)`` gives the random-weight starting point; ``scripts/pretrain_shapes.py``
trains it; the result ships in ``flowgrpo/assets/shapes-sd3`` and loads as ``model.pretrained: shapes-sd3``.
"""

from __future__ import annotations

import collections
import functools
import itertools

import torch
from diffusers import AutoencoderTiny, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from .pipelines import SHIPPED_MODELS
from .shapes import RESOLUTION, all_specs

SHAPES_MODEL_DIR = SHIPPED_MODELS["shapes-sd3"]
TEXT_LENGTH = 16  # CLIP tokens (the longest prompt takes 10) and T5 zero tokens
PATCH = 4


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
    return CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=TEXT_LENGTH, projection_dim=64, hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ))  # fmt: skip


def identity_vae() -> AutoencoderTiny:
    """An ``AutoencoderTiny`` whose encoder is the identity and whose decoder is TAESD's clamp ``3 tanh(x/3)``.

    ReLU layers pass a signed value as two channels, ``relu(x)`` and ``relu(-x)``; the blocks' residual
    convs are zero (each block is then ``relu(0 + x) = x`` on those non-negative channels).
    """
    vae = AutoencoderTiny(
        latent_channels=3, encoder_block_out_channels=(6,), decoder_block_out_channels=(6,),
        num_encoder_blocks=(1,), num_decoder_blocks=(1,), scaling_factor=1.0, shift_factor=0.0,
    )  # fmt: skip
    with torch.no_grad():
        for p in vae.parameters():
            p.zero_()
        eye = torch.eye(3)
        enc, dec = vae.encoder.layers, vae.decoder.layers
        # encoder input is (x + 1) / 2 in [0, 1]: copy it, then map back with 2 y - 1
        enc[0].weight[:3, :, 1, 1] = eye
        enc[-1].weight[:, :3, 1, 1] = 2 * eye
        enc[-1].bias.fill_(-1.0)
        # decoder input x (clamped): split into relu(x), relu(-x); output (a - b) / 2 + 1/2, then 2 y - 1
        dec[0].weight[:3, :, 1, 1] = eye
        dec[0].weight[3:, :, 1, 1] = -eye
        dec[-1].weight[:, :3, 1, 1] = 0.5 * eye
        dec[-1].weight[:, 3:, 1, 1] = -0.5 * eye
        dec[-1].bias.fill_(0.5)
    return vae.eval()


def pixels_to_latents(images: torch.Tensor) -> torch.Tensor:
    """``(B, 3, H, W)`` images in [0, 1] -> the latents that :func:`identity_vae` decodes back to them exactly."""
    return 3 * torch.atanh((images * 2 - 1) / 3)


def build_shapes_pipeline(seed: int = 0) -> StableDiffusion3Pipeline:
    """The untrained shapes pipeline (float32, CPU, eval mode); same seed -> same weights."""
    tokenizer, tokenizer_2 = shapes_tokenizer(), shapes_tokenizer()

    def seeded(offset: int, build):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 16 + offset)
            return build()

    transformer = seeded(0, lambda: SD3Transformer2DModel(
        sample_size=RESOLUTION, patch_size=PATCH, in_channels=3, out_channels=3, num_layers=4,
        attention_head_dim=32, num_attention_heads=4, joint_attention_dim=128, caption_projection_dim=128,
        pooled_projection_dim=128, pos_embed_max_size=RESOLUTION // PATCH, qk_norm="rms_norm",
    ))  # fmt: skip
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        vae=identity_vae(),
        text_encoder=seeded(1, lambda: _text_encoder(tokenizer)),
        text_encoder_2=seeded(2, lambda: _text_encoder(tokenizer_2)),
        text_encoder_3=None,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        tokenizer_3=None,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0),
    )
    for module in (pipe.transformer, pipe.text_encoder, pipe.text_encoder_2):
        module.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe
