"""Serve a reward over HTTP on 127.0.0.1, beside training (GenEval detectors, VLM judges, a reward on another GPU).

    python scripts/reward_server.py --reward ocr --port 8765
    python scripts/reward_server.py --reward ocr=1.0 --reward jpeg_compressibility=0.5 --device cuda:1
    python scripts/reward_server.py --spec '[{"name": "pickscore", "batch_size": 16}]' --port 0

Training side: ``rewards: [{name: remote, url: "http://127.0.0.1:8765/score"}]``. The server answers
with each reward's scores and their weighted ``total``. It prints ``listening on <url>`` once ready.
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

from rewards import build_reward, make_reward_server
from rewards.remote import DEFAULT_MAX_PIXELS, DEFAULT_MAX_REQUEST_MB, DEFAULT_SERVER_TIMEOUT


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reward", action="append", default=[], help="NAME[=WEIGHT]; repeat to combine")
    parser.add_argument("--spec", help="a rewards spec as JSON, or a .json/.yaml file (as the config's rewards:)")
    parser.add_argument("--port", type=int, default=8765, help="0 picks a free port (printed)")
    parser.add_argument("--host", default="127.0.0.1", help="loopback only: 127.0.0.1 or localhost")
    parser.add_argument("--device", default="cpu")
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
        help="seconds a client may take to send a request (default %(default)g)",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    try:
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be in 0..65535; got {args.port}")
        reward = build_reward(parse_spec(args.reward, args.spec), device=args.device, nan_policy=args.nan_policy)
    except (ValueError, OSError) as err:  # a bad spec, or a reward that cannot be built (e.g. weights not found)
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        server = make_reward_server(
            reward,
            port=args.port,
            host=args.host,
            max_request_mb=args.max_request_mb,
            max_pixels=args.max_pixels,
            timeout=args.timeout,
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
    print(f"listening on http://{host}:{port}/score  reward={reward!r}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
