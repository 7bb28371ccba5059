"""Qwen-Image-Edit adapter (``QwenImageEditPipeline``): Qwen-Image plus a source image that conditions twice. Its
packed VAE latents are appended to the image token sequence (a second entry in ``img_shapes``), and the Qwen2.5-VL
text encoder reads it with the instruction (the edit chat template, its first 64 tokens dropped), so a text embedding
belongs to a (prompt, source image) pair, the negative prompt's too.

As the pipeline does (diffusers ``QwenImageEditPipeline.__call__`` / ``prepare_latents`` / ``_encode_vae_image``): the
source is VAE-encoded once with a frame axis (the posterior's mode, ``(z - latents_mean) / latents_std``), packed 2x2,
concatenated after the noisy latents at every step, and the output is cut back to the generated tokens. Everything
else is Qwen-Image's (:class:`QwenImageAdapter`): the schedule's dynamic shift from the generated token count only,
true CFG with the negative prompt (read with the same source image) and the norm rescale, decoding.

Source size. As ``pipe()`` (and Flow-GRPO's current ``pipeline_with_logprob`` / ``compute_log_prob``), the source
is sized to ``calculate_dimensions(1024², aspect ratio)`` (multiples of 32) whatever the output size, and the text
encoder reads it at that same size (this pipeline has one source size; Edit-Plus has two). Flow-GRPO's
``train_qwenimage_edit.py`` first resizes every source to the training size (``ref_image.resize``, bicubic; here
H x W, ``model.size``), so the ratio is the output's and every source of a batch has the same size; this adapter does
the same (:meth:`source_size`). A rollout then equals ``pipe(image=<the source resized to W x H>, height=H, width=W)``.
``source_area`` (``model.source_area``) replaces 1024²: for tiny test models only, whose ``pipe()`` is matched by
swapping the area in ``calculate_dimensions`` (tests/test_qwenimage_edit.py).

The text encoder gets the sized source as a PIL image, as ``pipe()`` gives it (Flow-GRPO's pipeline hands it the
[-1, 1] tensor instead). ``max_sequence_length`` is checked but, as in ``pipe()``, nothing is truncated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from ..images import image_key, open_image
from .base import PromptEmbeds, image_size_rows
from .qwenimage import QwenImageAdapter, _pad_rows
from .registry import FamilySpec, register_family

SOURCE_AREA = 1024 * 1024  # QwenImageEditPipeline.__call__: calculate_dimensions(1024 * 1024, ratio) for the source


class QwenImageEditAdapter(QwenImageAdapter):
    """``QwenImageEditPipeline``. Needs a source image per prompt (:meth:`encode_conditions` with ``sources``);
    ``guidance_scale`` is ``true_cfg_scale`` as for Qwen-Image."""

    family = "qwenimage-edit"
    edits = True
    requires_sources = True  # unlike FLUX.1-Kontext, the pipeline cannot generate from text alone
    # Flow-GRPO's train_qwenimage_edit.py trains the same twelve Linear layers as its Qwen-Image script.
    default_lora_targets = QwenImageAdapter.default_lora_targets

    def __init__(self, pipe: Any, *, source_area: int = SOURCE_AREA, **options: Any) -> None:
        super().__init__(pipe, **options)
        self.source_area = source_area  # pixels of the source image as the model sees it (pipe(): 1024²)
        self._pair_cache: dict[
            tuple[str, tuple[str, ...], int, int], Tensor
        ] = {}  # (prompt, image keys, H, W) -> [L, D]

    # ------------------------------------------------------------------ the source image
    def source_size(self, height: int, width: int) -> tuple[int, int]:
        """``(h, w)`` of the source for a ``height`` x ``width`` output: ``calculate_dimensions(source_area,
        width / height)``, as ``pipe()`` sizes it (1024²: ``source_size(512, 768) == (832, 1248)``)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions  # heavy: on use

        w, h, _ = calculate_dimensions(self.source_area, width / height)
        if h <= 0 or w <= 0:
            raise ValueError(
                f"{self.family}: model.source_area={self.source_area} rounds a {height}x{width} output's source to "
                f"{int(h)}x{int(w)} pixels (multiples of 32): use a larger area (pipe(): 1024² = {SOURCE_AREA})"
            )
        return int(h), int(w)

    @staticmethod
    def _at_output_size(image: Image.Image, height: int, width: int) -> Image.Image:
        """The RGB source resized to the output size (bicubic, Flow-GRPO's ``ref_image.resize``) unless it has it."""
        if image.size != (width, height):
            image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
        return image

    def _source_image(self, image: Image.Image, height: int, width: int) -> Image.Image:
        """The RGB source as the model sees it: at the output size (:meth:`_at_output_size`), then resized to
        :meth:`source_size` by the pipeline's own ``image_processor.resize`` (a no-op when they agree)."""
        h, w = self.source_size(height, width)
        return self.pipe.image_processor.resize(self._at_output_size(image, height, width), h, w)

    def _prepare_source(self, image: Any, height: int, width: int) -> Tensor:
        h, w = self.source_size(height, width)
        return self.pipe.image_processor.preprocess(self._source_image(image, height, width), h, w)  # [1, 3, h, w]

    def _encode_sources(self, pixels: Tensor) -> Tensor:
        """``[N, 3, h, w]`` in [-1, 1] -> packed latents ``[N, (h/16)(w/16), 4C]`` (the pipeline's image_latents)."""
        pipe = self.pipe
        image = pixels.unsqueeze(2).to(device=self.vae.device, dtype=self.vae.dtype)  # the VAE's frame axis
        latents = pipe._encode_vae_image(image, generator=None)  # [N, C, 1, h/8, w/8], normalised per channel
        n, c, _, h, w = latents.shape
        return pipe._pack_latents(latents, n, c, h, w).to(device=self.device, dtype=self.dtype)

    # ------------------------------------------------------------------ conditions: text read with the image
    def encode_prompts(self, prompts: Sequence[str], *, with_negative: bool = False) -> PromptEmbeds:
        raise ValueError(
            "qwenimage-edit: the text encoder reads each prompt with its source image; use "
            "encode_conditions(prompts, sources=..., height=..., width=...)"
        )

    @torch.no_grad()
    def encode_conditions(
        self,
        prompts: Sequence[str],
        *,
        with_negative: bool = False,
        sources: Sequence[Any] | None = None,
        height: int | None = None,
        width: int | None = None,
    ) -> PromptEmbeds:
        """Text embeddings of each (prompt, source) pair (and of (negative prompt, source) with ``with_negative``),
        each pair encoded once (:meth:`_encode_pairs`), cached until :meth:`clear_prompt_cache`; plus the sources'
        ``source_latents`` / ``source_images`` (:meth:`PipelineAdapter.encode_sources`; with several sources per
        prompt, Edit-Plus, a row's latents one source after another along the sequence and its first source's image).
        Rows are zero-padded to the batch's longest, with masks."""

        prompts = list(prompts)
        if sources is None:
            raise ValueError(
                f"{self.family} edits images: give each prompt a source image (a .jsonl prompt file whose rows have "
                f'an "image"); {type(self.pipe).__name__} cannot generate from text alone'
            )
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError("encode_conditions needs a non-empty list of prompt strings")
        if len(sources) != len(prompts):
            raise ValueError(f"{len(sources)} source images for {len(prompts)} prompts: give one per prompt")
        if height is None or width is None:
            raise ValueError("source images are prepared for the generated size: pass height and width")
        groups = self._source_rows(sources)
        count = len(groups[0])
        images, latents = self.encode_sources([s for group in groups for s in group], height, width)
        latents = latents.reshape(len(groups), count * latents.shape[1], latents.shape[2])
        images = images[::count]  # what rewards comparing an edit with its source get: the first source
        keys = [tuple(image_key(s) for s in group) for group in groups]
        wanted = list(zip(prompts, keys, groups, strict=True))
        if with_negative:
            wanted += [(self.negative_prompt, k, g) for k, g in zip(keys, groups, strict=True)]
        missing: dict[tuple[str, tuple[str, ...], int, int], tuple[str, tuple[Any, ...]]] = {}
        for text, key, group in wanted:
            pair = (text, key, height, width)
            if pair not in self._pair_cache:
                missing.setdefault(pair, (text, group))
        if missing:
            encoded = self._encode_pairs(list(missing.values()), height, width)
            self._pair_cache.update(zip(missing, encoded, strict=True))
        rows = [self._pair_cache[(p, k, height, width)] for p, k in zip(prompts, keys, strict=True)]
        embeds, mask = _pad_rows(rows)
        size = image_size_rows(len(prompts), height, width)
        out = PromptEmbeds(embeds, mask=mask, source_latents=latents, source_images=images, image_size=size)
        if not with_negative:
            return out
        negative, negative_mask = _pad_rows([self._pair_cache[(self.negative_prompt, k, height, width)] for k in keys])
        return replace(out, negative_embeds=negative, negative_mask=negative_mask)

    def _source_rows(self, sources: Sequence[Any]) -> list[tuple[Any, ...]]:
        """Each prompt's source images as a tuple: one image (a path or a PIL image), or a list of them for a model
        that reads several (``max_sources``); every prompt of a batch the same number (a batch stacks them)."""
        groups = [tuple(s) if isinstance(s, list | tuple) else (s,) for s in sources]
        counts = sorted({len(g) for g in groups})
        if counts[0] == 0:
            raise ValueError(f"{self.family}: a prompt's list of source images is empty: give it at least one")
        if len(counts) > 1:
            raise ValueError(
                f"{self.family}: the prompts of a batch give {' or '.join(map(str, counts))} source images: a batch "
                "stacks each prompt's images, so give every prompt the same number"
            )
        if self.max_sources is not None and counts[0] > self.max_sources:
            raise ValueError(
                f"{self.family} takes {self.max_sources} source image per prompt, got {counts[0]}: give one image "
                "per prompt, or use a model that reads several (qwenimage-edit-plus)"
            )
        return groups

    def _encode_pairs(self, pairs: list[tuple[str, tuple[Any, ...]]], height: int, width: int) -> list[Tensor]:
        """The text encoder's ``[L, D]`` embedding of each (text, sources) pair, unpadded: one batched
        ``pipe.encode_prompt`` with each pair's source at :meth:`source_size`, as ``pipe()`` reads it."""

        self.text_encoder_calls += 1
        shown = [self._source_image(open_image(group[0]), height, width) for _, group in pairs]
        embeds, mask = self.pipe.encode_prompt(prompt=[t for t, _ in pairs], image=shown, device=self.device)
        lengths = [embeds.shape[1]] * len(pairs) if mask is None else mask.sum(dim=1).tolist()
        return [embeds[i, : int(n)] for i, n in enumerate(lengths)]

    def clear_prompt_cache(self) -> None:
        super().clear_prompt_cache()
        self._pair_cache.clear()

    # ------------------------------------------------------------------ velocity: the source tokens appended
    def _image_tokens(self, latents: Tensor, embeds: PromptEmbeds) -> tuple[Tensor, list]:
        if embeds.source_latents is None or embeds.source_images is None:
            raise ValueError(f"{self.family} needs each sample's source image: encode_conditions(..., sources=...)")
        source = embeds.source_latents.to(device=latents.device, dtype=latents.dtype)
        if source.shape[0] != latents.shape[0]:
            raise ValueError(f"{source.shape[0]} source images for a batch of {latents.shape[0]} latents")
        hidden, shapes = super()._image_tokens(latents, embeds)
        f = self.pipe.vae_scale_factor * 2
        h, w = embeds.source_images.shape[-2:]  # a source's size as the model saw it (rows, columns of 2x2 patches)
        count = source.shape[1] // ((h // f) * (w // f))  # sources per row (Edit-Plus: several, all of that size)
        return torch.cat([hidden, source], dim=1), [[*s, *[(1, h // f, w // f)] * count] for s in shapes]


SPEC = register_family(
    FamilySpec(
        name="qwenimage-edit",
        pipelines=("QwenImageEditPipeline",),  # the Edit-Plus (2509 / 2511) pipeline: qwenimage_edit_plus.py
        transformer="QwenImageTransformer2DModel",
        adapter=QwenImageEditAdapter,
        tiny="flowgrpo.tiny:qwenimage_edit_components",
    )
)
