"""``imagereward``: ImageReward v1.0 (https://arxiv.org/abs/2304.05977) on transformers' BLIP modules.

The model is BLIP's ViT-L/16 image encoder, a BERT-base text encoder that cross-attends to the image
tokens, and a 5-layer linear MLP on the text encoder's first token; the score is the MLP output
standardised by the constants the reference ships, ``(raw - 0.16717...) / 1.03333...``.

The ``image-reward`` package pins ``timm==0.6.13`` and ``fairscale``, and its BLIP code imports
helpers that transformers 5 removed, so it cannot live beside this project's pins. Instead the
official checkpoint (``ImageReward.pt`` from hub ``THUDM/ImageReward``, a torch state dict read with
``weights_only=True``) is renamed onto ``BlipVisionModel`` + ``BlipTextModel`` by ``convert_state_dict``;
that key map is checked against the reference's own classes in ``tests/test_rewards_imagereward.py``.

    {name: imagereward}                                   # downloads THUDM/ImageReward + bert-base-uncased
    {name: imagereward, checkpoint: /ckpt/ImageReward.pt, tokenizer: /ckpt/bert-base-uncased}

Inputs as the reference (``ImageReward.score`` / ``inference_rank``, which Flow-GRPO and MixGRPO call):
shortest side resized to 224 (bicubic), centre crop, CLIP mean/std; prompts tokenised by
bert-base-uncased with BLIP's added ``[DEC]`` / ``[ENC]`` tokens, padded / truncated to 35 tokens.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .base import ModelReward
from .clip_models import OPENAI_MEAN, OPENAI_STD, AestheticMLP, clip_preprocess, load_state_dict, resolve_file, seeded
from .registry import register_reward

logger = logging.getLogger(__name__)

# ImageReward.py: ``self.mean`` / ``self.std``, applied to every score.
SCORE_MEAN = 0.16717362830052426
SCORE_STD = 1.0333394966054072
MAX_LENGTH = 35  # ImageReward.score: padding="max_length", truncation=True, max_length=35

# BLIP's create_vit("large", 224): timm-style ViT, LayerNorm eps 1e-6, exact GELU, fused qkv with bias.
VISION_CONFIG: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "image_size": 224,
    "patch_size": 16,
    "layer_norm_eps": 1e-6,
    "hidden_act": "gelu",
}
# med_config.json of hub THUDM/ImageReward (BLIP's); encoder_width is replaced by the ViT width (1024).
MED_CONFIG: dict[str, Any] = {
    "attention_probs_dropout_prob": 0.1,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 768,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 512,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 0,
    "type_vocab_size": 2,
    "vocab_size": 30524,
    "encoder_width": 768,
    "add_cross_attention": True,
}
_MED_KEYS = (  # med_config fields that shape the text encoder; the rest (dropout, init, BERT's extras) do not
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "vocab_size",
    "layer_norm_eps",
    "hidden_act",
    "pad_token_id",
)
_CHECKPOINT_HELP = (
    "download ImageReward.pt from https://huggingface.co/THUDM/ImageReward (the ImageReward v1.0 state dict) "
    "and pass checkpoint=<path to ImageReward.pt>"
)


class ImageRewardModel(nn.Module):
    """BLIP vision tower + cross-attending BLIP text encoder + MLP; ``forward`` returns the raw (unstandardised)
    reward ``(B,)`` in float32."""

    def __init__(self, vision_config: Mapping[str, Any], med_config: Mapping[str, Any]) -> None:
        super().__init__()
        from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

        vision_cfg = BlipVisionConfig(**vision_config)
        text_cfg = BlipTextConfig(
            **{k: med_config[k] for k in _MED_KEYS if k in med_config},
            encoder_hidden_size=vision_cfg.hidden_size,  # BLIP_Pretrain: encoder_config.encoder_width = vision_width
            is_decoder=True,  # builds cross-attention; forward(is_decoder=False) keeps self-attention bidirectional
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            bos_token_id=None,
            eos_token_id=None,
            sep_token_id=None,  # generation ids: unused by an encoder
        )
        vision_cfg._attn_implementation = text_cfg._attn_implementation = "eager"  # the reference's additive masks
        self.vision = BlipVisionModel(vision_cfg)
        self.text = BlipTextModel(text_cfg, add_pooling_layer=False)
        # ImageReward's head (ImageReward.MLP) is LAION's aesthetic head: five linear layers, no activations.
        self.head = AestheticMLP(text_cfg.hidden_size)

    def forward(self, pixels: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        image_embeds = self.vision(pixel_values=pixels).last_hidden_state  # (B, 1 + patches, vision width)
        image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
        text = self.text(
            input_ids=input_ids,
            attention_mask=attention_mask,
            encoder_hidden_states=image_embeds,
            encoder_attention_mask=image_atts,
        )
        features = text.last_hidden_state[:, 0, :].float()  # (B, 768): the [CLS] token, as ImageReward.score
        return self.head(features.to(self.head.layers[0].weight.dtype)).float().squeeze(-1)


# Reference ViT block names -> transformers' BlipEncoderLayer names.
_VIT_BLOCK = {
    "norm1": "layer_norm1",
    "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection",
    "norm2": "layer_norm2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_VIT_TOP = {
    "cls_token": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding",
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}
_BLOCK_RE = re.compile(r"blocks\.(\d+)\.(norm1|attn\.qkv|attn\.proj|norm2|mlp\.fc1|mlp\.fc2)\.(weight|bias)")
_VIT_TOP_INV = {v: k for k, v in _VIT_TOP.items()}
_VIT_BLOCK_INV = {v: k for k, v in _VIT_BLOCK.items()}
_LAYER_RE = re.compile(r"vision\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)")
# In the checkpoint but unused by the score: BLIP's contrastive projections and BERT's position-id buffer.
_UNUSED = ("blip.vision_proj.", "blip.text_proj.", "blip.text_encoder.embeddings.position_ids")


def _rename(key: str) -> str | None:
    """One reference key -> its ``ImageRewardModel`` key, or None if it belongs to no mapped module."""
    if key.startswith("blip.visual_encoder."):
        rest = key.removeprefix("blip.visual_encoder.")
        if rest in _VIT_TOP:
            return "vision." + _VIT_TOP[rest]
        m = _BLOCK_RE.fullmatch(rest)
        return f"vision.encoder.layers.{m[1]}.{_VIT_BLOCK[m[2]]}.{m[3]}" if m else None
    if key.startswith("blip.text_encoder."):  # transformers' BlipText* modules keep med.py's names
        return "text." + key.removeprefix("blip.text_encoder.")
    if key.startswith("mlp.layers."):
        return "head." + key.removeprefix("mlp.")
    return None


def reference_name(key: str) -> str:
    """The inverse of the key map: an ``ImageRewardModel`` key -> its name in ``ImageReward.pt``."""
    if key.startswith("vision."):
        rest = key.removeprefix("vision.")
        if rest in _VIT_TOP_INV:
            return "blip.visual_encoder." + _VIT_TOP_INV[rest]
        m = _LAYER_RE.fullmatch(key)
        return f"blip.visual_encoder.blocks.{m[1]}.{_VIT_BLOCK_INV[m[2]]}.{m[3]}"
    if key.startswith("text."):
        return "blip.text_encoder." + key.removeprefix("text.")
    return "mlp." + key.removeprefix("head.")


def convert_state_dict(state: Mapping[str, Tensor], *, source: str = "checkpoint") -> dict[str, Tensor]:
    """Rename a reference ImageReward state dict (``ImageReward.pt``: ``blip.visual_encoder.*``,
    ``blip.text_encoder.*``, ``mlp.*``) to ``ImageRewardModel``'s keys.

    Known unused weights are dropped; a key inside the BLIP towers or the MLP that has no counterpart is an
    error (a different architecture); other keys are ignored with a warning, as the reference's
    ``load_state_dict(strict=False)`` does.
    """
    out: dict[str, Tensor] = {}
    unknown, ignored = [], []
    for key, value in state.items():
        if key.startswith(_UNUSED):
            continue
        new = _rename(key)
        if new is not None:
            out[new] = value
        elif key.startswith(("blip.visual_encoder.", "blip.text_encoder.", "mlp.")):
            unknown.append(key)
        else:
            ignored.append(key)
    if unknown:
        raise ValueError(
            f"imagereward: {source} has weights ImageReward v1.0 does not: {', '.join(sorted(unknown)[:5])}"
            f"{' ...' if len(unknown) > 5 else ''}; {_CHECKPOINT_HELP}"
        )
    if ignored:
        logger.warning(
            "imagereward: ignoring %d weights of %s outside BLIP/MLP: %s",
            len(ignored),
            source,
            ", ".join(sorted(ignored)[:5]),
        )
    return out


def load_reference_weights(model: ImageRewardModel, state: Mapping[str, Tensor], *, source: str) -> None:
    """Load a reference state dict into ``model`` through ``convert_state_dict``; every weight must be present."""
    mapped = convert_state_dict(state, source=source)
    expected = model.state_dict()
    missing = sorted(reference_name(k) for k in set(expected) - set(mapped))
    if missing:
        what = "is not an ImageReward checkpoint" if len(missing) == len(expected) else "lacks weights"
        raise ValueError(
            f"imagereward: {source} {what} ({len(missing)} of {len(expected)} weights missing, e.g. "
            f"{', '.join(missing[:3])}); {_CHECKPOINT_HELP}"
        )
    extra = sorted(reference_name(k) for k in set(mapped) - set(expected))
    if extra:
        raise ValueError(
            f"imagereward: {source} has weights ImageReward v1.0 does not: {', '.join(extra[:5])}; {_CHECKPOINT_HELP}"
        )
    wrong = [
        f"{reference_name(k)} {tuple(v.shape)} vs {tuple(expected[k].shape)}"
        for k, v in mapped.items()
        if tuple(v.shape) != tuple(expected[k].shape)
    ]
    if wrong:
        raise ValueError(
            f"imagereward: {source} does not fit the configured architecture ({'; '.join(wrong[:3])}); use the "
            f"default vision_config / med_config for ImageReward v1.0, or {_CHECKPOINT_HELP}"
        )
    model.load_state_dict(mapped, strict=True)


def _med_config(med_config: str | Mapping[str, Any] | None) -> dict[str, Any]:
    if med_config is None:
        return dict(MED_CONFIG)
    if isinstance(med_config, Mapping):
        return {**MED_CONFIG, **med_config}
    path = os.path.join(med_config, "med_config.json") if os.path.isdir(med_config) else med_config
    if not os.path.isfile(path):
        raise FileNotFoundError(f"imagereward: med_config {med_config!r} is not a file; pass med_config.json's path")
    with open(path) as f:
        return {**MED_CONFIG, **json.load(f)}


def load_tokenizer(tokenizer: str = "bert-base-uncased", *, local_files_only: bool = False) -> Any:
    """bert-base-uncased with BLIP's added tokens (``init_tokenizer``: bos ``[DEC]``, extra special ``[ENC]``)."""
    from transformers import BertTokenizer

    try:
        tok = BertTokenizer.from_pretrained(tokenizer, local_files_only=local_files_only)
    except OSError as err:
        raise FileNotFoundError(
            f"imagereward: tokenizer {tokenizer!r} is neither a local dir with vocab.txt nor a reachable hub repo "
            f"({err}); pass tokenizer=<dir holding bert-base-uncased's vocab.txt>"
        ) from err
    tok.add_special_tokens({"bos_token": "[DEC]"})
    tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tok


@register_reward("imagereward")
class ImageReward(ModelReward):
    """ImageReward v1.0 human-preference score (roughly -2..2, mean ~0 on its training prompts).

    ``checkpoint``: a local ``ImageReward.pt`` (or ``.safetensors``) file, a dir holding ``filename``, or a hub repo.
    ``tokenizer``: bert-base-uncased as a hub id or a local dir with its ``vocab.txt``.
    ``med_config``: path to (or dict overriding) the text encoder's ``med_config.json``; ``vision_config``:
    ``BlipVisionConfig`` kwargs. Both default to ImageReward v1.0 and exist for tiny test architectures, as does
    ``random_init`` (seeded random weights, no checkpoint).
    """

    def __init__(
        self,
        *,
        checkpoint: str = "THUDM/ImageReward",
        filename: str = "ImageReward.pt",
        tokenizer: str = "bert-base-uncased",
        med_config: str | Mapping[str, Any] | None = None,
        vision_config: Mapping[str, Any] | None = None,
        random_init: bool = False,
        seed: int = 0,
        local_files_only: bool = False,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        batch_size: int | None = 32,
    ) -> None:
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        path = None
        if not random_init:  # find the checkpoint before building a 450M-parameter model
            path = resolve_file(checkpoint, filename, what="imagereward checkpoint", local_files_only=local_files_only)
        vision = {**VISION_CONFIG, **(vision_config or {})}
        med = _med_config(med_config)
        self.tokenizer = load_tokenizer(tokenizer, local_files_only=local_files_only)
        if len(self.tokenizer) > med["vocab_size"]:
            raise ValueError(
                f"imagereward: tokenizer {tokenizer!r} has {len(self.tokenizer)} tokens but the text encoder only "
                f"{med['vocab_size']}; use bert-base-uncased (30522 + [DEC], [ENC] = 30524)"
            )
        with seeded(seed):
            net = ImageRewardModel(vision, med)
        if path is not None:
            try:
                state = load_state_dict(path)
            except Exception as err:  # a pickle with non-tensor objects, a truncated download, ...
                raise ValueError(
                    f"imagereward: cannot read {path} as a state dict ({err}); {_CHECKPOINT_HELP}"
                ) from err
            load_reference_weights(net, state, source=path)
        side = net.vision.config.image_size
        self.size = (side, side) if isinstance(side, int) else tuple(side)
        self.model = self._setup_model(net)
        self.model.head.float()  # the reference runs its MLP on float32 features

    def preprocess(self, images: Tensor) -> Tensor:
        """``(B, 3, H, W)`` in [0, 1] -> the model's normalised float32 pixels, on the reward's device."""
        # Move first: resizing belongs on the reward's device, not the sampler's GPU.
        return clip_preprocess(images.to(self.device, non_blocking=True), self.size, OPENAI_MEAN, OPENAI_STD)

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        pixels = self.preprocess(images).to(self.dtype)
        enc = self.tokenizer(prompts, padding="max_length", truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
        raw = self.model(pixels, enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device))
        return (raw - SCORE_MEAN) / SCORE_STD
