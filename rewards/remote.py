"""Scoring over HTTP, for rewards that live in another process or on another GPU (GenEval detectors, VLM judges).

Protocol (JSON both ways, standard library only):

    POST /score  {"format": "png" | "npz", "images": ..., "prompts": [str], "metadata": [dict]}
      png: "images" is a list of base64 PNGs (8-bit; rewards that quantise anyway score them identically)
      npz: "images" is one base64 ``.npz`` holding float32 ``images`` (B, 3, H, W) — lossless
    200  {"scores": {key: [float, ...], ...}}        4xx/500  {"error": "message"}
    GET  /health -> {"status": "ok", "reward": "..."}

``scripts/reward_server.py`` serves any registered reward (or combination) this way on 127.0.0.1. The server
answers every bad request with a 4xx and a message (400 malformed, 408 too slow, 411 no Content-Length, 413 too
large), checks image sizes from the PNG / ``.npy`` headers before decoding anything (``max_pixels`` per request),
caps the body (``max_request_mb``) and times out stalled connections (``timeout``).

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

import base64
import contextlib
import http.client
import io
import ipaddress
import json
import logging
import math
import pickle
import socket
import threading
import time
import urllib.parse
import warnings
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

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
    request together) before any pixel is decoded, so a small request cannot make the server allocate gigabytes."""
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


def _too_many_pixels(count: int, max_pixels: int) -> RequestError:
    return RequestError(
        f"request holds {count} pixels, more than the server's limit of {max_pixels}; send fewer images per request "
        "(the remote reward's batch_size option) or start the server with a larger --max-pixels",
        status=413,
    )


def _decode_pngs(images: Any, max_pixels: int) -> Tensor:
    if not isinstance(images, list) or not images or not all(isinstance(s, str) for s in images):
        raise RequestError("malformed request: png 'images' must be a non-empty list of base64 strings")
    opened = []
    for index, encoded in enumerate(images):
        data = base64.b64decode(encoded, validate=True)
        with warnings.catch_warnings():  # PIL warns, then raises, on images beyond its own (larger) pixel limit
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            try:
                opened.append(Image.open(io.BytesIO(data), formats=["PNG"]))  # reads the header only
            except (Image.DecompressionBombWarning, Image.DecompressionBombError):
                raise _too_many_pixels(max_pixels + 1, max_pixels) from None
            except OSError as err:
                raise RequestError(f"malformed request: image {index} is not a PNG ({err})") from None
    sizes = {image.size for image in opened}
    if len(sizes) != 1:
        raise RequestError(f"malformed request: images differ in size ({sorted(sizes)}); send one size per request")
    (width, height), batch = sizes.pop(), len(opened)
    if batch * width * height > max_pixels:
        raise _too_many_pixels(batch * width * height, max_pixels)
    pixels = torch.empty(batch, 3, height, width)
    for index, image in enumerate(opened):  # one image at a time: no stacked uint8 copy of the batch
        pixels[index] = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).float() / 255
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

    ``protocol``: ``json`` (default: ``scripts/reward_server.py``) or ``flowgrpo`` (Flow-GRPO's reward servers, with
    ``trust_pickle``, ``allow_non_loopback`` and ``only_strict``; see the module docstring); ``image_format`` (json
    only): ``png`` (default) or ``npz``; ``timeout`` (s): wall-clock limit of one attempt, from connecting to the
    last byte of the reply (a server that drips its reply cannot stretch it); ``retries`` more attempts on
    connection errors, timeouts and 502/503/504, waiting ``backoff * 2**attempt`` s between them; ``deadline`` (s):
    limit of the whole call, all attempts and waits together (default: what the attempts and waits add up to);
    ``batch_size`` images per request.
    """

    def __init__(
        self,
        *,
        url: str,
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
        self.url = url
        self._target = _parse_url(url)
        if protocol not in PROTOCOLS:
            raise ValueError(f"remote: protocol must be one of {', '.join(PROTOCOLS)}; got {protocol!r}")
        self.protocol = protocol
        self._headers = {"Content-Type": "application/json"}
        if protocol == "flowgrpo":
            _check_pickle_opt_in(url, self._target, trust_pickle, allow_non_loopback, image_format)
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

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> dict[str, Tensor]:
        if self.protocol == "flowgrpo":
            body = encode_flowgrpo_request(images, prompts, metadata, only_strict=self.only_strict)
            return flowgrpo_scores(self._post(body), len(prompts), only_strict=self.only_strict, url=self.url)
        body = encode_request(images, prompts, metadata, self.image_format)
        reply = self._post(body)
        scores = reply.get("scores") if isinstance(reply, dict) else None
        if not isinstance(scores, dict) or not scores:
            raise RemoteRewardError(f"remote reward at {self.url}: reply has no 'scores' object: {str(reply)[:200]}")
        out = {}
        for key, values in scores.items():
            if not isinstance(values, list) or len(values) != len(prompts):
                raise RemoteRewardError(
                    f"remote reward at {self.url}: scores['{key}'] must be a list of {len(prompts)} numbers"
                )
            try:
                out[key] = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)
            except (TypeError, ValueError) as err:
                message = f"remote reward at {self.url}: scores['{key}'] holds a non-number ({err})"
                raise RemoteRewardError(message, reward=self.name) from None
        return out

    def _post(self, body: bytes) -> Any:
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
                status, data = _post_once(self._target, body, min(self.timeout, left), headers=self._headers)
            except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out, garbled
                last = f"{type(err).__name__}: {err}"
            else:
                if status == 200:
                    return self._parse_reply(data)
                detail = _traceback_tail(data) if self.protocol == "flowgrpo" else _error_detail(data)
                if status not in _RETRY_STATUS:
                    raise RemoteRewardError(
                        f"remote reward at {self.url} answered HTTP {status}: {detail}", reward=self.name
                    )
                last = f"HTTP {status}: {detail}"
            logger.warning("remote reward %s: attempt %d/%d failed: %s", self.url, attempt + 1, self.retries + 1, last)
        raise RemoteRewardError(
            f"remote reward at {self.url}: no answer after {attempts} attempt(s) ({self.timeout:g} s each, "
            f"{self.deadline:g} s in all); last error: {last}. Is "
            f"{'the reward server' if self.protocol == 'flowgrpo' else 'scripts/reward_server.py'} running there?",
            reward=self.name,
        )

    def _parse_reply(self, data: bytes) -> Any:
        if self.protocol == "flowgrpo":
            return load_reply_pickle(data, self.url)
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as err:
            msg = f"remote reward at {self.url} sent invalid JSON: {type(err).__name__}: {err}"
            raise RemoteRewardError(msg, reward=self.name) from err


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


class _ReplyUnpickler(pickle.Unpickler):
    """Builds plain data only: the dicts, lists, tuples, sets, strings and numbers pickle's own opcodes make, which is
    all the reference servers send (they turn numpy scores into floats with ``.item()``). Any global a pickle names
    is refused, numpy's included: a class's ``__setstate__`` receives state that ``find_class`` cannot check (an
    object-dtype array built from raw bytes reads them as pointers), and a callable can be made to allocate."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"the reply names {module}.{name}; a reward server's reply must be plain data (lists, dicts, numbers, "
            "strings: send numpy values as floats, e.g. with .tolist() or .item())"
        )


def load_reply_pickle(data: bytes, url: str) -> Any:
    """A Flow-GRPO reward server's pickled reply, read by the restricted unpickler."""
    try:
        return _ReplyUnpickler(io.BytesIO(data)).load()
    except Exception as err:  # garbled, truncated or refused
        raise RemoteRewardError(f"remote reward at {url} sent a reply that is not a plain pickle ({err})") from None


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


def _post_once(
    target: urllib.parse.SplitResult, body: bytes, seconds: float, *, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """One POST, (status, reply body), within ``seconds`` of wall-clock time; ``headers`` default to JSON's.

    A socket timeout bounds each read only, so a server that sends a byte now and then could hold a read loop
    forever; a timer shuts the socket down at the deadline instead, which ends any blocked call at once."""
    cls = http.client.HTTPSConnection if target.scheme == "https" else http.client.HTTPConnection
    connection = cls(target.hostname, target.port, timeout=seconds)
    expired, sockets = threading.Event(), []

    def abort() -> None:
        expired.set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def check_time() -> None:
        if expired.is_set():
            raise TimeoutError(f"no complete reply within {seconds:g} s")

    timer = threading.Timer(seconds, abort)
    timer.daemon = True
    timer.start()
    path = (target.path or "/") + (f"?{target.query}" if target.query else "")
    try:
        connection.connect()
        sockets.append(connection.sock)  # kept: http.client drops its reference once a reply says it will close
        check_time()
        connection.request("POST", path, body=body, headers=headers or {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.length is not None and response.length > MAX_REPLY_BYTES:
            raise http.client.HTTPException(f"reply of {response.length} bytes; a reward server's is far smaller")
        data = response.read(MAX_REPLY_BYTES + 1)
        check_time()  # a socket shut down at the deadline reads as an early end of the reply
        if len(data) > MAX_REPLY_BYTES or (response.length is not None and response.length > 0):
            raise http.client.HTTPException(f"reply cut short or longer than {MAX_REPLY_BYTES} bytes")
        return response.status, data
    except (OSError, http.client.HTTPException) as err:
        check_time()
        raise err
    finally:
        timer.cancel()
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
    reward: Reward,
    port: int = 0,
    host: str = "127.0.0.1",
    max_request_mb: float = DEFAULT_MAX_REQUEST_MB,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    timeout: float = DEFAULT_SERVER_TIMEOUT,
) -> RewardServer:
    """An HTTP server (not started: call ``serve_forever``) scoring with ``reward``; ``port=0`` picks a free one.

    Requests are scored one at a time (reward models are not thread-safe); /health answers meanwhile. A request
    body may hold ``max_request_mb`` MiB and ``max_pixels`` pixels (all its images together); a connection that
    has not sent its whole request ``timeout`` seconds after it started sending the body is answered 408 and
    closed (an idle one is closed after ``timeout`` seconds without a byte).
    """
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"reward server binds loopback only ({', '.join(LOOPBACK_HOSTS)}); got {host!r}")
    if not (_positive(max_request_mb) and _positive(timeout) and isinstance(max_pixels, int) and max_pixels > 0):
        raise ValueError(
            f"reward server: max_request_mb, max_pixels and timeout must be > 0; got {max_request_mb!r}, "
            f"{max_pixels!r}, {timeout!r}"
        )
    limits = _Limits(max_bytes=int(max_request_mb * 2**20), max_pixels=max_pixels, timeout=float(timeout))
    return RewardServer((host, port), reward, limits)


class _Limits:
    def __init__(self, *, max_bytes: int, max_pixels: int, timeout: float) -> None:
        self.max_bytes, self.max_pixels, self.timeout = max_bytes, max_pixels, timeout


class RewardServer(ThreadingHTTPServer):
    """Serves ``POST /score`` and ``GET /health`` (see the module docstring); one thread per connection."""

    daemon_threads = True
    request_queue_size = 128  # listen backlog; socketserver's 5 reset connections when many clients start at once

    def __init__(self, address: tuple[str, int], reward: Reward, limits: _Limits) -> None:
        self.reward, self.limits, self.score_lock = reward, limits, threading.Lock()
        super().__init__(address, _Handler)


DRAIN_SECONDS = 2.0  # how long a refused request's unread body is read and dropped, so the client sees the reply


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer

    def setup(self) -> None:
        self.timeout = self.server.limits.timeout  # StreamRequestHandler sets it on the socket: no read waits longer
        self.body_unread = False
        super().setup()

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.rstrip("/") == "/health":
            self._reply(200, {"status": "ok", "reward": repr(self.server.reward)})
        else:
            self._reply(404, {"error": f"unknown path {self.path}; use POST /score or GET /health"})

    def do_POST(self) -> None:  # noqa: N802
        self.body_unread = True
        try:
            if self.path.rstrip("/") != "/score":
                raise RequestError(f"unknown path {self.path}; use POST /score", status=404)
            body = self._read_body()
            images, prompts, metadata = decode_request(body, max_pixels=self.server.limits.max_pixels)
        except RequestError as err:
            return self._refuse(err.status, str(err))
        try:
            with self.server.score_lock:
                output = self.server.reward(images, prompts, metadata)
                scores = as_score_dict(output, "reward", len(prompts))
        except Exception as err:
            logger.exception("reward server: scoring failed")
            return self._reply(500, {"error": f"{type(err).__name__}: {err}"})
        self._reply(200, {"scores": {k: v.tolist() for k, v in scores.items()}})

    def _read_body(self) -> bytearray:
        """The request body, bounded in size (``Content-Length`` checked first) and in time (a deadline for the
        whole body, not only for each read: a client sending a byte now and then is cut off too)."""
        limits = self.server.limits
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raise RequestError("send the body with a Content-Length; chunked bodies are not accepted", status=411)
        raw = self.headers.get("Content-Length")
        if raw is None:
            raise RequestError("a Content-Length header is required", status=411)
        if not raw.strip().isascii() or not raw.strip().isdigit():
            raise RequestError(f"Content-Length must be a whole number of bytes; got {raw[:50]!r}")
        length = int(raw)
        if length == 0:
            raise RequestError("empty request body; POST a JSON request (see rewards/remote.py)")
        if length > limits.max_bytes:
            raise RequestError(
                f"request body of {length} bytes exceeds the server's limit of {limits.max_bytes} bytes; send fewer "
                "images per request (the remote reward's batch_size option) or start the server with a larger "
                "--max-request-mb",
                status=413,
            )
        body, got = bytearray(length), 0
        view = memoryview(body)
        end = time.monotonic() + limits.timeout
        while got < length:
            try:
                if time.monotonic() > end:
                    raise TimeoutError
                n = self.rfile.readinto1(view[got : got + 2**20])  # one read: the deadline is checked between
            except TimeoutError:
                raise RequestError(f"request body not received within {limits.timeout:g} s", status=408) from None
            if not n:
                raise RequestError(f"request body ended after {got} of its {length} bytes")
            got += n
        self.body_unread = False
        return body

    def _refuse(self, status: int, message: str) -> None:
        """Reply to a bad request and close; an unread body is read and dropped for a moment first, or closing
        with it unread would reset the connection and the client would never see the reply."""
        self.close_connection = True
        self._reply(status, {"error": message})
        if not self.body_unread:
            return
        end = time.monotonic() + min(DRAIN_SECONDS, self.server.limits.timeout)
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_WR)  # the reply is complete
            while time.monotonic() < end and self.rfile.read1(2**16):
                pass

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode("utf-8")
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client timed out and left
            logger.warning("reward server: client %s left before the reply", self.address_string())

    def log_message(self, format: str, *args: Any) -> None:  # route access logs to logging, not stderr
        logger.debug("%s - " + format, self.address_string(), *args)
