"""Pretrain the shapes model (``flowgrpo.shapes_model``): its autoencoder, then its transformer with the
rectified-flow loss, on the CPU, from a seed.

    python scripts/pretrain_shapes.py     # work in runs/pretrain-shapes/, result in flowgrpo/assets/shapes-sd3
    python scripts/pretrain_shapes.py --vae-steps 100 --steps 200 --work /tmp/p --out /tmp/model   # a short try

Stage 1 (``--vae-steps``): the autoencoder learns to reconstruct freshly rendered train scenes (MSE on pixels),
decoding its latents plus Gaussian noise (std ``--vae-latent-noise``) so that the decoder forgives small errors in
generated latents, with a small L2 pull on the latents that keeps them in TAESD's clamp range. Its latents' mean and
std over fresh scenes become the ``shift_factor`` / ``scaling_factor``, and the verifier scores its reconstructions
(``<work>/vae/``, ``pretraining.json``). Stage 2: each step renders a fresh batch of train-split scenes
(``flowgrpo.shapes``; test prompts are never seen), encodes them, draws t from a logit-normal (SD3's), and regresses
the transformer's velocity on ``eps - x0``; the two CLIP text encoders train with it. 10% of captions are dropped to
"" so classifier-free guidance works. AdamW with linear warm-up and cosine decay; an EMA of the weights (0.999,
warmed up as ``min(0.999, (1 + step) / (10 + step))``) is what gets shipped.

Everything a step draws comes from ``(seed, step)``, so a run interrupted and resumed from its last checkpoint
(``<work>/vae-checkpoint/`` in stage 1, ``<work>/checkpoint/`` in stage 2, written atomically every
``--checkpoint-every`` steps; rerun the same command) ends with the same weights as an uninterrupted one, on the
same CPU kind and thread count. Every ``--eval-every`` steps the EMA model samples the held-out prompts (ODE, fixed
noise) and the shapes verifier scores them: ``<work>/eval.jsonl`` records accuracy against wall-clock time.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderTiny
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowgrpo.shapes import balanced_prompts, render, sample_scene, split  # noqa: E402
from flowgrpo.shapes_model import (  # noqa: E402
    LATENT_CHANNELS,
    LATENT_SIZE,
    SHAPES_MODEL_DIR,
    TEXT_LENGTH,
    build_shapes_pipeline,
    pixels_to_latents,
    render_scenes,
    shapes_vae,
)
from rewards.shapes import TAGS, ShapesReward  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4500, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--caption-dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (results depend on it in the last bits)")
    p.add_argument("--work", type=Path, default=Path("runs/pretrain-shapes"), help="checkpoint and logs")
    p.add_argument("--out", type=Path, default=SHAPES_MODEL_DIR, help="where the final pipeline is written")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=750)
    p.add_argument("--eval-per-tag", type=int, default=16, help="held-out prompts per tag at each evaluation")
    p.add_argument("--guidance-scale", type=float, default=4.5, help="CFG scale of the evaluations")
    p.add_argument("--eval-steps", type=int, default=20)
    p.add_argument("--vae-steps", type=int, default=1500, help="autoencoder optimizer steps (stage 1)")
    p.add_argument("--vae-batch-size", type=int, default=64)
    p.add_argument("--vae-lr", type=float, default=2e-3)
    p.add_argument("--vae-latent-noise", type=float, default=0.1, help="std of the noise added to latents in training")
    args = p.parse_args(argv)
    positive = (
        "steps",
        "batch_size",
        "vae_steps",
        "vae_batch_size",
        "warmup",
        "threads",
        "checkpoint_every",
        "eval_every",
        "eval_per_tag",
    )
    for name in positive:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.ema < 1 or not 0 <= args.caption_dropout < 1 or not args.lr > 0 or not args.vae_lr > 0:
        p.error("--ema and --caption-dropout must lie in [0, 1), --lr and --vae-lr must be > 0")
    if args.vae_latent_noise < 0:
        p.error("--vae-latent-noise must be >= 0")
    return args


def training_batch(
    by_tag: dict[str, list], rng: np.random.Generator, size: int, dropout: float
) -> tuple[torch.Tensor, list[str]]:
    """(pixels [B, 3, 32, 32] in [0, 1], prompts): tags drawn uniformly, then a train prompt of the tag, then a
    layout."""
    images, prompts = [], []
    for _ in range(size):
        pool = by_tag[TAGS[int(rng.integers(len(TAGS)))]]
        spec = pool[int(rng.integers(len(pool)))]
        images.append(render(sample_scene(spec, rng)))
        prompts.append("" if rng.random() < dropout else spec.prompt)
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2), prompts


def learning_rate(step: int, steps: int, lr: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to ``floor x lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def trainable(pipe) -> dict[str, torch.nn.Module]:
    return {"transformer": pipe.transformer, "text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2}


def flat_state(modules: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    return {
        f"{m}.{k}": v.detach().clone().contiguous() for m, mod in modules.items() for k, v in mod.state_dict().items()
    }


def load_flat_state(modules: dict[str, torch.nn.Module], state: dict[str, torch.Tensor]) -> None:
    for m, mod in modules.items():
        mod.load_state_dict({k[len(m) + 1 :]: v for k, v in state.items() if k.startswith(m + ".")})


def save_checkpoint(
    final: Path,
    step: int,
    modules: dict[str, torch.nn.Module],
    ema: dict[str, torch.Tensor] | None,
    optimizer,
    elapsed: float,
) -> None:
    """``final``: weights, EMA, optimizer (plain tensors: loads with weights_only), step; written atomically."""
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(flat_state(modules), tmp / "model.safetensors")
    if ema is not None:
        save_file(ema, tmp / "ema.safetensors")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, "elapsed_s": elapsed}))
    old = final.with_name(final.name + ".old")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


@torch.no_grad()
def evaluate(pipe, ema: dict[str, torch.Tensor], specs: list, args: argparse.Namespace) -> dict[str, float]:
    """Held-out accuracy of the EMA weights: ODE sampling with CFG, noise fixed per prompt index."""
    scored = copy.deepcopy(pipe)
    load_flat_state(trainable(scored), ema)
    prompts = [s.prompt for s in specs]
    generator = torch.Generator().manual_seed(12345)
    latents = torch.randn(len(prompts), LATENT_CHANNELS, LATENT_SIZE, LATENT_SIZE, generator=generator)
    images = []
    for i in range(0, len(prompts), 64):
        images.append(
            scored(
                prompts[i : i + 64],
                latents=latents[i : i + 64],
                num_inference_steps=args.eval_steps,
                guidance_scale=args.guidance_scale,
                max_sequence_length=TEXT_LENGTH,
                output_type="pt",
            ).images
        )
    scores = ShapesReward()(torch.cat(images), prompts)
    result = {
        "exact": scores["accuracy/exact"].mean().item(),
        "color_count": scores["accuracy/color_count"].mean().item(),
        "partial": scores["total"].mean().item(),
    }
    for tag in TAGS:
        mask = torch.tensor([s.tag == tag for s in specs])
        result[f"exact/{tag}"] = scores["accuracy/exact"][mask].mean().item()
    return result


class StageMismatch(RuntimeError):
    """The work directory holds another run's stage output (other arguments, or another autoencoder)."""


def vae_arguments(args: argparse.Namespace) -> dict:
    """What stage 1's result depends on: a finished autoencoder is reused only under the same values."""
    return {
        "seed": args.seed,
        "vae_steps": args.vae_steps,
        "vae_batch_size": args.vae_batch_size,
        "vae_lr": args.vae_lr,
        "vae_latent_noise": args.vae_latent_noise,
    }


def train_vae(
    args: argparse.Namespace, by_tag: dict[str, list], stop_after: int | None
) -> tuple[AutoencoderTiny | None, dict]:
    """Stage 1: the autoencoder (``<work>/vae/`` once done, then reused). None when stopped early (``stop_after``)."""
    done_dir = args.work / "vae"
    if (done_dir / "record.json").is_file():
        record = json.loads((done_dir / "record.json").read_text())
        if record.get("arguments") != vae_arguments(args):
            raise StageMismatch(
                f"{done_dir} was trained with {record.get('arguments')}, not {vae_arguments(args)}: pass the same "
                "arguments, or another --work directory (or delete it to start over)"
            )
        return AutoencoderTiny.from_pretrained(done_dir).eval(), record
    if (args.work / "checkpoint" / "state.json").is_file():
        raise StageMismatch(
            f"{args.work} holds a transformer checkpoint but no finished autoencoder ({done_dir}): the transformer "
            "was trained on another autoencoder's latents. Use another --work directory (or delete this one)"
        )
    vae = shapes_vae(args.seed)
    modules = {"vae": vae}
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    checkpoint = args.work / "vae-checkpoint"
    start, elapsed = _resume(checkpoint, modules, optimizer)
    vae.train()
    t0 = time.time() - elapsed
    end = args.vae_steps if stop_after is None else min(stop_after, args.vae_steps)
    bar = tqdm(range(start, end), initial=start, total=args.vae_steps, desc="autoencoder", dynamic_ncols=True)
    for step in bar:
        rng = np.random.default_rng([args.seed, step, 1])  # not the transformer stage's scenes
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step + 500_000_000)
        pixels = training_batch(by_tag, rng, args.vae_batch_size, 0.0)[0] * 2 - 1
        latents = vae.encoder(pixels)
        noise = torch.randn(latents.shape, generator=generator)
        reconstruction = vae.decoder(latents + args.vae_latent_noise * noise)
        mse = torch.nn.functional.mse_loss(reconstruction, pixels)
        loss = mse + 1e-3 * latents.square().mean()  # keeps latents well inside the decoder's 3 tanh(x/3) clamp
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.vae_steps, args.vae_lr, warmup=50, floor=0.05)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        bar.set_postfix(mse=f"{mse.item():.5f}")
        done = step + 1
        if done % args.checkpoint_every == 0 or done == args.vae_steps:
            save_checkpoint(checkpoint, done, modules, None, optimizer, time.time() - t0)
    if end < args.vae_steps:
        return None, {}
    vae.eval()
    with torch.no_grad():
        rng = np.random.default_rng([args.seed, 2**31])
        specs = [s for tag in TAGS for s in by_tag[tag]]
        specs = [specs[int(i)] for i in rng.integers(len(specs), size=512)]
        pixels = render_scenes(specs, rng)
        latents = vae.encode(pixels * 2 - 1).latents
        vae.register_to_config(shift_factor=latents.mean().item(), scaling_factor=1 / latents.std().item())
        decoded = ((vae.decode(latents).sample + 1) / 2).clamp(0, 1)
        scores = ShapesReward()(decoded, [s.prompt for s in specs])
    record = {
        "arguments": vae_arguments(args),
        "minutes": (time.time() - t0) / 60,
        "reconstruction_mse": (decoded - pixels).square().mean().item(),  # of 512 fresh scenes, in [0, 1]
        "reconstruction_exact": scores["accuracy/exact"].mean().item(),
        "shift_factor": vae.config.shift_factor,
        "scaling_factor": vae.config.scaling_factor,
    }
    tqdm.write(f"autoencoder: verifier exact on 512 reconstructions {record['reconstruction_exact']:.3f}")
    tmp = args.work / "vae.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    vae.save_pretrained(tmp, safe_serialization=True)
    (tmp / "record.json").write_text(json.dumps(record, indent=2))  # written last: it marks the stage done
    shutil.rmtree(done_dir, ignore_errors=True)  # an incomplete one, from an interruption before record.json
    tmp.rename(done_dir)
    return vae, record


def _resume(checkpoint: Path, modules: dict[str, torch.nn.Module], optimizer) -> tuple[int, float]:
    """Load ``checkpoint``'s weights and optimizer into place; (step, elapsed seconds), (0, 0) without one."""
    if not (checkpoint / "state.json").is_file():
        return 0, 0.0
    state = json.loads((checkpoint / "state.json").read_text())
    load_flat_state(modules, load_file(checkpoint / "model.safetensors"))
    optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt", weights_only=True))
    print(f"resuming from {checkpoint} at step {state['step']}")
    return state["step"], state["elapsed_s"]


def export(pipe, ema: dict[str, torch.Tensor], out: Path, args: argparse.Namespace, log: dict) -> None:
    final = copy.deepcopy(pipe)
    load_flat_state(trainable(final), ema)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    final.save_pretrained(tmp, safe_serialization=True)
    record = {
        "command": "python scripts/pretrain_shapes.py " + " ".join(sys.argv[1:]),
        "args": {k: str(v) for k, v in vars(args).items()},
        **log,
    }
    (tmp / "pretraining.json").write_text(json.dumps(record, indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def main(argv: list[str] | None = None, *, stop_after: int | None = None) -> int:
    """``stop_after``: end after that step's checkpoint without exporting, as an interruption would (tests); steps
    count the autoencoder's first, then the transformer's."""
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _pretrain(args, stop_after)
    except StageMismatch as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)


def _pretrain(args: argparse.Namespace, stop_after: int | None) -> int:
    args.work.mkdir(parents=True, exist_ok=True)
    train_specs, test_specs = split()
    train_by_tag = {tag: [s for s in train_specs if s.tag == tag] for tag in TAGS}  # grouped once, not per step
    eval_specs = balanced_prompts(test_specs, args.eval_per_tag, seed=args.seed)
    vae, vae_record = train_vae(args, train_by_tag, stop_after)
    if vae is None:
        return 0
    if stop_after is not None:
        stop_after -= args.vae_steps
    pipe = build_shapes_pipeline(args.seed, vae)
    modules = trainable(pipe)
    params = [p for m in modules.values() for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.01)
    ema = flat_state(modules)
    checkpoint = args.work / "checkpoint"
    start, elapsed = _resume(checkpoint, modules, optimizer)
    if start:
        ema = load_file(checkpoint / "ema.safetensors")
    for m in modules.values():
        m.train()
    ema_keys = [k for k in ema if ema[k].is_floating_point()]
    log_file = args.work / "eval.jsonl"
    if log_file.is_file():  # rows written after the checkpoint we resume from are redone
        rows = [line for line in log_file.read_text().splitlines() if json.loads(line)["step"] <= start]
        log_file.write_text("".join(row + "\n" for row in rows))
    t0 = time.time() - elapsed
    end = args.steps if stop_after is None else min(stop_after, args.steps)
    bar = tqdm(range(start, end), initial=start, total=args.steps, desc="pretraining", dynamic_ncols=True)
    for step in bar:
        rng = np.random.default_rng([args.seed, step])
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        pixels, prompts = training_batch(train_by_tag, rng, args.batch_size, args.caption_dropout)
        with torch.no_grad():
            x0 = pixels_to_latents(vae, pixels)
        t = torch.sigmoid(torch.randn(args.batch_size, generator=generator))  # logit-normal(0, 1)
        noise = torch.randn(x0.shape, generator=generator)
        xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * noise
        embeds, _, pooled, _ = pipe.encode_prompt(
            prompts, None, None, do_classifier_free_guidance=False, max_sequence_length=TEXT_LENGTH
        )
        v = pipe.transformer(
            hidden_states=xt,
            timestep=t * 1000,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        loss = torch.nn.functional.mse_loss(v, noise - x0)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        with torch.no_grad():
            current = {f"{m}.{k}": v for m, mod in modules.items() for k, v in mod.state_dict().items()}
            decay = min(args.ema, (1 + step) / (10 + step))  # warm-up: the random init fades out quickly
            for k in ema_keys:
                ema[k].lerp_(current[k], 1 - decay)
        bar.set_postfix(loss=f"{loss.item():.4f}")
        done = step + 1
        if done % args.eval_every == 0 or done == args.steps:
            for m in modules.values():
                m.eval()
            result = evaluate(pipe, ema, eval_specs, args)
            for m in modules.values():
                m.train()
            row = {"step": done, "minutes": (time.time() - t0) / 60, "loss": loss.item(), **result}
            with log_file.open("a") as f:
                f.write(json.dumps(row) + "\n")
            tqdm.write(
                f"step {done} ({row['minutes']:.1f} min): held-out exact {result['exact']:.3f} "
                f"colour+count {result['color_count']:.3f} partial {result['partial']:.3f}"
            )
        if done % args.checkpoint_every == 0 or done == args.steps:
            save_checkpoint(checkpoint, done, modules, ema, optimizer, time.time() - t0)
    if end < args.steps:
        return 0
    for m in modules.values():
        m.eval()
    rows = [json.loads(line) for line in log_file.read_text().splitlines()] if log_file.is_file() else []
    export(pipe, ema, args.out, args, {"minutes": (time.time() - t0) / 60, "autoencoder": vae_record, "eval": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
