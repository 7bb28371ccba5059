"""Scoring over HTTP, for rewards that live in another process or on another GPU (GenEval detectors, VLM judges).

Protocol (JSON both ways, standard library only):

    POST /score  {"format": "png" | "npz", "images": ..., "prompts": [str], "metadata": [dict]}
      png: "images" is a list of base64 PNGs (8-bit; rewards that quantise anyway score them identically)
      npz: "images" is one base64 ``.npz`` holding float32 ``images`` (B, 3, H, W) — lossless
    200  {"scores": {key: [float, ...], ...}}        4xx/500  {"error": "message"}
    GET  /health -> {"status": "ok", "reward": "...", "workers": n, "protocols": [...], ...}

``scripts/reward_server.py`` serves any registered reward (or combination) this way on 127.0.0.1, with one worker
(its own reward instance) per device; a complete request goes to the first free worker, which decodes and scores
it. The server answers every bad request with a 4xx and a message (400 malformed, 404 unknown path, 408 too slow,
411 no Content-Length, 413 too large, 431 headers over 64 KiB) and a busy one with 503, and bounds what any client
can cost it: a connection must send its whole request, headers included, within ``timeout`` s of connecting; at
most ``max_connections`` are served at once; a body is read in chunks as it arrives (never allocated from its
``Content-Length``), at most ``max_request_mb`` each and ``memory_budget_mb`` for all connections together; image
sizes are read from the PNG / JPEG / ``.npy`` headers before anything is decoded (``max_pixels`` per request), and
a request of more than 2**20 JSON values or pickle opcodes is refused before it is parsed.

The server also speaks Flow-GRPO's protocol when started with ``--flowgrpo-protocol`` (``flowgrpo_protocol=True``):
Flow-GRPO's trainer POSTs a pickle ``{"images": [JPEG bytes], "meta_datas": [dict], "only_strict": bool}`` to
``/``, and gets back a pickle of plain containers, GenEval's reply (below) for a reward with a ``strict_accuracy``
score, ``{"outputs": [total]}`` otherwise; errors are one line of text. Requests are unpickled with no global allowed
at all (every class and function a pickle names is refused: no code runs and no object is built but dicts, lists,
tuples, strings, bytes, numbers, booleans and None), so a client must pickle with protocol 3 or later and send
plain lists, not numpy arrays.

``protocol: flowgrpo`` calls Flow-GRPO's own reward servers (yifan123/reward-server: ``app_geneval.py`` on :18085,
``app_deqa.py`` on :18086) unchanged, as Flow-GRPO's ``geneval_score`` / ``deqa_score_remote`` clients do
(yifan123/flow_grpo ``flow_grpo/rewards.py``):

    POST /   pickle {"images": [JPEG bytes (PIL's default quality, 75)], "meta_datas": [dict], "only_strict": bool,
                     "prompts": [str]}           (each server reads the keys it needs and ignores the rest)
    200      pickle {"scores", "rewards", "strict_rewards", "group_rewards", "group_strict_rewards"}   (GenEval)
             pickle {"outputs": [float]}                                                             (DeQA)
    500      the server's traceback as text (its last line is shown; not retried)

    rewards:
      - {name: remote, protocol: flowgrpo, url: "http://127.0.0.1:18085", trust_pickle: true, key: geneval}

Scores: ``total`` (the weighted one) is GenEval's partial score ``scores`` (what Flow-GRPO trains on) or DeQA's
``outputs``; GenEval's ``strict_rewards`` come as ``strict_accuracy`` and ``group_strict_rewards[tag]`` as
``<tag>_strict_accuracy``, NaN for images of another tag (the server's -10 placeholder), so the logged mean is the
tag's accuracy. ``only_strict`` (default true, as Flow-GRPO trains) tells the server to skip GenEval's non-strict
check; with ``only_strict: false`` its results come too, as ``accuracy`` and ``<tag>_accuracy``. Each image's
``meta_datas`` entry is its metadata (GenEval's ``tag`` / ``include`` / ``exclude``; the prompt files' jsonl) with
``prompt`` added, which the GenEval server reads. Flow-GRPO sends 64 images per request (``batch_size: 64``).

Unpickling a reply lets whoever answers run code in this process, so this protocol needs ``trust_pickle: true``
(refused otherwise) and, by default, a loopback URL (127.0.0.0/8, ::1, localhost): reaching the server over a
network, where a reply can be forged on the way, needs ``allow_non_loopback: true`` as well. Replies are read by
an unpickler that builds only plain containers, numbers and strings (what those servers send) and refuses every
class or function a pickle names, numpy's included, so a reply cannot call code by name; pickle stays a large
attack surface all the same, hence the opt-ins.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import contextlib
import http
import http.client
import io
import ipaddress
import json
import logging
import math
import pickle
import pickletools
import queue
import socket
import threading
import time
import urllib.parse
import warnings
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from .base import BaseReward, Reward, RewardError, as_score_dict, check_inputs, to_uint8_hwc
from .registry import register_reward

logger = logging.getLogger("rewards.remote")
IMAGE_FORMATS = ("png", "npz")
PROTOCOLS = ("json", "flowgrpo")
FLOWGRPO_JPEG_QUALITY = 75  # PIL's default, what the reference client's img.save(buffer, format="JPEG") uses
LOOPBACK_HOSTS = ("127.0.0.1", "localhost")  # IPv4 server
_RETRY_STATUS = (502, 503, 504)  # proxies / overloaded servers; a reward's own failure (500) is not retried
DEFAULT_MAX_PIXELS = 2**25  # per request, all images together: 32 images of 1024² (0.4 GB as float32 RGB)
DEFAULT_MAX_REQUEST_MB = 640.0  # an npz request at the pixel limit (float32, base64) fits
DEFAULT_SERVER_TIMEOUT = 60.0  # seconds a connection may take to send its request
MAX_REPLY_BYTES = 64 * 2**20  # scores are small; a bigger reply is not from a reward server
DEFAULT_MAX_CONNECTIONS = 64  # connections served at once; more are answered 503 at once
DEFAULT_MEMORY_BUDGET_MB = 1024.0  # request bodies held at once, all connections together (at least max_request_mb)
MAX_REQUEST_VALUES = 2**20  # JSON values / pickle opcodes per request: a parsed value costs ~20x its bytes
MAX_HEADER_BYTES = 64 * 2**10  # request line and headers together


class RemoteRewardError(RewardError):
    """The remote endpoint could not be reached, or answered with an error or a malformed reply."""


def encode_request(images: Tensor, prompts: list[str], metadata: list[dict[str, Any]], image_format: str) -> bytes:
    if image_format == "png":
        encoded: Any = []
        for pixels in to_uint8_hwc(images):
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)  # speed over size on loopback
            encoded.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    elif image_format == "npz":
        buffer = io.BytesIO()
        np.savez(buffer, images=images.detach().to("cpu", torch.float32).numpy())
        encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    else:
        raise ValueError(f"image_format must be one of {', '.join(IMAGE_FORMATS)}; got {image_format!r}")
    try:
        body = {"format": image_format, "images": encoded, "prompts": prompts, "metadata": metadata}
        return json.dumps(body).encode("utf-8")
    except TypeError as err:
        raise ValueError(f"remote reward: metadata must be JSON-serialisable ({err})") from err


class RequestError(ValueError):
    """A request the server refuses; ``status`` is the HTTP status of the reply (400, 413)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def decode_request(
    body: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS
) -> tuple[Tensor, list[str], list[dict[str, Any]]]:
    """Inverse of ``encode_request``; raises ``RequestError`` on anything malformed or too large.

    Image sizes are read from the PNG / ``.npy`` headers and checked against ``max_pixels`` (all images of the
    request together) before any pixel is decoded, so a small request cannot make the server allocate gigabytes.
    A body of more than ``MAX_REQUEST_VALUES`` JSON values (counted as its commas) is refused before parsing: each
    ``[],`` would cost the parser some 60 bytes per 3 sent."""
    if body.count(b",") >= MAX_REQUEST_VALUES:
        raise _too_many_values()
    try:
        request = json.loads(body)
    except (ValueError, RecursionError) as err:  # bad JSON or UTF-8; nesting deeper than the parser's stack
        raise RequestError(f"malformed request: body is not a JSON object ({type(err).__name__}: {err})") from None
    if not isinstance(request, dict) or not {"format", "images", "prompts"} <= set(request):
        raise RequestError('malformed request: expected {"format", "images", "prompts", "metadata"}')
    image_format, images = request["format"], request["images"]
    try:
        if image_format == "png":
            pixels = _decode_pngs(images, max_pixels)
        elif image_format == "npz":
            pixels = _decode_npz(images, max_pixels)
        else:
            raise RequestError(f"malformed request: unknown image format {image_format!r}; use one of png, npz")
        prompts, metadata = check_inputs(pixels, request["prompts"], request.get("metadata"))
    except RequestError:
        raise
    except Exception as err:  # any failure to decode untrusted bytes is the request's fault, not the server's
        raise RequestError(f"malformed request: {type(err).__name__}: {err}") from None
    return pixels, prompts, metadata


def _too_many_values() -> RequestError:
    return RequestError(
        f"request holds more than {MAX_REQUEST_VALUES} values (JSON values or pickle opcodes), the server's limit; a "
        "reward request holds one image, prompt and metadata entry per sample: send fewer samples per request (the "
        "remote reward's batch_size option) or smaller metadata",
        status=413,
    )


def _too_many_pixels(count: int, max_pixels: int) -> RequestError:
    return RequestError(
        f"request holds {count} pixels, more than the server's limit of {max_pixels}; send fewer images per request "
        "(the remote reward's batch_size option) or start the server with a larger --max-pixels",
        status=413,
    )


def _decode_pngs(images: Any, max_pixels: int) -> Tensor:
    if not isinstance(images, list) or not images or not all(isinstance(s, str) for s in images):
        raise RequestError("malformed request: png 'images' must be a non-empty list of base64 strings")
    return decode_images([base64.b64decode(encoded, validate=True) for encoded in images], "PNG", max_pixels)


def decode_images(encoded: list[bytes], image_format: str, max_pixels: int) -> Tensor:
    """Encoded images (``PNG`` or ``JPEG`` files, one size) as float ``(B, 3, H, W)`` in [0, 1].

    Sizes come from the file headers and ``B * H * W`` is checked against ``max_pixels`` before any pixel is decoded;
    raises ``RequestError`` (400 malformed, 413 too many pixels)."""
    opened = []
    for index, data in enumerate(encoded):
        with warnings.catch_warnings():  # PIL warns, then raises, on images beyond its own (larger) pixel limit
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            try:
                opened.append(Image.open(io.BytesIO(data), formats=[image_format]))  # reads the header only
            except (Image.DecompressionBombWarning, Image.DecompressionBombError):
                raise _too_many_pixels(max_pixels + 1, max_pixels) from None
            except OSError as err:
                raise RequestError(f"malformed request: image {index} is not a {image_format} ({err})") from None
    sizes = {image.size for image in opened}
    if len(sizes) != 1:
        raise RequestError(f"malformed request: images differ in size ({sorted(sizes)}); send one size per request")
    (width, height), batch = sizes.pop(), len(opened)
    if batch * width * height > max_pixels:
        raise _too_many_pixels(batch * width * height, max_pixels)
    pixels = torch.empty(batch, 3, height, width)
    for index, image in enumerate(opened):  # one image at a time: no stacked uint8 copy of the batch
        try:
            array = np.array(image.convert("RGB"))
        except OSError as err:  # a valid header over truncated or corrupt data
            raise RequestError(f"malformed request: image {index} cannot be decoded ({err})") from None
        pixels[index] = torch.from_numpy(array).permute(2, 0, 1).float() / 255
    return pixels


def _decode_npz(images: Any, max_pixels: int) -> Tensor:
    if not isinstance(images, str):
        raise RequestError("malformed request: npz 'images' must be one base64 string")
    raw = io.BytesIO(base64.b64decode(images, validate=True))
    with zipfile.ZipFile(raw) as archive:
        if "images.npy" not in archive.namelist():
            raise RequestError("malformed request: the npz holds no 'images' array")
        with archive.open("images.npy") as member:  # the .npy header: shape and dtype, before any data
            version = np.lib.format.read_magic(member)
            readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in readers:
                raise RequestError(f"malformed request: unsupported .npy version {version}")
            shape, _, dtype = readers[version](member)
    if len(shape) != 4 or shape[1] != 3 or dtype.kind != "f":
        raise RequestError(f"malformed request: npz images must be float (B, 3, H, W); got {dtype} {shape}")
    count = shape[0] * shape[2] * shape[3]
    if count > max_pixels:
        raise _too_many_pixels(count, max_pixels)
    raw.seek(0)
    with np.load(raw, allow_pickle=False) as npz:
        return torch.from_numpy(npz["images"].astype(np.float32, copy=False))


@register_reward("remote")
class RemoteReward(BaseReward):
    """POSTs each batch to ``url`` and returns the endpoint's scores (all its keys, e.g. ``total`` and parts).

    ``url``: one URL, or a list of URLs serving the same reward: a batch is cut into requests (``batch_size`` images
    each; by default as many requests as URLs) and each URL's thread takes the next request as soon as its previous
    one is answered, so faster servers take more; the scores come back in the batch's order. ``protocol``: ``json``
    (default: ``scripts/reward_server.py``) or ``flowgrpo`` (Flow-GRPO's reward servers, with ``trust_pickle``,
    ``allow_non_loopback`` and ``only_strict``; see the module docstring); ``image_format`` (json only): ``png``
    (default) or ``npz``; ``timeout`` (s): wall-clock limit of one attempt, from connecting to the last byte of the
    reply (a server that drips its reply cannot stretch it); ``retries`` more attempts on connection errors, timeouts
    and 502/503/504, waiting ``backoff * 2**attempt`` s between them; ``deadline`` (s): limit of one request, all its
    attempts and waits together (default: what the attempts and waits add up to); ``batch_size`` images per request.
    """

    def __init__(
        self,
        *,
        url: str | list[str],
        protocol: str = "json",
        image_format: str | None = None,
        trust_pickle: bool = False,
        allow_non_loopback: bool = False,
        only_strict: bool = True,
        timeout: float = 120.0,
        retries: int = 2,
        backoff: float = 0.5,
        deadline: float | None = None,
        batch_size: int | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__(device="cpu", batch_size=batch_size)
        if isinstance(url, list | tuple) and not url:
            raise ValueError("remote: url is an empty list; give one URL or a list of URLs serving the same reward")
        self.urls = [url] if isinstance(url, str) or not isinstance(url, list | tuple) else list(url)
        self.url = self.urls[0]
        self._targets = [_parse_url(u) for u in self.urls]
        if protocol not in PROTOCOLS:
            raise ValueError(f"remote: protocol must be one of {', '.join(PROTOCOLS)}; got {protocol!r}")
        self.protocol = protocol
        self._headers = {"Content-Type": "application/json"}
        if protocol == "flowgrpo":
            for one, target in zip(self.urls, self._targets, strict=True):
                _check_pickle_opt_in(one, target, trust_pickle, allow_non_loopback, image_format)
            if not isinstance(only_strict, bool):
                raise ValueError(f"remote: only_strict must be true or false; got {only_strict!r}")
            self._headers = {"Content-Type": "application/octet-stream"}
        elif trust_pickle or allow_non_loopback:
            raise ValueError("remote: trust_pickle and allow_non_loopback apply to protocol 'flowgrpo' only")
        self.only_strict = only_strict
        image_format = "png" if image_format is None else image_format
        if image_format not in IMAGE_FORMATS:
            raise ValueError(f"remote: image_format must be one of {', '.join(IMAGE_FORMATS)}; got {image_format!r}")
        if not (isinstance(retries, int) and retries >= 0 and _positive(timeout) and _positive(backoff, zero=True)):
            raise ValueError(
                f"remote: need retries >= 0, timeout > 0 and backoff >= 0; got {retries!r}, {timeout!r}, {backoff!r}"
            )
        if deadline is not None and not _positive(deadline):
            raise ValueError(f"remote: deadline must be a number of seconds > 0 or null; got {deadline!r}")
        self.image_format = image_format
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        waits = sum(self.backoff * 2**i for i in range(self.retries))
        self.deadline = float(deadline) if deadline is not None else self.timeout * (self.retries + 1) + waits

    def __call__(
        self,
        images: Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
        source_images: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """One URL: ``BaseReward``'s chunked scoring. Several: the chunks spread over the URLs (one thread each)."""
        if len(self.urls) == 1:
            return super().__call__(images, prompts, metadata, source_images)
        prompts, metadata = check_inputs(images, prompts, metadata)
        batch = images.shape[0]
        step = self.batch_size or -(-batch // len(self.urls))
        todo = collections.deque(range(0, batch, step))
        results: dict[int, dict[str, Tensor]] = {}
        lock, failed = threading.Lock(), threading.Event()

        def work(index: int) -> None:
            while not failed.is_set():
                with lock:
                    if not todo:
                        return
                    start = todo.popleft()
                part = slice(start, start + step)
                try:
                    out = self._score_at(index, images[part], prompts[part], metadata[part])
                    results[start] = as_score_dict(out, self.name, len(prompts[part]))
                except BaseException:
                    failed.set()  # the other threads take no more requests
                    raise

        with concurrent.futures.ThreadPoolExecutor(len(self.urls), thread_name_prefix="remote-reward") as pool:
            futures = [pool.submit(work, index) for index in range(len(self.urls))]
        for future in futures:
            future.result()  # the first failure, as the one-URL path raises it
        chunks = [results[start] for start in sorted(results)]
        for chunk in chunks[1:]:
            if chunk.keys() != chunks[0].keys():
                raise RemoteRewardError(
                    f"remote reward: the servers at {', '.join(self.urls)} answer with different score keys "
                    f"({sorted(chunks[0])} and {sorted(chunk)}); serve the same reward at every url",
                    reward=self.name,
                )
        return {key: torch.cat([c[key] for c in chunks]) for key in chunks[0]}

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> dict[str, Tensor]:
        return self._score_at(0, images, prompts, metadata)

    def _score_at(
        self, index: int, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]
    ) -> dict[str, Tensor]:
        url = self.urls[index]
        if self.protocol == "flowgrpo":
            body = encode_flowgrpo_request(images, prompts, metadata, only_strict=self.only_strict)
            return flowgrpo_scores(self._post(body, index), len(prompts), only_strict=self.only_strict, url=url)
        body = encode_request(images, prompts, metadata, self.image_format)
        reply = self._post(body, index)
        scores = reply.get("scores") if isinstance(reply, dict) else None
        if not isinstance(scores, dict) or not scores:
            raise RemoteRewardError(f"remote reward at {url}: reply has no 'scores' object: {str(reply)[:200]}")
        out = {}
        for key, values in scores.items():
            if not isinstance(values, list) or len(values) != len(prompts):
                raise RemoteRewardError(
                    f"remote reward at {url}: scores['{key}'] must be a list of {len(prompts)} numbers"
                )
            try:
                out[key] = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)
            except (TypeError, ValueError) as err:
                message = f"remote reward at {url}: scores['{key}'] holds a non-number ({err})"
                raise RemoteRewardError(message, reward=self.name) from None
        return out

    def _post(self, body: bytes, index: int = 0) -> Any:
        url, target = self.urls[index], self._targets[index]
        end = time.monotonic() + self.deadline
        last, attempts = "no attempt made", 0
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), max(end - time.monotonic(), 0)))
            left = end - time.monotonic()
            if left <= 0:
                break
            attempts += 1
            try:
                status, data = _http_request("POST", target, body, min(self.timeout, left), self._headers)
            except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out, garbled
                last = f"{type(err).__name__}: {err}"
            else:
                if status == 200:
                    return self._parse_reply(data, url)
                detail = _traceback_tail(data) if self.protocol == "flowgrpo" else _error_detail(data)
                if status not in _RETRY_STATUS:
                    raise RemoteRewardError(
                        f"remote reward at {url} answered HTTP {status}: {detail}", reward=self.name
                    )
                last = f"HTTP {status}: {detail}"
            logger.warning("remote reward %s: attempt %d/%d failed: %s", url, attempt + 1, self.retries + 1, last)
        raise RemoteRewardError(
            f"remote reward at {url}: no answer after {attempts} attempt(s) ({self.timeout:g} s each, "
            f"{self.deadline:g} s in all); last error: {last}. Is "
            f"{'the reward server' if self.protocol == 'flowgrpo' else 'scripts/reward_server.py'} running there?",
            reward=self.name,
        )

    def _parse_reply(self, data: bytes, url: str) -> Any:
        if self.protocol == "flowgrpo":
            return load_reply_pickle(data, url)
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as err:
            msg = f"remote reward at {url} sent invalid JSON: {type(err).__name__}: {err}"
            raise RemoteRewardError(msg, reward=self.name) from err

    def __repr__(self) -> str:
        return f"RemoteReward(url={self.urls if len(self.urls) > 1 else self.url!r}, protocol={self.protocol})"


# ---------------------------------------------------------------------------- protocol: flowgrpo
def is_loopback(host: str) -> bool:
    """Whether ``host`` (a URL's hostname) is this machine: ``localhost`` or a loopback address."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it could resolve anywhere
        return False


def _check_pickle_opt_in(
    url: str, target: urllib.parse.SplitResult, trust_pickle: Any, allow_non_loopback: Any, image_format: Any
) -> None:
    if image_format is not None:
        raise ValueError("remote: image_format does not apply to protocol 'flowgrpo' (it sends JPEG, quality 75)")
    if trust_pickle is not True:
        raise ValueError(
            f"remote: protocol 'flowgrpo' reads the replies of {url} with pickle, and unpickling lets whoever answers "
            "there run code in this process. Set trust_pickle: true only for a server you run yourself (Flow-GRPO's "
            "reward-server app_geneval.py / app_deqa.py); scripts/reward_server.py speaks JSON (protocol: json)."
        )
    if allow_non_loopback is not True and not is_loopback(target.hostname or ""):
        raise ValueError(
            f"remote: protocol 'flowgrpo' is loopback-only by default, and {target.hostname!r} is not a loopback "
            "address: on a network a forged or tampered pickle reply can run code here. Prefer an SSH tunnel "
            "(ssh -L 18085:127.0.0.1:18085 host, then url: http://127.0.0.1:18085), or, on a network you trust, set "
            "allow_non_loopback: true as well."
        )


def encode_flowgrpo_request(
    images: Tensor, prompts: list[str], metadata: list[dict[str, Any]], *, only_strict: bool = True
) -> bytes:
    """The pickled request of Flow-GRPO's reward clients: JPEG bytes at PIL's default quality (75), plus
    ``meta_datas`` (each with ``prompt``), ``only_strict`` and ``prompts``."""
    jpegs = []
    for pixels in to_uint8_hwc(images):
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=FLOWGRPO_JPEG_QUALITY)
        jpegs.append(buffer.getvalue())
    try:  # plain data only: the server unpickles with its own classes, and a JSON round trip proves there are none
        meta_datas = [{**m, "prompt": m.get("prompt", p)} for m, p in zip(metadata, prompts, strict=True)]
        meta_datas = json.loads(json.dumps(meta_datas))
    except (TypeError, ValueError) as err:
        raise ValueError(f"remote: metadata must be JSON-like data (dicts, lists, strings, numbers) ({err})") from None
    request = {"images": jpegs, "meta_datas": meta_datas, "only_strict": only_strict, "prompts": list(prompts)}
    return pickle.dumps(request, protocol=4)  # Python >= 3.4 reads it; the reference server runs 3.10


class _PlainUnpickler(pickle.Unpickler):
    """Builds plain data only: what pickle's own opcodes make (dicts, lists, tuples, strings, bytes, numbers, and
    sets), never a class or function, numpy's included: any global a pickle names is refused, as is a persistent id.
    A class's ``__setstate__`` receives state that ``find_class`` cannot check (an object-dtype array built from raw
    bytes reads them as pointers), and a callable can be made to allocate or run code."""

    def __init__(self, data: bytes, what: str, fix: str) -> None:
        super().__init__(io.BytesIO(data))
        self.what, self.fix = what, fix

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"the {self.what} names {module}.{name}; {self.fix}")


def load_reply_pickle(data: bytes, url: str) -> Any:
    """A Flow-GRPO reward server's pickled reply, read by the restricted unpickler."""
    fix = "a reward server's reply must be plain data (lists, dicts, numbers, strings: send numpy values as floats, "
    fix += "e.g. with .tolist() or .item())"
    try:
        return _PlainUnpickler(data, "reply", fix).load()
    except Exception as err:  # garbled, truncated or refused
        raise RemoteRewardError(f"remote reward at {url} sent a reply that is not a plain pickle ({err})") from None


_PLAIN_TYPES = (dict, list, tuple, str, bytes, int, float, bool, type(None))  # bool: an int; listed for the reader


def load_request_pickle(body: bytes) -> dict[str, Any]:
    """A Flow-GRPO client's pickled request, for a server that opted in (``--flowgrpo-protocol``); ``RequestError``
    (400, 413) on anything else.

    No global is allowed at all (``find_class`` always raises, so no class is built and no function is called), the
    pickle may hold at most ``MAX_REQUEST_VALUES`` opcodes (counted with ``pickletools`` before unpickling: one
    ``]`` byte builds a 56-byte list), and the result must be a dict made of dicts, lists, tuples, strings, bytes,
    numbers, booleans and None only."""
    try:
        for count, _ in enumerate(pickletools.genops(body), start=1):
            if count > MAX_REQUEST_VALUES:
                raise _too_many_values()
    except RequestError:
        raise
    except Exception as err:  # an unknown opcode, a truncated argument
        raise RequestError(f"malformed request: body is not a pickle ({err})") from None
    fix = (
        "a request must be plain data: a dict of lists, strings, bytes and numbers (numpy arrays are refused: send "
        "prompts as a list of str, images as a list of JPEG bytes)"
    )
    try:
        request = _PlainUnpickler(body, "request", fix).load()
    except Exception as err:  # refused, garbled, truncated, too deep
        raise RequestError(f"malformed request: not a plain pickle ({err})") from None
    seen, stack = set(), [request]
    while stack:  # each container once: a pickle can share one object many times, or hold itself
        item = stack.pop()
        if not isinstance(item, _PLAIN_TYPES):
            raise RequestError(f"malformed request: the pickle holds a {type(item).__name__}; {fix}")
        if isinstance(item, dict | list | tuple) and id(item) not in seen:  # ids of objects the request keeps alive
            seen.add(id(item))
            if isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            else:
                stack.extend(item)
    if not isinstance(request, dict):
        raise RequestError(f"malformed request: the pickle is a {type(request).__name__}, not a dict")
    return request


def decode_flowgrpo_request(
    body: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS
) -> tuple[Tensor, list[str], list[dict[str, Any]], bool]:
    """A Flow-GRPO client's request -> ``(images, prompts, metadata, only_strict)``; ``RequestError`` if malformed.

    ``{"images": [JPEG bytes], "meta_datas": [dict] (optional), "only_strict": bool (default true), "prompts": [str]
    (optional)}``: each prompt is ``prompts[i]``, else ``meta_datas[i]["prompt"]``, else empty (Flow-GRPO's GenEval
    client sends the prompt in the metadata, its DeQA client sends images only)."""
    request = load_request_pickle(body)
    images = request.get("images")
    if not isinstance(images, list) or not images or not all(isinstance(i, bytes) for i in images):
        raise RequestError("malformed request: 'images' must be a non-empty list of JPEG bytes")
    batch = len(images)
    meta_datas = request.get("meta_datas")
    if meta_datas is None:
        meta_datas = [{} for _ in range(batch)]
    if not isinstance(meta_datas, list | tuple) or len(meta_datas) != batch:
        raise RequestError(f"malformed request: 'meta_datas' must be a list of {batch} dicts, one per image")
    if not all(isinstance(m, dict) for m in meta_datas):
        raise RequestError("malformed request: each 'meta_datas' entry must be a dict")
    prompts = request.get("prompts")
    if prompts is None:
        prompts = [m.get("prompt") if isinstance(m.get("prompt"), str) else "" for m in meta_datas]
    if not isinstance(prompts, list | tuple) or len(prompts) != batch or not all(isinstance(p, str) for p in prompts):
        raise RequestError(f"malformed request: 'prompts' must be a list of {batch} strings, one per image")
    only_strict = request.get("only_strict", True)
    if not isinstance(only_strict, bool):
        raise RequestError(f"malformed request: 'only_strict' must be True or False; got {only_strict!r}")
    pixels = decode_images(images, "JPEG", max_pixels)
    return pixels, list(prompts), [dict(m) for m in meta_datas], only_strict


FLOWGRPO_GENEVAL_TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


def flowgrpo_reply(scores: dict[str, Tensor], metadata: list[dict[str, Any]], *, only_strict: bool = True) -> dict:
    """The reply a Flow-GRPO client reads, from a reward's score dict (plain lists of floats only).

    A reward with exactly one ``strict_accuracy`` key (``geneval``: ``strict_accuracy`` or ``<key>/strict_accuracy``)
    answers as GenEval's server: ``scores`` = the weighted ``total``, ``strict_rewards``, ``rewards`` (the sibling
    ``accuracy``; all 0 with ``only_strict``, as that server skips the check), and ``group_rewards`` /
    ``group_strict_rewards`` {tag: column} for its six tags, each column holding the image's value where
    ``meta_datas[i]["tag"]`` is that tag and -10 elsewhere. Any other reward answers as DeQA's: ``outputs`` = total."""
    if "total" in scores:
        total = scores["total"]
    elif len(scores) == 1:
        (total,) = scores.values()
    else:
        raise ValueError(f"the reward returns several scores ({', '.join(sorted(scores))}) and no 'total'")
    strict_keys = [k for k in scores if k == "strict_accuracy" or k.endswith("/strict_accuracy")]
    if len(strict_keys) != 1:
        return {"outputs": [float(v) for v in total.tolist()]}
    strict = [float(v) for v in scores[strict_keys[0]].tolist()]
    accuracy_key = strict_keys[0][: -len("strict_accuracy")] + "accuracy"
    if only_strict or accuracy_key not in scores:
        accuracy = [0.0] * len(strict)
    else:
        accuracy = [float(v) for v in scores[accuracy_key].tolist()]
    tags = [m.get("tag") for m in metadata]

    def grouped(column: list[float]) -> dict[str, list[float]]:
        return {
            k: [v if tag == k else -10.0 for v, tag in zip(column, tags, strict=True)] for k in FLOWGRPO_GENEVAL_TAGS
        }

    return {
        "scores": [float(v) for v in total.tolist()],
        "rewards": accuracy,
        "strict_rewards": strict,
        "group_rewards": grouped(accuracy),
        "group_strict_rewards": grouped(strict),
    }


def flowgrpo_scores(reply: Any, batch: int, *, only_strict: bool = True, url: str = "") -> dict[str, Tensor]:
    """Score keys from a GenEval reply (``total`` = partial score, ``strict_accuracy``, ``<tag>_strict_accuracy``,
    and with ``only_strict`` false ``accuracy``, ``<tag>_accuracy``) or a DeQA one (``total`` = ``outputs``)."""
    if not isinstance(reply, dict):
        raise RemoteRewardError(f"remote reward at {url}: the reply is a {type(reply).__name__}, not a dict")

    def column(values: Any, what: str) -> Tensor:
        try:
            out = torch.as_tensor(np.asarray(values, dtype=np.float64)).reshape(-1)
        except (TypeError, ValueError) as err:
            raise RemoteRewardError(f"remote reward at {url}: {what} holds a non-number ({err})") from None
        if out.numel() != batch:
            raise RemoteRewardError(f"remote reward at {url}: {what} holds {out.numel()} values for {batch} images")
        return out

    if "scores" in reply:  # GenEval (app_geneval.py)
        missing = sorted({"strict_rewards", "group_strict_rewards"} - set(reply))
        if missing:
            raise RemoteRewardError(f"remote reward at {url}: GenEval reply without {', '.join(missing)}")
        parts = [("strict_rewards", "group_strict_rewards", "strict_accuracy")]
        if not only_strict:  # the server ran the non-strict check too (with only_strict its results are all 0)
            parts.append(("rewards", "group_rewards", "accuracy"))
        scores = {"total": column(reply["scores"], "scores")}
        for flat, grouped, name in parts:
            scores[name] = column(reply.get(flat), flat)
            groups = reply.get(grouped)
            if not isinstance(groups, dict):
                raise RemoteRewardError(f"remote reward at {url}: {grouped} is not a dict of tag -> values")
            for tag, values in groups.items():
                value = column(values, f"{grouped}[{tag!r}]")  # -10: the image has another tag
                scores[f"{tag}_{name}"] = torch.where(value == -10.0, math.nan, value)
        return scores
    if "outputs" in reply:  # DeQA (app_deqa.py), and Flow-GRPO's pickled UnifiedReward server
        return {"total": column(reply["outputs"], "outputs")}
    raise RemoteRewardError(
        f"remote reward at {url}: reply keys {sorted(map(str, reply))}: neither GenEval's (scores, strict_rewards, "
        "...) nor DeQA's (outputs)"
    )


def _positive(value: Any, *, zero: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    return value >= 0 if zero else value > 0


def _parse_url(url: Any) -> urllib.parse.SplitResult:
    """``url`` split, or a ValueError saying what is wrong with it."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"remote: url must start with http:// or https://; got {url!r}")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError as err:
        raise ValueError(f"remote: url {url!r} is malformed ({err})") from None
    if not parts.hostname:
        raise ValueError(f"remote: url {url!r} names no host")
    return parts


class _Stoppable(Protocol):
    """A group of requests that can be ended at once (the VLM judge's batch): ``add`` registers a request's abort
    (False once stopped: the request must not be sent), ``discard`` drops it, ``stopped`` is set by the stop."""

    stopped: threading.Event

    def add(self, abort: Callable[[], None]) -> bool: ...

    def discard(self, abort: Callable[[], None]) -> None: ...


def _http_request(
    method: str,
    target: urllib.parse.SplitResult,
    body: bytes | None,
    seconds: float,
    headers: dict[str, str],
    batch: _Stoppable | None = None,
    *,
    max_reply: int = MAX_REPLY_BYTES,
    replier: str = "a reward server's",
) -> tuple[int, bytes]:
    """One HTTP request, (status, reply body), within ``seconds`` of wall-clock time, or ended by ``batch``'s stop.
    A reply over ``max_reply`` bytes is refused (``replier``: what a reply comes from, for the message).

    A socket timeout bounds each read only (a server that drips bytes could hold a read loop forever), so a timer
    shuts the socket down at the deadline instead, as a stop does; either ends any blocked call at once. Raises
    ``TimeoutError`` then, and ``OSError`` / ``http.client.HTTPException`` for the connection's failures."""
    cls = http.client.HTTPSConnection if target.scheme == "https" else http.client.HTTPConnection
    connection = cls(target.hostname, target.port, timeout=max(seconds, 0.001))
    ended, sockets = threading.Event(), []

    def abort() -> None:
        ended.set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def check_time() -> None:
        if ended.is_set():
            stopped = batch is not None and batch.stopped.is_set()
            raise TimeoutError("the batch was stopped" if stopped else f"no complete reply within {seconds:.3g} s")

    if batch is not None and not batch.add(abort):
        raise TimeoutError("the batch was stopped")
    timer = threading.Timer(seconds, abort)
    timer.daemon = True
    timer.start()
    path = (target.path or "/") + (f"?{target.query}" if target.query else "")
    try:
        connection.connect()
        sockets.append(connection.sock)  # kept: http.client drops its reference once a reply says it will close
        check_time()  # an abort between connect() and the line above found no socket to shut
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        if response.length is not None and response.length > max_reply:
            raise http.client.HTTPException(f"reply of {response.length} bytes; {replier} is far smaller")
        data = response.read(max_reply + 1)
        check_time()  # a socket shut down at the deadline reads as an early end of the reply
        if len(data) > max_reply or (response.length is not None and response.length > 0):
            raise http.client.HTTPException(f"reply cut short or longer than {max_reply} bytes")
        return response.status, data
    except (OSError, http.client.HTTPException):
        check_time()
        raise
    finally:
        timer.cancel()
        if batch is not None:
            batch.discard(abort)
        connection.close()


def _traceback_tail(data: bytes) -> str:
    """The last line of a Flow-GRPO reward server's error reply (a Python traceback): the exception."""
    lines = [line for line in data[-4000:].decode("utf-8", "replace").splitlines() if line.strip()]
    return lines[-1].strip()[:500] if lines else "(empty reply)"


def _error_detail(data: bytes) -> str:
    try:
        return str(json.loads(data).get("error", ""))[:2000]
    except Exception:
        return data[:200].decode("utf-8", "replace")


def make_reward_server(
    reward: Reward | Sequence[Reward],
    port: int = 0,
    host: str = "127.0.0.1",
    max_request_mb: float = DEFAULT_MAX_REQUEST_MB,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    timeout: float = DEFAULT_SERVER_TIMEOUT,
    memory_budget_mb: float | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    flowgrpo_protocol: bool = False,
) -> RewardServer:
    """An HTTP server (not started: call ``serve_forever``) scoring with ``reward``; ``port=0`` picks a free one.

    ``reward`` may be a list of rewards (one per device): each gets a worker thread, and a request goes to the first
    free worker, so one reward instance never scores two requests at once; /health answers meanwhile. A request
    body may hold ``max_request_mb`` MiB and ``max_pixels`` pixels (all its images together); all bodies being
    received or waiting for a worker hold at most ``memory_budget_mb`` MiB together (default: the larger of 1024 and
    ``max_request_mb``), at most ``max_connections`` connections are served at once, and each connection must send
    its whole request, headers included, within ``timeout`` seconds of connecting. ``flowgrpo_protocol``: also
    accept Flow-GRPO's pickled requests on ``POST /`` (see the module docstring).
    """
    rewards = [reward] if callable(reward) else list(reward)
    if not rewards or not all(callable(r) for r in rewards):
        raise ValueError("reward server: give a reward, or a non-empty list of rewards (one per device)")
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"reward server binds loopback only ({', '.join(LOOPBACK_HOSTS)}); got {host!r}")
    budget_mb = max(DEFAULT_MEMORY_BUDGET_MB, max_request_mb) if memory_budget_mb is None else memory_budget_mb
    if not (_positive(max_request_mb) and _positive(timeout) and _positive(budget_mb) and _count(max_pixels)):
        raise ValueError(
            "reward server: max_request_mb (--max-request-mb), max_pixels (--max-pixels), timeout (--timeout) and "
            f"memory_budget_mb (--memory-budget-mb) must be > 0; got {max_request_mb!r}, {max_pixels!r}, {timeout!r}, "
            f"{memory_budget_mb!r}"
        )
    if not _count(max_connections):
        raise ValueError(
            f"reward server: max_connections (--max-connections) must be a whole number > 0; got {max_connections!r}"
        )
    if budget_mb < max_request_mb:
        raise ValueError(
            f"reward server: memory_budget_mb (--memory-budget-mb, {budget_mb:g}) is below max_request_mb "
            f"(--max-request-mb, {max_request_mb:g}), so "
            "the largest request allowed could never be received; raise the budget or lower the request limit"
        )
    limits = ServerLimits(
        max_bytes=int(max_request_mb * 2**20),
        max_pixels=max_pixels,
        timeout=float(timeout),
        budget_bytes=int(budget_mb * 2**20),
        max_connections=max_connections,
    )
    return RewardServer((host, port), rewards, limits, flowgrpo_protocol=flowgrpo_protocol)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class ServerLimits:
    """What one client may cost the server: body size (bytes), pixels per request, seconds to send a request, body
    bytes held by all connections together, connections at once."""

    max_bytes: int
    max_pixels: int
    timeout: float
    budget_bytes: int
    max_connections: int


LISTEN_BACKLOG = 128  # socketserver's 5 reset connections when many clients start at once
READ_CHUNK = 2**20  # most body bytes read (and reserved) at a time
DRAIN_SECONDS = 2.0  # how long a refused request's unread body is read and dropped, so the client sees the reply
BUSY_DRAIN_SECONDS = 0.25  # the same for a connection over --max-connections
_Reply = tuple[int, str, bytes]  # status, content type, body


class RewardServer:
    """Serves ``POST /score`` (JSON), with ``flowgrpo_protocol`` also ``POST /`` (Flow-GRPO's pickle), and
    ``GET /health``: one asyncio loop does all network I/O, one worker thread per reward decodes and scores.

    Limits (``ServerLimits``), so that no client can exhaust the server or starve the others:

    - connections: ``max_connections`` at once; one more is answered 503 at once and closed;
    - time: a connection must deliver its whole request (request line, headers, body) within ``timeout`` s of being
      accepted, else 408 and closed; a client sending a header or a byte now and then is cut off too;
    - memory: a body is read in chunks of at most 1 MiB, never allocated from its ``Content-Length``; each chunk is
      reserved from one budget of ``budget_bytes`` shared by all connections before it is kept, and the request is
      answered 503 if it would exceed the budget; a request's bytes stay reserved until it is answered. Headers are
      at most 64 KiB (431). A worker joins, decodes and scores one request at a time, so at most one decoded copy
      of a request exists per worker.

    ``buffered_bytes`` (``peak_buffered_bytes``) are the reserved body bytes now (at most so far);
    ``open_connections`` the connections being served; ``scored[i]`` the requests worker ``i`` has answered.
    ``serve_forever`` / ``shutdown`` / ``server_close`` behave as socketserver's.
    """

    def __init__(
        self,
        address: tuple[str, int],
        rewards: list[Reward],
        limits: ServerLimits,
        *,
        flowgrpo_protocol: bool = False,
    ) -> None:
        self.rewards, self.limits, self.flowgrpo_protocol = rewards, limits, flowgrpo_protocol
        self.socket = socket.create_server(address, backlog=LISTEN_BACKLOG)
        self.server_address: tuple[str, int] = self.socket.getsockname()[:2]
        self.buffered_bytes = self.peak_buffered_bytes = 0
        self.open_connections = self.refused_connections = 0
        self.scored = [0] * len(rewards)
        self._draining = 0
        self._jobs: queue.SimpleQueue | None = None
        self._shutdown_request, self._serving, self._stopped = threading.Event(), threading.Event(), threading.Event()

    # ------------------------------------------------------------------ socketserver's interface
    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Serve until ``shutdown()`` (from another thread); ``poll_interval``: how often the request is checked."""
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        workers = [
            threading.Thread(target=self._work, args=(i, jobs), name=f"reward-worker-{i}", daemon=True)
            for i in range(len(self.rewards))
        ]
        self._stopped.clear()
        self._serving.set()
        for worker in workers:
            worker.start()
        try:
            asyncio.run(self._serve(jobs, poll_interval))
        finally:
            for _ in workers:
                jobs.put(None)  # a worker scoring now finishes that request first (daemon threads: not joined)
            self._shutdown_request.clear()
            self._serving.clear()
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop ``serve_forever`` and wait until it has returned; open connections are closed unanswered."""
        self._shutdown_request.set()
        if self._serving.is_set():
            self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()

    # ------------------------------------------------------------------ the event loop
    async def _serve(self, jobs: queue.SimpleQueue, poll_interval: float) -> None:
        self._jobs = jobs
        # A duplicate of the listening socket: asyncio closes the one it serves, the original stays for server_close.
        server = await asyncio.start_server(
            self._connection, sock=self.socket.dup(), limit=MAX_HEADER_BYTES, backlog=LISTEN_BACKLOG
        )
        try:
            while not self._shutdown_request.is_set():
                await asyncio.sleep(poll_interval)
        finally:
            server.close()  # asyncio.run then cancels the connections' tasks

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open_connections >= self.limits.max_connections:
            return await self._refuse_busy(reader, writer)
        self.open_connections += 1
        request = _Request(deadline=asyncio.get_running_loop().time() + self.limits.timeout)
        try:
            await self._handle(reader, writer, request)
        except (OSError, asyncio.TimeoutError):  # the client left, or does not read its reply
            pass
        except Exception:  # a bug here must not take the loop down
            logger.exception("reward server: unexpected error on a connection")
        finally:
            self.open_connections -= 1
            self._release(request)
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: _Request) -> None:
        kind = "json"
        try:
            try:
                head = await _within(reader.readuntil(b"\r\n\r\n"), request.deadline)
            except asyncio.IncompleteReadError as err:
                if err.partial.strip():  # half a request, then the client stopped sending
                    raise RequestError("the request ended inside its headers") from None
                return  # connected and left
            except asyncio.LimitOverrunError:
                raise RequestError(f"request headers exceed {MAX_HEADER_BYTES} bytes", status=431) from None
            except asyncio.TimeoutError:
                raise RequestError(self._too_slow("request line and headers"), status=408) from None
            method, path, headers = _parse_head(head)
            if method == "GET":
                if path.rstrip("/") != "/health":
                    raise RequestError(f"unknown path {path}; use {self._routes()}", status=404)
                return await _send(writer, _json_reply(200, self._health()), self.limits.timeout)
            if method != "POST":
                raise RequestError(f"method {method} is not served; use {self._routes()}", status=405)
            if path.rstrip("/") == "/score":
                kind = "json"
            elif path == "/" and self.flowgrpo_protocol:
                kind = "flowgrpo"
            elif path == "/":
                message = (
                    "POST / is Flow-GRPO's pickled protocol, which this server does not accept: start "
                    "scripts/reward_server.py with --flowgrpo-protocol, or POST JSON to /score"
                )
                raise RequestError(message, status=404)
            else:
                raise RequestError(f"unknown path {path}; use {self._routes()}", status=404)
            request.body_unread = True
            chunks = await self._read_body(reader, writer, headers, request)
        except RequestError as err:
            self._release(request)
            await _send(writer, _error_reply(kind, err.status, str(err)), self.limits.timeout)
            if request.body_unread and err.status != 408:
                await self._drain(reader, writer, min(DRAIN_SECONDS, self.limits.timeout))
            return
        future = asyncio.get_running_loop().create_future()
        assert self._jobs is not None
        self._jobs.put((kind, chunks, future))
        del chunks
        reply = await future
        self._release(request)  # the worker is done with the body
        await _send(writer, reply, self.limits.timeout)

    async def _read_body(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        headers: dict[str, str],
        request: _Request,
    ) -> list[bytes]:
        """The body's chunks, each reserved from the shared budget as it arrives, within the request's deadline."""
        limits = self.limits
        if "transfer-encoding" in headers:
            raise RequestError("send the body with a Content-Length; chunked bodies are not accepted", status=411)
        raw = headers.get("content-length")
        if raw is None:
            raise RequestError("a Content-Length header is required", status=411)
        if not raw.isascii() or not raw.isdigit():
            raise RequestError(f"Content-Length must be a whole number of bytes; got {raw[:50]!r}")
        length = int(raw)
        if length == 0:
            raise RequestError("empty request body; POST a request (see rewards/remote.py)")
        if length > limits.max_bytes:
            raise RequestError(
                f"request body of {length} bytes exceeds the server's limit of {limits.max_bytes} bytes; send fewer "
                "images per request (the remote reward's batch_size option) or start the server with a larger "
                "--max-request-mb",
                status=413,
            )
        if headers.get("expect", "").lower() == "100-continue":  # curl waits for this before a large body
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        chunks, got = [], 0
        while got < length:
            try:
                data = await _within(reader.read(min(READ_CHUNK, length - got)), request.deadline)
            except asyncio.TimeoutError:
                raise RequestError(self._too_slow("request body"), status=408) from None
            if not data:
                raise RequestError(f"request body ended after {got} of its {length} bytes")
            if self.buffered_bytes + len(data) > limits.budget_bytes:
                raise RequestError(
                    f"the server is busy: the requests it holds fill its memory budget of {limits.budget_bytes} "
                    "bytes (--memory-budget-mb); retry in a moment",
                    status=503,
                )
            self.buffered_bytes += len(data)
            self.peak_buffered_bytes = max(self.peak_buffered_bytes, self.buffered_bytes)
            request.reserved += len(data)
            chunks.append(data)
            got += len(data)
        request.body_unread = False
        return chunks

    def _release(self, request: _Request) -> None:
        self.buffered_bytes -= request.reserved
        request.reserved = 0

    async def _refuse_busy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A connection over the bound: 503 at once; its request is read and dropped for a moment (so that the reply
        is not lost to a reset), by at most ``max_connections`` such connections at a time."""
        self.refused_connections += 1
        message = (
            f"the server is busy: it serves {self.limits.max_connections} connections at once (--max-connections); "
            "retry in a moment"
        )
        try:
            writer.write(_http_reply(_error_reply("json", 503, message)))
            if self._draining < self.limits.max_connections:
                self._draining += 1
                try:
                    await self._drain(reader, writer, BUSY_DRAIN_SECONDS)
                finally:
                    self._draining -= 1
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _drain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seconds: float) -> None:
        """Half-close (the reply is complete), then read and drop what the client still sends, for ``seconds``:
        closing with unread data would reset the connection, and the client would lose the reply."""
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()
        deadline = asyncio.get_running_loop().time() + seconds
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            while await _within(reader.read(2**16), deadline):
                pass

    def _too_slow(self, what: str) -> str:
        return (
            f"{what} not received within {self.limits.timeout:g} s of connecting (the server's --timeout covers the "
            "whole request)"
        )

    def _routes(self) -> str:
        flowgrpo = ", POST / (Flow-GRPO's pickle)" if self.flowgrpo_protocol else ""
        return f"POST /score{flowgrpo} or GET /health"

    def _health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "reward": repr(self.rewards[0]),
            "workers": len(self.rewards),
            "protocols": ["json", "flowgrpo"] if self.flowgrpo_protocol else ["json"],
            "open_connections": self.open_connections,
            "buffered_bytes": self.buffered_bytes,
        }

    # ------------------------------------------------------------------ the workers
    def _work(self, index: int, jobs: queue.SimpleQueue) -> None:
        """Worker ``index``: takes the next complete request, decodes and scores it with its own reward."""
        while (job := jobs.get()) is not None:
            kind, chunks, future = job
            try:
                reply = self._score(self.rewards[index], kind, chunks)
            except BaseException as err:  # MemoryError while decoding, say: answer, and keep the worker alive
                logger.exception("reward server: worker %d failed on a request", index)
                reply = _error_reply(kind, 500, f"{type(err).__name__}: {err}")
            self.scored[index] += 1
            with contextlib.suppress(RuntimeError):  # the loop has closed: the server shut down meanwhile
                future.get_loop().call_soon_threadsafe(_resolve, future, reply)

    def _score(self, reward: Reward, kind: str, chunks: list[bytes]) -> _Reply:
        body = b"".join(chunks)
        chunks.clear()
        try:
            if kind == "flowgrpo":
                images, prompts, metadata, only_strict = decode_flowgrpo_request(
                    body, max_pixels=self.limits.max_pixels
                )
            else:
                images, prompts, metadata = decode_request(body, max_pixels=self.limits.max_pixels)
        except RequestError as err:
            return _error_reply(kind, err.status, str(err))
        del body
        try:
            with torch.no_grad():
                scores = as_score_dict(reward(images, prompts, metadata), "reward", len(prompts))
            if kind == "flowgrpo":
                reply = flowgrpo_reply(scores, metadata, only_strict=only_strict)
                return 200, "application/octet-stream", pickle.dumps(reply, protocol=4)
            return _json_reply(200, {"scores": {key: value.tolist() for key, value in scores.items()}})
        except Exception as err:
            logger.exception("reward server: scoring failed")
            return _error_reply(kind, 500, f"{type(err).__name__}: {err}")


@dataclass
class _Request:
    deadline: float  # loop time by which the whole request must have arrived
    reserved: int = 0  # body bytes reserved from the server's budget
    body_unread: bool = False


def _resolve(future: asyncio.Future, reply: _Reply) -> None:
    if not future.done():  # cancelled: the connection was closed at shutdown
        future.set_result(reply)


async def _within(awaitable: Any, deadline: float) -> Any:
    """``await awaitable``, or ``asyncio.TimeoutError`` at ``deadline`` (loop time)."""
    left = deadline - asyncio.get_running_loop().time()
    if left <= 0:
        awaitable.close()
        raise asyncio.TimeoutError
    return await asyncio.wait_for(awaitable, left)


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    """(method, path without the query, {lower-case header name: value}) of a request's head; RequestError if
    malformed."""
    lines = head.decode("latin-1").split("\r\n")
    while lines and not lines[0]:  # empty lines before the request line are allowed (RFC 9112, 2.2)
        lines.pop(0)
    parts = lines[0].split(" ") if lines else []
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise RequestError(
            f"malformed request line {(lines[0] if lines else '')[:100]!r}; expected METHOD PATH HTTP/1.1"
        )
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or " " in name:
            raise RequestError(f"malformed header line {line[:100]!r}")
        key, value = name.lower(), value.strip()
        if key == "content-length" and headers.get(key, value) != value:
            raise RequestError("conflicting Content-Length headers")
        headers[key] = value
    return parts[0], parts[1].split("?", 1)[0], headers


def _json_reply(status: int, payload: dict[str, Any]) -> _Reply:
    return status, "application/json", json.dumps(payload).encode("utf-8")


def _error_reply(kind: str, status: int, message: str) -> _Reply:
    """JSON ``{"error": message}``; for Flow-GRPO's protocol the message as one line of text (its clients show the
    reply's last line)."""
    if kind == "flowgrpo":
        return status, "text/plain; charset=utf-8", " ".join(message.split()).encode("utf-8")
    return _json_reply(status, {"error": message})


def _http_reply(reply: _Reply) -> bytes:
    status, content_type, body = reply
    head = (
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


async def _send(writer: asyncio.StreamWriter, reply: _Reply, timeout: float) -> None:
    writer.write(_http_reply(reply))
    await asyncio.wait_for(writer.drain(), timeout)  # a client that never reads its reply is dropped
