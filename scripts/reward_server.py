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


def parse_spec(rewards: list[str], spec: str | None) -> Any:
    if spec:
        text = Path(spec).read_text() if os.path.isfile(spec) else spec
        if spec.endswith((".yaml", ".yml")):
            import yaml

            return yaml.safe_load(text)
        return json.loads(text)
    if not rewards:
        raise SystemExit("give --reward NAME[=WEIGHT] (repeatable) or --spec JSON/YAML")
    out: dict[str, float] = {}
    for item in rewards:
        name, _, weight = item.partition("=")
        out[name] = float(weight) if weight else 1.0
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reward", action="append", default=[], help="NAME[=WEIGHT]; repeat to combine")
    parser.add_argument("--spec", help="a rewards spec as JSON, or a .json/.yaml file (as the config's rewards:)")
    parser.add_argument("--port", type=int, default=8765, help="0 picks a free port (printed)")
    parser.add_argument("--host", default="127.0.0.1", help="loopback only: 127.0.0.1 or localhost")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--nan-policy", default="drop", choices=["error", "drop"],
                        help="drop (default): send NaN scores back, the trainer's policy decides")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    reward = build_reward(parse_spec(args.reward, args.spec), device=args.device, nan_policy=args.nan_policy)
    server = make_reward_server(reward, port=args.port, host=args.host)
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
