"""Tiny random-weight SD3 / FLUX / Qwen-Image / Wan pipelines, built offline from configs (tests, CI, benchmarks).

They are real diffusers pipelines (``StableDiffusion3Pipeline`` / ``FluxPipeline`` / ``QwenImagePipeline``)
with the same component layout and schedulers as SD3.5 / FLUX.1-dev / Qwen-Image, but under 0.1 M parameters
per model, so every code path (prompt encoding, latent packing, guidance embedding, true CFG, dynamic shift,
VAE decode, LoRA, save / load) runs on a CPU in milliseconds. Nothing is downloaded: the CLIP / T5 tokenizers
are built from open_clip's bundled CLIP BPE merges, the Qwen2 tokenizer from a byte-level BPE trained here on
a fixed word list, and the weights are random (seeded).

Each family's spec (``flowgrpo/adapters/<family>.py``) names its builder here, ``(seed, vae) -> components``
(``tiny="flowgrpo.tiny:flux_components"``); :func:`build_tiny_pipeline` puts them into the spec's pipeline class.

Key sizes (see ``TINY_SIZES``):

- VAE scale factor 2 (``block_out_channels=(8, 16)``): a 64x64 image is a 32x32 latent.
- SD3:  16 latent channels, patch 2 -> height / width must be multiples of 4, at most 128
  (``pos_embed_max_size=32`` patches); default 64x64.
- FLUX: 4 latent channels packed 2x2 into 16 transformer channels -> multiples of 4 as well, no
  upper bound; the FLUX pipeline's default is 256x256 (its fixed ``default_sample_size`` 128 x 2),
  so pass ``height`` / ``width`` (32 or 64) for speed.
- FLUX.1-Kontext (``flux-kontext``): the FLUX components in a ``FluxKontextPipeline`` (image editing). Its
  ``pipe()`` rescales the size to ``max_area`` (1024²) and the input image to a preferred Kontext resolution:
  pass ``max_area=H * W`` and ``_auto_resize=False`` at tiny sizes.
- Qwen-Image: 4 latent channels (an ``AutoencoderKLQwenImage``, z_dim 4, with the first 4 of the real
  latents_mean / latents_std) packed 2x2 into 16 transformer channels -> multiples of 4; the pipeline's default
  is 256x256 (``default_sample_size`` 128 x 2). Text: a Qwen2.5-VL with hidden size 32 (joint 32), a byte-level
  BPE of about 500 tokens whose system prompt of the pipeline's template is 34 tokens, as with the real
  tokenizer (the pipeline drops exactly 34: ``prompt_template_encode_start_idx``).
- Qwen-Image-Edit (``qwenimage-edit``, a ``QwenImageEditPipeline``, image editing): the Qwen-Image transformer and VAE
  (same seeds) with a Qwen2.5-VL that also reads the source image (vision tower: patch 2, 2x2 merge, hidden 16) through
  a ``Qwen2VLProcessor`` built here (images of 16² to 64² pixels at their own size, larger ones scaled down); its BPE
  also knows the edit template, whose system part is 64 tokens as with the real tokenizer (the pipeline drops 64).
  Its ``pipe()`` sizes the source to about 1024² pixels whatever the output size, slow at tiny sizes: the tiny demo
  sets ``model.source_area: 1024`` (32²), and tests swap that area into ``pipe()``'s ``calculate_dimensions``.
- Qwen-Image-Edit-Plus (``qwenimage-edit-plus``, a ``QwenImageEditPlusPipeline``, several source images per prompt):
  the Qwen-Image-Edit components, its processor reading each picture at 32² pixels at most. ``pipe()`` sizes every
  source for the VAE to about ``VAE_IMAGE_SIZE`` = 1024² pixels: the tiny demo sets ``model.source_area: 1024`` and
  tests swap that area into the pipeline module's ``VAE_IMAGE_SIZE``.
- Wan2.1 (``wan``, a ``WanPipeline``, text-to-video): an ``AutoencoderKLWan`` with z_dim 4 (the first 4 of the real
  latents_mean / latents_std), two down-sampling stages that both halve time too -> spatial factor 4, temporal factor
  4 as the real VAE (``num_frames = 4k + 1``: 5 frames are 2 latent frames); a ``WanTransformer3DModel`` with patch
  (1, 2, 2) -> height / width multiples of 16 (the pipeline's own rule); a UMT5 encoder (d_model 32) with the tiny T5
  tokenizer; the hub's ``UniPCMultistepScheduler`` (flow sigmas, ``flow_shift`` 3.0). The pipeline's default size is
  480x832 with 81 frames: pass ``height`` / ``width`` / ``num_frames`` (32, 32, 5) for speed.
- Wan2.2 (:func:`wan22_components`, no tiny source: tests build ``WanPipeline(**components)``): A14B's two experts, a
  second tiny transformer as ``transformer_2`` with ``boundary_ratio`` 0.875; or TI2V-5B's layout, the Wan2.2 VAE
  (``is_residual``, 2x2 patchify, spatial factor 8, z_dim 8) with ``expand_timesteps``.
- Wan image-to-video (``wan-i2v``, a ``WanImageToVideoPipeline``): the wan components with a transformer taking
  4 + 4 + 4 = 12 channels (noisy latents, first-frame mask, image latents) and Wan2.1 I2V's image branch fed by a
  tiny ``CLIPVisionModel`` (32² crops, patch 8: 17 tokens of 16); ``wan_i2v_components(wan22=True)``: Wan2.2 I2V's two
  experts without it (``boundary_ratio`` 0.9).
- HunyuanVideo (``hunyuanvideo``, a ``HunyuanVideoPipeline``, text-to-video): an ``AutoencoderKLHunyuanVideo`` with the
  real factors (spatial 8, temporal 4: ``num_frames = 4k + 1``) and 4 latent channels; a guidance-distilled
  ``HunyuanVideoTransformer3DModel`` (patch 2 -> height / width multiples of 16, the pipeline's own rule; one
  token-refiner, one dual- and one single-stream block); a 3-layer Llama (hidden 32) read through the pipeline's video
  template with a Llama-3-style byte-level BPE whose template prefix is 95 tokens as the real tokenizer's (the pipeline
  drops exactly 95), and CLIP's pooled output; FlowMatchEuler with HunyuanVideo's static shift 7. The pipeline's
  default is 720x1280 with 129 frames: pass ``height`` / ``width`` / ``num_frames`` (32, 32, 5) for speed.
- Z-Image (``zimage``, a ``ZImagePipeline``): FLUX's AutoencoderKL layout (4 latent channels, FLUX's scaling / shift
  factors) and a ``ZImageTransformer2DModel`` (dim 32, 2 heads of 16 = RoPE axes 4 + 6 + 6, patch 2: height / width
  multiples of 4, one noise- and one context-refiner block, 2 main blocks); a Qwen3 text encoder (hidden 32 = the
  transformer's ``cap_feat_dim``; the pipeline reads its second-to-last hidden state) with the tiny Qwen BPE and a
  Qwen3-style chat template; Z-Image-Turbo's scheduler (static shift 3). Its timestep embedder's 1024-wide hidden layer
  is fixed in diffusers (most of its 0.36 M parameters). The pipeline's default size is 1024²: pass ``height`` /
  ``width``.
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
from typing import Any, Literal

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLQwenImage,
    AutoencoderKLWan,
    AutoencoderTiny,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    FluxTransformer2DModel,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    UniPCMultistepScheduler,
    WanTransformer3DModel,
    ZImageTransformer2DModel,
)
from diffusers.utils import logging as diffusers_logging
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen3Config,
    Qwen3Model,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
    UMT5Config,
    UMT5EncoderModel,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from flowgrpo.adapters.registry import families, family

# CLIP BPE vocabulary: 256 byte symbols, the same 256 with "</w>", the first merges, 2 specials.
# Truncating CLIP's ranked merge list keeps a valid BPE (each merge only uses earlier symbols).
CLIP_VOCAB_SIZE = 1000
CLIP_MAX_LENGTH = 77  # what SD3 / FLUX pipelines pad CLIP prompts to (tokenizer.model_max_length)
T5_MAX_LENGTH = 512  # FLUX's max_sequence_length; SD3 uses 256

TINY_SIZES: dict[str, dict[str, int]] = {
    "sd3": {
        "latent_channels": 16,
        "vae_scale_factor": 2,
        "resolution_multiple": 4,
        "default_resolution": 64,
        "pooled_dim": 64,
        "joint_dim": 32,
    },
    "flux": {
        "latent_channels": 4,
        "vae_scale_factor": 2,
        "resolution_multiple": 4,
        "default_resolution": 256,
        "pooled_dim": 32,
        "joint_dim": 32,
    },
    # FluxKontextPipeline around the same components as "flux" (its default size 1024² comes from max_area).
    "flux-kontext": {
        "latent_channels": 4,
        "vae_scale_factor": 2,
        "resolution_multiple": 4,
        "default_resolution": 1024,
        "pooled_dim": 32,
        "joint_dim": 32,
    },
    "qwenimage": {
        "latent_channels": 4,
        "vae_scale_factor": 2,
        "resolution_multiple": 4,
        "default_resolution": 256,
        "pooled_dim": 0,
        "joint_dim": 32,
    },
    # QwenImageEditPipeline around the qwenimage components; its default size, like its source's, is ~1024² pixels.
    "qwenimage-edit": {
        "latent_channels": 4,
        "vae_scale_factor": 2,
        "resolution_multiple": 4,
        "default_resolution": 1024,
        "pooled_dim": 0,
        "joint_dim": 32,
    },
    # WanPipeline (text-to-video); its default size is 480x832 with 81 frames.
    "wan": {
        "latent_channels": 4,
        "vae_scale_factor": 4,
        "temporal_factor": 4,
        "resolution_multiple": 16,
        "default_resolution": 480,
        "default_num_frames": 81,
        "pooled_dim": 0,
        "joint_dim": 32,
    },
    # ZImagePipeline; its default size is 1024x1024.
    "zimage": {
        "latent_channels": 4,
        "vae_scale_factor": 2,
        "resolution_multiple": 4,
        "default_resolution": 1024,
        "pooled_dim": 0,
        "joint_dim": 32,
    },
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


# Qwen-Image's prompt template (QwenImagePipeline.prompt_template_encode): its system part is 34 tokens for the real
# tokenizer, and the pipeline drops exactly 34. Each of its words is one token in the tiny BPE too.
QWEN_TEMPLATE_WORDS = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"
)
# Words of the test and tiny prompts, so that they cost a token each; anything else falls back to bytes.
QWEN_EXTRA_WORDS = (
    "a an the photo of on in at over with and two three red blue green yellow white black cube ball sign that says "
    'hello "hello" cat dog apple table sunset sea city street night bowl fruit mountain lake portrait old man field '
    "flowers lighthouse cliff cup coffee snowy forest taxi"
)
# Qwen2.5-VL's special tokens, in the real tokenizer's order (ids follow the BPE vocabulary, as there).
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
QWEN_MAX_LENGTH = 1024 + 34  # what QwenImagePipeline truncates to: tokenizer_max_length + the dropped system prompt


# Qwen-Image-Edit's template (QwenImageEditPipeline.prompt_template_encode) up to the image: 64 tokens for the real
# tokenizer and for the edit BPE (the pipeline drops exactly 64), and the words of the tiny editing prompts.
QWEN_EDIT_WORDS = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new image "
    "that meets the user's requirements while maintaining consistency with the original input where appropriate."
    "<|im_end|>\n<|im_start|>user\n make add remove turn second one square squares circle triangle stripe stripes"
)


@functools.cache
def _qwen_bpe(edit: bool = False) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(vocab tokens in id order, merges) of a byte-level BPE trained on the words above (cached: built once)."""
    text = QWEN_TEMPLATE_WORDS + " " + QWEN_EXTRA_WORDS + (" " + QWEN_EDIT_WORDS if edit else "")
    return _byte_bpe((text.replace("<|im_start|>", "").replace("<|im_end|>", ""),))


@functools.cache
def _byte_bpe(texts: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(vocab tokens in id order, merges) of a byte-level BPE trained on ``texts``, each pre-tokenized on its own.

    Plain BPE training with a fixed tie-break (most frequent pair, then the smallest), run until every word is
    one token: deterministic, independent of the ``tokenizers`` version. The pre-tokenizer is Qwen2's own.
    """
    splitter = Qwen2Tokenizer(vocab={"<|endoftext|>": 0}, merges=[]).backend_tokenizer.pre_tokenizer
    counts: dict[tuple[str, ...], int] = {}
    for word, _ in (piece for text in texts for piece in splitter.pre_tokenize_str(text)):
        key = tuple(word)
        counts[key] = counts.get(key, 0) + 1
    words = {key: list(key) for key in counts}
    merges: list[tuple[str, str]] = []
    while True:
        pairs: dict[tuple[str, str], int] = {}
        for key, symbols in words.items():
            for pair in zip(symbols, symbols[1:], strict=False):
                pairs[pair] = pairs.get(pair, 0) + counts[key]
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        for symbols in words.values():
            i = 0
            while i < len(symbols) - 1:
                if (symbols[i], symbols[i + 1]) == best:
                    symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
                i += 1
    vocab = list(bytes_to_unicode().values()) + ["".join(m) for m in merges]
    return tuple(vocab), tuple(merges)


def tiny_qwen_tokenizer(edit: bool = False) -> Qwen2Tokenizer:
    """A Qwen2 byte-level BPE tokenizer (Qwen2's pre-tokenizer, NFC, the chat specials) with a small vocabulary."""
    vocab, merges = _qwen_bpe(edit)
    ids = {token: i for i, token in enumerate(vocab + QWEN_SPECIAL_TOKENS)}
    return Qwen2Tokenizer(
        vocab=ids,
        merges=list(merges),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
        model_max_length=QWEN_MAX_LENGTH,
    )


def __getattr__(name: str) -> Any:
    if name == "TINY_KINDS":  # the registered families with a tiny build, derived on each access
        return tuple(spec.name for spec in families() if spec.tiny is not None)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def sd3_components(seed: int, vae: str = "kl") -> dict[str, object]:
    """The tiny ``sd3`` family's components (``vae``: ``kl`` or ``tiny``)."""
    tok, tok_2, tok_3 = tiny_clip_tokenizer(), tiny_clip_tokenizer(), tiny_t5_tokenizer()
    s = seed * 16  # component offsets below stay < 16, so seeds never collide across pipelines
    return {
        # SD3.5-medium layout in miniature: qk RMS-norm, dual attention in the first block,
        # caption_projection_dim = heads * head_dim, pooled = the two CLIP projections concatenated.
        "transformer": _seeded(
            s + 0,
            lambda: SD3Transformer2DModel(
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
            ),
        ),
        "vae": _seeded(
            s + 1,
            lambda: (
                _vae(16, scaling_factor=1.5305, shift_factor=0.0609)  # SD3.5's factors
                if vae == "kl"
                else _tiny_autoencoder(16)
            ),
        ),
        "text_encoder": _seeded(s + 2, lambda: CLIPTextModelWithProjection(_clip_config(tok, 8, 32))),
        "text_encoder_2": _seeded(s + 3, lambda: CLIPTextModelWithProjection(_clip_config(tok_2, 16, 32))),
        "text_encoder_3": _seeded(s + 4, lambda: _t5_encoder(tok_3)),
        "tokenizer": tok,
        "tokenizer_2": tok_2,
        "tokenizer_3": tok_3,
        "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
    }


# The structure of Qwen3's chat template for what ZImagePipeline encodes (one user message, the generation prompt,
# enable_thinking=True): "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n". enable_thinking=False would
# add Qwen3's empty think block, as the real template does.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def zimage_components(seed: int, vae: str = "kl") -> dict[str, object]:
    """The tiny ``zimage`` family's components. ``vae``: only ``kl`` (``ZImagePipeline`` reads the VAE's
    ``block_out_channels`` and ``shift_factor``, which the tiny AutoencoderTiny lacks)."""
    if vae != "kl":
        raise ValueError("the tiny zimage pipeline has only vae='kl' (an AutoencoderKL with FLUX's factors)")
    tok = tiny_qwen_tokenizer()
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    s = seed * 16
    text = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,  # the pipeline reads hidden_states[-2]: the first layer's output
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=QWEN_MAX_LENGTH,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return {
        # Z-Image's single-stream layout in miniature: refiner blocks for the image and the caption tokens, then joint
        # blocks over [image, caption]; RoPE axes (frame/caption position, row, column) summing to the head dim.
        "transformer": _seeded(
            s + 0,
            lambda: ZImageTransformer2DModel(
                all_patch_size=(2,),
                all_f_patch_size=(1,),
                in_channels=4,
                dim=32,
                n_layers=2,
                n_refiner_layers=1,
                n_heads=2,
                n_kv_heads=2,
                cap_feat_dim=32,  # the text encoder's hidden size
                axes_dims=[4, 6, 6],
                axes_lens=[1024, 512, 512],
            ),
        ),
        "vae": _seeded(s + 1, lambda: _vae(4, scaling_factor=0.3611, shift_factor=0.1159)),  # FLUX's, as Z-Image's
        "text_encoder": _seeded(s + 2, lambda: Qwen3Model(text)),
        "tokenizer": tok,
        # Z-Image-Turbo's scheduler config: a static shift of 3 (the pipeline passes mu, which this config ignores).
        "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False),
    }


def flux_components(seed: int, vae: str = "kl") -> dict[str, object]:
    """The tiny ``flux`` family's components, also ``flux-kontext``'s (``vae``: ``kl`` or ``tiny``)."""
    tok, tok_2 = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    s = seed * 16
    return {
        # FLUX.1-dev layout in miniature: guidance embedding, RoPE axes summing to the head dim,
        # pooled = CLIP's pooled output (hidden size 32), joint = T5's d_model.
        "transformer": _seeded(
            s + 0,
            lambda: FluxTransformer2DModel(
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
            ),
        ),
        "vae": _seeded(
            s + 1,
            lambda: (
                _vae(4, scaling_factor=0.3611, shift_factor=0.1159)  # FLUX's factors
                if vae == "kl"
                else _tiny_autoencoder(4)
            ),
        ),
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


# FLUX.2 ([klein]: Qwen3 prompts; [dev]: Mistral-Small-3.1 prompts). The pipelines read the hidden states of text
# layers (9, 18, 27) / (10, 20, 30) by default, so the tiny text models are that deep (28 / 31 layers of width 16:
# under 0.1 M parameters each) and pipe()'s defaults run unchanged. The VAE's latents are 2x2-patchified and
# normalised by its BatchNorm's running statistics (set to non-trivial values here, as a trained VAE's).

# Mistral-Small-3.1's chat template reduced to what Flux2Pipeline renders with it (a system message and a user
# message, each a list of text parts): "<s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]", as the real one.
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{%- if message['content'] is string %}"
    "{%- set text = message['content'] %}{%- else %}{%- set text = message['content'] | selectattr('type', "
    "'equalto', 'text') | map(attribute='text') | join('') %}{%- endif %}{%- if message['role'] == 'system' %}"
    "{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}{%- elif message['role'] == 'user' %}"
    "{{- '[INST]' + text + '[/INST]' }}{%- else %}{{- text + eos_token }}{%- endif %}{%- endfor %}"
)
# Mistral's special tokens first, as in its tokenizer (<unk> 0, <s> 1, </s> 2), then the Pixtral image tokens.
MISTRAL_SPECIAL_TOKENS = (
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
)


def _flux2_shared(seed: int, vae: str, guidance_embeds: bool) -> dict[str, object]:
    """The FLUX.2 transformer, VAE and scheduler in miniature (``[klein]``: no guidance embedding)."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel  # imported on use, as the text models below

    if vae != "kl":
        raise ValueError("the tiny FLUX.2 pipelines have only vae='kl' (an AutoencoderKLFlux2)")

    def autoencoder() -> AutoencoderKLFlux2:
        model = AutoencoderKLFlux2(
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(8, 16),  # vae_scale_factor 2; 2x2 patches on top: sizes are multiples of 4
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=8,
            sample_size=64,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
        with torch.no_grad():  # the patchified latents' statistics, which the pipelines normalise by
            model.bn.running_mean.normal_(0.0, 0.5)
            model.bn.running_var.uniform_(0.5, 2.0)
        return model

    s = seed * 16
    return {
        # FLUX.2's layout: double- and single-stream blocks, 4-axis RoPE (time, row, column, token) summing to the
        # head dim, joint_attention_dim = 3 text layers x their width 16.
        "transformer": _seeded(
            s + 0,
            lambda: Flux2Transformer2DModel(
                patch_size=1,
                in_channels=16,  # 4 latent channels x 2x2 patches
                num_layers=1,
                num_single_layers=1,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=48,
                timestep_guidance_channels=32,
                axes_dims_rope=(4, 4, 4, 4),
                guidance_embeds=guidance_embeds,
            ),
        ),
        "vae": _seeded(s + 1, autoencoder),
        # FLUX.1's dynamic-shift config; pipe() computes its own mu (compute_empirical_mu) from the token count and
        # the step count, so only use_dynamic_shifting and the exponential shift of this config take effect.
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


def flux2_klein_components(seed: int, vae: str = "kl") -> dict[str, object]:
    """The tiny ``flux2-klein`` family's components (a ``Flux2KleinPipeline``, ``is_distilled=False``: the base
    model's true CFG): a Qwen3 of 28 layers with the tiny Qwen BPE, Qwen3's ``<think>`` tokens and chat template.
    ``vae``: only ``kl`` (an AutoencoderKLFlux2)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    components = _flux2_shared(seed, vae, guidance_embeds=False)
    tok = tiny_qwen_tokenizer()
    tok.add_tokens(["<think>", "</think>"])  # Qwen3's, outside Qwen2.5's vocabulary
    tok.chat_template = QWEN3_CHAT_TEMPLATE  # Klein renders it with enable_thinking=False: the empty think block
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=28,  # layers 9, 18, 27 are read
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=QWEN_MAX_LENGTH,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    text_encoder = _seeded(seed * 16 + 2, lambda: Qwen3ForCausalLM(config))
    return {**components, "text_encoder": text_encoder, "tokenizer": tok, "is_distilled": False}


def flux2_components(seed: int, vae: str = "kl") -> dict[str, object]:
    """The tiny ``flux2`` family's components (a ``Flux2Pipeline``, FLUX.2 [dev]: guidance embedding): a
    Mistral3ForConditionalGeneration of 31 text layers with a one-layer Pixtral vision tower (Flux2Pipeline encodes
    text only; the processor and model need one), read through a ``PixtralProcessor`` over the tiny byte-level BPE
    with Mistral's special tokens and a reduced chat template. ``vae``: only ``kl`` (an AutoencoderKLFlux2)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralImageProcessor, PixtralProcessor

    components = _flux2_shared(seed, vae, guidance_embeds=True)
    vocab, merges = _qwen_bpe()
    tok = Qwen2Tokenizer(  # byte-level BPE, as Mistral's tekken tokenizer
        vocab={token: i for i, token in enumerate(MISTRAL_SPECIAL_TOKENS + vocab)},
        merges=list(merges),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=list(MISTRAL_SPECIAL_TOKENS[4:]),
        model_max_length=2048,
    )
    processor = PixtralProcessor(
        image_processor=PixtralImageProcessor(patch_size=4, size={"longest_edge": 32}),
        tokenizer=tok,
        patch_size=4,
        spatial_merge_size=1,
        chat_template=MISTRAL_CHAT_TEMPLATE,
    )
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": len(tok),
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 31,  # layers 10, 20, 30 are read
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "max_position_embeddings": 2048,
            "sliding_window": None,
            **special,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 4,
            "image_size": 32,
            "patch_size": 4,
            "num_channels": 3,
        },
        image_token_index=tok.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=1,
        vision_feature_layer=-1,
    )
    text_encoder = _seeded(seed * 16 + 2, lambda: Mistral3ForConditionalGeneration(config))
    return {**components, "text_encoder": text_encoder, "tokenizer": processor}


def _qwen_text_encoder(tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    vision = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": 32,
        "patch_size": 2,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 4,
        "fullatt_block_indexes": [0],
    }  # reads the source image in qwenimage-edit only
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": QWEN_MAX_LENGTH,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},  # sums to 8/2
        "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    special = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=special("<|image_pad|>"),
        video_token_id=special("<|video_pad|>"),
        vision_start_token_id=special("<|vision_start|>"),
        vision_end_token_id=special("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def _qwen_processor(tokenizer: Qwen2Tokenizer, max_pixels: int = 64 * 64) -> Qwen2VLProcessor:
    """What Qwen-Image-Edit's text encoder reads the source image through: Qwen2.5-VL's processor with the tiny vision
    tower's patching (2x2 patches, 2 frames, 2x2 merge) and images kept between 16² and ``max_pixels`` pixels (the
    real one: 14x14 patches, 56² to 3584²)."""
    patching = {"patch_size": 2, "temporal_patch_size": 2, "merge_size": 2}
    images = Qwen2VLImageProcessor(**patching, min_pixels=16 * 16, max_pixels=max_pixels)
    videos = Qwen2VLVideoProcessor(**patching)  # unused, but the processor needs one
    return Qwen2VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=videos)


def qwenimage_components(seed: int, vae: str = "kl", edit: bool = False) -> dict[str, object]:
    """The tiny ``qwenimage`` family's components (``edit``: ``qwenimage-edit``'s, the same transformer and VAE with a
    text encoder that also reads the source image). ``vae``: only ``kl`` (an AutoencoderKLQwenImage)."""
    if vae != "kl":
        raise ValueError(
            f"the tiny {'qwenimage-edit' if edit else 'qwenimage'} pipeline has only vae='kl' (an "
            "AutoencoderKLQwenImage)"
        )
    tok = tiny_qwen_tokenizer(edit)
    s = seed * 16
    extra = {"processor": _qwen_processor(tok)} if edit else {}  # edit: the text encoder reads the source image too
    return {
        **extra,
        # Qwen-Image's layout in miniature: 2x2 patches of 4 latent channels, joint attention on the text
        # stream (dim = the text encoder's hidden size), RoPE axes summing to the head dim, no guidance embedding.
        "transformer": _seeded(
            s + 0,
            lambda: QwenImageTransformer2DModel(
                patch_size=2,
                in_channels=16,  # 4 latent channels x 2x2 packing
                out_channels=4,
                num_layers=2,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=32,
                guidance_embeds=False,
                axes_dims_rope=(4, 6, 6),
            ),
        ),
        # One down/up-sampling -> vae_scale_factor 2 (= 2 ** len(temperal_downsample)); the real first 4 channel stats.
        "vae": _seeded(
            s + 1,
            lambda: AutoencoderKLQwenImage(
                base_dim=4,
                z_dim=4,
                dim_mult=[1, 2],
                num_res_blocks=1,
                temperal_downsample=[False],
                latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075],
                latents_std=[2.8184, 1.4541, 2.3275, 2.6558],
            ),
        ),
        "text_encoder": _seeded(s + 2, lambda: _qwen_text_encoder(tok)),
        "tokenizer": tok,
        # Qwen-Image's scheduler config: dynamic exponential shift from the image token count, terminal sigma 0.02.
        "scheduler": FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000,
            shift=1.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=0.9,
            base_image_seq_len=256,
            max_image_seq_len=8192,
            shift_terminal=0.02,
            time_shift_type="exponential",
        ),
    }


def qwenimage_edit_components(seed: int, vae: str = "kl") -> dict[str, object]:
    """The tiny ``qwenimage-edit`` family's components: :func:`qwenimage_components` with ``edit=True``."""
    return qwenimage_components(seed, vae, edit=True)


def qwenimage_edit_plus_components(seed: int, vae: str = "kl") -> dict[str, object]:
    """The tiny ``qwenimage-edit-plus`` family's components: ``qwenimage-edit``'s (the same weights), with a processor
    that reads each picture at 32² pixels at most (64 tokens): ``pipe()`` hands it 384²-pixel pictures, several per
    prompt, which the edit processor would read at 64² (256 tokens each)."""
    components = qwenimage_components(seed, vae, edit=True)
    return {**components, "processor": _qwen_processor(components["tokenizer"], max_pixels=32 * 32)}


def _umt5_encoder(tokenizer: T5Tokenizer) -> UMT5EncoderModel:
    config = UMT5Config(
        vocab_size=len(tokenizer),
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",  # umt5-xxl, as Wan uses
        tie_word_embeddings=False,
        is_encoder_decoder=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return UMT5EncoderModel(config)


def wan_components(seed: int, vae: str = "kl") -> dict[str, object]:
    """The tiny ``wan`` family's components. ``vae``: only ``kl`` (an AutoencoderKLWan)."""
    if vae != "kl":
        raise ValueError("the tiny wan pipeline has only vae='kl' (an AutoencoderKLWan)")
    tok = tiny_t5_tokenizer()
    s = seed * 16
    return {
        "transformer": _seeded(s + 0, _wan_transformer),
        # Two down-sampling stages, both also halving time: spatial factor 4, temporal factor 4 (the real VAE's).
        "vae": _seeded(
            s + 1,
            lambda: AutoencoderKLWan(
                base_dim=4,
                z_dim=4,
                dim_mult=[1, 2, 2],
                num_res_blocks=1,
                temperal_downsample=[True, True],
                latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075],
                latents_std=[2.8184, 1.4541, 2.3275, 2.6558],
                scale_factor_temporal=4,
                scale_factor_spatial=4,
            ),
        ),
        "text_encoder": _seeded(s + 2, lambda: _umt5_encoder(tok)),
        "tokenizer": tok,
        # Wan2.1-T2V-1.3B-Diffusers' scheduler config: UniPC on flow sigmas with a static shift of 3 (480p).
        "scheduler": UniPCMultistepScheduler(
            num_train_timesteps=1000,
            prediction_type="flow_prediction",
            use_flow_sigmas=True,
            flow_shift=3.0,
            solver_order=2,
            final_sigmas_type="zero",
        ),
    }


def _wan_transformer(channels: int = 4, **options: Any) -> WanTransformer3DModel:
    """Wan's transformer in miniature: 3D patches (1, 2, 2), self-attention with RoPE over (frame, row, column)
    (head dim 12 = 4 + 4 + 4), cross-attention on the UMT5 embeddings (text_dim = d_model 32). ``channels``: its
    latent channels in and out; ``options``: more of its config (image-to-video's)."""
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=options.pop("in_channels", channels),
        out_channels=channels,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
        **options,
    )


def wan22_components(seed: int, vae: str = "kl", *, ti2v: bool = False) -> dict[str, object]:
    """Wan2.2 text-to-video in miniature, for ``WanPipeline(**components)`` (the ``wan`` family has one tiny source,
    Wan2.1's). Default: A14B's layout, :func:`wan_components` plus a second transformer (seeded apart) as the
    low-noise expert ``transformer_2`` and ``boundary_ratio`` 0.875 (the T2V-A14B's). ``ti2v``: TI2V-5B's instead, one
    transformer on the Wan2.2 VAE's latents (``is_residual``, a 2x2 patchify before the encoder: spatial factor 8
    here, z_dim 8 where the real one has 48) with ``expand_timesteps`` (per-token timesteps)."""
    components = wan_components(seed, vae)
    s = seed * 16
    if not ti2v:
        return {**components, "transformer_2": _seeded(s + 3, _wan_transformer), "boundary_ratio": 0.875}
    z_dim = 8
    components["vae"] = _seeded(
        s + 4,
        lambda: AutoencoderKLWan(
            base_dim=8,
            z_dim=z_dim,
            dim_mult=[1, 2, 2],
            num_res_blocks=1,
            temperal_downsample=[True, True],
            is_residual=True,
            in_channels=12,  # 3 colours x the 2x2 patch
            out_channels=12,
            patch_size=2,
            # Wan2.1's first 8 statistics (AutoencoderKLWan's defaults; the real Wan2.2 VAE has its own 48)
            latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508],
            latents_std=[2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743],
            scale_factor_temporal=4,
            scale_factor_spatial=8,
        ),
    )
    components["transformer"] = _seeded(s + 0, lambda: _wan_transformer(z_dim))
    return {**components, "expand_timesteps": True}


def wan_i2v_components(seed: int, vae: str = "kl", *, wan22: bool = False) -> dict[str, object]:
    """The tiny ``wan-i2v`` family's components (``WanImageToVideoPipeline``): the tiny wan VAE, UMT5 and scheduler,
    with a transformer that takes the noisy latents, the 4-channel first-frame mask and the image's latents
    (4 + 4 + 4 = 12 channels in, as the real 16 + 4 + 16 = 36). Default: Wan2.1 I2V's layout, with a tiny CLIP vision
    tower (patch 8 on 32² crops: 17 tokens, hidden 16) whose penultimate hidden states reach the transformer's image
    cross-attention (``image_dim`` 16, ``added_kv_proj_dim`` = its inner dim 24). ``wan22``: Wan2.2 I2V A14B's, two such
    transformers without the image branch (no image encoder) and ``boundary_ratio`` 0.9."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel  # only this build uses them

    components = wan_components(seed, vae)
    s = seed * 16
    if wan22:
        expert = lambda: _wan_transformer(in_channels=12)  # noqa: E731
        return {
            **components,
            "transformer": _seeded(s + 5, expert),
            "transformer_2": _seeded(s + 6, expert),
            "boundary_ratio": 0.9,
            "image_encoder": None,
            "image_processor": None,
        }
    vision = CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        projection_dim=16,
    )
    return {
        **components,
        "transformer": _seeded(s + 5, lambda: _wan_transformer(in_channels=12, image_dim=16, added_kv_proj_dim=24)),
        "image_encoder": _seeded(s + 7, lambda: CLIPVisionModel(vision)),
        "image_processor": CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
    }


# HunyuanVideo's Llama-3 tokenizer in miniature: Llama-3's special tokens and pre-tokenizer split (its digits in runs of
# up to 3, else Qwen2's), byte-level BPE, <|begin_of_text|> prepended. HunyuanVideoPipeline drops the first 95 tokens
# (crop_start of DEFAULT_PROMPT_TEMPLATE): <|begin_of_text|> and the template up to the prompt, 95 tokens for the real
# tokenizer, and each word of the template is one token of the tiny BPE too: the same 95 are dropped.
LLAMA3_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
LLAMA_MAX_LENGTH = 512  # the tiny Llama's positions: 95 template tokens + HunyuanVideoPipeline's 256 + room


def tiny_llama3_tokenizer() -> Any:
    """A Llama-3-style byte-level BPE tokenizer (``PreTrainedTokenizerFast``, as Llama-3's own) whose vocabulary holds
    HunyuanVideo's prompt template and the tiny prompts' words, one token each; padding on the right."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    texts = re.split("|".join(map(re.escape, LLAMA3_SPECIAL_TOKENS)), DEFAULT_PROMPT_TEMPLATE["template"])
    vocab, merges = _byte_bpe((*texts, QWEN_EXTRA_WORDS))
    ids = {token: i for i, token in enumerate(vocab + LLAMA3_SPECIAL_TOKENS)}
    backend = Tokenizer(models.BPE(vocab=ids, merges=list(merges)))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    bos = LLAMA3_SPECIAL_TOKENS[0]
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, ids[bos])])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token="<|end_of_text|>",
        pad_token="<|end_of_text|>",
        additional_special_tokens=list(LLAMA3_SPECIAL_TOKENS[2:]),
        model_max_length=LLAMA_MAX_LENGTH,
    )


def hunyuanvideo_components(seed: int, vae: str = "kl") -> dict[str, object]:
    """The tiny ``hunyuanvideo`` family's components (``HunyuanVideoPipeline``, text-to-video): HunyuanVideo's layout in
    miniature. A guidance-distilled ``HunyuanVideoTransformer3DModel`` (patch 2 x 2, one frame; 2 heads of 16 = RoPE
    axes 4 + 6 + 6 over (frame, row, column); one token-refiner, one dual- and one single-stream block); an
    ``AutoencoderKLHunyuanVideo`` with the real factors (spatial 8, temporal 4: ``num_frames = 4k + 1``, sizes multiples
    of 16) and scaling factor, 4 latent channels; a Llama of 3 layers (hidden 32; the pipeline reads
    ``hidden_states[-3]``, the first layer's output) with the tiny Llama-3 tokenizer; CLIP's pooled output (hidden 32);
    FlowMatchEuler with HunyuanVideo's static shift 7. ``vae``: only ``kl``. The pipeline's default is 720 x 1280
    with 129 frames: pass ``height`` / ``width`` / ``num_frames`` (32, 32, 5) for speed."""
    from diffusers import AutoencoderKLHunyuanVideo, HunyuanVideoTransformer3DModel
    from transformers import LlamaConfig, LlamaModel

    if vae != "kl":
        raise ValueError("the tiny hunyuanvideo pipeline has only vae='kl' (an AutoencoderKLHunyuanVideo)")
    tok, tok_2 = tiny_llama3_tokenizer(), tiny_clip_tokenizer()
    llama = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=LLAMA_MAX_LENGTH,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    s = seed * 16
    return {
        "transformer": _seeded(
            s + 0,
            lambda: HunyuanVideoTransformer3DModel(
                in_channels=4,
                out_channels=4,
                num_attention_heads=2,
                attention_head_dim=16,
                num_layers=1,
                num_single_layers=1,
                num_refiner_layers=1,
                mlp_ratio=2.0,
                patch_size=2,
                patch_size_t=1,
                guidance_embeds=True,
                text_embed_dim=32,  # the Llama's hidden size
                pooled_projection_dim=32,  # CLIP's
                rope_axes_dim=(4, 6, 6),
            ),
        ),
        # Four blocks: three spatial down-samplings (8) and two temporal ones (4), as the real VAE.
        "vae": _seeded(
            s + 1,
            lambda: AutoencoderKLHunyuanVideo(
                latent_channels=4,
                block_out_channels=(8, 8, 8, 8),
                layers_per_block=1,
                norm_num_groups=4,
                scaling_factor=0.476986,
                spatial_compression_ratio=8,
                temporal_compression_ratio=4,
            ),
        ),
        "text_encoder": _seeded(s + 2, lambda: LlamaModel(llama)),
        "tokenizer": tok,
        "text_encoder_2": _seeded(s + 3, lambda: CLIPTextModel(_clip_config(tok_2, 32, 32))),
        "tokenizer_2": tok_2,
        # FlowMatchEuler with HunyuanVideo's flow shift 7 (its sampling default; diffusers' HunyuanVideo tests too).
        "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=7.0),
    }


def tiny_gemma_tokenizer() -> Any:
    """A Gemma tokenizer (``GemmaTokenizer``: ``▁`` for spaces, ``<bos>`` first, as the real one) over single
    characters: every prompt tokenizes, with Gemma's special tokens' ids (``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2)."""
    import string

    from transformers import GemmaTokenizer  # only the LTX-2 build uses it

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    pieces = ["▁", *string.ascii_letters, *string.digits, *string.punctuation]
    return GemmaTokenizer(vocab={t: i for i, t in enumerate(specials + pieces)}, merges=[], add_bos_token=True)


def ltx2_components(seed: int, vae: str = "kl") -> dict[str, object]:
    """The tiny ``ltx2`` family's components (``LTX2Pipeline``, text-to-video with audio), after diffusers' own tiny
    LTX-2 test build (tests/pipelines/ltx2/test_ltx2.py): a Gemma-3 (hidden 16, 2 layers: 3 stacked hidden states,
    a tiny SigLIP tower the pipeline never runs) with :func:`tiny_gemma_tokenizer`; LTX-2.0's connectors (one layer
    per stream, no registers); a 2-block audio-visual transformer whose video tokens (4 latent channels, patch 1)
    and audio tokens (2 channels x 2 latent mel bins) are both 4 wide, as LTX-2's are both 128; an
    ``AutoencoderKLLTX2Video`` with two spatio-temporal stages (spatial and temporal factor 4: ``num_frames = 4k + 1``,
    height / width multiples of 32 by the pipeline's own rule) and non-trivial ``latents_mean`` / ``latents_std`` /
    ``scaling_factor``; the audio VAE (8 mel bins) and vocoder ``pipe()`` needs to build and to return audio; the
    scheduler with the shift rule ``pipe()`` falls back to (base / max sequence 1024 / 4096, shifts 0.95 / 2.05),
    dynamic. ``vae``: only ``kl``."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    if vae != "kl":
        raise ValueError("the tiny ltx2 pipeline has only vae='kl' (an AutoencoderKLLTX2Video)")
    tok = tiny_gemma_tokenizer()
    text = Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=2048,  # pipe() pads every prompt to 1024 tokens
        sliding_window=64,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    gemma = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)

    def video_vae() -> AutoencoderKLLTX2Video:
        model = AutoencoderKLLTX2Video(
            latent_channels=4,
            block_out_channels=(8, 8),
            decoder_block_out_channels=(8, 8),
            layers_per_block=(1, 1, 1),
            decoder_layers_per_block=(1, 1, 1),
            spatio_temporal_scaling=(True, True),
            decoder_spatio_temporal_scaling=(True, True),
            decoder_inject_noise=(False, False, False),
            downsample_type=("spatiotemporal", "spatiotemporal"),
            upsample_type=("spatiotemporal", "spatiotemporal"),
            upsample_residual=(False, False),
            upsample_factor=(1, 1),
            patch_size=1,
            patch_size_t=1,
            scaling_factor=0.9,
            decoder_causal=False,
        )
        with torch.no_grad():  # the per-channel statistics pipe() (de)normalises the latents by
            model.latents_mean.copy_(torch.tensor([0.1, -0.2, 0.05, 0.3]))
            model.latents_std.copy_(torch.tensor([0.8, 1.3, 1.1, 0.6]))
        return model

    s = seed * 16
    return {
        "transformer": _seeded(
            s + 0,
            lambda: LTX2VideoTransformer3DModel(
                in_channels=4,
                out_channels=4,
                num_attention_heads=2,
                attention_head_dim=8,
                cross_attention_dim=16,
                vae_scale_factors=(4, 4, 4),  # the tiny VAE's (temporal, height, width) factors, for the positions
                audio_in_channels=4,
                audio_out_channels=4,
                audio_num_attention_heads=2,
                audio_attention_head_dim=4,
                audio_cross_attention_dim=8,
                num_layers=2,
                caption_channels=16,
                rope_double_precision=False,
            ),
        ),
        "vae": _seeded(s + 1, video_vae),
        "audio_vae": _seeded(
            s + 2,
            lambda: AutoencoderKLLTX2Audio(
                base_channels=4,
                output_channels=2,
                ch_mult=(1,),
                num_res_blocks=1,
                attn_resolutions=None,
                in_channels=2,
                resolution=32,
                latent_channels=2,
                norm_type="pixel",
                causality_axis="height",
                mid_block_add_attention=False,
                mel_bins=8,
            ),
        ),
        "text_encoder": _seeded(s + 3, lambda: Gemma3ForConditionalGeneration(gemma)),
        "tokenizer": tok,
        "connectors": _seeded(
            s + 4,
            lambda: LTX2TextConnectors(
                caption_channels=16,
                text_proj_in_factor=3,  # Gemma's 2 layers + the embeddings
                video_connector_num_attention_heads=2,
                video_connector_attention_head_dim=8,
                video_connector_num_layers=1,
                video_connector_num_learnable_registers=None,
                audio_connector_num_attention_heads=2,
                audio_connector_attention_head_dim=8,
                audio_connector_num_layers=1,
                audio_connector_num_learnable_registers=None,
                connector_rope_base_seq_len=32,
                rope_double_precision=False,
            ),
        ),
        "vocoder": _seeded(
            s + 5,
            lambda: LTX2Vocoder(
                in_channels=16,  # the audio VAE's 2 output channels x 8 mel bins
                hidden_channels=32,
                out_channels=2,
                upsample_kernel_sizes=[4, 4],
                upsample_factors=[2, 2],
                resnet_kernel_sizes=[3],
                resnet_dilations=[[1, 3, 5]],
                output_sampling_rate=16000,
            ),
        ),
        "scheduler": FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000,
            use_dynamic_shifting=True,
            base_shift=0.95,
            max_shift=2.05,
            base_image_seq_len=1024,
            max_image_seq_len=4096,
        ),
    }


def build_tiny_pipeline(
    kind: str, seed: int = 0, dtype: torch.dtype = torch.float32, vae: Literal["kl", "tiny"] = "kl"
) -> DiffusionPipeline:
    """A tiny random-weight pipeline of a registered family on CPU, in eval mode; same seed -> same weights.

    The family's spec gives the components (its ``tiny`` builder) and the pipeline class (its first).
    vae: ``kl`` — an AutoencoderKL with the real model's scaling/shift factors (default; Qwen-Image / Wan: their own
    VAE type, the only choice); ``tiny`` — a TAESD-style AutoencoderTiny without normalisation layers, on which
    image-level rewards (brightness) respond to the policy: the CPU learning tests use it.
    """
    if vae not in ("kl", "tiny"):
        raise ValueError(f"tiny pipeline vae must be 'kl' or 'tiny', got {vae!r}")
    tiny_kinds = tuple(spec.name for spec in families() if spec.tiny is not None)
    if kind not in tiny_kinds:
        raise ValueError(f"unknown tiny pipeline kind {kind!r}; expected one of {tiny_kinds}")
    spec = family(kind)
    if vae not in spec.tiny_vaes:
        raise ValueError(f"the tiny {kind} pipeline has only vae={' or '.join(map(repr, spec.tiny_vaes))}")
    pipe = spec.pipeline_class(**spec.tiny_builder(seed, vae))
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
