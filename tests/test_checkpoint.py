"""Checkpoints: exact resume, atomic writes, SIGTERM, non-finite losses, export to plain diffusers, scripts."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from script_helper import load_script
from signal_helper import sigterm_after_epochs

import flowgrpo.checkpoint.save as save_module
import flowgrpo.objectives.clipped as clipped_module
import flowgrpo.rollouts.chain as chain_module
import flowgrpo.trainer as trainer_module
from flowgrpo.checkpoint import CheckpointError, CheckpointParts, list_checkpoints, read_rng_state, save_checkpoint
from flowgrpo.config import load_config
from flowgrpo.trainer import GRPOTrainer, StopRequest, TrainingError

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny_sd3.yaml"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _trainer(tmp_path, *overrides):
    return GRPOTrainer(
        load_config(TINY, [f"run.output_dir={tmp_path}", "run.progress=false", "eval.every=0", *overrides])
    )


def _parts(trainer: GRPOTrainer) -> CheckpointParts:
    """What the trainer hands save_checkpoint / load_checkpoint."""
    return CheckpointParts(
        accelerator=trainer.accelerator,
        transformer=trainer.adapter.transformer,
        params=trainer.params,
        optimizer=trainer.optimizer,
        ema=trainer.ema,
        state=trainer.state,
        config=trainer.config,
        run_dir=trainer.run_dir,
        family=trainer.adapter.family,
    )


NFT_SOFT = ["grpo.objective=nft", "sampler.noise_level=0", "grpo.nft.old_decay_rate=0.2", "grpo.nft.old_decay_max=0.6"]
LAGGED = ["grpo.objective=lagged", "grpo.lagged.old_decay_rate=0.2", "grpo.lagged.old_decay_max=0.6"]


@pytest.mark.parametrize(
    "objective",
    [[], ["grpo.objective=awm", "sampler.noise_level=0", "grpo.kl.beta=0.1"], NFT_SOFT, LAGGED],
    ids=["clipped", "awm", "nft_soft_update", "lagged"],
)
def test_resumed_run_ends_with_the_same_weights_as_an_uninterrupted_one(tmp_path, objective):
    # Several rollout batches per epoch: the text embeddings must not depend on which prompts an earlier epoch
    # encoded together (a batch's composition moves them by ~1e-7). awm: its noise levels and noise are drawn anew
    # every epoch, from (seed, epoch), so a resumed run draws the same ones.
    common = ["train.ema=0.5", "checkpoint.every=1", "checkpoint.keep_last=2", "sampler.batch_size=4", *objective]
    full = _trainer(tmp_path / "a", "run.epochs=4", *common)
    full.fit()
    part = _trainer(tmp_path / "b", "run.epochs=2", *common)
    part.fit()
    resumed = _trainer(tmp_path / "b", "run.epochs=4", f"run.resume={part.run_dir}", *common)
    assert resumed.run_dir == part.run_dir and resumed.state.epoch == 2
    resumed.fit()
    a, b = list_checkpoints(full.run_dir)[-1], list_checkpoints(part.run_dir)[-1]
    assert a.name == b.name == "epoch-00004"
    # nft's soft update and lagged's: the old weights carried from epoch to epoch (they sample the next epoch) resume
    carried = ["old_weights.safetensors"] if objective in (NFT_SOFT, LAGGED) else []
    assert (a / "old_weights.safetensors").is_file() == bool(carried)
    for name in ("adapter.safetensors", "ema.safetensors", *carried):
        wa, wb = load_file(str(a / name)), load_file(str(b / name))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), name
    assert json.loads((a / "state.json").read_text())["global_step"] == resumed.state.global_step
    assert [p.name for p in list_checkpoints(part.run_dir)] == ["epoch-00003", "epoch-00004"]  # keep_last=2
    rows = [json.loads(line) for line in (part.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3]  # the resumed run appends to the same log


def test_the_lr_schedule_follows_the_optimizer_steps_and_a_resume_continues_it(tmp_path):
    # Two passes per epoch: the steps per epoch (the schedule's length) count both.
    common = [
        "run.epochs=3",
        "checkpoint.every=1",
        "checkpoint.keep_last=3",
        "train.lr=1e-3",
        "train.inner_epochs=2",
        "train.lr_schedule=cosine",
        "train.lr_warmup_steps=1",
    ]
    full = _trainer(tmp_path / "a", *common)
    full.fit()
    rows = [json.loads(line) for line in (full.run_dir / "metrics.jsonl").read_text().splitlines()]
    per_epoch = rows[0]["global_step"]
    total = 3 * per_epoch
    assert per_epoch >= 4 and [r["global_step"] for r in rows] == [per_epoch, 2 * per_epoch, total]

    def cosine(step):  # diffusers' cosine with warmup, by hand: warmup 1 step from 0, then half a cosine to 0
        return step / 1 if step < 1 else 0.5 * (1 + math.cos(math.pi * (step - 1) / (total - 1)))

    # train/lr is the lr of the epoch's last optimizer step, taken after (e + 1) · per_epoch - 1 steps.
    assert [r["train/lr"] for r in rows] == pytest.approx(
        [1e-3 * cosine((e + 1) * per_epoch - 1) for e in range(3)], rel=1e-12
    )
    # Interrupted after epoch 1 and resumed: the schedule continues from the step count, so the run ends equal.
    copy = tmp_path / "b" / full.run_dir.name
    shutil.copytree(full.run_dir, copy)
    for name in ("epoch-00002", "epoch-00003"):
        shutil.rmtree(copy / "checkpoints" / name)
    (copy / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    resumed = _trainer(tmp_path / "b", *common, f"run.resume={copy / 'checkpoints' / 'epoch-00001'}")
    resumed.fit()
    again = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/lr"] for r in again] == [r["train/lr"] for r in rows]
    a, b = (load_file(str(run / "checkpoints" / "epoch-00003" / "adapter.safetensors")) for run in (full.run_dir, copy))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("objective", [[], NFT_SOFT, LAGGED], ids=["clipped", "nft_soft_update", "lagged"])
def test_a_stop_during_sampling_abandons_the_epoch_and_the_resume_redoes_it_exactly(tmp_path, monkeypatch, objective):
    # A launcher kills its workers soon after forwarding a signal, so processes check for a stop after every
    # rollout batch too, not only after updates. nft's (and lagged's) soft update mixed the old weights the abandoned
    # rollout sampled with: the resume must mix the same ones again, not mix twice.
    common = ["train.ema=0.5", "sampler.batch_size=4", *objective]  # 4 rollout batches per epoch
    full = _trainer(tmp_path / "a", "run.epochs=2", *common)
    full.fit()
    real_rollout, calls = chain_module.rollout, {"n": 0}

    def signalled_rollout(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:  # epoch 1 starts: what the checkpoint must store, though sampling draws from it
            calls["rng"] = torch.get_rng_state()
        torch.rand(1)
        if calls["n"] == 6:  # epoch 1, second rollout batch
            part.stop.on_signal(signal.SIGTERM)
        return real_rollout(*args, **kwargs)

    monkeypatch.setattr(chain_module, "rollout", signalled_rollout)
    part = _trainer(tmp_path / "b", "run.epochs=2", *common)
    part.fit()
    assert calls["n"] == 6  # no further rollout, no training in epoch 1
    (checkpoint,) = list_checkpoints(part.run_dir)
    state = json.loads((checkpoint / "state.json").read_text())
    assert checkpoint.name == "epoch-00001" and state["epoch"] == 1 and state["global_step"] == 2
    assert torch.equal(read_rng_state(checkpoint, 0)["torch"], calls["rng"])
    monkeypatch.setattr(chain_module, "rollout", real_rollout)
    resumed = _trainer(tmp_path / "b", "run.epochs=2", f"run.resume={part.run_dir}", *common)
    resumed.fit()
    a, b = list_checkpoints(full.run_dir)[-1], list_checkpoints(part.run_dir)[-1]
    assert a.name == b.name == "epoch-00002"
    carried = ["old_weights.safetensors"] if objective in (NFT_SOFT, LAGGED) else []
    for name in ("adapter.safetensors", "ema.safetensors", *carried):
        wa, wb = load_file(str(a / name)), load_file(str(b / name))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), name
    rows = [json.loads(line) for line in (part.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1]


def test_a_signal_during_a_checkpoint_stops_before_the_next_epoch_samples(tmp_path, monkeypatch):
    real_save, real_rollout, calls = trainer_module.save_checkpoint, chain_module.rollout, {"rollouts": 0}

    def signalled_save(parts, *args, **kwargs):
        trainer.stop.on_signal(signal.SIGTERM)
        return real_save(parts, *args, **kwargs)

    def counted_rollout(*args, **kwargs):
        calls["rollouts"] += 1
        return real_rollout(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "save_checkpoint", signalled_save)
    monkeypatch.setattr(chain_module, "rollout", counted_rollout)
    trainer = _trainer(tmp_path, "run.epochs=5", "checkpoint.every=1")
    trainer.fit()
    assert calls["rollouts"] == 2  # epoch 0 only (2 rollout batches); that checkpoint is not written again
    assert [p.name for p in list_checkpoints(trainer.run_dir)] == ["epoch-00001"]


def test_a_stop_during_training_skips_that_epochs_evaluation(tmp_path, monkeypatch):
    real_loss, calls = clipped_module.grpo_loss, {"n": 0}

    def signalled_loss(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 10:  # the last backward of epoch 0
            trainer.stop.on_signal(signal.SIGTERM)
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(clipped_module, "grpo_loss", signalled_loss)
    trainer = _trainer(tmp_path, "run.epochs=3", "eval.every=1")
    trainer.fit()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert ["eval/total" in r for r in rows] == [True, False]  # the evaluation before training, then epoch 0
    assert [p.name for p in list_checkpoints(trainer.run_dir)] == ["epoch-00001"]


def test_resuming_an_older_checkpoint_sets_the_later_output_aside(tmp_path):
    common = [
        "checkpoint.every=1",
        "checkpoint.keep_last=5",
        "eval.every=1",
        "run.image_grid_every=1",
        "run.trackers=[tensorboard]",
    ]
    first = _trainer(tmp_path, "run.epochs=3", *common)
    first.fit()
    run = first.run_dir
    (run / "eval" / "epoch00002.json.bak").write_text("{}")
    resumed = _trainer(tmp_path, "run.epochs=3", f"run.resume={run}/checkpoints/epoch-00001", *common)
    (aside,) = (run / "superseded").iterdir()
    assert aside.name.startswith("after-epoch-00001-")
    files = sorted(str(p.relative_to(aside)) for p in aside.rglob("*") if p.is_file() and "checkpoints" not in p.parts)
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["epoch-00002", "epoch-00003"]
    assert files == [
        "eval/epoch00002.json",
        "eval/epoch00002.png",
        "eval/epoch00003.json",
        "eval/epoch00003.png",
        "metrics.jsonl",
        "samples/epoch00001.png",
        "samples/epoch00002.png",
    ]
    assert [json.loads(r)["epoch"] for r in (aside / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert [p.name for p in list_checkpoints(run)] == ["epoch-00001"]  # `latest` now means this run
    assert (run / "eval" / "epoch00002.json.bak").is_file()  # not a report of ours: left where it was
    with pytest.raises(CheckpointError, match="superseded/ folder"):
        _trainer(tmp_path, f"run.resume={aside}/checkpoints/epoch-00003")
    resumed.fit()
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 0, 1, 2]  # the evaluation before training, then each epoch once
    assert [p.name for p in list_checkpoints(run)] == ["epoch-00001", "epoch-00002", "epoch-00003"]
    # TensorBoard drops the first attempt's points from the resumed epoch on (purge_step): each epoch once.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = run / "tiny-sd3"  # accelerate's tracker folder: the run name (hparams go to subfolders)
    assert len(list(events.glob("events.out.tfevents.*"))) == 2  # one file per attempt
    board = EventAccumulator(str(events))
    board.Reload()
    points = board.Scalars("reward/total/mean")
    assert [e.step for e in points] == [0, 1, 2]
    assert [e.value for e in points] == pytest.approx([r["reward/total/mean"] for r in rows[1:]])
    again, before = (load_file(str(d / "checkpoints" / "epoch-00003" / "adapter.safetensors")) for d in (run, aside))
    assert all(torch.equal(again[k], before[k]) for k in before)  # and the resume was exact


def test_failed_checkpoint_write_leaves_the_previous_one_intact(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, "run.epochs=1", "checkpoint.every=1")
    trainer.fit()
    (good,) = list_checkpoints(trainer.run_dir)
    before = {p.name: p.read_bytes() for p in good.iterdir()}

    def broken_save(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(save_module, "save_file", broken_save)
    with pytest.raises(CheckpointError, match=r"cannot write .*epoch-00001/adapter.safetensors: disk full"):
        save_checkpoint(_parts(trainer), 1)  # overwriting the same epoch must not destroy it
    with pytest.raises(CheckpointError, match=r"cannot write .*epoch-00002/adapter.safetensors: disk full"):
        save_checkpoint(_parts(trainer), 2)
    assert list_checkpoints(trainer.run_dir) == [good]
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    assert [p.name for p in (trainer.run_dir / "checkpoints").iterdir()] == [good.name]  # no temporary left


def test_nonfinite_losses_are_skipped_then_stop_with_a_clear_message(tmp_path, monkeypatch):
    real_loss = clipped_module.grpo_loss
    calls = {"n": 0}

    def sometimes_nan(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan"), stats) if calls["n"] == 2 else (loss, stats)

    monkeypatch.setattr(clipped_module, "grpo_loss", sometimes_nan)
    trainer = _trainer(tmp_path, "run.epochs=1")
    before = [p.detach().clone() for p in trainer.params]
    trainer.fit()
    assert calls["n"] == 10 and trainer.state.nonfinite_in_a_row == 0  # reset by the next finite step
    assert all(torch.isfinite(p).all() for p in trainer.params)
    assert any(not torch.equal(p, q) for p, q in zip(trainer.params, before, strict=True))

    # A non-finite loss on the step that would sync gradients (call 5 of 5 per update): that whole update is
    # dropped (its gradients were never all-reduced), the next one goes ahead.
    calls["n"] = 0

    def nan_on_sync(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan"), stats) if calls["n"] == 5 else (loss, stats)

    monkeypatch.setattr(clipped_module, "grpo_loss", nan_on_sync)
    trainer = _trainer(tmp_path, "run.epochs=1")
    trainer.fit()
    assert trainer.state.global_step == 1 and all(p.grad is None for p in trainer.params)

    monkeypatch.setattr(
        clipped_module, "grpo_loss", lambda *a, **k: (real_loss(*a, **k)[0] * float("inf"), real_loss(*a, **k)[1])
    )
    trainer = _trainer(tmp_path, "run.epochs=1", "run.max_nonfinite_steps=3")
    with pytest.raises(TrainingError, match="3 non-finite losses or gradients in a row"):
        trainer.fit()


def test_a_finite_loss_with_nonfinite_gradients_drops_the_update(tmp_path, capsys):
    # The loss is finite but its backward overflows in one LoRA weight: the clipped norm is inf, and stepping
    # would write NaN into every weight through the clip coefficient (and into the EMA for good).
    trainer = _trainer(tmp_path, "run.epochs=1", "train.ema=0.5")
    overflowing = trainer.params[0].register_hook(lambda grad: torch.full_like(grad, float("inf")))
    before = [p.detach().clone() for p in trainer.params]
    shadow = [s.clone() for s in trainer.ema.shadow]
    trainer.fit()
    assert trainer.state.global_step == 0  # both updates of the epoch dropped
    assert all(torch.equal(p, q) for p, q in zip(trainer.params, before, strict=True))
    assert all(torch.equal(s, t) for s, t in zip(trainer.ema.shadow, shadow, strict=True))
    assert capsys.readouterr().out.count("warning: non-finite gradients, step skipped") == 2

    overflowing.remove()  # the next cycle is healthy again
    trainer.config.run.epochs = 2
    trainer.fit()
    assert trainer.state.global_step == 2 and all(torch.isfinite(p).all() for p in trainer.params)
    assert any(not torch.equal(p, q) for p, q in zip(trainer.params, before, strict=True))


def test_sigterm_finishes_the_step_checkpoints_and_exits_zero(tmp_path):
    cmd = [
        sys.executable,
        "scripts/train.py",
        "--config",
        str(TINY),
        f"run.output_dir={tmp_path}",
        "run.epochs=200",
        "run.progress=false",
        "eval.every=0",
        "checkpoint.every=0",
    ]
    proc, out, err = sigterm_after_epochs(cmd, tmp_path, 1, cwd=ROOT, env=ENV, timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert "stop requested" in out
    (run_dir,) = tmp_path.iterdir()
    (ckpt,) = list_checkpoints(run_dir)
    state = json.loads((ckpt / "state.json").read_text())
    assert 1 <= state["epoch"] < 200 and state["global_step"] >= 1
    # The checkpoint resumes.
    args = ["run.progress=false", "eval.every=0", f"run.epochs={state['epoch'] + 1}", f"run.resume={run_dir}"]
    resumed = subprocess.run(cmd[:-4] + args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ckpt}" in resumed.stdout


def _with_one_other(other: bool):
    """``any_process`` over this process and one other whose flag is ``other``."""
    return lambda mine: mine or other


def test_a_signal_that_lands_during_the_stop_agreement_stops_at_the_next_one():
    # Every process got SIGTERM while it waited inside the agreement's all-gather (their handlers ran after the
    # flags were read): no one stops at this step, but the request is kept, and all stop after the next one.
    stop = StopRequest()

    def signalled_mid_gather(mine):
        stop.on_signal(signal.SIGTERM)
        return _with_one_other(False)(mine)

    assert stop.agree(signalled_mid_gather) is False and stop.received
    assert stop.agree(_with_one_other(False)) is True
    assert stop.agree(lambda mine: False) is True  # once agreed, it stays set

    # Another process's signal stops this one too.
    assert StopRequest().agree(_with_one_other(True)) is True


def test_repeated_signals_stop_at_once_only_for_a_later_second_ctrl_c():
    stop = StopRequest()
    assert [stop.on_signal(signal.SIGTERM) for _ in range(3)] == [False, False, False]  # scheduler + launcher
    stop = StopRequest()
    assert [stop.on_signal(signal.SIGINT) for _ in range(2)] == [False, False]  # terminal + launcher, same press
    stop.interrupt_again_after_s = 0.0
    assert stop.on_signal(signal.SIGINT) is True


PLAIN_DIFFUSERS = """
import sys, torch
from diffusers import StableDiffusion3Pipeline
base, lora, merged, latents_file, out = sys.argv[1:6]
latents = torch.load(latents_file)
kw = dict(prompt=["a red cube", "a blue ball"], latents=latents, num_inference_steps=6, guidance_scale=4.5,
          height=32, width=32, max_sequence_length=16, output_type="pt")  # tiny_sd3.yaml's T5 tokens
pipe = StableDiffusion3Pipeline.from_pretrained(base)
pipe.load_lora_weights(lora)
with_lora = pipe(**kw).images
fused = StableDiffusion3Pipeline.from_pretrained(merged)(**kw).images
base_images = StableDiffusion3Pipeline.from_pretrained(base)(**kw).images
torch.save({"lora": with_lora, "merged": fused, "base": base_images}, out)
"""


def test_export_round_trip_through_plain_diffusers(tmp_path):
    from flowgrpo.config import WindowConfig
    from flowgrpo.evaluation import ode_sampler
    from flowgrpo.export import adapter_from_checkpoint, export_checkpoint, run_config
    from flowgrpo.rollout import rollout
    from flowgrpo.tiny import build_tiny_pipeline

    base = tmp_path / "base"
    build_tiny_pipeline("sd3", seed=0).save_pretrained(str(base))
    # One epoch of 4 images in 2 sampling steps, one update: it moves the images below by 0.08 (max), far over 1e-3.
    small = ["grpo.group_size=2", "grpo.groups_per_epoch=2", "sampler.batch_size=4", "train.batch_size=4"]
    small += ["sampler.num_steps=2", "run.epochs=1"]
    trainer = _trainer(tmp_path / "runs", f"model.pretrained={base}", *small, "train.lr=5e-2", "train.ema=0.5")
    trainer.fit()
    ckpt = list_checkpoints(trainer.run_dir)[-1]
    result = subprocess.run(
        [sys.executable, "scripts/export.py", "--checkpoint", str(ckpt), "--out", str(tmp_path / "lora")],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    export_checkpoint(ckpt, tmp_path / "merged", merge=True)
    export_checkpoint(ckpt, tmp_path / "lora_ema", ema=True)
    assert load_file(str(tmp_path / "lora" / "pytorch_lora_weights.safetensors")).keys()
    ema_w = load_file(str(tmp_path / "lora_ema" / "pytorch_lora_weights.safetensors"))
    last_w = load_file(str(tmp_path / "lora" / "pytorch_lora_weights.safetensors"))
    assert any(not torch.equal(ema_w[k], last_w[k]) for k in last_w)

    # The trainer's own noise-free sampling with the checkpoint's adapter.
    config = run_config(ckpt)
    adapter = adapter_from_checkpoint(config, ckpt)
    latents = adapter.initial_noise(2, 32, 32, generator=torch.Generator().manual_seed(0))
    sampler = ode_sampler(config.eval)
    sampler.num_steps, sampler.window = 6, WindowConfig(size=0)
    ours = rollout(
        adapter,
        ["a red cube", "a blue ball"],
        [0, 1],
        sampler,
        range(0, 0),
        height=32,
        width=32,
        initial_latents=latents,
    ).images

    torch.save(latents, tmp_path / "latents.pt")
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_DIFFUSERS)
    run = subprocess.run(
        [
            sys.executable,
            str(script),
            str(base),
            str(tmp_path / "lora"),
            str(tmp_path / "merged"),
            str(tmp_path / "latents.pt"),
            str(tmp_path / "images.pt"),
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    images = torch.load(tmp_path / "images.pt")
    assert (images["base"] - ours).abs().max() > 1e-3  # the adapter really changes the images
    torch.testing.assert_close(images["lora"], ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(images["merged"], ours, rtol=0, atol=1e-4)


def test_plain_diffusers_evaluation_of_an_export_matches_the_trainers(tmp_path, capsys):
    # configs/shapes_best.yaml, one short epoch at a high lr, exported; scripts/evaluate.py --lora evaluates the export
    # in plain diffusers (from_pretrained + load_lora_weights, pipe(...)) as flowgrpo evaluates the checkpoint.
    from flowgrpo.data import PromptDataset
    from flowgrpo.evaluation import evaluate
    from flowgrpo.export import adapter_from_checkpoint, export_checkpoint
    from flowgrpo.pipelines import load_pipeline
    from flowgrpo.plain import PlainPipeline, load_plain
    from rewards import build_reward

    small = ["grpo.group_size=4", "grpo.groups_per_epoch=2", "sampler.batch_size=8", "train.batch_size=8"]
    evaluation = ["eval.num_steps=4", "eval.max_prompts=12", "eval.samples_per_prompt=2", "eval.batch_size=8"]
    run = [f"run.output_dir={tmp_path / 'runs'}", "run.progress=false", "eval.every=0", "run.epochs=1"]
    overrides = [*run, *small, "sampler.num_steps=4", "train.lr=5e-2", *evaluation]
    config = load_config(ROOT / "configs" / "shapes_best.yaml", overrides)
    trainer = GRPOTrainer(config)
    trainer.fit()
    ckpt = list_checkpoints(trainer.run_dir)[-1]
    export_checkpoint(ckpt, tmp_path / "lora")

    dataset = PromptDataset.from_file(ROOT / config.data.test)
    reward = build_reward(config.rewards)
    options = {"resolution": 32, "seed": config.run.seed}
    adapter = adapter_from_checkpoint(config, ckpt)
    ours, our_images, names, _ = evaluate(adapter, dataset, reward, config.eval, **options)
    summary, images, plain_names, _ = evaluate(
        load_plain(config, tmp_path / "lora"), dataset, reward, config.eval, **options
    )
    base = PlainPipeline(load_pipeline("shapes-sd3", dtype="fp32"), max_sequence_length=16)
    _, base_images, _, _ = evaluate(base, dataset, reward, config.eval, **options)
    assert plain_names == names and len(names) == 24
    assert (base_images - our_images).abs().max() > 0.05  # the LoRA really changes the images
    torch.testing.assert_close(images, our_images, rtol=0, atol=1e-5)
    assert summary.keys() == ours.keys() and "shapes/accuracy/exact/pass@2" in summary
    for key, value in ours.items():
        assert summary[key] == (value if "accuracy" in key else pytest.approx(value, abs=1e-5)), key

    # The script, in this process (an interpreter start per call costs more than the evaluation): the same summary
    # in <lora>-eval/eval.json; refused before anything is written without --config and for a folder without a LoRA.
    script = _evaluate_script()
    run_config = str(trainer.run_dir / "config.yaml")
    assert script.main(["--lora", str(tmp_path / "lora"), "--config", run_config, "--device", "cpu"]) == 0
    report = json.loads((tmp_path / "lora-eval" / "eval.json").read_text())
    assert report["summary"] == pytest.approx(summary, abs=1e-6) and len(report["images"]) == 24
    with pytest.raises(SystemExit) as refused:
        script.main(["--lora", str(tmp_path / "lora")])
    assert refused.value.code == 2 and "--lora needs --config" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert script.main(["--lora", str(tmp_path / "empty"), "--config", run_config, "--device", "cpu"]) == 2
    assert "has no pytorch_lora_weights.safetensors" in capsys.readouterr().err
    assert not (tmp_path / "empty-eval").exists()


def _evaluate_script():
    return load_script("evaluate")


def _one_layer_lora(transformer, extra_in=0):
    """A diffusers LoRA file's weights for the first block's to_q (``extra_in`` more inputs than the layer takes)."""
    layer = transformer.transformer_blocks[0].attn.to_q
    name = "transformer.transformer_blocks.0.attn.to_q"
    return {
        f"{name}.lora_A.weight": torch.zeros(4, layer.in_features + extra_in),
        f"{name}.lora_B.weight": torch.zeros(layer.out_features, 4),
    }


def test_a_lora_that_does_not_fit_the_model_is_refused_before_loading(tmp_path, monkeypatch, capsys):
    from safetensors.torch import save_file

    import rewards
    from flowgrpo.adapters import family
    from flowgrpo.pipelines import load_pipeline
    from flowgrpo.plain import check_lora_fits

    transformer = load_pipeline("shapes-sd3", dtype="fp32").transformer
    layer = transformer.transformer_blocks[0].attn.to_q
    name = "transformer.transformer_blocks.0.attn.to_q"
    check_lora_fits(transformer, _one_layer_lora(transformer), Path("x"))
    for bad, match in [
        ({}, "holds no weights"),
        ({f"{name}.lora_A.weight": torch.zeros(4, layer.in_features + 1)}, "takes"),
        ({f"{name}.lora_B.weight": torch.zeros(layer.out_features * 2, 4)}, "outputs"),
        ({"transformer.transformer_blocks.99.attn.to_q.lora_A.weight": torch.zeros(4, 4)}, "no such linear layer"),
        ({"text_encoder.foo.lora_A.weight": torch.zeros(4, 4)}, "text-encoder LoRA is not supported by --lora"),
        ({"text_encoder_2.foo.lora_B.weight": torch.zeros(4, 4)}, "text-encoder LoRA is not supported by --lora"),
        ({f"{name}.lora_magnitude_vector": torch.zeros(4)}, "not a LoRA A or B weight"),
    ]:
        with pytest.raises(CheckpointError, match=match):
            check_lora_fits(transformer, bad, Path("x"))

    # scripts/evaluate.py --lora refuses it before the rewards and the model are loaded: exit 2, nothing written.
    def loaded(*args, **kwargs):
        pytest.fail("scripts/evaluate.py --lora loaded the rewards or the model before refusing the LoRA")

    monkeypatch.setattr(rewards, "build_reward", loaded)
    monkeypatch.setattr(family("sd3").pipeline_class, "from_pretrained", loaded)
    lora = tmp_path / "lora"
    lora.mkdir()
    save_file(_one_layer_lora(transformer, extra_in=1), str(lora / "pytorch_lora_weights.safetensors"))
    config = str(ROOT / "configs" / "shapes_best.yaml")
    script = _evaluate_script()
    ema = ["eval.use_ema=true", "train.ema=0.9"]  # the run chose by its EMA weights: no "pass --ema" for an export
    assert script.main(["--lora", str(lora), "--config", config, "--device", "cpu", *ema]) == 2
    err = capsys.readouterr().err
    assert "does not fit model.pretrained" in err and "the layer takes" in err and "Traceback" not in err
    assert "--ema" not in err
    assert not (tmp_path / "lora-eval").exists()

    # The default report directory of --lora . is <the LoRA's name>-eval beside it (not .-eval): an earlier one there
    # is refused without --overwrite.
    (tmp_path / "lora-eval").mkdir()
    (tmp_path / "lora-eval" / "notes.txt").write_text("mine")
    monkeypatch.chdir(lora)
    assert script.main(["--lora", ".", "--config", config, "--device", "cpu"]) == 2
    assert f"--out {tmp_path / 'lora-eval'} is not empty" in capsys.readouterr().err
    assert not (lora / ".-eval").exists()


def test_lora_refusals_of_models_prompts_and_loads_diffusers_cannot_take(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from flowgrpo.adapters import family
    from flowgrpo.data import PromptDataset
    from flowgrpo.evaluation import evaluate
    from flowgrpo.pipelines import load_pipeline
    from flowgrpo.plain import PlainPipeline, check_plain, dtype_note, load_plain

    config = load_config(ROOT / "configs" / "shapes_best.yaml", [])
    lora = tmp_path / "lora"
    lora.mkdir()
    weights = _one_layer_lora(load_pipeline("shapes-sd3", dtype="fp32").transformer)
    save_file(weights, str(lora / "pytorch_lora_weights.safetensors"))
    check_plain(config, lora)  # fits, from the transformer's config alone

    # Editing prompts (source images): refused early by check_plain, and by the evaluation itself.
    editing = PromptDataset(["make it red"], [{}], "edits.jsonl", sources=["a.png"])
    with pytest.raises(CheckpointError, match=r"edits\.jsonl .*editing models are not supported by --lora"):
        check_plain(config, lora, editing)

    class FakePipe:
        def set_progress_bar_config(self, **kwargs):
            pass

    with pytest.raises(CheckpointError, match="editing models are not supported by --lora"):
        evaluate(PlainPipeline(FakePipe()), editing, None, config.eval, resolution=32)

    # What diffusers raises while loading becomes a CheckpointError (scripts/evaluate.py: exit 2, no traceback).
    cls = family("sd3").pipeline_class

    def unreadable(*args, **kwargs):
        raise OSError("Error no file named diffusion_pytorch_model.safetensors")

    monkeypatch.setattr(cls, "from_pretrained", unreadable)
    with pytest.raises(CheckpointError, match=r"model\.pretrained='shapes-sd3' cannot be loaded \(Error no file"):
        load_plain(config, lora)

    class RefusingPipe(FakePipe):
        def load_lora_weights(self, *args, **kwargs):
            raise RuntimeError("size mismatch for lora_A")

    monkeypatch.setattr(cls, "from_pretrained", lambda *args, **kwargs: RefusingPipe())
    with pytest.raises(CheckpointError, match=r"cannot be loaded by load_lora_weights \(size mismatch for lora_A\)"):
        load_plain(config, lora)

    # model.vae_fp32 on a bf16 model: plain diffusers decodes in bf16, and the script says so.
    assert dtype_note(config) is None  # fp32: the checkpoint's evaluation
    bf16 = load_config(ROOT / "configs" / "shapes_best.yaml", ["model.dtype=bf16", "model.vae_fp32=true"])
    assert "in model.dtype=bf16, so its scores may differ slightly" in dtype_note(bf16)
    assert dtype_note(load_config(ROOT / "configs" / "shapes_best.yaml", ["model.dtype=bf16"])) is None


def test_evaluate_and_plot_scripts(tmp_path):
    trainer = _trainer(tmp_path, "run.epochs=2", "eval.every=1", "run.image_grid_every=1", "run.trackers=[tensorboard]")
    trainer.fit()
    assert list(trainer.run_dir.rglob("events.out.tfevents.*"))  # TensorBoard through accelerate's trackers
    assert sorted(p.name for p in (trainer.run_dir / "samples").iterdir()) == ["epoch00000.png", "epoch00001.png"]
    assert (trainer.run_dir / "eval" / "epoch00002.json").is_file()
    ckpt = list_checkpoints(trainer.run_dir)[-1]
    result = subprocess.run(
        [sys.executable, "scripts/evaluate.py", "--checkpoint", str(ckpt)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((ckpt / "eval" / "eval.json").read_text())
    # Same weights, same seed, same prompts: the script reproduces the in-training evaluation.
    in_training = json.loads((trainer.run_dir / "eval" / "epoch00002.json").read_text())
    assert report["summary"]["total"] == pytest.approx(in_training["summary"]["total"], abs=1e-6)
    assert (ckpt / "eval" / "eval.png").is_file()
    plot = subprocess.run(
        [sys.executable, "scripts/plot.py", str(trainer.run_dir)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plot.returncode == 0, plot.stderr[-3000:]
    assert (trainer.run_dir / "curves.png").stat().st_size > 10_000
