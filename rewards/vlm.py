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
- ``parser``: how a reply becomes a score (every parser reads the reply as cleaned below).
  ``number``: the number after the last score keyword (``score``, ``rating``, ``grade``, ``answer``, ``overall``,
  ``rate it``, ``give it``..., case ignored; one qualified ``final`` / ``overall`` / ``total`` wins over the
  others; the keyword may be followed by a parenthesis such as ``(1-10)``, by ``:``, ``=``, ``is``, ``of``, ``a``);
  without a keyword, a reply that opens with a refusal (``I'm sorry``, ``I cannot``...) is unparsable, else the
  number the reply starts with, else its last number. ``7/10``, ``7 out of 10`` and ``7 on a scale of 10`` read
  as 7; a range ``7-8`` (or ``7 to 8``) reads as its midpoint after a keyword or at the reply's start, and is
  skipped elsewhere (``on a 1-10 scale`` names the scale, not a score); a numbered list's markers
  (``1.``, ``2.`` opening two or more lines) are not numbers.
  ``regex``: ``float`` of the one group of ``pattern`` (``re.search``, first match);
  ``yes_no``: P(yes) from the first token's ``top_logprobs`` (the server is asked for ``logprobs``; tokens that
  are only blanks or markdown, such as ``**``, are passed over), ``P(yes) / (P(yes) + P(no))`` summed over the
  tokens that read as ``yes_words`` / ``no_words`` (case, blanks, quotes, markdown and punctuation ignored);
  when the server returns no log-probs, none of those tokens is among them, or the reply holds a reasoning block
  (its first token is not the answer), the text decides: 1.0 if it starts with a yes word, 0.0 for a no word,
  after an optional ``Answer:`` / ``The answer is`` / ``Final answer:`` / ``Verdict:``.
  Cleaning: reasoning blocks go (``<think>...</think>``, also ``<thinking>`` / ``<reasoning>``; everything up to
  a lone closing tag, as chat templates that open the block themselves produce; everything from an opening tag
  that is never closed, i.e. a reply cut short while reasoning, which leaves nothing to parse); an
  ``<answer>...</answer>`` block, when there is one, is all that is read (UnifiedReward-Think's format); markdown
  emphasis (``*``, ``__``, backticks), heading and quote markers, ``$`` and ``\\boxed{...}`` are removed.
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
  429 or any 5xx, waiting ``backoff * 2**attempt`` s between them (defaults 3 and 1.0).
- ``deadline``: seconds one batch (the images of one ``score`` call: ``batch_size`` of them, or all) may take, all
  its requests, retries and waits together; default ``timeout * (retries + 1)`` plus the waits (247 s with the
  defaults), so a hung judge costs one request's worth of attempts, not one per wave of ``max_concurrency``
  images. When it passes, the requests in flight are abandoned (their connections shut) and those not yet sent
  are never sent; their images count as failed. Raise it (or ``max_concurrency``) when a slow but healthy judge
  needs longer for a batch.
- ``on_error``: what a failed request does: one that ran out of retries (or of the deadline), or that the server
  refused with a 4xx other than 401, 403, 404 and 429 (e.g. a prompt too long for the model's context).
  ``nan`` (default): its image scores NaN, a warning counts the failures per batch (``request_failures`` counts
  them all), and the trainer's ``grpo.nan_policy`` decides (``drop``: those groups are left out; a run whose
  every group fails stops after ``run.max_empty_epochs``). ``raise``: the batch fails at the first failure; the
  requests in flight are abandoned and nothing more is sent. Whatever ``on_error`` says, errors that concern
  every request fail the batch at once: HTTP 401 / 403 (the API key), 404 (no such model or path), and a reply
  that is not a chat completion (invalid JSON, no ``choices``), each naming the URL and the server's message.
- ``probe``: when the reward is built, send one cheap request, a 224 × 224 grey image (Qwen-VL processors refuse
  images under 28 pixels a side) with the template and ``max_tokens: 1``, the real request's shape otherwise
  (``extra_body`` included), and fail there, before the first rollout, if the judge is unreachable, does not
  serve ``model``, refuses the key or the request, or does not answer in the chat-completions format; the error
  names the URL and the fix. Default true; ``false`` skips it (a judge that is started later). It obeys
  ``timeout``, ``retries`` and ``deadline``; each process of a multi-GPU run sends its own.
- ``batch_size``: images per call to the judge (all of them by default).

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

Where this follows the references and where it differs. Flow-GRPO's ``unifiedreward_score_sglang`` matches its
regex on the raw reply (``re.search``, first match) and scores a reply without a match 0; the regex here is the
same and also takes the first match, but on the cleaned reply, so ``**Final Score:** 4`` and ``Final Score: **4**``
(markdown) and a ``<think>`` draft before the answer score as the judge meant instead of 0, and an unparsable
reply is NaN unless ``parse_failure_score: 0``. Flow-GRPO sends a batch's requests all at once
(``asyncio.gather``) through the OpenAI client (600 s timeout, 2 retries) and one failure fails the batch, as
``on_error: raise`` does; UnifiedReward's own vLLM client (``inference_qwen/UnifiedReward-2.0-inference/
vllm_request.py``) retries each request 3 times and records a request that still fails as failed, for that item
only, as ``on_error: nan`` does. Reasoning judges' replies are read after ``</think>``, as parsers for chat
templates that open the block themselves do (``(.*?)</think>``), and UnifiedReward-Think's are read from
``<answer>``; neither reference parses a free-form number (their templates fix the format), so the ``number``
parser's rules above are this module's own.
"""

from __future__ import annotations

import base64
import difflib
import functools
import http.client
import io
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from .base import BaseReward, to_uint8_hwc
from .registry import register_reward
from .remote import RemoteRewardError, _http_request, _parse_url, _positive

logger = logging.getLogger("rewards.vlm")
PARSERS = ("number", "yes_no", "regex")
IMAGE_FORMATS = ("png", "jpeg")
ON_ERROR = ("nan", "raise")
MAX_REPLY_BYTES = 16 * 2**20  # a chat completion is a few KiB; a bigger reply is not from a judge
PROBE_PROMPT = "a grey square"  # the start-up check's prompt, with a grey image and max_tokens 1
PROBE_SIZE = 224  # pixels a side: above any VLM's minimum (Qwen-VL: 28), a few hundred bytes as PNG
_FATAL_STATUS = (401, 403, 404)  # the key or the model/path is wrong: every request would fail alike


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
    """The judge could not be reached, refused a request, or answered outside the chat-completions format;
    ``status``: the HTTP status of the reply that caused it, when there was one."""

    def __init__(
        self, message: str, *, reward: str | None = None, batch: int | None = None, status: int | None = None
    ) -> None:
        super().__init__(message, reward=reward, batch=batch)
        self.status = status


class _RequestFailed(Exception):
    """One image's request failed (out of retries or of the deadline, or refused): NaN or the batch fails."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class _Abandoned(_RequestFailed):
    """A request the batch's stop ended (or kept from being sent): a consequence, not a failure of its own."""


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


# ---------------------------------------------------------------------------- one batch's requests
class _Batch:
    """What the requests of one ``score`` call share: its deadline, and a stop that ends them all at once.

    ``stop`` shuts every open connection down (a blocked read or write ends at once) and keeps any request from
    being sent or retried afterwards."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.stopped = threading.Event()
        self._aborts: set[Callable[[], None]] = set()
        self._lock = threading.Lock()

    def left(self) -> float:
        return self.end - time.monotonic()

    def stop(self) -> None:
        with self._lock:
            self.stopped.set()
            aborts = list(self._aborts)
        for abort in aborts:
            abort()

    def add(self, abort: Callable[[], None]) -> bool:
        """Register a request's abort; False once the batch has stopped (the request must not be sent)."""
        with self._lock:
            if self.stopped.is_set():
                return False
            self._aborts.add(abort)
            return True

    def discard(self, abort: Callable[[], None]) -> None:
        with self._lock:
            self._aborts.discard(abort)


# One HTTP request within a deadline, ended at once by the batch's stop: the remote reward's, with a judge's limit.
_request = functools.partial(_http_request, max_reply=MAX_REPLY_BYTES, replier="a chat completion")


# ---------------------------------------------------------------------------- reading replies
_REASONING_TAG = re.compile(r"<(/?)(?:think|thinking|reasoning)\s*>", re.IGNORECASE)
_ANSWER_TAG = re.compile(r"<(/?)answer\s*>", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")
_EMPHASIS = re.compile(r"\*+|__+|`+|\$")
_LINE_MARKER = re.compile(r"^[ \t]*(?:#{1,6}[ \t]*|>[ \t]?)+", re.MULTILINE)  # headings, quotes
_LIST_MARKER = re.compile(r"^[ \t]*\d{1,2}[.)][ \t]+(?=\S)", re.MULTILINE)
_NUM = r"-?(?:\d++(?:\.\d++)?|\.\d++)"
_UNSIGNED = r"(?:\d++(?:\.\d++)?|\.\d++)"
# One value: a number, a range "7-8" / "7 to 8" (group b), and what only names the scale: "/10", "out of 10",
# "on a scale of 10" / "of 1 to 10" (consumed, not read).
_VALUE = (
    rf"(?<![\w.\-])(?P<a>{_NUM})(?![\w]|\.\d)"
    rf"(?:\s*+(?:-|–|—|\bto\b)\s*+(?P<b>{_UNSIGNED})(?![\w]|\.\d))?"
    rf"(?:\s*+(?:/|\bout\s++of\b|\bon\s++a\s++scale\s++(?:of|from)\b)\s*+"
    rf"(?:{_UNSIGNED}\s*+(?:-|–|\bto\b)\s*+)?{_UNSIGNED}(?![\w]|\.\d))?"
)
_VALUES = re.compile(_VALUE, re.IGNORECASE)
_KEYWORD = re.compile(  # possessive blanks (*+): a long run of them cannot make the match backtrack
    r"\b(?P<qual>final|overall|total)?\s*+"
    r"(?:score[ds]?|rating|grade|answer|verdict|overall|"
    r"(?:rate[ds]?|rating|give[ns]?|giving|gave|assign(?:ed)?)\s++(?:it|this(?:\s++image)?|the\s++image))\b"
    r"[\"']?\s*+(?:\([^)\n]{0,40}\))?\s*+[\"']?\s*+"
    r"(?:[:=]|-(?=\s)|\bis\b|\bof\b|\bas\b|\bat\b|\bwould\s++be\b)?\s*+[\"']?\s*+(?:\b(?:a|an)\s++)?" + _VALUE,
    re.IGNORECASE,
)
_REFUSAL = re.compile(
    r"^\W*(?:i'?m\s+sorry|sorry|i\s+(?:can\s*not|can'?t|cannot|am\s+(?:not\s+)?(?:unable|able)|'m\s+unable)|"
    r"i\s+won'?t|unable\s+to|as\s+an\s+ai)\b",
    re.IGNORECASE,
)
_ANSWER_PREFIX = re.compile(
    r"^[\W_]*(?:(?:the|my)\s+)?(?:final\s+)?(?:answer|verdict|judge?ment|response)\s*(?:is)?\s*[:\-]?[\W_]*",
    re.IGNORECASE,
)


def clean_reply(text: str) -> str:
    """A reply as the parsers read it: reasoning blocks, markdown and ``\\boxed{}`` gone (see the module doc)."""
    kept: list[str] = []
    position, opened = 0, False  # one pass over the tags: linear in the reply, whatever its tags
    for tag in _REASONING_TAG.finditer(text):
        if not tag.group(1):  # <think>: what came before it is kept
            if not opened:
                kept.append(text[position : tag.start()])
                opened = True
        else:  # </think>: the block ends; with no <think> before it, the chat template opened it
            if not opened:
                kept = []
            position, opened = tag.end(), False
    if not opened:  # else never closed: the reply ended while reasoning, the rest is dropped
        kept.append(text[position:])
    text = " ".join(kept)
    answer, start = None, None
    for tag in _ANSWER_TAG.finditer(text):
        if not tag.group(1):
            start = tag.end()
        elif start is not None:
            answer, start = text[start : tag.start()], None
    if answer is not None:  # the last complete <answer>...</answer>
        text = answer
    text = _BOXED.sub(r"\1", text)
    text = _EMPHASIS.sub("", text)
    text = _LINE_MARKER.sub("", text)
    return text.strip()


def _value_of(match: re.Match[str], *, ranges: bool) -> float | None:
    """A ``_VALUE`` match as a number: ``a``, or the midpoint of a range ``a``-``b`` (None if ranges are not
    read here)."""
    low = float(match.group("a"))
    if match.group("b") is None:
        return low
    if not ranges:
        return None
    high = float(match.group("b"))
    return (low + high) / 2 if high > low else low


def parse_number(text: str) -> float | None:
    """The ``number`` parser on a reply's text (cleaned here): the score, or None (rules in the module doc)."""
    text = clean_reply(text)
    keyed = list(_KEYWORD.finditer(text))
    if keyed:
        qualified = [m for m in keyed if m.group("qual")]
        return _value_of((qualified or keyed)[-1], ranges=True)
    if _REFUSAL.match(text):
        return None
    if len(_LIST_MARKER.findall(text)) >= 2:  # "1. ...\n2. ...": list markers, not scores
        text = _LIST_MARKER.sub("", text)
    values = list(_VALUES.finditer(text))
    if values and values[0].start() == 0:
        return _value_of(values[0], ranges=True)
    for match in reversed(values):
        value = _value_of(match, ranges=False)
        if value is not None:
            return value
    return None


def _starts_with(text: str, words: tuple[str, ...]) -> bool:
    return any(re.match(rf"{re.escape(word)}(?![\w])", text) for word in words)


# ---------------------------------------------------------------------------- the reward
@register_reward("vlm")
class VlmReward(BaseReward):
    """Scores each image with a VLM judge over OpenAI-compatible ``/chat/completions``; options in the module doc.

    Building it probes the judge once (``probe``); each ``score`` call (one batch) ends within ``deadline``
    seconds, a failed request scoring NaN or failing the batch (``on_error``)."""

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
        deadline: float | None = None,
        on_error: str = "nan",
        probe: bool = True,
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
        if deadline is not None and not _positive(deadline):
            raise ValueError(
                f"vlm: deadline must be the seconds one batch may take (> 0), or null for timeout * (retries + 1) "
                f"plus the backoff waits; got {deadline!r}"
            )
        if on_error not in ON_ERROR:
            raise ValueError(
                f"vlm: on_error must be 'nan' (a failed request scores NaN, for grpo.nan_policy) or 'raise' (it "
                f"fails the batch); got {on_error!r}"
            )
        if not isinstance(probe, bool):
            raise ValueError(
                f"vlm: probe must be true (check the judge when the reward is built) or false; got {probe!r}"
            )
        self.parse_failure_score = math.nan if parse_failure_score is None else float(parse_failure_score)
        self.system_prompt, self.image_format, self.jpeg_quality = system_prompt, image_format, jpeg_quality
        self.image_size, self.max_concurrency = image_size, max_concurrency
        self.timeout, self.retries, self.backoff = float(timeout), retries, float(backoff)
        waits = sum(self.backoff * 2**i for i in range(self.retries))
        self.deadline = float(deadline) if deadline is not None else self.timeout * (self.retries + 1) + waits
        self.on_error = on_error
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
        self.request_failures = 0  # requests that failed and scored NaN (on_error: nan) so far
        if probe:
            self.probe()

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

    def probe(self) -> None:
        """The start-up check: one request shaped as the real ones (a grey ``PROBE_SIZE``² image, ``max_tokens: 1``).

        Raises ``VlmRewardError`` naming the URL and the fix when the judge is unreachable, refuses the request
        or the key, serves no such model, or answers outside the chat-completions format."""
        body = self.request_body(np.full((PROBE_SIZE, PROBE_SIZE, 3), 128, dtype=np.uint8), PROBE_PROMPT)
        body["max_tokens"] = 1
        try:
            reply = self._ask(body, _Batch(self.deadline))
            self._choice(reply)
        except (_RequestFailed, VlmRewardError) as err:
            detail = str(err).removeprefix(f"vlm judge at {self.url}").lstrip(":").strip().rstrip(".")
            raise VlmRewardError(
                f"vlm judge at {self.url} failed its start-up check (one request for model {self.model!r}, sent "
                f"when the reward is built, before the first rollout): {detail}. {self._probe_hint(err)} Or set "
                "probe: false in this reward's options to skip the check.",
                reward=self.name,
            ) from None

    def _probe_hint(self, err: Exception) -> str:
        status = getattr(err, "status", None)
        if status == 404:
            served = self._served_models()
            listed = f" The server lists: {', '.join(served)}." if served else ""
            return (
                "Check url (an OpenAI base URL such as http://host:port/v1) and model (the name the server serves; "
                f"vLLM: --served-model-name).{listed}"
            )
        if status in (401, 403):
            return "Set api_key_env to the name of the environment variable that holds the server's API key."
        if status is not None and status < 500 and status != 429:
            return (
                "The server refused the request: check model, extra_body, top_logprobs (vLLM: at most its "
                "--max-logprobs) and that the model takes images."
            )
        if status is not None:
            return "The server is up but failing: see its log."
        if isinstance(err, _RequestFailed):
            return (
                "Start the judge first (e.g. vllm serve <model> --port <port>, or sglang's launch_server) and wait "
                "until it answers, and check url (http://host:port/v1)."
            )
        return "Is url an OpenAI-compatible chat endpoint (vLLM, sglang)?"

    def _served_models(self) -> list[str]:
        """The model names ``GET .../models`` lists (OpenAI's format), or [] when that fails."""
        path = self._target.path.removesuffix("/chat/completions") + "/models"
        try:
            status, data = _request("GET", self._target._replace(path=path), None, self.timeout, self._headers)
            entries = json.loads(data).get("data") if status == 200 else None
            return [str(e["id"]) for e in entries if isinstance(e, dict) and "id" in e][:20]
        except Exception:  # a hint only
            return []

    def _ask(self, body: dict[str, Any], batch: _Batch) -> dict[str, Any]:
        """One request with its retries, within the batch's deadline; the decoded reply.

        Raises ``_RequestFailed`` for this image's failure (retries or deadline spent, a 4xx refusal) and
        ``VlmRewardError`` for what concerns every request (401 / 403 / 404, a reply that is no JSON object)."""
        data_out = json.dumps(body).encode("utf-8")
        last, last_status, attempts, made = "no attempt made", None, self.retries + 1, 0
        for attempt in range(attempts):
            if attempt and batch.stopped.wait(max(min(self.backoff * 2 ** (attempt - 1), batch.left()), 0)):
                break
            left = batch.left()
            if left <= 0 or batch.stopped.is_set():
                break
            made += 1
            try:
                status, data = _request("POST", self._target, data_out, min(self.timeout, left), self._headers, batch)
            except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out, garbled
                if batch.stopped.is_set():
                    break
                last, last_status = f"{type(err).__name__}: {err}", None
            else:
                if status == 200:
                    return self._decode(data)
                detail = _error_message(data)
                if status in _FATAL_STATUS:
                    raise VlmRewardError(
                        f"vlm judge at {self.url} answered HTTP {status}: {detail} (model {self.model!r})",
                        reward=self.name,
                        status=status,
                    )
                if status != 429 and status < 500:  # this request is refused (too long a prompt, ...): no retry
                    raise _RequestFailed(f"HTTP {status}: {detail}", status)
                last, last_status = f"HTTP {status}: {detail}", status
            logger.warning("vlm judge %s: attempt %d/%d failed: %s", self.url, attempt + 1, attempts, last)
        if batch.stopped.is_set():
            raise _Abandoned("abandoned: the batch was stopped")
        raise _RequestFailed(
            f"no answer after {made} attempt(s) ({self.timeout:g} s each, {self.deadline:g} s in all); last error: "
            f"{last}",
            last_status,
        )

    def _decode(self, data: bytes) -> dict[str, Any]:
        try:
            reply = json.loads(data)
        except (ValueError, RecursionError) as err:
            raise VlmRewardError(f"vlm judge at {self.url} sent invalid JSON ({err})", reward=self.name) from None
        if not isinstance(reply, dict):
            raise VlmRewardError(
                f"vlm judge at {self.url} sent {type(reply).__name__}, not an object", reward=self.name
            )
        return reply

    # ------------------------------------------------------------------ parsing
    def _choice(self, reply: dict[str, Any]) -> dict[str, Any]:
        choices = reply.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise VlmRewardError(f"vlm judge at {self.url}: reply has no choices: {str(reply)[:300]}", reward=self.name)
        return choices[0]

    def parse(self, reply: dict[str, Any]) -> float | None:
        """The score of one chat-completions reply, or None when it cannot be parsed (rules in the module doc)."""
        choice = self._choice(reply)
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        text = message.get("content") if isinstance(message.get("content"), str) else ""
        if self.parser == "yes_no":
            return self._yes_probability(choice.get("logprobs"), text)
        if self.parser == "number":
            value = parse_number(text)
        else:
            match = self.pattern.search(clean_reply(text))
            try:
                value = float(match.group(1)) if match else None
            except (TypeError, ValueError):
                value = None
        if value is None or not math.isfinite(value):
            return None
        if self.score_range is not None:
            low, high = self.score_range
            if not low <= value <= high:
                return None
            value = (value - low) / (high - low)
        return value

    def _yes_probability(self, logprobs: Any, text: str) -> float | None:
        tokens = logprobs.get("content") if isinstance(logprobs, dict) else None
        reasoning = _REASONING_TAG.search(text)
        answer_tokens = [] if reasoning else [t for t in tokens or [] if isinstance(t, dict) and _norm(t.get("token"))]
        first = answer_tokens[0] if answer_tokens else None
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
        answer = _ANSWER_PREFIX.sub("", clean_reply(text), count=1).lower()
        answer = re.sub(r"^[\W_]+", "", answer)
        return 1.0 if _starts_with(answer, self.yes_words) else 0.0 if _starts_with(answer, self.no_words) else None

    # ------------------------------------------------------------------ scoring
    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        """One batch, within ``deadline`` seconds: a score per image (NaN for a failed request with
        ``on_error: nan``; ``parse_failure_score`` for an unparsable reply); raises ``VlmRewardError`` otherwise."""
        pixels = to_uint8_hwc(images)
        batch = _Batch(self.deadline)
        results: list[tuple[float | None, str] | None] = [None] * len(prompts)
        failures: dict[int, _RequestFailed] = {}
        pool = ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(prompts)), thread_name_prefix="vlm")
        try:
            futures: dict[Future, int] = {
                pool.submit(self._judge, p, prompt, batch): i
                for i, (p, prompt) in enumerate(zip(pixels, prompts, strict=True))
            }
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=max(batch.left(), 0), return_when=FIRST_COMPLETED)
                if not done:  # the deadline: what is in flight is abandoned, what is queued never sent
                    late = _RequestFailed(f"no reply within the deadline of {self.deadline:g} s")
                    failures.update((futures[future], late) for future in pending)
                    break
                for future in done:
                    try:
                        results[futures[future]] = future.result()
                    except _Abandoned:  # ended by the stop another request's failure caused
                        pass
                    except _RequestFailed as err:
                        failures[futures[future]] = err
                if failures and self.on_error == "raise":
                    break
        finally:
            batch.stop()  # in-flight connections shut, nothing more sent or retried
            pool.shutdown(wait=False, cancel_futures=True)
        if failures:
            first = min(failures)
            if self.on_error == "raise":
                status = failures[first].status
                hint = (
                    f"Is the server (vLLM, sglang) running and serving {self.model!r}, and is deadline "
                    f"({self.deadline:g} s) long enough for {len(prompts)} images, {self.max_concurrency} at a time?"
                    if status is None
                    else "The server is up but failing: see its log."
                    if status == 429 or status >= 500
                    else "The server refused this request."
                )
                raise VlmRewardError(
                    f"vlm judge at {self.url}: the request for prompt {prompts[first]!r} failed: {failures[first]}. "
                    f"on_error: raise fails the whole batch; on_error: nan scores such an image NaN instead (for "
                    f"grpo.nan_policy). {hint}",
                    reward=self.name,
                )
            self.request_failures += len(failures)
            logger.warning(
                "vlm judge %s: %d of %d requests failed, scored NaN (on_error: nan); first, for prompt %r: %s",
                self.url,
                len(failures),
                len(prompts),
                prompts[first],
                failures[first],
            )
        unparsed = [i for i, r in enumerate(results) if r is not None and r[0] is None]
        if unparsed:
            self.parse_failures += len(unparsed)
            logger.warning(
                "vlm judge %s: %d of %d replies could not be parsed by the '%s' parser (scored %s); first, for "
                "prompt %r: %r",
                self.url,
                len(unparsed),
                len(results),
                self.parser,
                self.parse_failure_score,
                prompts[unparsed[0]],
                results[unparsed[0]][1][:200],
            )
        scores = [math.nan if r is None else self.parse_failure_score if r[0] is None else r[0] for r in results]
        return torch.tensor(scores, dtype=torch.float64)

    def _judge(self, pixels_hwc: np.ndarray, prompt: str, batch: _Batch) -> tuple[float | None, str]:
        if batch.stopped.is_set():  # queued when the batch ended: never sent
            raise _Abandoned("the batch was stopped before this request was sent")
        try:
            reply = self._ask(self.request_body(pixels_hwc, prompt), batch)
            value = self.parse(reply)
        except _RequestFailed:
            if self.on_error == "raise":  # stopped here, before this worker can take the next image
                batch.stop()
            raise
        except Exception:  # fails the batch whatever on_error says
            batch.stop()
            raise
        try:
            text = str(reply["choices"][0]["message"]["content"])
        except (KeyError, IndexError, TypeError):
            text = str(reply)
        return value, text

    def __repr__(self) -> str:
        return f"VlmReward(url={self.url!r}, model={self.model!r}, parser={self.parser!r}, on_error={self.on_error!r})"


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _norm(token: Any) -> str:
    """A token or word as the yes/no parser compares it: no blanks, BPE space markers, quotes, markdown or
    punctuation around it, lower case."""
    if not isinstance(token, str):
        return ""
    return token.strip().strip("Ġ▁Ċ").strip(" \t\r\n*_`#\"'.,!?:;()[]").lower()


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
