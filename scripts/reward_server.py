"""Serve a reward over HTTP on 127.0.0.1, beside training (GenEval detectors, VLM judges, a reward on another GPU).

    python scripts/reward_server.py --reward ocr --port 8765
    python scripts/reward_server.py --reward ocr=1.0 --reward jpeg_compressibility=0.5 --device cuda:1
    python scripts/reward_server.py --spec '[{"name": "pickscore", "batch_size": 16}]' --port 0
    python scripts/reward_server.py --reward geneval --devices cuda:0,cuda:1 --flowgrpo-protocol --port 18085

Training side: ``rewards: [{name: remote, url: "http://127.0.0.1:8765/score"}]``. The server answers
with each reward's scores and their weighted ``total``. It prints ``listening on <url>`` once ready.

``--devices cuda:0,cuda:1`` (or a count, ``--devices 2``) builds the reward once per device, one worker each; a
request goes to the first free worker. ``--flowgrpo-protocol`` also accepts Flow-GRPO's own trainer's requests
(pickled, on ``POST /``), unpickled with no class or function allowed. Every client is bounded in time
(``--timeout``: the whole request, headers included), memory (``--max-request-mb`` per body,
``--memory-budget-mb`` for all bodies held at once) and connections (``--max-connections``); see
``rewards/remote.py`` and docs/rewards.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from rewards import build_reward, make_reward_server
from rewards.remote import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_PIXELS,
    DEFAULT_MAX_REQUEST_MB,
    DEFAULT_MEMORY_BUDGET_MB,
    DEFAULT_SERVER_TIMEOUT,
)


def parse_spec(rewards: list[str], spec: str | None) -> Any:
    """The rewards spec from ``--spec`` (JSON, or a .json / .yaml file) or the ``--reward`` items; ValueError if bad."""
    if spec:
        return _read_spec(spec)
    if not rewards:
        raise ValueError("give --reward NAME[=WEIGHT] (repeatable) or --spec JSON/YAML")
    out: dict[str, float] = {}
    for item in rewards:
        name, _, weight = item.partition("=")
        try:
            out[name] = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"--reward {item}: the weight after '=' must be a number") from None
    return out


def _read_spec(spec: str) -> Any:
    is_file = os.path.isfile(spec)
    if not is_file and spec.endswith((".json", ".yaml", ".yml")):
        raise ValueError(f"--spec file {spec} does not exist")
    where = f"--spec file {spec}" if is_file else "--spec"
    try:
        text = Path(spec).read_text(encoding="utf-8") if is_file else spec
        if spec.endswith((".yaml", ".yml")):
            import yaml

            return yaml.safe_load(text)
        return json.loads(text)
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{where} cannot be read ({err})") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
        raise ValueError(f"{where} is not valid JSON ({err}); give JSON, or a .json / .yaml file") from None
    except Exception as err:  # yaml.YAMLError
        raise ValueError(f"{where} is not valid YAML ({err})") from None


def parse_devices(devices: str | None, device: str | None) -> list[str]:
    """The workers' devices: ``--devices`` (a comma-separated list, or a count of CUDA devices) or ``--device``."""
    if devices is None:
        return [device or "cpu"]
    if device is not None:
        raise ValueError("give --device or --devices, not both (--devices cuda:0,cuda:1 makes one worker per device)")
    text = devices.strip()
    if text.isdigit():
        count = int(text)
        available = _cuda_count()
        if count < 1 or count > available:
            raise ValueError(
                f"--devices {text}: a count means cuda:0 .. cuda:{count - 1}, and this machine has {available} CUDA "
                "device(s); give a smaller count, or name the devices (e.g. --devices cpu,cpu)"
            )
        return [f"cuda:{i}" for i in range(count)]
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise ValueError(f"--devices {devices!r}: give a comma-separated list such as cuda:0,cuda:1, or a count")
    for name in names:
        try:
            torch.device(name)
        except RuntimeError:
            raise ValueError(f"--devices: {name!r} is not a device; use names such as cuda:0, cuda:1 or cpu") from None
    return names


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reward", action="append", default=[], help="NAME[=WEIGHT]; repeat to combine")
    parser.add_argument("--spec", help="a rewards spec as JSON, or a .json/.yaml file (as the config's rewards:)")
    parser.add_argument("--port", type=int, default=8765, help="0 picks a free port (printed)")
    parser.add_argument("--host", default="127.0.0.1", help="loopback only: 127.0.0.1 or localhost")
    parser.add_argument("--device", default=None, help="the reward's device (default cpu); see --devices")
    parser.add_argument(
        "--devices",
        help="one worker per device, each with its own reward: cuda:0,cuda:1 (or cpu,cpu), or a count of CUDA devices",
    )
    parser.add_argument(
        "--nan-policy",
        default="drop",
        choices=["error", "drop"],
        help="drop (default): send NaN scores back, the trainer's policy decides",
    )
    parser.add_argument(
        "--max-request-mb",
        type=float,
        default=DEFAULT_MAX_REQUEST_MB,
        help="largest request body, MiB (default %(default)g)",
    )
    parser.add_argument(
        "--max-pixels",
        type=int,
        default=DEFAULT_MAX_PIXELS,
        help="most pixels per request, all images together (default %(default)d)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_SERVER_TIMEOUT,
        help="seconds from connecting by which a client must have sent its whole request, headers included "
        "(default %(default)g)",
    )
    parser.add_argument(
        "--memory-budget-mb",
        type=float,
        default=None,
        help=f"MiB all request bodies being received or waiting for a worker may hold together (default: the larger "
        f"of {DEFAULT_MEMORY_BUDGET_MB:g} and --max-request-mb); over it a request is answered 503",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="connections served at once; more are answered 503 at once (default %(default)d)",
    )
    parser.add_argument(
        "--flowgrpo-protocol",
        action="store_true",
        help="also accept Flow-GRPO's pickled requests on POST / (no class or function is unpickled)",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    try:
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be in 0..65535; got {args.port}")
        devices = parse_devices(args.devices, args.device)
        spec = parse_spec(args.reward, args.spec)
        rewards = [build_reward(spec, device=device, nan_policy=args.nan_policy) for device in devices]
    except (ValueError, OSError) as err:  # a bad spec, or a reward that cannot be built (e.g. weights not found)
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        server = make_reward_server(
            rewards,
            port=args.port,
            host=args.host,
            max_request_mb=args.max_request_mb,
            max_pixels=args.max_pixels,
            timeout=args.timeout,
            memory_budget_mb=args.memory_budget_mb,
            max_connections=args.max_connections,
            flowgrpo_protocol=args.flowgrpo_protocol,
        )
    except ValueError as err:  # a host that is not loopback, a limit that is not positive
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the port is taken, or the host cannot be bound
        print(f"error: cannot listen on {args.host}:{args.port} ({err.strerror or err})", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    # SIGTERM -> clean shutdown (shutdown() must be called from another thread than serve_forever's).
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    flowgrpo = f"  flowgrpo=http://{host}:{port}/" if args.flowgrpo_protocol else ""
    workers = ",".join(devices)
    print(f"listening on http://{host}:{port}/score{flowgrpo}  workers={workers}  reward={rewards[0]!r}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
