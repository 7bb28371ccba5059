"""The ``vlm`` reward against a fake OpenAI-compatible chat server on 127.0.0.1 (no model, no network)."""

import base64
import io
import json
import logging
import math
import re
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from rewards import RewardError, VlmReward, VlmRewardError, build_reward
from rewards.base import to_uint8_hwc

# The text Flow-GRPO's unifiedreward_score_sglang sends (yifan123/flow_grpo flow_grpo/rewards.py), copied from there
# on its own so that a change to the template in rewards/vlm.py is caught.
UNIFIEDREWARD_TEXT = (
    "<image>\nYou are given a text caption and a generated image based on that caption. Your task is to evaluate "
    "this image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with "
    "the provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as "
    "described in the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including "
    "clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria, assign "
    "a score from 1 to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]"
)


def chat_reply(text, logprobs=None):
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
    if logprobs is not None:
        choice["logprobs"] = {"content": logprobs}
    return {"id": "x", "object": "chat.completion", "model": "judge", "choices": [choice]}


def first_token(*alternatives):
    """vLLM's chat ``logprobs.content[0]``: the sampled token and its ``top_logprobs`` alternatives."""
    top = [{"token": t, "logprob": math.log(p), "bytes": list(t.encode())} for t, p in alternatives]
    return [{**top[0], "top_logprobs": top}]


def is_probe(body):
    """The reward's start-up check: the real request's shape with max_tokens 1 (no test sets max_tokens 1)."""
    return body.get("max_tokens") == 1


@contextmanager
def fake_judge(answer, probe=None, models=("m",)):
    """A chat server; ``answer(body, state) -> (status, payload)``; yields (base URL, state with every request).

    The start-up probe is answered by ``probe(body, state)`` (default: a 200 chat reply) and kept apart, in
    ``state["probes"]``; ``GET .../models`` lists ``models``."""
    state = {"bodies": [], "headers": [], "probes": [], "lock": threading.Lock()}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if is_probe(body):
                with state["lock"]:
                    state["probes"].append(body)
                status, payload = probe(body, state) if probe else (200, chat_reply("OK"))
            else:
                with state["lock"]:
                    state["bodies"].append(body)
                    state["headers"].append(dict(self.headers))
                    state["path"] = self.path
                status, payload = answer(body, state)
            self._send(status, payload)

        def do_GET(self):  # noqa: N802
            if self.path.endswith("/models"):
                self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in models]})
            else:
                self._send(404, {"error": {"message": "no such path"}})

        def _send(self, status, payload):
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client gave up on this request (timeout tests)
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", state
    finally:
        server.shutdown()
        server.server_close()


def prompt_of(body):
    """The prompt the reward filled into the ``rating``-style test template ``... [{prompt}]``."""
    text = body["messages"][-1]["content"][1]["text"]
    return text[text.rindex("[") + 1 : -1]


def decode_data_url(url):
    header, _, data = url.partition(",")
    assert header in ("data:image/png;base64", "data:image/jpeg;base64"), header
    return np.array(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"))


def images(n, size=16, seed=0):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def test_unifiedreward_request_and_flowgrpo_parsing(monkeypatch):
    replies = {"a red car": "The car is red.\nFinal Score: 4.5", "two cats": "Final Score: 2", "a dog": "Score: 3"}
    with fake_judge(lambda body, state: (200, chat_reply(replies[prompt_of(body)]))) as (url, state):
        monkeypatch.setenv("JUDGE_KEY", "sk-test")
        reward = build_reward(
            [
                {
                    "name": "vlm",
                    "url": url,
                    "model": "UnifiedReward-7b-v1.5",
                    "template": "unifiedreward",
                    "api_key_env": "JUDGE_KEY",
                    "key": "unifiedreward",
                }
            ],
            nan_policy="drop",
        )
        batch = images(3)
        out = reward(batch, list(replies))
    # Flow-GRPO: regex Final Score:\s*([1-5](?:\.\d+)?) divided by 5; no match -> NaN here (the trainer's nan_policy)
    assert out["unifiedreward"][:2].tolist() == pytest.approx([0.9, 0.4]) and math.isnan(out["unifiedreward"][2])
    assert state["path"] == "/v1/chat/completions"
    bodies = sorted(state["bodies"], key=prompt_of)
    pixels = to_uint8_hwc(batch)
    for body, prompt in zip(bodies, sorted(replies), strict=True):
        assert body["model"] == "UnifiedReward-7b-v1.5" and body["temperature"] == 0.0 and "logprobs" not in body
        (message,) = body["messages"]
        image_part, text_part = message["content"]
        assert message["role"] == "user" and image_part["type"] == "image_url" and text_part["type"] == "text"
        assert text_part["text"] == UNIFIEDREWARD_TEXT.replace("{prompt}", prompt)
        index = list(replies).index(prompt)
        assert np.array_equal(decode_data_url(image_part["image_url"]["url"]), pixels[index])  # PNG: lossless
    assert all(h["Authorization"] == "Bearer sk-test" for h in state["headers"])


def test_number_parser_range_resize_jpeg_system_prompt_and_extra_body():
    answers = iter(["8", "I'd say 7/10.", "12", "no idea"])
    lock = threading.Lock()

    def answer(body, state):
        with lock:
            return 200, chat_reply(next(answers))

    with fake_judge(answer) as (url, state):
        reward = VlmReward(
            url=url + "/chat/completions",
            model="qwen",
            template="Rate [{prompt}]",
            score_range=[0, 10],
            image_format="jpeg",
            image_size=24,
            system_prompt="You are a judge.",
            extra_body={"top_k": 1},
            max_concurrency=1,
            parse_failure_score=-1.0,
        )
        out = reward(images(4), ["p0", "p1", "p2", "p3"])
    assert out["vlm"].tolist() == pytest.approx(
        [0.8, 0.7, -1.0, -1.0]
    )  # 12 is outside [0, 10]; "no idea" has no number
    assert reward.parse_failures == 2 and state["path"] == "/v1/chat/completions"
    body = state["bodies"][0]
    assert body["messages"][0] == {"role": "system", "content": "You are a judge."}
    assert body["top_k"] == 1 and body["max_tokens"] == 1024
    assert decode_data_url(body["messages"][1]["content"][0]["image_url"]["url"]).shape == (24, 24, 3)
    assert body["messages"][1]["content"][0]["image_url"]["url"].startswith("data:image/jpeg;base64,")


def test_yes_no_from_top_logprobs_then_from_text():
    def answer(body, state):
        prompt = prompt_of(body)
        if prompt == "logprobs":  # P(yes) = (0.6 + 0.1) / (0.6 + 0.1 + 0.2): both spellings of yes count
            return 200, chat_reply(
                "Yes",
                [{"token": "\n", "logprob": -0.01}]
                + first_token(("Yes", 0.6), ("No", 0.2), (" yes", 0.1), ("Maybe", 0.05)),
            )
        if prompt == "text only":  # a server that returns no log-probs: the text decides
            return 200, chat_reply("No, it does not.")
        if prompt == "neither":  # no yes/no among the alternatives, nor in the text
            return 200, chat_reply("Perhaps", first_token(("Perhaps", 0.9)))
        return 200, chat_reply("yes.", first_token(("Sure", 0.9)))

    with fake_judge(answer) as (url, state):
        reward = VlmReward(url=url, model="qwen", template="Is this [{prompt}]", parser="yes_no", top_logprobs=5)
        out = reward(images(4), ["logprobs", "text only", "neither", "text yes"])
    scores = out["vlm"].tolist()
    assert scores[0] == pytest.approx(0.7 / 0.9) and scores[1] == 0.0 and math.isnan(scores[2]) and scores[3] == 1.0
    body = state["bodies"][0]
    assert body["logprobs"] is True and body["top_logprobs"] == 5 and body["max_tokens"] == 8


def test_named_yes_no_template_and_regex_parser_options():
    with fake_judge(lambda body, state: (200, chat_reply("Yes"))) as (url, state):
        out = VlmReward(url=url, model="m", template="yes_no")(images(1), ["a cat"])
    assert out["vlm"].tolist() == [1.0]
    assert state["bodies"][0]["messages"][0]["content"][1]["text"] == (
        'Does this image match the description "a cat"? Answer Yes or No.'
    )
    with fake_judge(lambda body, state: (200, chat_reply("alignment=3 quality=0.25"))) as (url, state):
        out = VlmReward(url=url, model="m", template="Judge {prompt}", parser="regex", pattern=r"quality=([\d.]+)")(
            images(1), ["x"]
        )
    assert out["vlm"].tolist() == [0.25]


def test_concurrency_is_bounded_and_used():
    limit, total = 3, 7
    cond = threading.Condition()
    counts = {"in_flight": 0, "max": 0, "arrived": 0}

    def answer(body, state):
        with cond:  # hold each request until `limit` are in flight (or every request has come): no sleeps
            counts["in_flight"] += 1
            counts["arrived"] += 1
            counts["max"] = max(counts["max"], counts["in_flight"])
            cond.notify_all()
            cond.wait_for(lambda: counts["in_flight"] >= limit or counts["arrived"] == total, timeout=5)
            counts["in_flight"] -= 1
        return 200, chat_reply(str(int(prompt_of(body))))

    with fake_judge(answer) as (url, state):
        reward = VlmReward(url=url, model="m", template="n [{prompt}]", max_concurrency=limit, timeout=10)
        out = reward(images(total), [str(i) for i in range(total)])
    assert counts["max"] == limit and out["vlm"].tolist() == list(range(total))  # in order, whatever order served


def test_retries_on_5xx_and_429_then_gives_up_naming_url_and_status(caplog):
    attempts = {}

    def flaky(body, state):
        n = attempts[prompt_of(body)] = attempts.get(prompt_of(body), 0) + 1
        if n == 1:
            return 503, {"object": "error", "message": "engine busy"}
        if n == 2:
            return 429, {"error": {"message": "rate limited"}}
        return 200, chat_reply("5")

    with fake_judge(flaky) as (url, state), caplog.at_level(logging.WARNING, "rewards.vlm"):
        out = VlmReward(url=url, model="m", template="n [{prompt}]", retries=2, backoff=0.01)(images(2), ["a", "b"])
    assert out["vlm"].tolist() == [5.0, 5.0] and attempts == {"a": 3, "b": 3}
    assert "HTTP 503: engine busy" in caplog.text and "HTTP 429: rate limited" in caplog.text

    oom = {"object": "error", "message": "CUDA out of memory"}
    spec = {"name": "vlm", "model": "m", "template": "n {prompt}", "retries": 1, "backoff": 0.01, "on_error": "raise"}
    with fake_judge(lambda body, state: (500, oom)) as (url, state):
        reward = build_reward([{**spec, "url": url}])
        with pytest.raises(RewardError, match=r"no answer after 2 attempt\(s\).*HTTP 500: CUDA out of memory") as info:
            reward(images(1), ["a"])
    assert len(state["bodies"]) == 2 and f"vlm judge at {url}:" in str(info.value)
    assert "on_error: nan scores such an image NaN" in str(info.value)


def test_client_errors_are_not_retried_and_a_missing_model_fails_the_batch_whatever_on_error():
    reply = {"object": "error", "message": "The model `nope` does not exist.", "code": 404}
    with fake_judge(lambda body, state: (404, reply)) as (url, state):
        reward = VlmReward(url=url, model="nope", template="n {prompt}", retries=3, backoff=0.01, on_error="nan")
        with pytest.raises(
            VlmRewardError, match=rf"vlm judge at {re.escape(url)} answered HTTP 404: The model `nope` does not"
        ):
            reward(images(1), ["a"])
    assert len(state["bodies"]) == 1


def test_timeout_then_retry():
    release = threading.Event()
    seen = []

    def slow_first(body, state):
        seen.append(1)
        if len(seen) == 1:
            release.wait(10)  # answered only after the client's timeout
        return 200, chat_reply("3")

    try:
        with fake_judge(slow_first) as (url, state):
            reward = VlmReward(url=url, model="m", template="n {prompt}", timeout=0.3, retries=1, backoff=0.01)
            assert reward(images(1), ["a"])["vlm"].tolist() == [3.0]
    finally:
        release.set()
    assert len(seen) == 2


def closed_url():
    """The URL of a judge that has gone: nothing listens there any more."""
    with fake_judge(lambda body, state: (200, chat_reply("1"))) as (url, state):
        pass
    return url


def test_an_unreachable_judge_fails_when_built_naming_url_and_fix():
    url = closed_url()
    start = time.monotonic()
    with pytest.raises(RewardError) as info:
        build_reward([{"name": "vlm", "url": url, "model": "m", "template": "rating", "retries": 1, "backoff": 0.01}])
    assert time.monotonic() - start < 2
    message = str(info.value)
    assert f"vlm judge at {url} failed its start-up check" in message and "ConnectionRefusedError" in message
    assert "vllm serve" in message and "probe: false" in message and "Traceback" not in message
    # probe: false skips the check; the batch then fails per image (NaN) or as a whole (on_error: raise)
    options = {"url": url, "model": "m", "template": "rating", "retries": 1, "backoff": 0.01, "probe": False}
    assert torch.isnan(VlmReward(**options)(images(2), ["a", "b"])["vlm"]).all()
    with pytest.raises(VlmRewardError, match=rf"vlm judge at {re.escape(url)}: the request .* no answer after 2"):
        VlmReward(**options, on_error="raise")(images(2), ["a", "b"])


def test_probe_is_one_request_shaped_as_the_real_ones():
    with fake_judge(lambda body, state: (200, chat_reply("5"))) as (url, state):
        reward = VlmReward(
            url=url,
            model="m",
            template="n [{prompt}]",
            parser="yes_no",
            system_prompt="Judge.",
            extra_body={"top_k": 1},
        )
        (probe,) = state["probes"]
        assert state["bodies"] == []
        reward(images(1), ["a"])
    assert probe["model"] == "m" and probe["max_tokens"] == 1 and probe["top_k"] == 1 and probe["top_logprobs"] == 20
    system, user = probe["messages"]
    assert system == {"role": "system", "content": "Judge."} and prompt_of(probe) == "a grey square"
    assert decode_data_url(user["content"][0]["image_url"]["url"]).shape == (224, 224, 3)  # Qwen-VL refuses < 28 px
    assert len(state["probes"]) == 1 and len(state["bodies"]) == 1  # once, when built: not per batch


@pytest.mark.parametrize(
    ("status", "payload", "words"),
    [
        (
            404,
            {"object": "error", "message": "The model `nope` does not exist."},
            r"HTTP 404: The model `nope`.*"
            r"--served-model-name\)\. The server lists: UnifiedReward-7b-v1\.5",
        ),
        (401, {"error": {"message": "Invalid API key"}}, r"HTTP 401: Invalid API key.*Set api_key_env"),
        (400, {"object": "error", "message": "top_logprobs must be <= 5"}, r"HTTP 400: top_logprobs.*--max-logprobs"),
        (503, {"object": "error", "message": "loading"}, r"HTTP 503: loading.*up but failing"),
        (200, {"object": "chat.completion"}, r"reply has no choices.*OpenAI-compatible chat endpoint"),
    ],
)
def test_probe_failures_name_the_fix(status, payload, words):
    with fake_judge(None, probe=lambda body, state: (status, payload), models=["UnifiedReward-7b-v1.5"]) as (url, s):
        with pytest.raises(VlmRewardError, match=rf"vlm judge at {re.escape(url)} failed its start-up check.*{words}"):
            VlmReward(url=url, model="nope", template="yes_no", retries=1, backoff=0.01)
    assert len(s["probes"]) == (2 if status == 503 else 1) and s["bodies"] == []  # only 429 / 5xx are retried


@pytest.mark.parametrize("on_error", ["raise", "nan"])
def test_a_hung_judge_costs_one_deadline_per_batch_and_no_second_wave(on_error):
    """Issue 28: 16 images, timeout 10, retries 1 sent 32 requests (two waves) and failed after 47 s."""
    release = threading.Event()

    def hang(body, state):
        release.wait(10)
        return 200, chat_reply("5")

    n, concurrency = 12, 4
    with fake_judge(hang) as (url, state):
        try:
            reward = VlmReward(
                url=url,
                model="m",
                template="n [{prompt}]",
                timeout=0.4,
                retries=1,
                backoff=0.0,
                max_concurrency=concurrency,
                on_error=on_error,
            )
            assert reward.deadline == pytest.approx(0.8)  # timeout * (retries + 1) + the backoff waits
            start = time.monotonic()
            if on_error == "raise":
                with pytest.raises(VlmRewardError, match=r"no answer after 2 attempt\(s\)|deadline"):
                    reward(images(n), [str(i) for i in range(n)])
            else:
                assert torch.isnan(reward(images(n), [str(i) for i in range(n)])["vlm"]).all()
            elapsed = time.monotonic() - start
            sent = len(state["bodies"])
            time.sleep(0.3)  # nothing is sent once the call has returned
            assert len(state["bodies"]) == sent
        finally:
            release.set()
    # before: a second wave of `concurrency` images (2 x 0.8 s) and 4 x 2 more requests, 12 x 2 with more waves
    assert elapsed < reward.deadline + 0.6
    assert sent <= concurrency * (reward.retries + 1)


def test_on_error_raise_ends_the_batch_at_the_first_failure():
    release = threading.Event()
    too_long = {"object": "error", "message": "This model's maximum context length is 4096 tokens"}

    def answer(body, state):
        if prompt_of(body) == "bad":
            return 400, too_long
        release.wait(10)  # the others hang
        return 200, chat_reply("5")

    prompts = ["slow", "bad", "x", "y", "z", "w"]
    with fake_judge(answer) as (url, state):
        try:
            reward = VlmReward(
                url=url, model="m", template="n [{prompt}]", timeout=5, retries=2, max_concurrency=2, on_error="raise"
            )
            start = time.monotonic()
            with pytest.raises(VlmRewardError, match=r"prompt 'bad' failed: HTTP 400: This model's maximum context"):
                reward(images(len(prompts)), prompts)
            elapsed = time.monotonic() - start
            time.sleep(0.3)
            sent = sorted(prompt_of(b) for b in state["bodies"])
        finally:
            release.set()
    assert elapsed < 2  # not the 5 s the request in flight would take: it is abandoned
    assert "bad" in sent and set(sent) <= {"slow", "bad"}  # the 400 is not retried; nothing sent after it


def test_on_error_nan_scores_a_failed_request_nan_for_its_image_only(caplog):
    tries = {}

    def answer(body, state):
        prompt = prompt_of(body)
        tries[prompt] = tries.get(prompt, 0) + 1
        if prompt == "down":
            return 503, {"object": "error", "message": "engine overloaded"}
        if prompt == "long":
            return 400, {"object": "error", "message": "maximum context length exceeded"}
        return 200, chat_reply(prompt[-1])

    spec = {"name": "vlm", "model": "m", "template": "n [{prompt}]", "retries": 1, "backoff": 0.01}
    with fake_judge(answer) as (url, state), caplog.at_level(logging.WARNING, "rewards.vlm"):
        reward = build_reward([{**spec, "url": url}], nan_policy="drop")  # the trainer's; on_error: nan by default
        out = reward(images(4), ["ok 3", "down", "long", "ok 7"])
    scores = out["vlm"].tolist()
    assert scores[0] == 3.0 and scores[3] == 7.0 and math.isnan(scores[1]) and math.isnan(scores[2])
    assert tries == {"ok 3": 1, "down": 2, "long": 1, "ok 7": 1}  # 503 retried, 400 not
    assert "2 of 4 requests failed, scored NaN (on_error: nan)" in caplog.text and "engine overloaded" in caplog.text
    assert reward.entries[0].reward.request_failures == 2


def test_unparsable_replies_are_nan_with_a_warning_not_a_crash(caplog):
    answers = {"a": chat_reply("Final Score: 3"), "b": chat_reply("I cannot rate this."), "c": chat_reply(None)}
    with fake_judge(lambda body, state: (200, answers[prompt_of(body)])) as (url, state):
        reward = build_reward({"vlm": {"url": url, "model": "m", "template": "unifiedreward"}}, nan_policy="drop")
        with caplog.at_level(logging.WARNING, "rewards.vlm"):
            out = reward(images(3), ["a", "b", "c"])
        assert out["vlm"][0] == pytest.approx(0.6) and torch.isnan(out["vlm"][1:]).all()
        assert "2 of 3 replies could not be parsed" in caplog.text and "I cannot rate this." in caplog.text
        strict = build_reward({"vlm": {"url": url, "model": "m", "template": "unifiedreward"}})  # nan_policy=error
        with pytest.raises(RewardError, match="non-finite"):
            strict(images(3), ["a", "b", "c"])
    with fake_judge(lambda body, state: (200, {"object": "chat.completion"})) as (url, state):  # not a chat reply
        with pytest.raises(VlmRewardError, match="reply has no choices"):
            VlmReward(url=url, model="m", template="unifiedreward")(images(1), ["a"])


def test_options_are_checked_when_built(monkeypatch):
    base = {"url": "http://127.0.0.1:1/v1", "model": "m"}
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    bad = [
        ({"template": "unifiedreword"}, "did you mean 'unifiedreward'"),
        ({"template": "x {prompt}", "parser": "regex", "pattern": "no group"}, "exactly one group"),
        ({"template": "x {prompt}", "parser": "logits"}, "parser must be one of"),
        ({"template": "x {prompt}", "score_range": [5, 1]}, "score_range"),
        ({"template": "x {prompt}", "api_key_env": "NO_SUCH_KEY_VAR"}, "is not set"),
        ({"template": "x {prompt}", "extra_body": {"messages": []}}, "extra_body may not set messages"),
        ({"template": "x {prompt}", "max_concurrency": 0}, "max_concurrency"),
        ({"template": "x {prompt}", "top_logprobs": 50}, "top_logprobs"),
        ({"template": "x {prompt}", "url": "127.0.0.1:8000"}, "vlm: url must start with http"),
        ({"template": "x {prompt}", "on_error": "skip"}, "on_error must be 'nan'"),
        ({"template": "x {prompt}", "deadline": 0}, "deadline must be the seconds one batch may take"),
        ({"template": "x {prompt}", "probe": "yes"}, "probe must be true"),
    ]
    for options, words in bad:
        with pytest.raises(ValueError, match=words):
            VlmReward(**{**base, **options})
    with pytest.raises(ValueError, match="needs option"):
        build_reward([{"name": "vlm", "url": "http://127.0.0.1:1"}])


# Real-world reply shapes: (parser's template, reply text, expected score after score_range; None: unparsable).
# `rating` reads numbers on [0, 10], `unifiedreward` its regex on [0, 5], `yes_no` P(yes) from the text.
REPLIES = [
    ("rating", "8", 0.8),
    ("rating", "<think>Step 1: the cat is there. Step 2: the colours match.</think> 8", 0.8),  # issue 28: was 0.1
    ("rating", "<think>\nStep 1 ...\n</think>\n\n**Score: 9**", 0.9),
    ("rating", "Step 1: the cat is there.\n</think>\n\n7", 0.7),  # the chat template opened the block
    ("rating", "<think>The image shows a red car. Score so far: 7", None),  # cut short while reasoning
    ("rating", "**Final Score:** 4", 0.4),
    ("rating", "Final Score: **4**", 0.4),
    ("rating", "## Rating\n\n**9/10**", 0.9),
    ("rating", "Score: 7/10", 0.7),
    ("rating", "7 out of 10", 0.7),
    ("rating", "Rating: 8.5", 0.85),
    ("rating", "Score: 10/10", 1.0),
    ("rating", "8\n\nThe image shows 2 cats and 1 dog, as described.", 0.8),
    ("rating", "8. The image shows 2 cats.", 0.8),
    ("rating", "I'd rate it 6. Step 2 of my analysis found 3 issues.", 0.6),
    ("rating", "I would give this image a 7 because 2 of the 3 cats are visible.", 0.7),
    ("rating", "The image depicts 3 cats; I'd say it deserves 8", 0.8),
    ("rating", "Score: 7-8", 0.75),
    ("rating", "On a scale of 1 to 10, 7.", 0.7),
    ("rating", "This is a 7 on a scale of 10.", 0.7),
    ("rating", '{"score": 8, "reason": "2 cats, 1 dog"}', 0.8),
    ("rating", "1. Alignment: good\n2. Quality: fair\nOverall: 6", 0.6),
    ("rating", "Final Score: 4\n\nA score of 3 was considered, but the colours are right.", 0.4),
    ("rating", "Alignment score: 3, quality score: 5. Overall score: 4", 0.4),
    ("rating", "Score (1-10): 7", 0.7),
    ("rating", "The answer is $\\boxed{7}$.", 0.7),
    ("rating", "<think>hmm, 3?</think><answer>9</answer>", 0.9),  # UnifiedReward-Think's format
    ("rating", "I'm sorry, but I can't evaluate images on a 1-10 scale.", None),  # refusals
    ("rating", "I cannot rate this image.", None),
    ("rating", "As an AI, I am unable to judge 2 images at once.", None),
    ("rating", "no idea", None),
    ("rating", "Rating: N/A", None),
    ("rating", "12", None),  # outside [0, 10]
    ("unifiedreward", "The image matches the caption.\nFinal Score: 4.5", 0.9),
    ("unifiedreward", "**Final Score:** 4", 0.8),  # issue 28: was NaN (Flow-GRPO: 0)
    ("unifiedreward", "Final Score: **4**", 0.8),
    ("unifiedreward", "<think>Final Score: 2? No, look again.</think>\nFinal Score: 5", 1.0),
    ("unifiedreward", "Score: 3", None),
    ("yes_no", "Yes", 1.0),
    ("yes_no", "**Yes**", 1.0),  # issue 28: was NaN
    ("yes_no", "Yes.", 1.0),
    ("yes_no", '"Yes"', 1.0),
    ("yes_no", "No, it does not.", 0.0),
    ("yes_no", "Answer: No.", 0.0),
    ("yes_no", "The answer is yes.", 1.0),
    ("yes_no", "**Final answer:** YES!", 1.0),
    ("yes_no", "<think>A cat, so yes... wait, it is a fox.</think>\nNo", 0.0),
    ("yes_no", "I cannot determine that.", None),
    ("yes_no", "Perhaps", None),
    ("yes_no", "Nope", None),  # not one of no_words
]


@pytest.mark.parametrize(("template", "text", "expected"), REPLIES, ids=[repr(r[1])[:40] for r in REPLIES])
def test_real_world_reply_shapes(template, text, expected):
    reward = VlmReward(url="http://127.0.0.1:1/v1", model="m", template=template, probe=False)
    value = reward.parse(chat_reply(text))
    assert value == (None if expected is None else pytest.approx(expected))


def test_yes_no_log_probs_skip_markdown_tokens_and_yield_to_the_text_after_reasoning():
    reward = VlmReward(url="http://127.0.0.1:1/v1", model="m", template="yes_no", probe=False)
    markdown = [{"token": "**", "logprob": -0.01, "top_logprobs": [{"token": "**", "logprob": -0.01}]}]
    assert reward.parse(chat_reply("**Yes**", markdown + first_token(("Yes", 0.8), ("No", 0.2)))) == pytest.approx(0.8)
    reasoning = [{"token": "<think>", "logprob": -0.01, "top_logprobs": [{"token": "Yes", "logprob": -5.0}]}]
    assert reward.parse(chat_reply("<think>a fox, not a cat</think>\nNo", reasoning)) == 0.0


def test_parsing_stays_linear_on_hostile_replies():
    number = VlmReward(url="http://127.0.0.1:1/v1", model="m", template="rating", probe=False)
    yes_no = VlmReward(url="http://127.0.0.1:1/v1", model="m", template="yes_no", probe=False)
    hostile = ["Score" + " " * 20000 + "x", "<think>" * 5000, "<answer>" * 5000, "1" * 20000 + "x"]
    hostile += ["rate it" + " " * 20000, "The answer is" + " " * 20000]
    start = time.monotonic()
    for text in hostile:
        assert number.parse(chat_reply(text)) is None and yes_no.parse(chat_reply(text)) is None
    assert time.monotonic() - start < 2  # nested blank quantifiers once took 16 s for 100 blanks
