"""Negative-aware fine-tuning (grpo.objective: nft): the loss against DiffusionNFT's formula on the bare transformer,
its gradient at the old weights, the old-weights swap, the config checks, and a trainer run."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from rollout_helper import forward_rows, record_epoch_weights
from test_awm import PROMPTS, TINY, _conditional_velocity, _draws, _setup

from flowgrpo.config import ConfigError, load_config
from flowgrpo.objectives import MicroBatch
from flowgrpo.objectives.nft import OldWeights, nft_loss, old_decay
from flowgrpo.trainer import GRPOTrainer

NFT = ["grpo.objective=nft", "sampler.noise_level=0"]
DRAWS = ["grpo.nft.logit_mean=0.3", "grpo.nft.logit_std=0.7", "grpo.nft.time_shift=3"]
ADVANTAGES = torch.tensor([7.0, -0.5, 2.5, -1.25])  # the first beyond the clip (5)
POSITIONS = torch.zeros(len(PROMPTS), dtype=torch.long)


def _config(*overrides):
    return load_config(TINY, ["run.progress=false", *NFT, *overrides])


def _loss(adapter, cfg, traj, old=None):
    batch = MicroBatch(traj, ADVANTAGES, POSITIONS, torch.Generator().manual_seed(7))
    return nft_loss(adapter, cfg.grpo.nft, cfg.grpo.kl.beta, batch, old)


def _trainable(adapter):
    return [p for p in adapter.transformer.parameters() if p.requires_grad]


def test_nft_loss_is_diffusionnfts_formula_with_the_old_weights():
    adapter, traj = _setup()
    old_transformer = copy.deepcopy(adapter.transformer)
    old = OldWeights(_trainable(adapter))
    with torch.no_grad():  # then the weights move: current and old velocities differ
        for p in _trainable(adapter):
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    cfg = _config(*DRAWS, "grpo.nft.beta=0.7", "grpo.nft.adv_clip_max=5", "grpo.kl.beta=0.5")
    loss, stats = _loss(adapter, cfg, traj, old)

    # By hand, as the paper's code: r from the clipped advantage, the two implicit policies, x0 predictions,
    # squared errors over their (constant) mean absolute errors, times c / β; + β_KL · mean|v - v_ref|².
    x0 = traj.final_latents
    sigma, noise = _draws(x0)
    s = sigma.view(4, 1, 1, 1)
    noisy = (1 - s) * x0 + s * noise
    with torch.no_grad():
        v = _conditional_velocity(adapter.transformer, traj, noisy, sigma)
        v_old = _conditional_velocity(old_transformer, traj, noisy, sigma)
        adapter.transformer.disable_adapters()
        v_ref = _conditional_velocity(adapter.transformer, traj, noisy, sigma)
        adapter.transformer.enable_adapters()
    beta, c = 0.7, 5.0
    r = (ADVANTAGES.clamp(-c, c) / c / 2 + 0.5).clamp(0, 1)
    assert r[0] == 1.0
    terms = []
    for prediction in (beta * v + (1 - beta) * v_old, (1 + beta) * v_old - beta * v):
        error = noisy - s * prediction - x0
        terms.append((error**2).mean(dim=(1, 2, 3)) / error.abs().mean(dim=(1, 2, 3)).clamp(min=1e-5))
    policy = ((r * terms[0] + (1 - r) * terms[1]) / beta * c).mean()
    kl = ((v - v_ref) ** 2).mean()
    assert not torch.allclose(v, v_old, atol=1e-3)  # the old weights were really used
    # Same process and tensors: only the order of the final reductions may differ (a few ulp).
    torch.testing.assert_close(stats["policy_loss"], policy, rtol=1e-6, atol=0)
    torch.testing.assert_close(stats["kl"], kl, rtol=1e-6, atol=0)
    torch.testing.assert_close(loss.detach(), policy + 0.5 * kl, rtol=1e-6, atol=0)
    assert set(stats) == {"loss", "policy_loss", "kl"}  # no likelihood ratio to report


def test_at_the_old_weights_the_nft_gradient_is_advantage_weighted_matching():
    """With v_θ = v_old both implicit policies are v_θ; their gradients add up to clip(A) · σ² / w times the
    gradient of the flow-matching error |v - (ε - x0)|² (w: the mean absolute x0 error, held constant) — AWM's
    gradient with the advantage clipped and each sample rescaled; β cancels."""
    adapter, traj = _setup()
    params = _trainable(adapter)
    for beta in (1.0, 0.3):
        cfg = _config(*DRAWS, f"grpo.nft.beta={beta}", "grpo.nft.adv_clip_max=5")
        loss, _ = _loss(adapter, cfg, traj)
        grads = torch.autograd.grad(loss, params)

        x0 = traj.final_latents
        sigma, noise = _draws(x0)
        s = sigma.view(4, 1, 1, 1)
        v = _conditional_velocity(adapter.transformer, traj, (1 - s) * x0 + s * noise, sigma)
        with torch.no_grad():
            w = (s * (noise - x0 - v)).abs().mean(dim=(1, 2, 3))  # |x0 - x̂0| = σ |ε - x0 - v|
        matching = ((v - (noise - x0)) ** 2).mean(dim=(1, 2, 3))
        surrogate = (ADVANTAGES.clamp(-5, 5) * sigma**2 / w * matching).mean()
        expected = torch.autograd.grad(surrogate, params)
        for got, want in zip(grads, expected, strict=True):
            # The same forward on the same tensors, summed in another order: fp32 rounding of a few ulp, relative
            # to the largest entry.
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * want.abs().max().item())
        assert any(g.abs().sum() > 0 for g in grads)


def test_before_the_first_step_the_old_velocity_is_the_current_one_without_a_second_forward():
    """Weights no optimizer step has moved: one forward per term, and the loss and its gradient equal those of the
    old forward run on the (equal) snapshot; once the weights move, the snapshot's forward runs again."""
    adapter, traj = _setup()
    params = _trainable(adapter)
    cfg = _config(*DRAWS, "grpo.nft.beta=0.7", "grpo.kl.beta=0.5")

    class AlwaysMoved(OldWeights):
        def moved(self) -> bool:
            return True

    results = {}
    for name, old in (("skipped", OldWeights(params)), ("forced", AlwaysMoved(params))):
        with forward_rows(adapter) as forwards:
            loss, _ = _loss(adapter, cfg, traj, old)
        results[name] = (loss.detach(), torch.autograd.grad(loss, params), len(forwards))
    (loss, grads, n), (loss_forced, grads_forced, n_forced) = results["skipped"], results["forced"]
    assert (n, n_forced) == (2, 3)  # current + the KL's reference, and the old one when forced
    torch.testing.assert_close(loss, loss_forced, rtol=0, atol=0)
    for got, want in zip(grads, grads_forced, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    old = OldWeights(params)
    with torch.no_grad():
        params[0].add_(0.01)
    with forward_rows(adapter) as forwards:
        _loss(adapter, cfg, traj, old)
    assert old.moved() and len(forwards) == 3


def test_old_weights_run_a_block_on_the_snapshot_and_restore_the_storage():
    adapter, traj = _setup()
    params = _trainable(adapter)
    old = OldWeights(params)
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    storage = [p.data_ptr() for p in params]
    with old.swapped_in():
        assert all(torch.equal(p, s) for p, s in zip(params, old.saved, strict=True))
    assert [p.data_ptr() for p in params] == storage
    assert all(torch.equal(p, s + 1.0) for p, s in zip(params, old.saved, strict=True))


@pytest.mark.parametrize(
    "override, key",
    [
        ("sampler.last_step=sde", "sampler.last_step"),  # the ODE rollout has no SDE step
        ("grpo.nft.beta=0", "grpo.nft.beta"),
        ("grpo.nft.adv_clip_max=-1", "grpo.nft.adv_clip_max"),
        ("grpo.nft.timesteps=0", "grpo.nft.timesteps"),
        ("grpo.nft.logit_std=0", "grpo.nft.logit_std"),
        ("grpo.nft.old_decay_rate=0.001", "needs grpo.nft.old_decay_max"),  # η would stay 0
        ("grpo.nft.old_decay_max=0.5", "needs grpo.nft.old_decay_rate"),
        ("grpo.nft.old_decay_start=75", "grpo.nft.old_decay_start=75 does nothing"),
        ("grpo.nft.old_decay_max=1", "grpo.nft.old_decay_max"),  # the old weights would never move
        ("grpo.nft.old_decay_start=-1", "grpo.nft.old_decay_start"),
    ],
)
def test_nft_config_mistakes_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        _config(override)
    if key.startswith("sampler."):
        assert "grpo.objective=nft" in str(err.value)


def test_awm_settings_under_nft_are_refused_with_nfts_key():
    """nft reads its σ draws from its own section; grpo.awm.* (where they lived before) would do nothing."""
    with pytest.raises(ConfigError, match=r"grpo\.awm\.timesteps=2 .* did you mean grpo\.nft\.timesteps\?"):
        _config("grpo.awm.timesteps=2")
    assert _config("grpo.nft.timesteps=2").grpo.nft.timesteps == 2


def test_trainer_with_nft_takes_the_old_weights_when_each_epochs_training_starts(tmp_path, monkeypatch):
    snapshots, swaps = [], []

    class Recorded(OldWeights):
        def __init__(self, params):
            super().__init__(params)
            snapshots.append([s.clone() for s in self.saved])

        def swapped_in(self):
            swaps.append(len(snapshots))
            return super().swapped_in()

    monkeypatch.setattr("flowgrpo.objectives.nft.OldWeights", Recorded)  # (looked up when each epoch starts)
    config = _config(f"run.output_dir={tmp_path}", "run.epochs=2", "eval.every=0", "train.weight_decay=0")
    trainer = GRPOTrainer(config)
    params = _trainable(trainer.adapter)
    start = [p.detach().clone() for p in params]
    trainer.fit()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in rows if "train/loss" in r] == [2, 4]  # 2 optimizer steps per epoch
    # Epoch 0's old weights are the initial ones; epoch 1's are where epoch 0 ended (moved), not the current ones.
    assert len(snapshots) == 2
    # 2 micro-batches × 1 term per epoch, one optimizer step after each: the first term of an epoch runs before any
    # step (its old velocity is the current one, no swap), the second on its epoch's snapshot.
    assert swaps == [1, 2]
    assert all(torch.equal(s, p) for s, p in zip(snapshots[0], start, strict=True))
    assert any(not torch.equal(s, p) for s, p in zip(snapshots[1], start, strict=True))
    assert any(not torch.equal(s, p.detach()) for s, p in zip(snapshots[1], params, strict=True))


def test_old_decay_is_diffusionnfts_return_decay():
    # train_nft_sd3.py's decay_type 1 (flat 0, uprate 0.001, uphold 0.5) and 2 (flat 75, uprate 0.0075, uphold 0.999)
    type1 = [old_decay(step, 0.001, 0.5) for step in (0, 1, 250, 500, 10_000)]
    assert type1 == pytest.approx([0.0, 0.001, 0.25, 0.5, 0.5])
    type2 = [old_decay(step, 0.0075, 0.999, 75) for step in (0, 74, 75, 175, 10_000)]
    assert type2 == pytest.approx([0.0, 0.0, 0.0, 0.75, 0.999])


def test_soft_update_samples_each_epoch_with_the_mixed_old_weights_and_trains_against_them(tmp_path):
    # 2 optimizer steps an epoch, η grows by 0.25 a step up to 0.9: 0.5 before epoch 1's rollout, 0.9 before epoch 2's
    decay = ["grpo.nft.old_decay_rate=0.25", "grpo.nft.old_decay_max=0.9"]
    config = _config(f"run.output_dir={tmp_path}", "run.epochs=3", "eval.every=0", *decay)
    trainer = GRPOTrainer(config)
    record = record_epoch_weights(trainer, lambda: trainer.objective.old_weights.saved)
    trainer.fit()
    assert trainer.state.global_step == 6
    sampled, trained_from, trained_to = record["sampled"], record["trained_from"], record["trained_to"]
    olds = record["after"]

    def close(a, b):
        return all(torch.allclose(x, y, rtol=0, atol=1e-7) for x, y in zip(a, b, strict=True))

    assert close(sampled[0], trained_from[0])  # epoch 0: the initial weights, nothing to mix
    for epoch, eta in ((1, 0.5), (2, 0.9)):
        mixed = [eta * o + (1 - eta) * c for o, c in zip(sampled[epoch - 1], trained_to[epoch - 1], strict=True)]
        assert close(sampled[epoch], mixed)  # the rollout ran on η old + (1 - η) current
        assert close(trained_from[epoch], trained_to[epoch - 1])  # and the live weights came back for training
        assert close(olds[epoch], mixed)  # the loss's old weights are the ones that sampled
        assert not close(sampled[epoch], trained_from[epoch])
    saved = trainer.objective.checkpoint_weights()
    assert saved is not None and close(saved, olds[2])


def test_the_soft_update_mixes_from_the_last_trained_epoch_so_a_redone_rollout_samples_the_same_weights(tmp_path):
    config = _config(
        f"run.output_dir={tmp_path}",
        "run.epochs=1",
        "eval.every=0",
        "grpo.nft.old_decay_rate=0.3",
        "grpo.nft.old_decay_max=0.6",
    )
    trainer = GRPOTrainer(config)
    trainer.fit()
    objective, params = trainer.objective, _trainable(trainer.adapter)
    seen = []
    for _ in range(2):  # a rollout abandoned (a stop during sampling), then redone
        with objective.sampling_weights(params, trainer.state.global_step):
            seen.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*seen, strict=True))
    eta = old_decay(trainer.state.global_step, 0.3, 0.6)
    expected = [eta * o + (1 - eta) * p.detach() for o, p in zip(objective.old_weights.saved, params, strict=True)]
    assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(seen[0], expected, strict=True))
    # A checkpoint written without the soft update holds none: they restart from the current weights, said aloud.
    live = [p.detach().clone() for p in params]
    assert any(not torch.equal(a, b) for a, b in zip(seen[0], live, strict=True))
    assert "holds no old weights" in objective.restore_weights(None, params)
    assert objective.checkpoint_weights() is None
    with objective.sampling_weights(params, trainer.state.global_step):
        assert all(torch.equal(p, q) for p, q in zip(params, live, strict=True))
