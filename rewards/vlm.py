"""A vision-language judge behind an OpenAI-compatible chat endpoint (vLLM, sglang, ...), as a reward.

Each image is sent on its own ``POST {url}/chat/completions`` request: one user message whose content is the image
as a data URL (an ``image_url`` part) followed by the template with ``{prompt}`` filled in; the reply's text (or the
log-probabilities of its first token) is turned into a score. Requests run ``max_concurrency`` at a time.

    rewards:
      - {name: vlm, url: "http://127.0.0.1:17140/v1", model: UnifiedReward-7b-v1.5, template: unifiedreward,
         image_size: 512, key: unifiedreward}

Options (``configs/sd35m_unifiedreward.yaml`` uses them; the judge is served separately, e.g.
``vllm serve CodeGoat24/UnifiedReward-qwen-7b --port 17140`` or sglang's ``launch_server``):

- ``url``: the server's OpenAI base URL (``http://host:port/v1``; ``/chat/completions`` is appended) or the full
  endpoint URL (ending in ``/chat/completions``). A bare ``http://host:port`` means ``/v1/chat/completions``.
- ``model``: the model name the server expects (vLLM: ``--served-model-name``, else the path it loaded).
- ``template``: a named template (below) or the text itself. ``{prompt}`` is replaced by the image's prompt; other
  braces are left as they are, so JSON examples in a template need no escaping. A named template also sets
  ``parser``, ``pattern`` and ``score_range`` unless those are given.
- ``parser``: how a reply becomes a score.
  ``number``: the first number in the reply's text;
  ``regex``: ``float`` of the one group of ``pattern`` (``re.search``, first match);
  ``yes_no``: P(yes) from the first non-blank token's ``top_logprobs`` (the server is asked for ``logprobs``),
  ``P(yes) / (P(yes) + P(no))`` summed over the tokens that read as ``yes_words`` / ``no_words`` (case, blanks and
  trailing punctuation ignored); without log-probs (a server that does not return them) or when no such token is
  among them, the text decides: 1.0 if it starts with a yes word, 0.0 for a no word.
- ``pattern``: the ``regex`` parser's pattern, with exactly one group.
- ``score_range``: ``[low, high]``: a parsed number is rescaled to ``(x - low) / (high - low)``; one outside the
  range counts as unparsable. ``null`` keeps the number as it is. (``yes_no`` scores are probabilities already.)
- ``yes_words``, ``no_words``: the ``yes_no`` parser's words (default ``[yes]``, ``[no]``).
- ``top_logprobs``: how many alternatives the ``yes_no`` parser asks for (vLLM allows up to its
  ``--max-logprobs``, 20 by default).
- ``parse_failure_score``: the score of a reply that cannot be parsed. ``null`` (default): NaN, with a warning
  counting them per batch, for the trainer's ``grpo.nan_policy`` (``drop`` leaves those groups out; ``error``
  stops). Flow-GRPO's UnifiedReward scorer scores such replies 0.
- ``system_prompt``: an optional system message before the user message.
- ``image_format``: ``png`` (default; lossless) or ``jpeg`` (``jpeg_quality``, default 95, as UnifiedReward's own
  vLLM client sends). ``image_size``: resize to ``image_size`` × ``image_size`` first (PIL's default bicubic,
  as Flow-GRPO's scorer resizes to 512 × 512); ``null`` sends the images as generated.
- ``max_tokens``: the reply's length limit (default: 8 for ``yes_no``, 1024 otherwise); ``temperature``
  (default 0: greedy, as the references judge); ``extra_body``: more request fields sent as they are (vLLM's
  ``top_k``, ``chat_template_kwargs``, ...).
- ``api_key_env``: the name of an environment variable holding the API key, sent as ``Authorization: Bearer``
  (the key itself never goes into a config); the variable must be set when the reward is built.
- ``max_concurrency``: requests in flight at once (default 8); ``timeout``: seconds per attempt, from connecting
  to the reply's last byte (default 60); ``retries``: further attempts after a connection error, a timeout, HTTP
  429 or any 5xx, waiting ``backoff * 2**attempt`` s between them (defaults 3 and 1.0). Other statuses (400: the
  request is wrong, 404: no such model or path) are errors at once, naming the URL and the server's message, as is
  a batch whose retries run out. ``batch_size``: images per call to the judge (all of them by default).

Named templates:

- ``unifiedreward``: UnifiedReward's pointwise image-generation prompt, as its LLaVA inference script
  (CodeGoat24/UnifiedReward ``inference/image_generation/point_score_image_generation.py``) and Flow-GRPO's
  ``unifiedreward_score_sglang`` (yifan123/flow_grpo ``flow_grpo/rewards.py``) send it, ``<image>`` line
  included; parsed as Flow-GRPO does, ``Final Score:\\s*([1-5](?:\\.\\d+)?)`` divided by 5 (``score_range``
  ``[0, 5]``). Flow-GRPO also resizes to 512 × 512, sends PNG, and judges with ``UnifiedReward-7b-v1.5``.
- ``unifiedreward_qwen``: the prompt of UnifiedReward's Qwen-VL models (the same repository,
  ``inference_qwen/image_generation/qwen_point_score_image_generation.py``: the model first lists the caption's
  elements as ``element (type): 0/1``), parsed the same way.
- ``yes_no``: ``Does this image match the description "{prompt}"? Answer Yes or No.``, parser ``yes_no``.
- ``rating``: a 0-10 rating of prompt alignment and quality, number only, parser ``number``, range ``[0, 10]``.
"""

from __future__ import annotations

import base64
import difflib
import http.client
import io
import json
import logging
import math
import os
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from .base import BaseReward, to_uint8_hwc
from .registry import register_reward
from .remote import RemoteRewardError, _parse_url, _positive, _post_once

logger = logging.getLogger("rewards.vlm")
PARSERS = ("number", "yes_no", "regex")
IMAGE_FORMATS = ("png", "jpeg")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


@dataclass(frozen=True)
class Template:
    text: str
    parser: str
    pattern: str | None = None
    score_range: tuple[float, float] | None = None


# UnifiedReward's pointwise prompt, verbatim: CodeGoat24/UnifiedReward inference/image_generation/
# point_score_image_generation.py, the text Flow-GRPO's unifiedreward_score_sglang sends (yifan123/flow_grpo
# flow_grpo/rewards.py), with its score regex and its division by 5.
_UNIFIEDREWARD_CRITERIA = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this image "
    "based on two key criteria:\n"
    "1. Alignment with the Caption: Assess how well this image aligns with the provided caption. Consider the "
    "accuracy of depicted objects, their relationships, and attributes as described in the caption.\n"
    "2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail preservation, "
    "color accuracy, and overall aesthetic appeal.\n"
)
_FINAL_SCORE = r"Final Score:\s*([1-5](?:\.\d+)?)"
TEMPLATES: dict[str, Template] = {
    "unifiedreward": Template(
        "<image>\n" + _UNIFIEDREWARD_CRITERIA + "Based on the above criteria, assign a score from 1 to 5 after "
        "'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]",
        "regex",
        _FINAL_SCORE,
        (0.0, 5.0),
    ),
    # CodeGoat24/UnifiedReward inference_qwen/image_generation/qwen_point_score_image_generation.py
    "unifiedreward_qwen": Template(
        _UNIFIEDREWARD_CRITERIA + "Extract key elements from the provided text caption, evaluate their presence in "
        "the generated image using the format: 'element (type): value' (where value=0 means not generated, and "
        "value=1 means generated), and assign a score from 1 to 5 after 'Final Score:'.\nYour task is provided as "
        "follows:\nText Caption: [{prompt}]",
        "regex",
        _FINAL_SCORE,
        (0.0, 5.0),
    ),
    "yes_no": Template('Does this image match the description "{prompt}"? Answer Yes or No.', "yes_no"),
    "rating": Template(
        'Rate this image from 0 to 10 for how well it matches the description "{prompt}" and for its visual '
        "quality (10: a faithful, flawless image). Reply with the number only.",
        "number",
        None,
        (0.0, 10.0),
    ),
}


class VlmRewardError(RemoteRewardError):
    """The judge could not be reached, refused a request, or answered outside the chat-completions format."""


def _chat_target(url: str) -> Any:
    """``url`` split, its path pointing at ``.../chat/completions``."""
    try:
        target = _parse_url(url)
    except ValueError as err:
        raise ValueError(str(err).replace("remote:", "vlm:", 1)) from None
    path = target.path.rstrip("/")
    if not path.endswith("/chat/completions"):
        path = (path or "/v1") + "/chat/completions"
    return target._replace(path=path)


def _range(value: Any) -> tuple[float, float] | None:
    if value is None:
        return None
    ok = isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2
    if ok and all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value):
        low, high = float(value[0]), float(value[1])
        if high > low:
            return low, high
    raise ValueError(f"vlm: score_range must be [low, high] with finite low < high, or null; got {value!r}")


@register_reward("vlm")
class VlmReward(BaseReward):
    """Scores each image with a VLM judge over OpenAI-compatible ``/chat/completions``; options in the module doc."""

    def __init__(
        self,
        *,
        url: str,
        model: str,
        template: str,
        parser: str | None = None,
        pattern: str | None = None,
        score_range: Sequence[float] | None = None,
        yes_words: Sequence[str] = ("yes",),
        no_words: Sequence[str] = ("no",),
        top_logprobs: int = 20,
        parse_failure_score: float | None = None,
        system_prompt: str | None = None,
        image_format: str = "png",
        jpeg_quality: int = 95,
        image_size: int | None = None,
        max_tokens: int | None = None,
        temperature: float = 0.0,
        extra_body: dict[str, Any] | None = None,
        api_key_env: str | None = None,
        max_concurrency: int = 8,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 1.0,
        batch_size: int | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__(device="cpu", batch_size=batch_size)
        self.url = url
        self._target = _chat_target(url)
        if not isinstance(model, str) or not model:
            raise ValueError(f"vlm: model must be the model name the server serves; got {model!r}")
        if not isinstance(template, str) or not template:
            raise ValueError(f"vlm: template must be a template name ({', '.join(TEMPLATES)}) or its text")
        named = TEMPLATES.get(template)
        if named is None and not any(c.isspace() for c in template):  # one word: a name, misspelt
            close = difflib.get_close_matches(template, TEMPLATES, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(
                f"vlm: unknown template {template!r}; named templates: {', '.join(TEMPLATES)}{hint} (or give the "
                "template's text, with {prompt} where the prompt goes)"
            )
        self.model, self.template = model, named.text if named else template
        self.parser = parser or (named.parser if named else "number")
        if self.parser not in PARSERS:
            raise ValueError(f"vlm: parser must be one of {', '.join(PARSERS)}; got {self.parser!r}")
        pattern = pattern if pattern is not None else (named.pattern if named else None)
        self.pattern = None
        if self.parser == "regex":
            try:
                self.pattern = re.compile(pattern) if isinstance(pattern, str) else None
            except re.error as err:
                raise ValueError(f"vlm: pattern {pattern!r} is not a regular expression ({err})") from None
            if self.pattern is None or self.pattern.groups != 1:
                raise ValueError(f"vlm: parser 'regex' needs a pattern with exactly one group (...); got {pattern!r}")
        self.score_range = _range(score_range) if score_range is not None else (named.score_range if named else None)
        self.yes_words = _words("yes_words", yes_words)
        self.no_words = _words("no_words", no_words)
        if set(self.yes_words) & set(self.no_words):
            raise ValueError("vlm: yes_words and no_words overlap")
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or not 1 <= top_logprobs <= 20:
            raise ValueError(f"vlm: top_logprobs must be an integer in [1, 20]; got {top_logprobs!r}")
        if parse_failure_score is not None and not (
            isinstance(parse_failure_score, int | float)
            and not isinstance(parse_failure_score, bool)
            and math.isfinite(parse_failure_score)
        ):
            raise ValueError(f"vlm: parse_failure_score must be a finite number or null; got {parse_failure_score!r}")
        if image_format not in IMAGE_FORMATS:
            raise ValueError(f"vlm: image_format must be one of {', '.join(IMAGE_FORMATS)}; got {image_format!r}")
        if not _count(jpeg_quality) or jpeg_quality > 100:
            raise ValueError(f"vlm: jpeg_quality must be an integer in [1, 100]; got {jpeg_quality!r}")
        if image_size is not None and not _count(image_size):
            raise ValueError(f"vlm: image_size must be a positive integer (pixels) or null; got {image_size!r}")
        max_tokens = max_tokens if max_tokens is not None else (8 if self.parser == "yes_no" else 1024)
        if not _count(max_tokens):
            raise ValueError(f"vlm: max_tokens must be a positive integer; got {max_tokens!r}")
        if not _positive(temperature, zero=True):
            raise ValueError(f"vlm: temperature must be a number >= 0; got {temperature!r}")
        extra_body = dict(extra_body or {})
        clash = sorted({"messages", "model"} & set(extra_body))
        if clash:
            raise ValueError(f"vlm: extra_body may not set {', '.join(clash)}; use the options of the same name")
        if not _count(max_concurrency):
            raise ValueError(f"vlm: max_concurrency must be a positive integer; got {max_concurrency!r}")
        retries_ok = isinstance(retries, int) and not isinstance(retries, bool) and retries >= 0
        if not (retries_ok and _positive(timeout) and _positive(backoff, zero=True)):
            raise ValueError(
                f"vlm: need retries >= 0, timeout > 0 and backoff >= 0; got {retries!r}, {timeout!r}, {backoff!r}"
            )
        self.parse_failure_score = math.nan if parse_failure_score is None else float(parse_failure_score)
        self.system_prompt, self.image_format, self.jpeg_quality = system_prompt, image_format, jpeg_quality
        self.image_size, self.max_concurrency = image_size, max_concurrency
        self.timeout, self.retries, self.backoff = float(timeout), retries, float(backoff)
        self._request_fields: dict[str, Any] = {"max_tokens": max_tokens, "temperature": float(temperature)}
        if self.parser == "yes_no":
            self._request_fields.update(logprobs=True, top_logprobs=top_logprobs)
        self._request_fields.update(extra_body)
        self._headers = {"Content-Type": "application/json"}
        if api_key_env is not None:
            key = os.environ.get(api_key_env)
            if not key:
                raise ValueError(f"vlm: api_key_env names {api_key_env!r}, but that environment variable is not set")
            self._headers["Authorization"] = f"Bearer {key}"
        self.parse_failures = 0  # replies scored parse_failure_score so far (all batches)

    # ------------------------------------------------------------------ requests
    def request_body(self, pixels_hwc: np.ndarray, prompt: str) -> dict[str, Any]:
        """The chat-completions request for one image (uint8 ``(H, W, 3)``) and its prompt."""
        image = Image.fromarray(pixels_hwc)
        if self.image_size is not None:
            image = image.resize((self.image_size, self.image_size))
        buffer = io.BytesIO()
        if self.image_format == "png":
            image.save(buffer, format="PNG")
        else:
            image.save(buffer, format="JPEG", quality=self.jpeg_quality)
        data_url = f"data:image/{self.image_format};base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
        content = [
            {"type": "image_url", "image_url": {"url": data_url}},
            {"type": "text", "text": self.template.replace("{prompt}", prompt)},
        ]
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
        messages.append({"role": "user", "content": content})
        return {"model": self.model, "messages": messages, **self._request_fields}

    def _ask(self, body: dict[str, Any]) -> dict[str, Any]:
        """One request with its retries; the decoded reply."""
        data_out = json.dumps(body).encode("utf-8")
        last, attempts = "no attempt made", self.retries + 1
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                status, data = _post_once(self._target, data_out, self.timeout, headers=self._headers)
            except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out, garbled
                last = f"{type(err).__name__}: {err}"
            else:
                if status == 200:
                    try:
                        reply = json.loads(data)
                    except (ValueError, RecursionError) as err:
                        raise VlmRewardError(f"vlm judge at {self.url} sent invalid JSON ({err})") from None
                    if not isinstance(reply, dict):
                        raise VlmRewardError(f"vlm judge at {self.url} sent {type(reply).__name__}, not an object")
                    return reply
                detail = _error_message(data)
                if status != 429 and status < 500:
                    raise VlmRewardError(
                        f"vlm judge at {self.url} answered HTTP {status}: {detail} (model {self.model!r})",
                        reward=self.name,
                    )
                last = f"HTTP {status}: {detail}"
            logger.warning("vlm judge %s: attempt %d/%d failed: %s", self.url, attempt + 1, attempts, last)
        raise VlmRewardError(
            f"vlm judge at {self.url}: no answer after {attempts} attempt(s) ({self.timeout:g} s each); last error: "
            f"{last}. Is the server (vLLM, sglang) running and serving {self.model!r}?",
            reward=self.name,
        )

    # ------------------------------------------------------------------ parsing
    def parse(self, reply: dict[str, Any]) -> float | None:
        """The score of one chat-completions reply, or None when it cannot be parsed."""
        choices = reply.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise VlmRewardError(f"vlm judge at {self.url}: reply has no choices: {str(reply)[:300]}")
        choice = choices[0]
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        text = message.get("content") if isinstance(message.get("content"), str) else ""
        if self.parser == "yes_no":
            return self._yes_probability(choice.get("logprobs"), text)
        if self.parser == "number":
            match = _NUMBER.search(text)
            raw = match.group(0) if match else None
        else:
            match = self.pattern.search(text)
            raw = match.group(1) if match else None
        try:
            value = float(raw) if raw is not None else math.nan
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            return None
        if self.score_range is not None:
            low, high = self.score_range
            if not low <= value <= high:
                return None
            value = (value - low) / (high - low)
        return value

    def _yes_probability(self, logprobs: Any, text: str) -> float | None:
        tokens = logprobs.get("content") if isinstance(logprobs, dict) else None
        first = next((t for t in tokens or [] if isinstance(t, dict) and _norm(t.get("token"))), None)
        if first is not None:
            p_yes = p_no = 0.0
            alternatives = first.get("top_logprobs") or [first]
            for alt in alternatives if isinstance(alternatives, list) else []:
                if not isinstance(alt, dict) or not isinstance(alt.get("logprob"), int | float):
                    continue
                word = _norm(alt.get("token"))
                if word in self.yes_words:
                    p_yes += math.exp(alt["logprob"])
                elif word in self.no_words:
                    p_no += math.exp(alt["logprob"])
            if p_yes + p_no > 0:
                return p_yes / (p_yes + p_no)
        words = text.strip().split(maxsplit=1)
        word = _norm(words[0]) if words else ""
        return 1.0 if word in self.yes_words else 0.0 if word in self.no_words else None

    # ------------------------------------------------------------------ scoring
    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        pixels = to_uint8_hwc(images)
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(prompts)), thread_name_prefix="vlm") as pool:
            futures = [pool.submit(self._judge, p, prompt) for p, prompt in zip(pixels, prompts, strict=True)]
            try:
                results = [f.result() for f in futures]
            except BaseException:
                for f in futures:  # the first failure ends the batch: do not send what has not started
                    f.cancel()
                raise
        failed = [i for i, (value, _) in enumerate(results) if value is None]
        if failed:
            self.parse_failures += len(failed)
            logger.warning(
                "vlm judge %s: %d of %d replies could not be parsed by the '%s' parser (scored %s); first, for "
                "prompt %r: %r",
                self.url,
                len(failed),
                len(results),
                self.parser,
                self.parse_failure_score,
                prompts[failed[0]],
                results[failed[0]][1][:200],
            )
        scores = [self.parse_failure_score if value is None else value for value, _ in results]
        return torch.tensor(scores, dtype=torch.float64)

    def _judge(self, pixels_hwc: np.ndarray, prompt: str) -> tuple[float | None, str]:
        reply = self._ask(self.request_body(pixels_hwc, prompt))
        value = self.parse(reply)
        try:
            text = str(reply["choices"][0]["message"]["content"])
        except (KeyError, IndexError, TypeError):
            text = str(reply)
        return value, text

    def __repr__(self) -> str:
        return f"VlmReward(url={self.url!r}, model={self.model!r}, parser={self.parser!r})"


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _norm(token: Any) -> str:
    """A token or word as the yes/no parser compares it: no blanks, BPE space markers or trailing punctuation."""
    if not isinstance(token, str):
        return ""
    return token.strip().strip("Ġ▁").strip().rstrip(".,!:;").lower()


def _words(option: str, words: Any) -> tuple[str, ...]:
    if isinstance(words, str) or not isinstance(words, Sequence) or not words:
        raise ValueError(f"vlm: {option} must be a non-empty list of words; got {words!r}")
    normed = tuple(_norm(w) for w in words)
    if not all(normed):
        raise ValueError(f"vlm: {option} must be words, not blanks or punctuation; got {words!r}")
    return normed


def _error_message(data: bytes) -> str:
    """The server's message: OpenAI's ``{"error": {"message"}}``, vLLM's ``{"message"}``, or the text."""
    try:
        reply = json.loads(data)
        error = reply.get("error", reply)
        message = error.get("message") if isinstance(error, dict) else error
        return str(message if message is not None else reply)[:2000]
    except Exception:
        return data[:300].decode("utf-8", "replace")
