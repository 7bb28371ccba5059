"""AsyncReward: background scoring keeps batch order, snapshots inputs and names the failing batch and reward."""

import threading
import time

import pytest
import torch

from rewards import AsyncReward, RewardError, build_reward


class Recorder:
    """Scores each image by its first pixel; optionally waits for a gate and sleeps per batch."""

    def __init__(self, delays=(), gate=None, fail_on=None):
        self.delays, self.gate, self.fail_on = list(delays), gate, fail_on
        self.calls = 0

    def __call__(self, images, prompts, metadata=None):
        index, self.calls = self.calls, self.calls + 1
        if self.gate is not None:
            assert self.gate.wait(timeout=30)
        if index < len(self.delays):
            time.sleep(self.delays[index])
        if self.fail_on == index:
            raise RuntimeError("model exploded")
        return {"first_pixel": images[:, 0, 0, 0].clone(), "grad": torch.tensor([float(torch.is_grad_enabled())])}


def _batch(value, n=1):
    return torch.full((n, 3, 4, 4), value)


def test_results_in_submission_order():
    reward = Recorder(delays=[0.05, 0.0, 0.03, 0.0, 0.01])
    with AsyncReward(reward) as scorer:
        for i in range(5):
            assert scorer.submit(_batch(i / 10), ["p"]) == i
        results = scorer.results()
    assert [r["first_pixel"].item() for r in results] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert all(r["grad"].item() == 0.0 for r in results)  # scored without grad in the worker


def test_submit_returns_before_scoring_and_snapshots_inputs():
    gate = threading.Event()
    with AsyncReward(Recorder(gate=gate)) as scorer:
        images = _batch(0.5, n=2)
        metadata = [{"k": [1]}, {"k": [2]}]
        scorer.submit(images, ["a", "b"], metadata)
        assert scorer.pending == 1  # submit did not wait for the (blocked) reward
        images.fill_(0.0)  # the sampler reuses its buffer for the next batch
        metadata[0]["k"].append(99)
        gate.set()
        (result,) = scorer.results()
    assert result["first_pixel"].tolist() == [0.5, 0.5]


def test_worker_error_names_batch_and_reward_and_leaves_inputs_alone():
    images = [0.95 + 0.05 * torch.rand(2, 3, 16, 16) for _ in range(3)]  # near-white: OCR finds no text, fast
    originals = [x.clone() for x in images]
    prompts = [['a "x"', 'a "y"'], ["no quotes", "here"], ['a "z"', 'a "w"']]
    reward = build_reward({"jpeg_compressibility": 1.0, "ocr": 1.0})
    scorer = AsyncReward(reward)
    # Raised by results(), or earlier by the submit after batch 1 failed: whichever comes first.
    with pytest.raises(RewardError, match=r"scoring batch 1 failed in reward 'ocr'.*no quoted text") as info:
        for x, p in zip(images, prompts, strict=True):
            scorer.submit(x, p)
        scorer.results()
    assert info.value.batch == 1 and info.value.reward == "ocr"
    assert all(torch.equal(x, o) for x, o in zip(images, originals, strict=True))
    assert torch.is_grad_enabled() and scorer.pending == 0
    scorer.submit(images[0], prompts[0])  # usable again after a failure
    (out,) = scorer.results()
    assert set(out) == {"jpeg_compressibility", "ocr", "total"}
    scorer.close()


def test_earlier_failure_surfaces_at_next_submit():
    reward = Recorder(fail_on=0)
    scorer = AsyncReward(reward, name="judge")
    scorer.submit(_batch(0.1), ["a"])
    while scorer._futures and not scorer._futures[0][1].done():
        time.sleep(0.01)
    with pytest.raises(RewardError, match=r"scoring batch 0 failed in reward 'judge': RuntimeError: model exploded"):
        scorer.submit(_batch(0.2), ["b"])
    assert scorer.pending == 0
    scorer.close()


def test_max_pending_bounds_the_queue():
    gate, log = threading.Event(), []

    def release():
        time.sleep(0.1)
        log.append("released")
        gate.set()

    with AsyncReward(Recorder(gate=gate), max_pending=1) as scorer:
        scorer.submit(_batch(0.1), ["a"])
        threading.Thread(target=release).start()
        scorer.submit(_batch(0.2), ["b"])  # waits for batch 0, which waits for the gate
        log.append("second submit returned")
        assert [r["first_pixel"].item() for r in scorer.results()] == pytest.approx([0.1, 0.2])
    assert log == ["released", "second submit returned"]
    with pytest.raises(ValueError, match="max_pending"):
        AsyncReward(Recorder(), max_pending=0)
