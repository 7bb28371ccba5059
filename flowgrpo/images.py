"""Source images (image editing): a file or PIL image opened, decoded and converted to 8-bit RGB, and the key that
caches its encoding. :func:`to_rgb` says how each PIL mode is converted (16-bit and float grayscale scaled,
transparency composited onto white, CMYK by formula); a file or image that cannot be used is a
:class:`~flowgrpo.checks.DataError` saying why and how to re-save it. A leaf beside :mod:`flowgrpo.data`, which reads
the prompt files that name these images, so the adapters that encode them need not import the data module.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path

import numpy as np
from PIL import ExifTags, Image, ImageOps

from .checks import DataError

BACKGROUND = (255, 255, 255)  # white: what the transparent pixels of a source image are composited onto


class UnusableImage(Exception):
    """Why a file cannot serve as a source image: the message completes "image 'x.png' ..."."""


# What each conversion is called in PromptDataset.notes ("3 source image(s) <note> (first: ...)").
_NOTE_ALPHA = (
    f"had transparent pixels: composited onto white {BACKGROUND}, each channel round((c·a + 255·(255 − a)) / 255)"
)
_NOTE_16BIT = "were 16-bit grayscale: scaled to 8 bits as round(v / 257)"
_NOTE_FLOAT = "were float grayscale in [0, 1]: scaled to 8 bits as round(v · 255)"
_NOTE_CMYK = "were CMYK: converted as round((255 − C)·(255 − K) / 255) per channel (no ICC colour profile applied)"
_NOTE_EXIF = "had an EXIF orientation: turned upright, as image viewers show them"
_SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N")
_FLOAT_SLACK = 0.5 / 255  # a float pixel this far outside [0, 1] still rounds to 0 or 255: clipped, not refused
_CONVERTED_BY_PIL = ("1", "L", "RGBX", "YCbCr", "HSV")  # no alpha; Pillow's own conversion to RGB is the right one
_WITH_ALPHA = ("LA", "RGBA", "PA", "RGBa")
_SAVE_AS_PNG = "save it as an 8-bit RGB (or RGBA) PNG"


def to_rgb(image: Image.Image) -> tuple[Image.Image, list[str]]:
    """``image`` as 8-bit RGB, and the conversions it needed beyond a plain decode (phrases for
    :attr:`flowgrpo.data.PromptDataset.notes`; empty for RGB, L, 1, P without transparency, ...). By PIL mode:

    - ``RGB``, ``L``, ``1`` (0 / 255), ``P`` without transparency, ``RGBX``, ``YCbCr``, ``HSV``: Pillow's
      ``convert("RGB")``.
    - ``I;16`` / ``I;16B`` / ``I;16L`` / ``I;16N`` (16-bit grayscale, e.g. a 16-bit PNG or TIFF), and ``I`` read from a
      PNG (older Pillow reads 16-bit PNGs as ``I``): ``round(v / 257)``, so 65535 -> 255 (``convert("RGB")`` clips
      everything above 255 to white instead). A 16-bit ``transparency`` value is composited as below.
    - ``I`` otherwise (32-bit integers: no defined range): refused.
    - ``F`` (float grayscale, e.g. a float TIFF): read as intensities in [0, 1], ``round(v · 255)``
      (``convert("RGB")`` gives black for all of [0, 1]); values within half a step (0.5 / 255) outside [0, 1] are
      clipped; further out, or NaN / infinite, refused.
    - ``CMYK`` (e.g. a print JPEG): ``round((255 − C)·(255 − K) / 255)`` per channel (Pillow's formula, with
      Pillow's handling of Adobe's inverted JPEG CMYK); an embedded ICC profile is not applied.
    - With transparency (``LA``, ``RGBA``, ``PA``, ``RGBa``, and ``P`` / ``L`` / ``RGB`` / ``1`` with a
      ``transparency`` entry): composited onto white :data:`BACKGROUND`, each channel
      ``round((c·a + 255·(255 − a)) / 255)`` with ``a`` the 8-bit alpha (``convert("RGB")`` drops the alpha, showing
      whatever colour the transparent pixels hold). A fully opaque alpha changes nothing and is not noted.
    - Any other mode (``LAB``, ``I;16S``, ...): refused.

    A refusal is a :class:`DataError` saying why and how to re-save the image (:func:`open_image` adds the file)."""
    try:
        return _to_rgb(image)
    except UnusableImage as err:
        raise DataError(f"the source image (a PIL image) {err}") from None


def _to_rgb(image: Image.Image) -> tuple[Image.Image, list[str]]:
    """:func:`to_rgb`, refusing with :class:`UnusableImage`."""
    mode, transparency = image.mode, image.info.get("transparency")
    if mode == "RGB" and transparency is None:
        return image, []
    if mode in _SIXTEEN_BIT or (mode == "I" and image.format == "PNG"):
        values = np.asarray(image).astype(np.int64)
        if values.size and (values.min() < 0 or values.max() > 65535):  # "I" from a PNG holds 16-bit values
            raise UnusableImage(f"holds 32-bit pixels in [{values.min()}, {values.max()}], not 16-bit: {_SAVE_AS_PNG}")
        gray = ((values + 128) // 257).astype(np.uint8)  # round(v / 257): v / 257 is never exactly k + 0.5
        alpha = None
        if isinstance(transparency, int) and (values == transparency).any():
            alpha = np.where(values == transparency, 0, 255).astype(np.uint8)
        rgb, notes = _composite(np.repeat(gray[..., None], 3, axis=2), alpha)
        return rgb, [_NOTE_16BIT, *notes]
    if mode == "I":
        raise UnusableImage(
            "holds 32-bit integer pixels (PIL mode I), which have no defined range (is 255 or 65535 white?): "
            f"{_SAVE_AS_PNG}, or as a 16-bit grayscale PNG"
        )
    if mode == "F":
        values = np.asarray(image, dtype=np.float64)
        if not np.isfinite(values).all():
            raise UnusableImage(f"holds NaN or infinite float pixels: {_SAVE_AS_PNG}")
        if values.size and (values.min() < -_FLOAT_SLACK or values.max() > 1 + _FLOAT_SLACK):
            raise UnusableImage(
                f"holds float pixels in [{values.min():.6g}, {values.max():.6g}], but a float image is read as "
                f"intensities in [0, 1] (scaled by 255): rescale it to [0, 1], or {_SAVE_AS_PNG}"
            )
        gray = np.round(np.clip(values, 0.0, 1.0) * 255).astype(np.uint8)
        return Image.fromarray(np.repeat(gray[..., None], 3, axis=2), "RGB"), [_NOTE_FLOAT]
    if mode == "CMYK":
        cmyk = np.asarray(image).astype(np.int64)
        rgb = ((255 - cmyk[..., :3]) * (255 - cmyk[..., 3:]) + 127) // 255  # never exactly k + 0.5: plain rounding
        return Image.fromarray(rgb.astype(np.uint8), "RGB"), [_NOTE_CMYK]
    if mode in _WITH_ALPHA or (transparency is not None and mode in ("P", "L", "RGB", "1")):
        rgba = np.asarray(image.convert("RGBA"))
        return _composite(rgba[..., :3], rgba[..., 3])
    if mode in (*_CONVERTED_BY_PIL, "P"):
        return image.convert("RGB"), []
    raise UnusableImage(f"has PIL mode {mode}, which is not converted to RGB here: {_SAVE_AS_PNG}")


def _composite(rgb: np.ndarray, alpha: np.ndarray | None) -> tuple[Image.Image, list[str]]:
    """8-bit ``rgb [H, W, 3]`` over :data:`BACKGROUND` by 8-bit ``alpha [H, W]`` (None or all 255: opaque)."""
    if alpha is None or (alpha == 255).all():
        return Image.fromarray(np.ascontiguousarray(rgb, dtype=np.uint8), "RGB"), []
    a = alpha.astype(np.int64)[..., None]
    background = np.asarray(BACKGROUND, dtype=np.int64)
    out = (rgb.astype(np.int64) * a + background * (255 - a) + 127) // 255  # never exactly k + 0.5: plain rounding
    return Image.fromarray(out.astype(np.uint8), "RGB"), [_NOTE_ALPHA]


def _path_problem(file: Path) -> str | None:
    """Why ``file`` cannot be opened as a file (missing, a symbolic-link loop, a folder, ...), or None."""
    try:
        info = file.stat()
    except OSError as err:
        if err.errno == errno.ELOOP:
            return (
                f"is a symbolic link that leads back to itself ({file}): make it point at the image file, or give "
                "the image's own path"
            )
        if file.is_symlink():
            try:
                target = os.readlink(file)
            except OSError:
                target = "?"
            return f"is a symbolic link to a file that does not exist ({file} -> {target})"
        if err.errno in (errno.ENOENT, errno.ENOTDIR):
            return f"does not exist (looked for {file})"
        return f"cannot be opened ({file}: {err.strerror or err})"
    if not stat.S_ISREG(info.st_mode):
        return f"is not a file ({file})"
    return None


def read_image_file(file: Path) -> tuple[Image.Image, list[str]]:
    """The image at ``file`` decoded whole (a truncated file fails here), turned upright by its EXIF orientation,
    converted by :func:`to_rgb`; with the conversion notes. Every failure is an :class:`UnusableImage`."""
    problem = _path_problem(file)
    if problem:
        raise UnusableImage(problem)
    try:
        with Image.open(file) as opened:
            opened.load()
            turned = opened.getexif().get(ExifTags.Base.Orientation, 1) not in (1, None)
            upright = ImageOps.exif_transpose(opened) if turned else opened.copy()
            upright.format = opened.format  # mode I is 16-bit only when read from a PNG
    except Exception as err:  # noqa: BLE001 - PIL raises OSError, SyntaxError, DecompressionBombError, ...
        raise UnusableImage(f"cannot be read as an image ({type(err).__name__}: {err})") from None
    rgb, notes = _to_rgb(upright)
    return rgb, ([_NOTE_EXIF] if turned else []) + notes


def resolved_path(file: Path) -> str:
    """``file``'s absolute path with symbolic links resolved (made absolute only, where resolving fails)."""
    try:
        return str(file.resolve())
    except (OSError, RuntimeError):  # a link loop (RuntimeError before Python 3.13)
        return os.path.abspath(file)


def open_image(source: str | os.PathLike | Image.Image) -> Image.Image:
    """A source image as 8-bit RGB: a file path (opened, decoded, turned upright by its EXIF orientation) or a PIL image
    (as given), converted by :func:`to_rgb` (16-bit and float grayscale scaled, transparency composited onto white,
    CMYK by formula). A file that cannot be used is a :class:`DataError` naming it, and, for a
    :class:`flowgrpo.data.SourceImage` of a prompt file, its row (it was usable when the prompt file was read: it
    changed since)."""
    if isinstance(source, Image.Image):
        return to_rgb(source)[0]
    if not isinstance(source, str | os.PathLike):
        raise TypeError(f"a source image must be a file path or a PIL image, got {type(source).__name__}")
    try:
        return read_image_file(Path(source))[0]
    except UnusableImage as err:
        origin = getattr(source, "origin", "")
        if not origin:
            raise DataError(f"source image {os.fspath(source)} {err}") from None
        raise DataError(
            f"{origin}: the source image {os.fspath(source)} {err}. It was usable when the prompt file was read at the "
            "start of the run, so it changed or was removed since: restore it (or fix the row), then resume the run "
            "from its last checkpoint (run.resume)"
        ) from None


def image_key(source: str | os.PathLike | Image.Image) -> str:
    """A cache key for a source image: its resolved path, or a digest of a PIL image's pixels."""
    if isinstance(source, Image.Image):
        digest = hashlib.sha1(source.tobytes()).hexdigest()
        return f"pil:{source.mode}:{source.size[0]}x{source.size[1]}:{digest}"
    if not isinstance(source, str | os.PathLike):
        raise TypeError(f"a source image must be a file path or a PIL image, got {type(source).__name__}")
    return f"file:{resolved_path(Path(source))}"
