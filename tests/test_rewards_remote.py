"""Remote scoring over loopback: scripts/reward_server.py in a subprocess, and in-thread servers for error paths."""

import base64
import contextlib
import io
import json
import os
import pickle
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import tracemalloc
import urllib.error
import urllib.request
import zipfile
import zlib
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont
from script_helper import load_script

from rewards import NonFiniteRewardError, RemoteRewardError, RewardError, build_reward, make_reward_server
from rewards.base import to_uint8_hwc
from rewards.remote import load_reply_pickle

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
def serving_server(reward, **limits):
    """make_reward_server in a thread; yields (server, its /score URL)."""
    server = make_reward_server(reward, port=0, **limits)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}/score"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def serving(reward, **limits):
    with serving_server(reward, **limits) as (_, url):
        yield url


@contextmanager
def server_process(*args: str):
    """scripts/reward_server.py on a free port; yields its URL once it prints it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "reward_server.py"), "--port", "0", "--log-level", "WARNING", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
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
    args = ("--reward", "ocr=1.0", "--reward", "jpeg_compressibility=0.5", "--devices", "cpu,cpu")
    with server_process(*args, "--flowgrpo-protocol") as url:
        with urllib.request.urlopen(url.replace("/score", "/health"), timeout=10) as r:
            health = json.loads(r.read())
        assert (health["status"], health["workers"], health["protocols"]) == ("ok", 2, ["json", "flowgrpo"])
        remote = build_reward([{"name": "remote", "url": [url, url], "batch_size": 2, "key": "server"}])
        out = remote(images, prompts)
        flowgrpo = {"name": "remote", "protocol": "flowgrpo", "url": url.removesuffix("/score"), "trust_pickle": True}
        jpeg = build_reward([flowgrpo])(images, prompts)["remote"]  # "outputs": the total, on JPEG-75 images
        assert torch.allclose(jpeg, local["total"], atol=0.1), (jpeg, local["total"])  # JPEG barely moves them
    assert set(out) == {"server", "server/ocr", "server/jpeg_compressibility", "total"}
    assert torch.equal(out["server/ocr"], local["ocr"])  # PNG is lossless for 8-bit images
    assert torch.equal(out["server/jpeg_compressibility"], local["jpeg_compressibility"])
    assert torch.equal(out["server"], local["total"]) and torch.equal(out["total"], local["total"])
    assert local["ocr"][:3].min() >= 0.95 and local["ocr"][3] == 0.0


def test_reward_server_devices_flag(capsys):
    script = load_script("reward_server")
    assert script.parse_devices("cpu, cpu", None) == ["cpu", "cpu"] and script.parse_devices(None, None) == ["cpu"]
    cases = [
        (["--devices", "99"], "--devices 99: a count means cuda:0 .. cuda:98"),
        (["--devices", "cpu,,cpu"], "comma-separated"),
        (["--devices", "gpu0"], "'gpu0' is not a device"),
        (["--device", "cpu", "--devices", "cpu,cpu"], "give --device or --devices, not both"),
        (["--memory-budget-mb", "1", "--max-request-mb", "2"], "below max_request_mb (--max-request-mb, 2)"),
        (["--max-connections", "0"], "--max-connections"),
    ]
    for argv, words in cases:
        assert script.main(["--reward", "brightness", *argv]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert words in err and err.count("error:") == 1 and "Traceback" not in err, err


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


# ---------------------------------------------------------------------------- hostile requests and servers
def _png(width: int, height: int) -> bytes:
    """A valid PNG header claiming width × height pixels, with almost no image data: a decompression bomb's
    opening (a real 9000 × 9000 PNG of zeros compresses to about 13 KB)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _npz_claiming(shape: tuple[int, ...]) -> bytes:
    """An npz whose images.npy header claims ``shape`` (float32) but holds a few bytes."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": shape})
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("images.npy", header.getvalue() + b"\0" * 64)
    return archive.getvalue()


def _score_request(image_format: str, images, n: int = 1) -> bytes:
    return json.dumps({"format": image_format, "images": images, "prompts": ["p"] * n}).encode()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _raw_http(port: int, request: bytes, wait: float = 20.0) -> tuple[int, str]:
    """Send raw bytes; (status, body) of the reply, or (0, "") when the server closed without one."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return (int(head.split()[1]) if head else 0), body.decode("utf-8", "replace")


def _post(body: bytes, length: str | None = None) -> bytes:
    length = str(len(body)) if length is None else length
    return f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode() + body


def _zeros(images, prompts, metadata=None):
    return {"s": torch.zeros(len(prompts))}


BAD_REQUESTS = {  # name: (raw request, expected status, words of the error)
    "9000x9000 png bombs": (_post(_score_request("png", [_b64(_png(9000, 9000))] * 2, 2)), 413, "pixels"),
    "100000x100000 png bomb": (_post(_score_request("png", [_b64(_png(100_000, 100_000))])), 413, "pixels"),
    "npz claiming 10^10 pixels": (
        _post(_score_request("npz", _b64(_npz_claiming((100, 3, 10_000, 10_000))))),
        413,
        "pixels",
    ),
    "bad zip": (_post(_score_request("npz", _b64(b"PK\x03\x04 not a zip"))), 400, "malformed request"),
    "bad base64": (_post(_score_request("png", ["***"])), 400, "malformed request"),
    "png sizes differ": (_post(_score_request("png", [_b64(_png(8, 8)), _b64(_png(9, 9))], 2)), 400, "differ"),
    "deep json": (_post(b"[" * 200_000), 400, "not a JSON object"),
    "non-UTF-8 json": (_post(b"\xff\xfe{}"), 400, "not a JSON object"),
    "non-integer Content-Length": (_post(b"{}", "12abc"), 400, "Content-Length"),
    "negative Content-Length": (_post(b"", "-5"), 400, "Content-Length"),
    "huge Content-Length": (_post(b"", str(10**12)), 413, "exceeds"),
    "no Content-Length": (b"POST /score HTTP/1.1\r\nHost: x\r\n\r\n", 411, "Content-Length"),
    # 2 MB of JSON that json.loads would turn into ~50 MB of objects: refused by counting its commas
    "a million JSON values": (_post(b"[" + b"[]," * 2**20 + b"[]]"), 413, "more than 1048576 values"),
    "headers over 64 KiB": (b"POST /score HTTP/1.1\r\n" + b"X: " + b"a" * 70_000 + b"\r\n\r\n", 431, "65536 bytes"),
    "garbled request line": (b"HELLO\r\n\r\n", 400, "request line"),
    "conflicting lengths": (
        b"POST /score HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        400,
        "conflicting",
    ),
    "pickle to a JSON server": (b"POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\n}.", 404, "--flowgrpo-protocol"),
}


def test_every_bad_request_gets_a_4xx_reply():
    # Each of these used to drop the connection without a reply (the client then retried and blamed the server),
    # and the two 9000 x 9000 PNGs in a 26 KB request decoded to gigabytes.
    with serving(_zeros) as url:
        port = int(url.split(":")[2].split("/")[0])
        for name, (request, status, words) in BAD_REQUESTS.items():
            start = time.monotonic()
            got, body = _raw_http(port, request)
            assert (got, words in body) == (status, True), f"{name}: {got} {body[:300]}"
            assert time.monotonic() - start < 10, name  # refused from headers, nothing decoded
        with urllib.request.urlopen(url.replace("/score", "/health"), timeout=10) as r:
            assert json.loads(r.read())["status"] == "ok"  # still serving


def test_the_client_sees_the_servers_limits_and_does_not_retry():
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with serving(_zeros, max_pixels=64 * 64) as url:  # one 64 x 64 image per request
        remote = build_reward([{"name": "remote", "url": url, "retries": 3, "backoff": 5}])
        with pytest.raises(RewardError, match=r"HTTP 413: request holds 8192 pixels.*batch_size"):
            remote(images, ["a", "b"])
        one_at_a_time = build_reward([{"name": "remote", "url": url, "batch_size": 1}])
        assert one_at_a_time(images, ["a", "b"])["total"].shape == (2,)
    images = torch.rand(2, 3, 256, 256, generator=torch.Generator().manual_seed(0))  # 2 MB as base64 npz
    # A body over the size limit is refused from its Content-Length; the server reads and drops the rest for a
    # moment, so that the client, still sending, gets the reply instead of a reset connection.
    with serving(_zeros, max_request_mb=0.5) as url:
        remote = build_reward([{"name": "remote", "url": url, "image_format": "npz", "retries": 3, "backoff": 5}])
        with pytest.raises(RewardError, match=r"HTTP 413: request body of \d+ bytes exceeds .* 524288 bytes"):
            remote(images, ["a", "b"])


def test_stalled_and_dripping_clients_are_timed_out():
    with serving(_zeros, timeout=0.5) as url:
        port = int(url.split(":")[2].split("/")[0])
        start = time.monotonic()
        status, body = _raw_http(port, _post(b'{"format": ', "100"))  # then nothing
        assert status == 408 and "not received within 0.5 s" in body
        assert time.monotonic() - start < 10
        # A byte every 0.1 s never trips a per-read timeout of 0.5 s: the whole body has a deadline.
        stop = threading.Event()
        with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
            sock.sendall(_post(b"", "1000"))
            start = time.monotonic()

            def drip():
                with contextlib.suppress(OSError):
                    while not stop.wait(0.1):
                        sock.sendall(b" ")

            threading.Thread(target=drip, daemon=True).start()
            try:
                reply = sock.recv(65536)
            finally:
                stop.set()
        assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 10


def test_listen_backlog_takes_a_burst_of_clients():
    # socketserver's default backlog of 5 left the rest of a burst of connections waiting or reset.
    server = make_reward_server(_zeros, port=0)
    sockets = []
    try:
        for _ in range(64):  # nobody accepts yet: every connection waits in the backlog
            sockets.append(socket.create_connection(server.server_address, timeout=1.0))
    finally:
        for sock in sockets:
            sock.close()
        server.server_close()
    assert len(sockets) == 64


def test_a_dripping_server_cannot_hold_the_client_past_its_deadline():
    stop = threading.Event()

    class Dripping(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.wfile.write(b"HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\n")
            with contextlib.suppress(OSError):
                while not stop.wait(0.1):  # a byte every 0.1 s: no single read ever times out
                    self.wfile.write(b" ")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Dripping)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/score"
    try:
        remote = build_reward([{"name": "remote", "url": url, "timeout": 1, "retries": 1, "backoff": 0.01}])
        start = time.monotonic()
        with pytest.raises(RewardError, match=r"no answer after 2 attempt\(s\).*TimeoutError: no complete reply"):
            remote(torch.rand(1, 3, 8, 8), ["a"])
        assert time.monotonic() - start < 6  # two attempts of 1 s (was: 10 s each, a byte at a time)
        remote = build_reward([{"name": "remote", "url": url, "timeout": 30, "retries": 5, "deadline": 1.5}])
        start = time.monotonic()
        with pytest.raises(RewardError, match=r"no answer after 1 attempt\(s\) \(30 s each, 1.5 s in all\)"):
            remote(torch.rand(1, 3, 8, 8), ["a"])
        assert time.monotonic() - start < 6
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------------ hostile clients: memory, time, connections
def _valid_request(n: int = 1) -> bytes:
    """A raw POST /score holding n real 8 x 8 PNGs."""
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), "gray").save(buffer, format="PNG")
    return _post(_score_request("png", [_b64(buffer.getvalue())] * n, n))


def _wait_for(condition, seconds: float = 5.0) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def test_an_announced_length_reserves_no_memory():
    # The server used to allocate bytearray(Content-Length) before a byte of the body arrived: 8 connections
    # announcing 60 MB each (under the 64 MiB limit) and sending nothing held 480 MB of zeros.
    with serving_server(_zeros, max_request_mb=64, timeout=10) as (server, url):
        port = server.server_address[1]
        tracemalloc.start()
        sockets = []
        try:
            for _ in range(8):
                sockets.append(socket.create_connection(("127.0.0.1", port), timeout=10))
                sockets[-1].sendall(_post(b"", str(60_000_000)))
            time.sleep(0.5)  # time for every connection's headers to be read
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            for sock in sockets:
                sock.close()
        assert peak < 8 * 2**20, f"{peak} bytes allocated for {len(sockets)} announced bodies"
        assert server.peak_buffered_bytes == 0
        _wait_for(lambda: server.open_connections == 0)


def test_a_flood_of_announced_bodies_does_not_delay_a_valid_client():
    # Issue 28: 40 requests of ~90 bytes announcing 600 MB (under the default 640 MiB cap), closed at once, delayed
    # the next valid reply to 40 s; 5 held open took the server from 850 MB to 3.7 GB.
    with serving_server(_zeros) as (server, url):
        port = server.server_address[1]
        for _ in range(40):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(_post(b"", "600000000"))
        held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(5)]
        try:
            for sock in held:
                sock.sendall(_post(b"", "600000000"))
            remote = build_reward([{"name": "remote", "url": url, "retries": 0, "timeout": 10}])
            start = time.monotonic()
            out = remote(torch.rand(2, 3, 8, 8), ["a", "b"])
            assert time.monotonic() - start < 3 and out["total"].tolist() == [0.0, 0.0]
            assert server.buffered_bytes == 0 and server.peak_buffered_bytes < 2**20
        finally:
            for sock in held:
                sock.close()
        _wait_for(lambda: server.open_connections == 0)


def test_slow_headers_are_cut_off_at_the_deadline():
    # A header every 0.2 s never trips a per-read timeout: the whole request, headers included, has one deadline.
    # (Before: one header every 1.5 s kept a connection 12 s with --timeout 2.)
    with serving(_zeros, timeout=1) as url:
        port = int(url.split(":")[2].split("/")[0])
        stop = threading.Event()
        with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
            sock.sendall(b"POST /score HTTP/1.1\r\n")
            start = time.monotonic()

            def drip():
                with contextlib.suppress(OSError):
                    for index in range(40):  # 8 s of headers
                        if stop.wait(0.2):
                            return
                        sock.sendall(f"X-Slow-{index}: 1\r\n".encode())

            threading.Thread(target=drip, daemon=True).start()
            try:
                reply = sock.recv(65536)
            finally:
                stop.set()
        elapsed = time.monotonic() - start
    assert reply.startswith(b"HTTP/1.1 408") and b"headers not received within 1 s" in reply, reply[:300]
    assert elapsed < 3, elapsed


def test_bodies_share_one_memory_budget():
    # Four clients each send 400 KB of a 500 KB body and stall: with a budget of 1 MiB two fit, the others are
    # refused (503) as their bytes would exceed it, and the reserved bytes never pass the budget.
    budget = 2**20
    with serving_server(_zeros, max_request_mb=0.5, memory_budget_mb=1, timeout=2) as (server, url):
        port = server.server_address[1]
        sockets = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(4)]
        try:
            for sock in sockets:
                sock.sendall(_post(b" " * 400_000, "500000"))
            replies = []
            for sock in sockets:  # 503 at once for the refused ones, 408 after 2 s for the others
                replies.append(sock.recv(65536))
        finally:
            for sock in sockets:
                sock.close()
        statuses = sorted(int(r.split()[1]) for r in replies)
        assert 503 in statuses and set(statuses) <= {408, 503}, replies
        assert b"memory budget of 1048576 bytes (--memory-budget-mb)" in next(r for r in replies if b" 503 " in r)
        assert 800_000 <= server.peak_buffered_bytes <= budget
        _wait_for(lambda: server.open_connections == 0)
        assert server.buffered_bytes == 0
        assert _raw_http(port, _valid_request())[0] == 200  # the budget is free again


def test_connections_over_the_bound_get_a_quick_503():
    with serving_server(_zeros, max_connections=4, timeout=3) as (server, url):
        port = server.server_address[1]
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(4)]
        try:
            _wait_for(lambda: server.open_connections == 4)
            start = time.monotonic()
            status, body = _raw_http(port, _valid_request())
            assert (status, "--max-connections" in body) == (503, True), body
            assert time.monotonic() - start < 1.5
        finally:
            for sock in idle:
                sock.close()
        _wait_for(lambda: server.open_connections == 0)
        out = build_reward([{"name": "remote", "url": url, "retries": 0}])(torch.rand(1, 3, 8, 8), ["a"])
        assert out["total"].tolist() == [0.0]
        assert server.refused_connections == 1


# ---------------------------------------------------------------------------- several workers, several URLs
def test_one_worker_per_reward_scores_requests_in_parallel():
    # Each reward waits at a barrier for the other: the requests pass only if two workers score at the same time.
    barrier = threading.Barrier(2, timeout=20)
    seen = []

    def worker_reward(name: str):
        def reward(images, prompts, metadata=None):
            seen.append(name)
            barrier.wait()
            return {"worker": torch.full((len(prompts),), float(name == "b"))}

        return reward

    with serving_server([worker_reward("a"), worker_reward("b")]) as (server, url):
        with urllib.request.urlopen(url.replace("/score", "/health"), timeout=10) as r:
            assert json.loads(r.read())["workers"] == 2
        remote = build_reward([{"name": "remote", "url": [url, url], "batch_size": 1, "timeout": 30}])
        out = remote(torch.rand(2, 3, 8, 8), ["x", "y"])
        assert sorted(seen) == ["a", "b"] and server.scored == [1, 1]
    assert sorted(out["remote"].tolist()) == [0.0, 1.0]


def test_the_client_spreads_a_batch_over_several_urls():
    calls = {"first": [], "second": []}

    def recording(name: str):
        def reward(images, prompts, metadata=None):
            calls[name].append(list(prompts))
            time.sleep(0.2)  # both URLs are busy at once
            mean = images.mean(dim=(1, 2, 3))
            return {"total": mean, "mean": mean, "server": torch.full((len(prompts),), float(name == "second"))}

        return reward

    images = torch.stack([torch.full((3, 8, 8), k / 255) for k in range(6)])  # exact in 8-bit PNG
    prompts = [str(k) for k in range(6)]
    with serving(recording("first")) as first, serving(recording("second")) as second:
        out = build_reward([{"name": "remote", "url": [first, second]}])(images, prompts)  # one request per URL
        assert sorted(map(len, calls["first"] + calls["second"])) == [3, 3]
        assert calls["first"] and calls["second"]
        assert torch.allclose(out["remote/mean"], images.mean(dim=(1, 2, 3)))  # in the batch's order
        for name in calls:
            calls[name].clear()
        build_reward([{"name": "remote", "url": [first, second], "batch_size": 1}])(images, prompts)
        assert calls["first"] and calls["second"]
        assert sorted(calls["first"] + calls["second"]) == [[p] for p in prompts]
    with serving(_zeros) as alive:
        with serving(_zeros) as dead:
            pass  # a closed port (taken by nothing else while alive holds its own)
        remote = build_reward([{"name": "remote", "url": [alive, dead], "retries": 0, "timeout": 2}])
        with pytest.raises(RewardError, match=re.escape(f"remote reward at {dead}: no answer")):
            remote(torch.rand(2, 3, 8, 8), ["a", "b"])
    with pytest.raises(ValueError, match="url is an empty list"):
        build_reward([{"name": "remote", "url": []}])


# ---------------------------------------------------------------------------- protocol: flowgrpo (pickle)
GENEVAL_TAGS = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]


def _fake_geneval(images, meta_datas, only_strict):
    """The shapes of reward_server/gen_eval.py's compute_geneval, with made-up judgements: the partial score is the
    image's mean brightness, strict correctness is "brighter than 0.5", -10 marks the other tags' columns."""
    scores, rewards, strict_rewards = [], [], []
    grouped_rewards, grouped_strict = {k: [] for k in GENEVAL_TAGS}, {k: [] for k in GENEVAL_TAGS}
    for image, metadata in zip(images, meta_datas, strict=True):
        assert metadata["prompt"] and metadata["include"]  # the reference server reads both (KeyError otherwise)
        score = float(np.asarray(image, dtype=np.float64).mean() / 255)
        strict = 1.0 if score > 0.5 else 0.0
        correct = 0.0 if only_strict else strict
        scores.append(score), rewards.append(correct), strict_rewards.append(strict)
        for key in GENEVAL_TAGS:
            grouped_strict[key].append(strict if key == metadata["tag"] else -10.0)
            grouped_rewards[key].append(correct if key == metadata["tag"] else -10.0)
    return scores, rewards, strict_rewards, grouped_rewards, grouped_strict


@contextmanager
def reference_server(kind="geneval"):
    """A stand-in for yifan123/reward-server's app_geneval.py / app_deqa.py: the request decoded as they decode it
    (pickle, JPEG images), the reply pickled the way they pickle it, a traceback with HTTP 500 on any error."""
    state = {"requests": []}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            if self.path != "/":  # Flask's route("/", methods=["POST"])
                self.send_error(404)
                return
            data = self.rfile.read(int(self.headers["Content-Length"]))
            try:
                data = pickle.loads(data)
                state["requests"].append(data)
                images = [Image.open(io.BytesIO(d), formats=["jpeg"]) for d in data["images"]]
                if kind == "geneval":
                    meta_datas = data["meta_datas"]
                    only_strict = data["only_strict"]
                    scores, rewards, strict_rewards, group_rewards, group_strict_rewards = _fake_geneval(
                        images, meta_datas, only_strict
                    )
                    response = {"scores": scores, "rewards": rewards, "strict_rewards": strict_rewards}
                    response.update(group_rewards=group_rewards, group_strict_rewards=group_strict_rewards)
                elif kind == "deqa":  # app_deqa.py: score = [sc.item() for sc in score]
                    response = {"outputs": [np.float32(np.asarray(i).mean() / 255 / 5).item() for i in images]}
                elif kind == "numpy":  # numpy scalars: plain data only is accepted
                    response = {"outputs": [np.float32(0.5) for _ in images]}
                elif kind == "object_array":  # an object-dtype array whose raw bytes would be read as pointers
                    response = {"outputs": np.array([0.5, 0.25], dtype=object)}
                elif kind == "crash":
                    raise RuntimeError("CUDA out of memory")
                else:  # a reply that would run code if unpickled naively
                    response = _Evil()
                response, code = pickle.dumps(response), 200
            except Exception:
                response, code = traceback.format_exc().encode("utf-8"), 500
            self.send_response(code)
            self.send_header("Content-Length", str(len(response)))
            self.end_headers()
            self.wfile.write(response)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()


class _Evil:
    def __reduce__(self):
        return (eval, ("1 + 1",))  # harmless here; os.system in a real attack


GENEVAL_META = [
    {"tag": "counting", "include": [{"class": "cat", "count": 2}]},
    {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]},
    {"tag": "counting", "include": [{"class": "dog", "count": 3}]},
]


def test_flowgrpo_protocol_talks_to_the_reference_geneval_server():
    images = torch.stack([torch.full((3, 32, 32), v) for v in (0.8, 0.2, 0.3)])
    prompts = ["a photo of two cats", "a photo of a red car", "a photo of three dogs"]
    with reference_server("geneval") as (url, state):
        spec = {
            "name": "remote",
            "protocol": "flowgrpo",
            "url": url,
            "trust_pickle": True,
            "key": "geneval",
            "batch_size": 2,
        }
        out = build_reward([spec])(images, prompts, GENEVAL_META)
        full = build_reward([{**spec, "only_strict": False}])(images[:1], prompts[:1], GENEVAL_META[:1])
    first, second = state["requests"][:2]
    assert [len(r["images"]) for r in state["requests"]] == [2, 1, 1]  # batch_size images per request
    assert first["only_strict"] is True and state["requests"][2]["only_strict"] is False
    assert first["meta_datas"][0] == {**GENEVAL_META[0], "prompt": prompts[0]} and first["prompts"] == prompts[:2]
    for request, offset in ((first, 0), (second, 2)):  # the bytes the reference client's img.save(b, "JPEG") makes
        for index, jpeg in enumerate(request["images"]):
            buffer = io.BytesIO()
            Image.fromarray(to_uint8_hwc(images[offset + index : offset + index + 1])[0]).save(buffer, format="JPEG")
            assert jpeg == buffer.getvalue()
    brightness = [
        float(np.asarray(Image.open(io.BytesIO(j)), dtype=np.float64).mean() / 255)
        for r in state["requests"][:2]
        for j in r["images"]
    ]
    assert torch.allclose(out["geneval"], torch.tensor(brightness))  # the partial score is the weighted one
    assert out["geneval/strict_accuracy"].tolist() == [1.0, 0.0, 0.0] and "geneval/accuracy" not in out
    counting, colors = out["geneval/counting_strict_accuracy"], out["geneval/colors_strict_accuracy"]
    assert counting[0] == 1.0 and counting[2] == 0.0 and torch.isnan(counting[1])  # -10: another tag -> NaN
    assert torch.isnan(colors[[0, 2]]).all() and colors[1] == 0.0
    assert torch.isnan(out["geneval/position_strict_accuracy"]).all()
    assert torch.equal(out["total"], out["geneval"])
    assert full["geneval/accuracy"].tolist() == [1.0] and full["geneval/counting_accuracy"].tolist() == [1.0]


def test_flowgrpo_protocol_deqa_reply():
    images = torch.stack([torch.full((3, 16, 16), v) for v in (0.5, 1.0)])
    with reference_server("deqa") as (url, state):
        remote = build_reward([{"name": "remote", "protocol": "flowgrpo", "url": url, "trust_pickle": True}])
        out = remote(images, ["a", "b"])
    assert out["remote"].tolist() == pytest.approx([128 / 255 / 5, 0.2], abs=1e-3)


def test_flowgrpo_protocol_errors_refusals_and_hostile_replies():
    with reference_server("crash") as (url, state):
        remote = build_reward(
            [{"name": "remote", "protocol": "flowgrpo", "url": url, "trust_pickle": True, "retries": 3, "backoff": 5}]
        )
        with pytest.raises(RewardError, match=r"HTTP 500: RuntimeError: CUDA out of memory"):
            remote(torch.rand(1, 3, 8, 8), ["a"])
    assert len(state["requests"]) == 1  # the traceback's last line shown, not retried
    with reference_server("evil") as (url, state):
        remote = build_reward([{"name": "remote", "protocol": "flowgrpo", "url": url, "trust_pickle": True}])
        with pytest.raises(RewardError, match=r"not a plain pickle.*builtins\.eval"):
            remote(torch.rand(1, 3, 8, 8), ["a"])
    for kind in ("numpy", "object_array"):  # numpy's classes take state find_class cannot check: none are built
        with reference_server(kind) as (url, state):
            remote = build_reward([{"name": "remote", "protocol": "flowgrpo", "url": url, "trust_pickle": True}])
            with pytest.raises(RewardError, match=r"not a plain pickle.*names numpy.*must be plain data"):
                remote(torch.rand(2, 3, 8, 8), ["a", "b"])
    # opt-in, loopback only by default
    with pytest.raises(ValueError, match=r"unpickling lets whoever answers there run code.*trust_pickle: true"):
        build_reward([{"name": "remote", "protocol": "flowgrpo", "url": "http://127.0.0.1:18085"}])
    for host in ("10.1.2.3", "reward-host", "0.0.0.0"):
        with pytest.raises(ValueError, match=r"loopback-only by default.*allow_non_loopback: true"):
            build_reward(
                [{"name": "remote", "protocol": "flowgrpo", "url": f"http://{host}:18085", "trust_pickle": True}]
            )
    build_reward(
        [
            {
                "name": "remote",
                "protocol": "flowgrpo",
                "url": "http://10.1.2.3:18085",
                "trust_pickle": True,
                "allow_non_loopback": True,
            }
        ]
    )
    for url in ("http://localhost:18085", "http://[::1]:18085", "http://127.0.0.2:18085"):
        build_reward([{"name": "remote", "protocol": "flowgrpo", "url": url, "trust_pickle": True}])
    with pytest.raises(ValueError, match="apply to protocol 'flowgrpo' only"):
        build_reward([{"name": "remote", "url": "http://127.0.0.1:1/score", "trust_pickle": True}])
    with pytest.raises(ValueError, match="protocol must be one of json, flowgrpo"):
        build_reward([{"name": "remote", "url": "http://127.0.0.1:1/score", "protocol": "pickle"}])


# ---------------------------------------------------------------------------- the server speaking Flow-GRPO's protocol
def _geneval_like(images, prompts, metadata=None):
    """Scores shaped as build_reward's geneval: a weighted total, strict and non-strict accuracies."""
    brightness = images.mean(dim=(1, 2, 3))
    return {
        "total": brightness,
        "geneval": brightness,
        "geneval/strict_accuracy": (brightness > 0.5).float(),
        "geneval/accuracy": (brightness > 0.25).float(),
    }


def _jpegs(images: torch.Tensor) -> list[bytes]:
    """JPEG bytes as Flow-GRPO's clients make them: img.save(buffer, format="JPEG")."""
    out = []
    for pixels in to_uint8_hwc(images):
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG")
        out.append(buffer.getvalue())
    return out


def _post_pickle(base_url: str, body: bytes) -> tuple[int, bytes]:
    """POST as Flow-GRPO's trainer does: raw bytes to the server's root."""
    request = urllib.request.Request(base_url, data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=20) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


PROMPTS3 = ["two cats", "a red car", "three dogs"]


def test_the_server_answers_flowgrpo_clients():
    images = torch.stack([torch.full((3, 32, 32), v) for v in (0.8, 0.3, 0.1)])
    seen = []

    def reward(images, prompts, metadata=None):
        seen.append((prompts, metadata))
        return _geneval_like(images, prompts, metadata)

    with serving(reward, flowgrpo_protocol=True) as url:
        base = url.removesuffix("/score")
        # Flow-GRPO's geneval_score: np.array_split of the metadata list, JPEGs, pickle.dumps (its default protocol)
        metadatas = [{**m, "prompt": p} for m, p in zip(GENEVAL_META, PROMPTS3, strict=True)]
        (batch,) = np.array_split(metadatas, 1)
        body = pickle.dumps({"images": _jpegs(images), "meta_datas": list(batch), "only_strict": True})
        status, data = _post_pickle(base, body)
        assert status == 200, data[:300]
        reply = load_reply_pickle(data, base)  # plain containers only: no class is named
        assert seen[-1][0] == ["two cats", "a red car", "three dogs"] and seen[-1][1][0]["tag"] == "counting"
        decoded = torch.stack([torch.from_numpy(np.array(Image.open(io.BytesIO(j)))) for j in _jpegs(images)])
        brightness = decoded.double().mean(dim=(1, 2, 3)) / 255
        assert reply["scores"] == pytest.approx(brightness.tolist(), abs=1e-6)
        assert reply["strict_rewards"] == [1.0, 0.0, 0.0] and reply["rewards"] == [0.0, 0.0, 0.0]  # only_strict
        assert reply["group_strict_rewards"]["counting"] == [1.0, -10.0, 0.0]
        assert reply["group_strict_rewards"]["colors"] == [-10.0, 0.0, -10.0]
        assert reply["group_rewards"]["position"] == [-10.0] * 3 and len(reply["group_rewards"]) == 6
        status, data = _post_pickle(
            base, pickle.dumps({"images": _jpegs(images), "meta_datas": list(batch), "only_strict": False})
        )
        assert load_reply_pickle(data, base)["rewards"] == [1.0, 1.0, 0.0]
        # our own client with protocol flowgrpo reads the same reply
        spec = {"name": "remote", "protocol": "flowgrpo", "url": base, "trust_pickle": True, "key": "geneval"}
        out = build_reward([spec])(images, ["two cats", "a red car", "three dogs"], GENEVAL_META)
        assert out["geneval/strict_accuracy"].tolist() == [1.0, 0.0, 0.0]
        counting = out["geneval/counting_strict_accuracy"]
        assert counting[0] == 1.0 and counting[2] == 0.0 and torch.isnan(counting[1])
        # the JSON protocol still answers on /score
        assert build_reward([{"name": "remote", "url": url}])(images, ["a", "b", "c"])["remote/geneval"].shape == (3,)
    # Flow-GRPO's deqa_score_remote sends images only; a reward without strict_accuracy answers "outputs"
    with serving(_zeros, flowgrpo_protocol=True) as url:
        status, data = _post_pickle(url.removesuffix("/score"), pickle.dumps({"images": _jpegs(images[:2])}))
        assert (status, load_reply_pickle(data, url)) == (200, {"outputs": [0.0, 0.0]})


MARKS: list[str] = []


def _mark(what: str) -> str:
    MARKS.append(what)
    return what


class _Marker:
    def __reduce__(self):
        return (_mark, ("unpickled",))  # os.system in a real attack


def test_the_servers_unpickler_allows_no_globals():
    jpeg = _jpegs(torch.rand(1, 3, 8, 8))
    hostile = {  # name: (pickled request, status, words of the error)
        "a callable": (pickle.dumps({"images": jpeg, "x": _Marker()}), 400, "_mark; a request must be plain data"),
        "numpy prompts": (pickle.dumps({"images": jpeg, "prompts": np.array(["a"])}), 400, "names numpy"),
        "a set": (pickle.dumps({"images": jpeg, "meta_datas": [{"tags": {1, 2}}]}), 400, "holds a set"),
        "bytes at protocol 2": (pickle.dumps({"images": jpeg}, protocol=2), 400, "names _codecs.encode"),
        "not a dict": (pickle.dumps([jpeg]), 400, "is a list, not a dict"),
        "not a pickle": (b"\x80\x04garbage", 400, "not a pickle"),
        "a million empty lists": (b"](" + b"]" * 2**20 + b"e.", 413, "more than 1048576 values"),
        "no images": (pickle.dumps({"meta_datas": []}), 400, "'images' must be a non-empty list of JPEG bytes"),
        "a png": (pickle.dumps({"images": [_png(8, 8)]}), 400, "not a JPEG"),
        "bad only_strict": (pickle.dumps({"images": jpeg, "only_strict": "yes"}), 400, "'only_strict' must be"),
        "short meta_datas": (pickle.dumps({"images": jpeg * 2, "meta_datas": [{}]}), 400, "list of 2 dicts"),
    }
    with serving(_zeros, flowgrpo_protocol=True) as url:
        port = int(url.split(":")[2].split("/")[0])
        for name, (body, status, words) in hostile.items():
            request = f"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
            got, text = _raw_http(port, request)
            assert (got, words in text) == (status, True), f"{name}: {got} {text[:300]}"
            assert "\n" not in text  # one line: Flow-GRPO clients show an error reply's last line
    with serving(_zeros) as url:  # not opted in: POST / is refused unread
        status, text = _raw_http(
            int(url.split(":")[2].split("/")[0]), _post(pickle.dumps(_Marker())).replace(b"/score", b"/")
        )
        assert status == 404 and "--flowgrpo-protocol" in text
    assert MARKS == []
