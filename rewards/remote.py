"""Scoring over HTTP, for rewards that live in another process or on another GPU (GenEval detectors, VLM judges).

Protocol (JSON both ways, standard library only):

    POST /score  {"format": "png" | "npz", "images": ..., "prompts": [str], "metadata": [dict]}
      png: "images" is a list of base64 PNGs (8-bit; rewards that quantise anyway score them identically)
      npz: "images" is one base64 ``.npz`` holding float32 ``images`` (B, 3, H, W) — lossless
    200  {"scores": {key: [float, ...], ...}}        400/500  {"error": "message"}
    GET  /health -> {"status": "ok", "reward": "..."}

``scripts/reward_server.py`` serves any registered reward (or combination) this way on 127.0.0.1.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.request
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
LOOPBACK_HOSTS = ("127.0.0.1", "localhost")  # IPv4 server
_RETRY_STATUS = (502, 503, 504)  # proxies / overloaded servers; a reward's own failure (500) is not retried


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


def decode_request(body: bytes) -> tuple[Tensor, list[str], list[dict[str, Any]]]:
    """Inverse of ``encode_request``; raises ``ValueError`` on anything malformed."""
    try:
        request = json.loads(body)
        image_format, images = request["format"], request["images"]
        prompts, metadata = request["prompts"], request.get("metadata")
        if image_format == "png":
            arrays = [np.asarray(Image.open(io.BytesIO(base64.b64decode(s))).convert("RGB")) for s in images]
            pixels = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255
        elif image_format == "npz":
            with np.load(io.BytesIO(base64.b64decode(images)), allow_pickle=False) as npz:
                pixels = torch.from_numpy(npz["images"].astype(np.float32))
        else:
            raise ValueError(f"unknown image format {image_format!r}; use one of {', '.join(IMAGE_FORMATS)}")
    except (KeyError, TypeError, json.JSONDecodeError, OSError) as err:
        raise ValueError(f"malformed request: {type(err).__name__}: {err}") from err
    prompts, metadata = check_inputs(pixels, prompts, metadata)
    return pixels, prompts, metadata


@register_reward("remote")
class RemoteReward(BaseReward):
    """POSTs each batch to ``url`` and returns the endpoint's scores (all its keys, e.g. ``total`` and parts).

    ``timeout`` (s) per attempt; ``retries`` more attempts on connection errors, timeouts and
    502/503/504, waiting ``backoff * 2**attempt`` s between them; ``batch_size`` images per request.
    """

    def __init__(
        self,
        *,
        url: str,
        image_format: str = "png",
        timeout: float = 120.0,
        retries: int = 2,
        backoff: float = 0.5,
        batch_size: int | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__(device="cpu", batch_size=batch_size)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"remote: url must start with http:// or https://; got {url!r}")
        if image_format not in IMAGE_FORMATS:
            raise ValueError(f"remote: image_format must be one of {', '.join(IMAGE_FORMATS)}; got {image_format!r}")
        if retries < 0 or timeout <= 0:
            raise ValueError(f"remote: need retries >= 0 and timeout > 0; got {retries}, {timeout}")
        self.url, self.image_format = url, image_format
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> dict[str, Tensor]:
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
            out[key] = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)
        return out

    def _post(self, body: bytes) -> Any:
        last = "no attempt made"
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(
                self.url, data=body, method="POST", headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as err:
                detail = _error_detail(err)
                if err.code not in _RETRY_STATUS:
                    raise RemoteRewardError(
                        f"remote reward at {self.url} answered HTTP {err.code}: {detail}", reward=self.name
                    ) from err
                last = f"HTTP {err.code}: {detail}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as err:
                last = f"{type(err).__name__}: {getattr(err, 'reason', err)}"
            except json.JSONDecodeError as err:
                msg = f"remote reward at {self.url} sent invalid JSON: {err}"
                raise RemoteRewardError(msg, reward=self.name) from err
            logger.warning("remote reward %s: attempt %d/%d failed: %s", self.url, attempt + 1, self.retries + 1, last)
        raise RemoteRewardError(
            f"remote reward at {self.url}: no answer after {self.retries + 1} attempt(s) "
            f"({self.timeout:g} s timeout each); last error: {last}. Is scripts/reward_server.py running there?",
            reward=self.name,
        )


def _error_detail(err: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(err.read()).get("error", ""))[:2000]
    except Exception:
        return err.reason or ""


def make_reward_server(
    reward: Reward, port: int = 0, host: str = "127.0.0.1", max_request_mb: float = 1024.0
) -> ThreadingHTTPServer:
    """An HTTP server (not started: call ``serve_forever``) scoring with ``reward``; ``port=0`` picks a free one.

    Requests are scored one at a time (reward models are not thread-safe); /health answers meanwhile.
    """
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"reward server binds loopback only ({', '.join(LOOPBACK_HOSTS)}); got {host!r}")
    lock = threading.Lock()
    max_bytes = int(max_request_mb * 2**20)

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode("utf-8")
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                logger.warning("reward server: client %s left before the reply", self.address_string())

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") == "/health":
                self._reply(200, {"status": "ok", "reward": repr(reward)})
            else:
                self._reply(404, {"error": f"unknown path {self.path}; use POST /score or GET /health"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") != "/score":
                return self._reply(404, {"error": f"unknown path {self.path}; use POST /score"})
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= max_bytes:
                return self._reply(400, {"error": f"Content-Length must be in 1..{max_bytes}; got {length}"})
            try:
                images, prompts, metadata = decode_request(self.rfile.read(length))
            except ValueError as err:
                return self._reply(400, {"error": str(err)})
            try:
                with lock:
                    scores = as_score_dict(reward(images, prompts, metadata), "reward", len(prompts))
            except Exception as err:
                logger.exception("reward server: scoring failed")
                return self._reply(500, {"error": f"{type(err).__name__}: {err}"})
            self._reply(200, {"scores": {k: v.tolist() for k, v in scores.items()}})

        def log_message(self, format: str, *args: Any) -> None:  # route access logs to logging, not stderr
            logger.debug("%s - " + format, self.address_string(), *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server
