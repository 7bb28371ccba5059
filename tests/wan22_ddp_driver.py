"""Two CPU processes (gloo) training the tiny Wan2.2 pipeline's two experts under DDP, where rank 0's micro-batch
straddles the expert boundary and rank 1's does not: tests/test_wan22_ddp.py starts one process per rank,
``python tests/wan22_ddp_driver.py <rank> <rendezvous file>``. Exits non-zero when a check fails or a collective times
out.

Per rank: the velocity and LoRA gradients of its micro-batch without DDP (the bare :class:`WanExperts`), then two
training forwards through ``DistributedDataParallel`` with its defaults (``broadcast_buffers=True``, as
``accelerator.prepare``), each checked against them: the velocity exactly, the gradients against the two ranks' local
gradients averaged by hand. Then the no-grad forwards that bypass DDP (``without_ddp``: the old weights'; the
reference's) on rank 1 only, as a gated KL skips them on another rank, and one more DDP step, which would pair
wrongly if those forwards had reached DDP."""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

STEPS_THROUGH_DDP = 2


def _worker(rank: int, rendezvous: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
    from torch.nn.parallel import DistributedDataParallel

    from flowgrpo.adapters import make_adapter
    from flowgrpo.tiny import wan22_components

    pipe = WanPipeline(**wan22_components(0))
    pipe.set_progress_bar_config(disable=True)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    adapter = make_adapter(pipe, num_frames=5, guidance_scale_2=3.0)
    torch.manual_seed(0)  # the same LoRA on both ranks (DDP would broadcast rank 0's anyway)
    adapter.add_lora(rank=2, alpha=4)
    experts = adapter.transformer
    params = [p for p in experts.parameters() if p.requires_grad]
    with torch.no_grad():  # a non-zero LoRA: the adapted and the reference predictions differ
        for name, p in experts.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    assert len(list(experts.buffers())) > 0  # the rope tables DDP broadcasts at every training forward

    x = adapter.initial_noise(2, 16, 16, generator=torch.Generator().manual_seed(rank))
    embeds = adapter.encode_prompts(["a red cube", 'a sign that says "hello"'], with_negative=True)
    sigma = torch.tensor([0.95, 0.5] if rank == 0 else [0.95, 0.9])  # boundary 0.875: rank 0 on both experts
    assert adapter.expert_of(sigma * 1000).tolist() == ([0, 1] if rank == 0 else [0, 0])

    # Without DDP: this rank's velocity and gradients, and the gradients averaged over the ranks by hand.
    local_v = adapter.velocity(x, sigma, embeds, 4.5)
    local_v.square().mean().backward()
    mean_grads = [p.grad.clone() for p in params]
    for g in mean_grads:
        dist.all_reduce(g)
        g /= 2
    with torch.no_grad(), adapter.adapter_disabled():
        base_v = adapter.velocity(x, sigma, embeds, 4.5)

    adapter.transformer = DistributedDataParallel(experts)  # defaults: broadcast_buffers=True
    worst = 0.0
    for step in range(STEPS_THROUGH_DDP + 1):
        if step == STEPS_THROUGH_DDP and rank == 1:
            # Forwards one rank runs and the other skips (a gated KL, the old weights'): no collective.
            with torch.no_grad(), adapter.without_ddp():
                assert torch.equal(adapter.velocity(x, sigma, embeds, 4.5), local_v.detach())
            with torch.no_grad(), adapter.reference():
                assert torch.equal(adapter.velocity(x, sigma, embeds, 4.5), base_v)
                assert (base_v - local_v).abs().max() > 1e-3
        for p in params:
            p.grad = None
        v = adapter.velocity(x, sigma, embeds, 4.5)
        assert torch.equal(v, local_v), (rank, step)
        v.square().mean().backward()
        for p, g in zip(params, mean_grads, strict=True):
            torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
            worst = max(worst, float((p.grad - g).abs().max()))
    dist.barrier()
    steps = STEPS_THROUGH_DDP + 1
    print(f"rank {rank} ok: {steps} DDP steps, max |grad - mean of local grads| {worst:.2e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2])
