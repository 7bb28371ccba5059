"""Score batch i in a background thread while batch i+1 is sampled.

    scorer = AsyncReward(reward)
    for i in range(num_batches):
        images = sample(i)                           # GPU busy here ...
        scorer.submit(images, prompts[i], meta[i])   # ... while the previous batch is scored
    scores = scorer.results()                        # one dict per batch, in submission order

A thread suffices: sampling waits on the GPU and the reward models (torch, ONNX Runtime,
PIL, sockets) release the GIL. One worker keeps batches in order and the reward single-threaded.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch
from torch import Tensor

from .base import Metadata, Reward, RewardError, accepts_source_images


class AsyncReward:
    """Wraps a reward; ``submit`` returns at once, ``results`` returns the scores of every batch in order.

    Inputs are copied at submission, so the caller may reuse its buffers and a failing worker
    never touches the caller's tensors. A failure is raised (by the next ``submit`` or by
    ``results``) as a ``RewardError`` naming the batch and the reward; the pending batches are
    then discarded so the wrapper can be used again. ``max_pending`` bounds the queued batches
    (``submit`` waits for the oldest one beyond it). ``source_images`` (editing) reach the reward only if its
    signature takes them (checked once, here).
    """

    def __init__(self, reward: Reward, *, max_pending: int = 2, name: str | None = None) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1; got {max_pending}")
        self.reward = reward
        self.max_pending = max_pending
        self.name = name or getattr(reward, "name", None) or type(reward).__name__
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        self._futures: list[tuple[int, Future]] = []
        self._next_batch = 0
        self._takes_sources = accepts_source_images(reward)

    def submit(
        self,
        images: Tensor,
        prompts: Sequence[str],
        metadata: Metadata | None = None,
        source_images: Tensor | None = None,
    ) -> int:
        """Queue one batch; returns its index (counted from 0 since the last ``results``)."""
        self._raise_first_failure(done_only=True)
        running = [f for _, f in self._futures if not f.done()]
        if len(running) >= self.max_pending:
            wait(running[: len(running) - self.max_pending + 1])
            self._raise_first_failure(done_only=True)
        images = images.detach().clone()  # snapshot: the sampler may overwrite its buffers
        prompts, metadata = list(prompts), copy.deepcopy(list(metadata) if metadata is not None else None)
        sources = {}
        if source_images is not None and self._takes_sources:
            sources["source_images"] = source_images.detach().clone()
        index = self._next_batch
        self._futures.append((index, self._executor.submit(self._score, index, images, prompts, metadata, sources)))
        self._next_batch += 1
        return index

    def _score(
        self, index: int, images: Tensor, prompts: list[str], metadata: Any, sources: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        try:
            with torch.no_grad():  # grad mode is thread-local: set it in the worker
                return self.reward(images, prompts, metadata, **sources)
        except Exception as err:
            reward = getattr(err, "reward", None) or self.name
            detail = str(err) if isinstance(err, RewardError) else f"{type(err).__name__}: {err}"
            raise RewardError(
                f"scoring batch {index} failed in reward '{reward}': {detail}", reward=reward, batch=index
            ) from err

    def results(self) -> list[dict[str, Tensor]]:
        """Wait for every submitted batch; return their scores in submission order."""
        self._raise_first_failure(done_only=False)
        out = [f.result() for _, f in self._futures]
        self._futures.clear()
        self._next_batch = 0
        return out

    @property
    def pending(self) -> int:
        return len(self._futures)

    def _raise_first_failure(self, *, done_only: bool) -> None:
        for _, future in self._futures:
            if done_only and not future.done():
                return  # earlier batches first: later failures surface once those are done
            err = future.exception()
            if err is not None:
                self._discard()
                raise err

    def _discard(self) -> None:
        for _, future in self._futures:
            future.cancel()
        wait([f for _, f in self._futures])
        self._futures.clear()
        self._next_batch = 0

    def close(self) -> None:
        self._discard()
        self._executor.shutdown(wait=True)

    def __enter__(self) -> AsyncReward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
