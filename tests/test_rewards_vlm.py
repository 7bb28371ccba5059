"""The ``vlm`` reward against a fake OpenAI-compatible chat server on 127.0.0.1 (no model, no network)."""

import base64
import io
import json
import logging
import math
import re
import threading
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


@contextmanager
def fake_judge(answer):
    """A chat server; ``answer(body, state) -> (status, payload)``; yields (base URL, state with every request)."""
    state = {"bodies": [], "headers": [], "lock": threading.Lock()}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state["lock"]:
                state["bodies"].append(body)
                state["headers"].append(dict(self.headers))
                state["path"] = self.path
            status, payload = answer(body, state)
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client gave up on this request (timeout test)
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

    with fake_judge(lambda body, state: (500, {"object": "error", "message": "CUDA out of memory"})) as (url, state):
        reward = build_reward(
            [{"name": "vlm", "url": url, "model": "m", "template": "n {prompt}", "retries": 1, "backoff": 0.01}]
        )
        with pytest.raises(RewardError, match=r"no answer after 2 attempt\(s\).*HTTP 500: CUDA out of memory") as info:
            reward(images(1), ["a"])
    assert len(state["bodies"]) == 2 and f"vlm judge at {url}:" in str(info.value)


def test_client_errors_are_not_retried():
    reply = {"object": "error", "message": "The model `nope` does not exist.", "code": 404}
    with fake_judge(lambda body, state: (404, reply)) as (url, state):
        reward = VlmReward(url=url, model="nope", template="n {prompt}", retries=3, backoff=0.01)
        with pytest.raises(
            VlmRewardError, match=rf"vlm judge at {re.escape(url)} answered HTTP 404: The model `nope` does not"
        ):
            reward(images(1), ["a"])
    assert len(state["bodies"]) == 1


def test_timeout_then_retry_and_unreachable_server():
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
    with fake_judge(lambda body, state: (200, chat_reply("1"))) as (url, state):
        pass  # closed: nothing listens there any more
    reward = VlmReward(url=url, model="m", template="n {prompt}", timeout=1, retries=1, backoff=0.01)
    with pytest.raises(VlmRewardError, match=rf"vlm judge at {re.escape(url)}: no answer after 2 attempt\(s\)"):
        reward(images(1), ["a"])


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
    ]
    for options, words in bad:
        with pytest.raises(ValueError, match=words):
            VlmReward(**{**base, **options})
    with pytest.raises(ValueError, match="needs option"):
        build_reward([{"name": "vlm", "url": "http://127.0.0.1:1"}])
