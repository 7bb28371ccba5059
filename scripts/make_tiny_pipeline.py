"""Save a tiny random-weight SD3 / FLUX / FLUX.1-Kontext / Qwen-Image(-Edit) / Wan pipeline as a diffusers directory.

    python scripts/make_tiny_pipeline.py OUT --kind sd3|flux|flux-kontext|qwenimage|qwenimage-edit|wan|... [--seed N]
                                         [--dtype fp32] [--vae kl|tiny]

The result opens with ``flowgrpo.pipelines.load_pipeline(OUT)`` or the diffusers class itself
(``StableDiffusion3Pipeline`` / ``FluxPipeline`` / ``FluxKontextPipeline`` / ``QwenImagePipeline`` /
``QwenImageEditPipeline`` / ``WanPipeline`` ``.from_pretrained(OUT)``) and gives
the same outputs as ``flowgrpo.tiny.build_tiny_pipeline(kind, seed)`` in memory.
"""

from __future__ import annotations

import argparse
import sys

from flowgrpo.pipelines import parse_dtype
from flowgrpo.tiny import TINY_KINDS, TINY_SIZES, build_tiny_pipeline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output directory (created; existing files are overwritten)")
    parser.add_argument("--kind", required=True, choices=TINY_KINDS)  # the registered families with a tiny build
    parser.add_argument("--seed", type=int, default=0, help="weight seed (same seed -> identical weights)")
    parser.add_argument("--dtype", default="fp32", help="bf16 | fp16 | fp32 (default fp32)")
    parser.add_argument(
        "--vae",
        default="kl",
        choices=["kl", "tiny"],
        help="kl: AutoencoderKL with the real scaling factors (qwenimage(-edit), wan: their own VAE, the only choice); "
        "tiny: normalisation-free (as -taesd)",
    )
    args = parser.parse_args(argv)

    try:
        pipe = build_tiny_pipeline(args.kind, seed=args.seed, dtype=parse_dtype(args.dtype), vae=args.vae)
    except ValueError as err:  # e.g. --vae tiny for qwenimage or wan, or an unknown dtype
        parser.error(str(err))
    pipe.save_pretrained(args.out, safe_serialization=True)
    sizes = ", ".join(f"{k}={v}" for k, v in TINY_SIZES.get(args.kind, {}).items())  # a family may list none
    print(f"saved tiny {args.kind} pipeline (seed {args.seed}) to {args.out}" + (f": {sizes}" if sizes else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
