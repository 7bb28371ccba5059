"""Remote scoring over loopback: scripts/reward_server.py in a subprocess, and in-thread servers for error paths."""

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from rewards import NonFiniteRewardError, RemoteRewardError, RewardError, build_reward, make_reward_server

ROOT = Path(__file__).resolve().parents[1]
OPEN_CLIP_TINY = {
    "embed_dim": 32,
    "vision_cfg": {"layers": 2, "width": 32, "head_width": 16, "patch_size": 16, "image_size": 64},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}


def render(text: str, size=256, font_size=28) -> torch.Tensor:
    img = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(img).text((12, size // 2 - 16), text, fill="black", font=ImageFont.load_default(size=font_size))
    return torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255


@contextmanager
def serving(reward):
    server = make_reward_server(reward, port=0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def server_process(*args: str):
    """scripts/reward_server.py on a free port; yields its URL once it prints it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "reward_server.py"), "--port", "0", "--log-level", "WARNING", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
    )
    lines: list[str] = []
    found: list[str] = []

    def read():  # a reader thread, so a server that never prints cannot hang the test
        for line in proc.stdout:
            lines.append(line)
            match = re.search(r"listening on (http://127\.0\.0\.1:\d+/score)", line)
            if match:
                found.append(match.group(1))

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while not found and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert found, f"server did not start: {''.join(lines)}"
        yield found[0]
    finally:
        proc.terminate()
        try:
            assert proc.wait(timeout=30) == 0, "".join(lines)  # SIGTERM -> clean shutdown
        finally:
            if proc.poll() is None:
                proc.kill()


def test_reward_server_script_matches_in_process_scores():
    texts = ["FLOW GRPO", "Hello World", "Open 24"]
    images = torch.stack([render(t) for t in texts] + [torch.ones(3, 256, 256)])
    prompts = [f'a sign that says "{t}"' for t in texts] + ['a sign that says "blank"']
    local = build_reward({"ocr": 1.0, "jpeg_compressibility": 0.5})(images, prompts)
    with server_process("--reward", "ocr=1.0", "--reward", "jpeg_compressibility=0.5") as url:
        with urllib.request.urlopen(url.replace("/score", "/health"), timeout=10) as r:
            assert json.loads(r.read())["status"] == "ok"
        remote = build_reward([{"name": "remote", "url": url, "batch_size": 3, "key": "server"}])
        out = remote(images, prompts)
    assert set(out) == {"server", "server/ocr", "server/jpeg_compressibility", "total"}
    assert torch.equal(out["server/ocr"], local["ocr"])  # PNG is lossless for 8-bit images
    assert torch.equal(out["server/jpeg_compressibility"], local["jpeg_compressibility"])
    assert torch.equal(out["server"], local["total"]) and torch.equal(out["total"], local["total"])
    assert local["ocr"][:3].min() >= 0.95 and local["ocr"][3] == 0.0


def test_npz_transport_is_lossless_for_float_models():
    reward = build_reward([{"name": "clipscore", "random_init": True, "model_config": OPEN_CLIP_TINY}])
    images = torch.rand(3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    prompts = ["a cat", "a dog", "a car"]
    local = reward(images, prompts)
    with serving(reward) as url:
        out = build_reward([{"name": "remote", "url": url, "image_format": "npz"}])(images, prompts)
    assert torch.equal(out["remote/clipscore"], local["clipscore"])


def test_server_error_surfaces_without_retry():
    calls = []

    def failing(images, prompts, metadata=None):
        calls.append(len(prompts))
        raise RuntimeError("detector crashed")

    with serving(failing) as url:
        remote = build_reward([{"name": "remote", "url": url, "retries": 3, "backoff": 0.01}])
        with pytest.raises(RewardError, match="HTTP 500: RuntimeError: detector crashed") as info:
            remote(torch.rand(2, 3, 8, 8), ["a", "b"])
    assert isinstance(info.value.__cause__, RemoteRewardError) and info.value.reward == "remote"
    assert calls == [2]  # a reward's own failure is not retried


def test_unreachable_endpoint_retries_then_explains():
    with serving(lambda images, prompts, metadata=None: {}) as url:
        pass  # the port is free again once the server is closed
    remote = build_reward([{"name": "remote", "url": url, "retries": 1, "backoff": 0.01, "timeout": 2}])
    with pytest.raises(RewardError, match=r"no answer after 2 attempt\(s\).*Is scripts/reward_server.py running"):
        remote(torch.rand(1, 3, 8, 8), ["a"])


def test_timeout_then_retry_on_503():
    state = {"n": 0}
    release = threading.Event()  # holds the first attempt until the client has given up on it

    class Flaky(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            state["n"] += 1
            if state["n"] == 1:
                release.wait(30)  # first attempt: answered only after the client's timeout
            status, body = (503, {"error": "busy"}) if state["n"] == 2 else (200, {"scores": {"s": [0.25, 0.5]}})
            data = json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except BrokenPipeError:  # the timed-out first attempt: the client has gone
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/score"
        remote = build_reward([{"name": "remote", "url": url, "retries": 2, "backoff": 0.01, "timeout": 1.0}])
        out = remote(torch.rand(2, 3, 8, 8), ["a", "b"])
    finally:
        release.set()
        server.shutdown()
        server.server_close()
    assert state["n"] == 3 and out["remote"].tolist() == [0.25, 0.5]


def test_bad_requests_and_replies():
    with serving(lambda images, prompts, metadata=None: {"s": torch.zeros(len(prompts))}) as url:
        request = urllib.request.Request(url, data=b'{"format": "gif"}', method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=10)
        assert info.value.code == 400 and "malformed request" in json.loads(info.value.read())["error"]
        bad = torch.rand(2, 3, 8, 8, dtype=torch.float64) * 3  # out of [0, 1]: rejected before sending
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            build_reward([{"name": "remote", "url": url, "image_format": "npz"}])(bad, ["a", "b"])
        with pytest.raises(RewardError, match="JSON-serialisable"):
            build_reward([{"name": "remote", "url": url}])(torch.rand(1, 3, 8, 8), ["a"], [{"x": object()}])
    with pytest.raises(ValueError, match="loopback only"):
        make_reward_server(lambda *a: {}, host="0.0.0.0")
    with pytest.raises(ValueError, match="url must start with http"):
        build_reward([{"name": "remote", "url": "127.0.0.1:8000"}])


def test_nan_from_server_reaches_the_client_policy():
    with serving(lambda images, prompts, metadata=None: {"s": torch.tensor([1.0, float("nan")])}) as url:
        with pytest.raises(NonFiniteRewardError, match=r"reward 'remote' returned non-finite scores at indices \[1\]"):
            build_reward([{"name": "remote", "url": url}])(torch.rand(2, 3, 8, 8), ["a", "b"])
        out = build_reward([{"name": "remote", "url": url}], nan_policy="drop")(torch.rand(2, 3, 8, 8), ["a", "b"])
    assert out["remote"][0] == 1.0 and torch.isnan(out["remote"][1])
