"""Two processes on the CPU through ``accelerate launch``: DDP, DeepSpeed ZeRO-2 and FSDP2 (groups across
ranks, weights in sync, exact resume, each back-end trains like DDP, non-finite losses, refused launches: those
set up in this process from the environment accelerate's launcher builds, and one launched for real).

FSDP runs through tests/fsdp_cpu_driver.py, which lets accelerate select FSDP on the CPU (it does so only on
GPUs); everything else is accelerate's and torch's own FSDP2 code."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from signal_helper import sigterm_after_epochs

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny_sd3.yaml"
# 16 images per epoch, 8 per process: 2 micro-batches of 4 × 5 trained steps = one update of 10 backwards.
COMMON = [
    "run.epochs=2",
    "run.debug_dump=true",
    "run.progress=false",
    "sampler.batch_size=4",
    "train.batch_size=4",
    "train.gradient_accumulation=2",
    "eval.every=1",
    "train.ema=0.5",
    "checkpoint.every=1",
]
# accelerate's --cpu launcher starts one process without mpirun; --multi_gpu on a GPU-less machine runs torchrun,
# and the trainer falls back to the CPU (gloo).
DDP = [
    "--multi_gpu",
    "--num_processes",
    "2",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
]
ZERO2 = ["--config_file", "configs/accelerate/deepspeed_zero2.yaml", "--num_processes", "2"]
FSDP2 = ["--config_file", "configs/accelerate/fsdp.yaml", "--num_processes", "2"]
FSDP_DRIVER = "tests/fsdp_cpu_driver.py"
# Port 0: accelerate picks a free port for each launch. With its default, 29500, two launches that xdist runs
# at once on two workers (a fixture's run beside a test's own) collide: EADDRINUSE at the rendezvous.
FREE_PORT = ["--main_process_port", "0"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _uses_deepspeed(launcher: list[str]) -> bool:
    """A DeepSpeed launch: ``--use_deepspeed`` or one of configs/accelerate/deepspeed_*.yaml."""
    return any("deepspeed" in flag for flag in launcher)


def _launch(
    launcher: list[str],
    output_dir: Path,
    *overrides: str,
    script: str = "scripts/train.py",
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    if _uses_deepspeed(launcher):  # gloo, not a kernel compiled first (tests/loss_driver.py)
        script = "tests/loss_driver.py" if script == "scripts/train.py" else script
        env = {"FLOWGRPO_TEST_DEEPSPEED_SHM": "off", **(env or {})}
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *launcher,
        *FREE_PORT,
        script,
        "--config",
        str(TINY),
        f"run.output_dir={output_dir}",
        *COMMON,
        *overrides,
    ]
    return subprocess.run(cmd, cwd=ROOT, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=600)


def _run(launcher: list[str], output_dir: Path, *overrides: str, **kwargs) -> Path:
    result = _launch(launcher, output_dir, *overrides, **kwargs)
    assert result.returncode == 0, result.stderr[-4000:]
    (run_dir,) = [p for p in output_dir.iterdir() if p.is_dir()]
    return run_dir


def _final(run_dir: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "debug" / f"final_rank{rank}.pt")


def _assert_same_finals(run: Path, reference: Path) -> None:
    """Bit-equal final weights and EMA, rank by rank. Exact on purpose: a resumed process is built like the
    uninterrupted one (the same pipeline loading, the LoRA weights and optimizer state copied into buffers
    allocated as before), so it runs the same kernels on the same data; only the pipeline-loading test
    (test_pipelines.py) compares copies in differently aligned memory, and allows for that."""
    for rank in range(2):
        ours, theirs = _final(run, rank), _final(reference, rank)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), f"rank {rank}"


def _resume_from_first_checkpoint(
    launcher: list[str], run_dir: Path, tmp_path: Path, *overrides: str, script: str = "scripts/train.py"
) -> Path:
    """A copy of the run, cut back to its epoch-1 checkpoint, resumed to the end."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "epoch-00002")
    shutil.rmtree(copy / "debug")
    result = _launch(
        launcher, tmp_path, f"run.resume={copy / 'checkpoints' / 'epoch-00001'}", *overrides, script=script
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resumed from" in result.stdout
    return copy


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    return _run(DDP, tmp_path_factory.mktemp("ddp"))


# FSDP's forwards are collectives: 3 test prompts in batches of 1 leave rank 1 one batch short, which it pads.
FSDP_EVAL = ["eval.batch_size=1", "eval.max_prompts=3"]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Path:
    return _run(FSDP2, tmp_path_factory.mktemp("fsdp"), *FSDP_EVAL, script=FSDP_DRIVER)


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory) -> Path:
    pytest.importorskip("deepspeed")
    return _run(ZERO2, tmp_path_factory.mktemp("zero2"))


def test_two_processes_share_groups_and_stay_in_sync(ddp_run):
    debug = ddp_run / "debug"
    for epoch in range(2):
        ranks = [torch.load(debug / f"epoch{epoch}_rank{r}.pt") for r in range(2)]
        local_groups = [set(d["group_ids"].tolist()) for d in ranks]
        assert local_groups[0] & local_groups[1], "some group should span both ranks"
        # Each rank saw every rank's rewards, in rank order.
        gathered_total = torch.cat([d["local_total"] for d in ranks])
        gathered_ids = torch.cat([d["group_ids"] for d in ranks])
        for d in ranks:
            assert torch.equal(d["all_total"], gathered_total) and torch.equal(d["all_group_ids"], gathered_ids)
        from flowgrpo.advantages import group_advantages

        single = group_advantages(gathered_total, gathered_ids, std="group", clip=5.0)
        torch.testing.assert_close(torch.cat([d["advantages"] for d in ranks]), single)
    # Evaluation was split over both ranks and gathered: every test prompt once, in file order; every rank took
    # part in the best-checkpoint decisions.
    report = json.loads((ddp_run / "eval" / "epoch00002.json").read_text())
    test_prompts = (ROOT / "configs" / "prompts" / "tiny_test.txt").read_text().split("\n")
    assert [r["prompt"] for r in report["images"]] == [p for p in test_prompts if p]
    assert (ddp_run / "eval" / "epoch00002.png").is_file()
    assert sorted(p.name for p in (ddp_run / "checkpoints").iterdir()) == ["epoch-00001", "epoch-00002"]
    finals = [_final(ddp_run, r) for r in range(2)]
    assert finals[0].keys() == finals[1].keys() and any(k.startswith("ema") for k in finals[0])
    for key in finals[0]:
        assert torch.equal(finals[0][key], finals[1][key]), key


def test_two_process_resume_is_exact(ddp_run, tmp_path):
    _assert_same_finals(_resume_from_first_checkpoint(DDP, ddp_run, tmp_path), ddp_run)


NFT = ["grpo.objective=nft", "sampler.noise_level=0"]


# The clipped loss on soft-updated rollouts: epoch 1 samples with η = 0.6 of epoch 0's weights swapped in
LAGGED = ["grpo.objective=lagged", "grpo.lagged.old_decay_rate=0.5", "grpo.lagged.old_decay_max=0.6"]


@pytest.mark.parametrize("objective", [NFT, LAGGED], ids=["nft", "lagged"])
def test_old_weights_under_ddp_train_in_sync_and_resume_exactly(tmp_path, objective):
    """DiffusionNFT's loss runs three forwards a micro-batch (the old weights' and the base model's without
    gradient, swapped in by storage, and the trained one), lagged's rollout samples on swapped-in weights and its
    loss runs the proximal forward without gradient: under DDP the gradient still reaches both ranks' weights
    equally, and a resume restores the old weights and the σ/ε draws bit for bit."""
    overrides = [*objective, "grpo.kl.beta=0.1"]
    run_dir = _run(DDP, tmp_path / "trained", *overrides)
    finals = [_final(run_dir, r) for r in range(2)]
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    first, last = (load_file(str(run_dir / "checkpoints" / f"epoch-0000{e}" / "adapter.safetensors")) for e in (1, 2))
    assert any(not torch.equal(first[k], last[k]) for k in first)  # the second epoch trained
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kl = [row["train/kl"] for row in rows if "train/kl" in row]
    # The KL to the base model (nft's of the velocity, lagged's of the transition), measured before each epoch's one
    # update: 0 on the initial weights, then positive once the adapter moved.
    assert kl[0] == 0 < kl[1]
    _assert_same_finals(_resume_from_first_checkpoint(DDP, run_dir, tmp_path, *overrides), run_dir)


# GARDO's gated KL with the reference reset (epoch 1 compares with a snapshot of the weights): at most 2 images of an
# epoch's 16 gated, so the ranks' micro-batches differ in whether they run the reference forward.
GATED = ["rewards={brightness: 1.0, jpeg_compressibility: 0.0}", "grpo.kl.beta=0.1", "grpo.kl.reset_every=1"]
GATED += ["grpo.kl.gate.auxiliary=[jpeg_compressibility]", "grpo.kl.gate.fraction=0.1"]
GATED += ["eval.every=0", "checkpoint.every=0"]


def test_the_gated_kl_under_ddp_skips_reference_forwards_on_one_rank_and_stays_in_sync(tmp_path):
    """grpo.kl.gate: a micro-batch without a gated sample skips the reference forward, and which micro-batches hold
    one differs between the ranks. The reference forwards run on the module DDP wraps (``adapter.without_ddp``):
    through the wrapper each would broadcast the buffers (SD3's ``pos_embed``), a collective the other rank does
    not make then, which pairs with its gradient all-reduce instead (a hang, or a gradient summed with a buffer).
    The run finishes, and both ranks end with the same weights."""
    run_dir = _run(DDP, tmp_path, *GATED)
    debug = run_dir / "debug"
    gated = [[torch.load(debug / f"epoch{e}_rank{r}.pt")["kl_gate"].sum().item() for r in range(2)] for e in range(2)]
    # In each epoch one rank holds a gated image the other does not: it runs reference forwards the other skips.
    assert all(min(g) == 0 < max(g) for g in gated), gated
    finals = [_final(run_dir, r) for r in range(2)]
    assert finals[0].keys() == finals[1].keys()
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


def test_sigterm_to_the_launcher_stops_both_processes_after_the_same_step(tmp_path):
    """torchrun forwards SIGTERM to its workers; they agree to stop, checkpoint once and exit (torchrun itself
    then reports the signal: exit code 143)."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *DDP,
        *FREE_PORT,
        "scripts/train.py",
        "--config",
        str(TINY),
        f"run.output_dir={tmp_path}",
        "run.epochs=500",
        "run.progress=false",
        "eval.every=0",
        "sampler.batch_size=4",
        "train.batch_size=4",
    ]
    # torchrun SIGKILLs its workers this long after forwarding the signal (30 s by default): room for a slow machine.
    env = {**ENV, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "180"}
    _, out, err = sigterm_after_epochs(cmd, tmp_path, 2, cwd=ROOT, env=env)
    assert "stop requested (signal): checkpoint written" in out, err[-3000:]
    (run_dir,) = tmp_path.iterdir()
    (checkpoint,) = (run_dir / "checkpoints").iterdir()
    state = json.loads((checkpoint / "state.json").read_text())
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert 2 <= state["epoch"] == len(rows) < 500
    assert (checkpoint / "rng_rank0.json").is_file() and (checkpoint / "rng_rank1.json").is_file()


def test_deepspeed_zero2_trains_like_ddp(zero2_run, ddp_run):
    # ZeRO-2 all-gathers the updated weights; only the order of the gradient reduction differs from DDP.
    _same_training(zero2_run, ddp_run, atol=1e-5)
    finals = [_final(zero2_run, r) for r in range(2)]
    checkpoint = zero2_run / "checkpoints" / "epoch-00002"
    assert (checkpoint / "deepspeed").is_dir() and not (checkpoint / "optimizer.pt").exists()
    # DeepSpeed's module file holds the LoRA weights only: no frozen weights, no buffers (SD3's pos_embed).
    (module_file,) = (checkpoint / "deepspeed").rglob("mp_rank_00_model_states.pt")
    saved = torch.load(module_file, map_location="cpu", weights_only=False)["module"]
    assert saved and all(".lora_" in k for k in saved), [k for k in saved if ".lora_" not in k][:3]
    # adapter.safetensors (what export reads) holds the trained weights.
    weights = load_file(str(checkpoint / "adapter.safetensors"))
    params = [v for k, v in finals[0].items() if k.startswith("p")]
    assert len(params) == len(weights) > 0
    assert all(any(w.shape == p.shape and torch.equal(w, p) for w in weights.values()) for p in params)
    rows = [json.loads(line) for line in (zero2_run / "metrics.jsonl").read_text().splitlines()]
    ddp_rows = [json.loads(line) for line in (ddp_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in rows if "global_step" in r] == [1, 2]
    norms = [
        (r["train/grad_norm"], d["train/grad_norm"])
        for r, d in zip(rows, ddp_rows, strict=True)
        if "train/grad_norm" in r
    ]
    assert len(norms) == 2  # DeepSpeed's own global norm, before clipping, as clip_grad_norm_ returns under DDP
    assert all(z == pytest.approx(d, rel=1e-4) for z, d in norms)


def test_deepspeed_zero2_resume_is_exact(zero2_run, tmp_path):
    _assert_same_finals(_resume_from_first_checkpoint(ZERO2, zero2_run, tmp_path), zero2_run)


class _Payload:
    """Unpickling this creates ``marker`` (an attacker's code could do anything)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_deepspeed_files_with_code_in_them_are_refused(zero2_run, tmp_path):
    """DeepSpeed itself reads its files with torch.load(weights_only=False): a planted pickle would run on resume."""
    copy = tmp_path / "run"
    shutil.copytree(zero2_run, copy)
    checkpoint = copy / "checkpoints" / "epoch-00002"
    (shard,) = (checkpoint / "deepspeed").rglob("zero_pp_rank_0_*optim_states.pt")
    marker = tmp_path / "pwned"
    state = torch.load(shard, map_location="cpu", weights_only=False)  # our own file: a real one, plus the payload
    state["payload"] = _Payload(marker)
    torch.save(state, shard)
    result = _launch(ZERO2, tmp_path / "out", "run.epochs=3", f"run.resume={checkpoint}")
    assert result.returncode != 0
    assert "could run code" in result.stderr and shard.name in result.stderr, result.stderr[-3000:]
    assert not marker.exists()


def test_deepspeed_nonfinite_loss_on_the_sync_step_adds_nothing(tmp_path):
    """Under ZeRO-2 a non-finite micro-step, even the one that ends the accumulation cycle, contributes no
    gradient and the update goes ahead with the others: the same weights as when those losses are 0.
    Frozen weights in bf16 here (model.dtype): the LoRA weights DeepSpeed shards stay fp32."""
    pytest.importorskip("deepspeed")
    one_epoch = ["run.epochs=1", "eval.every=0", "checkpoint.every=0", "model.dtype=bf16"]
    runs = {}
    for mode in ("nan", "zero"):
        out = tmp_path / mode
        out.mkdir()
        result = _launch(
            ZERO2, out, *one_epoch, script="tests/loss_driver.py", env={"FLOWGRPO_TEST_LOSS": f"{mode}:3,10"}
        )
        assert result.returncode == 0, result.stderr[-4000:]
        assert ("non-finite loss, step skipped" in result.stdout) == (mode == "nan")
        (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
        runs[mode] = run_dir
        (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert row["global_step"] == 1
    for rank in range(2):
        nan, zero = _final(runs["nan"], rank), _final(runs["zero"], rank)
        assert all(torch.isfinite(v).all() and v.dtype == torch.float32 for v in nan.values())
        assert all(torch.equal(nan[k], zero[k]) for k in nan), f"rank {rank}"


def _refusal_in_process(launcher: list[str], tmp_path: Path, monkeypatch, *overrides: str) -> str:
    """The trainer's setup in this process as ``accelerate launch <launcher> scripts/train.py`` starts it on one
    process, and the ConfigError it raises. The environment is the one accelerate's own launcher builds from the
    flags (its process start, torchrun, replaced by a capture); FSDP is selected on the CPU as fsdp_cpu_driver.py
    selects it; accelerate's process-wide state is set aside for the trainer's Accelerator and put back after.
    test_a_refused_launch_exits_before_the_run_directory launches one such refusal for real."""
    import accelerate.commands.launch as accelerate_launch
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType
    from fsdp_cpu_driver import fsdp_on_cpu_init
    from transformers.integrations import unset_hf_deepspeed_config

    from flowgrpo.config import ConfigError, load_config
    from flowgrpo.trainer import GRPOTrainer

    if _uses_deepspeed(launcher):  # gloo, not a kernel compiled first, as _launch
        monkeypatch.setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)
    launched: dict[str, str] = {}
    monkeypatch.setattr(accelerate_launch, "_run_torchrun", lambda args: launched.update(os.environ))
    parser = accelerate_launch.launch_command_parser()
    accelerate_launch.launch_command(parser.parse_args([*launcher, *FREE_PORT, "scripts/train.py"]))
    assert launched, "accelerate's launcher did not reach torchrun"
    for key, value in launched.items():
        if os.environ.get(key) != value:
            monkeypatch.setenv(key, value)
    monkeypatch.setattr(AcceleratorState, "__init__", fsdp_on_cpu_init(DistributedType.NO))
    states = [(s, dict(s._shared_state)) for s in (PartialState, AcceleratorState, GradientState)]
    for state, _ in states:
        state._shared_state.clear()
    try:
        config = load_config(TINY, [f"run.output_dir={tmp_path}", *COMMON, *overrides])
        with pytest.raises(ConfigError) as refused:
            GRPOTrainer(config)
    finally:
        for state, saved in states:  # the objects other tests hold share these dictionaries
            state._shared_state.clear()
            state._shared_state.update(saved)
        unset_hf_deepspeed_config()  # a ZeRO-3 plugin registers itself with transformers (zero3 from_pretrained)
    return str(refused.value)


ONE_DEEPSPEED_PROCESS = ["--use_deepspeed", "--num_processes", "1", "--num_machines", "1", "--dynamo_backend", "no"]


@pytest.mark.parametrize(
    "stage, precision, message",
    [
        ("3", "no", "ZeRO-3 shards the frozen base weights"),
        ("1", "no", "ZeRO stage 1"),
        ("2", "bf16", "launch with mixed_precision 'no'"),
    ],
)
def test_unsupported_deepspeed_launches_are_refused_with_the_fix(tmp_path, monkeypatch, stage, precision, message):
    pytest.importorskip("deepspeed")
    launcher = [*ONE_DEEPSPEED_PROCESS, "--zero_stage", stage, "--mixed_precision", precision]
    assert message in _refusal_in_process(launcher, tmp_path, monkeypatch)
    assert not list(tmp_path.iterdir())  # refused before the run directory was made


def test_nft_is_refused_under_deepspeed_with_the_fix(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    launcher = [*ONE_DEEPSPEED_PROCESS, "--zero_stage", "2", "--mixed_precision", "no"]
    refusal = _refusal_in_process(launcher, tmp_path, monkeypatch, *NFT)
    assert "under DeepSpeed or FSDP use grpo.objective: awm" in refusal
    assert not list(tmp_path.iterdir())  # refused before the run directory was made


def test_a_refused_launch_exits_before_the_run_directory(tmp_path):
    """One refusal through a real ``accelerate launch``: the wiring the in-process refusals above rely on (the
    launch's flags reach the trainer's checks, which run before the run directory exists, and the message reaches
    stderr with a failing exit code)."""
    pytest.importorskip("deepspeed")
    result = _launch([*ONE_DEEPSPEED_PROCESS, "--zero_stage", "3", "--mixed_precision", "no"], tmp_path)
    assert result.returncode != 0
    assert "ZeRO-3 shards the frozen base weights" in " ".join(result.stderr.split())
    assert not list(tmp_path.iterdir())


def test_deepspeed_is_refused_with_an_accelerate_that_steps_after_every_backward(monkeypatch):
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

    from flowgrpo.config import ConfigError
    from flowgrpo.parallel import require_deepspeed_boundaries

    require_deepspeed_boundaries()  # the installed accelerate has what the loop needs

    def old_backward(self, loss, **kwargs):  # accelerate before per-backward boundaries
        self.engine.backward(loss, **kwargs)
        self.engine.step()

    monkeypatch.setattr(DeepSpeedEngineWrapper, "backward", old_backward)
    with pytest.raises(ConfigError, match="upgrade accelerate"):
        require_deepspeed_boundaries()


def _same_training(run: Path, reference: Path, atol: float) -> None:
    """Same groups on every rank and, from the same initial weights, the same rewards and advantages; final
    weights and EMA equal on both ranks and within ``atol`` of the reference run's."""
    for epoch, rank in ((0, 0), (0, 1), (1, 0), (1, 1)):
        ours, theirs = (torch.load(r / "debug" / f"epoch{epoch}_rank{rank}.pt") for r in (run, reference))
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ("group_ids", "all_group_ids"))
        if epoch == 0:
            # Same initial weights, but another back-end's process: its tensors lie in other buffers (FSDP2 gathers
            # each layer's weights into fresh ones), and CPU GEMM kernels pick their blocking by alignment, so
            # rewards (~0.5) agree to a few fp32 ulps, not bit for bit: 1e-5. Advantages divide reward differences
            # by the group's reward std (3e-4 here), which magnifies those ulps: 1e-3 on values of order 1. A wrong
            # group, order or gather moves them by far more.
            for key, atol in (("local_total", 1e-5), ("all_total", 1e-5), ("advantages", 1e-3)):
                torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=atol, msg=key)
    finals = [_final(run, r) for r in range(2)]
    expected = _final(reference, 0)
    assert finals[0].keys() == expected.keys()
    for key in finals[0]:
        assert torch.equal(finals[0][key], finals[1][key]), key
        torch.testing.assert_close(finals[0][key], expected[key], atol=atol, rtol=0, msg=key)


def test_fsdp2_trains_like_ddp(fsdp_run, ddp_run):
    # Sharded LoRA weights (DTensors), gathered whole for the debug dump and the checkpoint.
    _same_training(fsdp_run, ddp_run, atol=1e-6)
    checkpoint = fsdp_run / "checkpoints" / "epoch-00002"
    assert (checkpoint / "optimizer_full.pt").is_file() and not (checkpoint / "optimizer.pt").exists()
    ours, theirs = (
        load_file(str(r / "checkpoints" / "epoch-00002" / "adapter.safetensors")) for r in (fsdp_run, ddp_run)
    )
    assert ours.keys() == theirs.keys()
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], atol=1e-6, rtol=0, msg=k)
    # Evaluation padded rank 1's shard: every prompt once, in file order.
    report = json.loads((fsdp_run / "eval" / "epoch00002.json").read_text())
    prompts = [p for p in (ROOT / "configs" / "prompts" / "tiny_test.txt").read_text().split("\n") if p][:3]
    assert [r["prompt"] for r in report["images"]] == prompts


def test_fsdp2_resume_is_exact(fsdp_run, tmp_path):
    resumed = _resume_from_first_checkpoint(FSDP2, fsdp_run, tmp_path, *FSDP_EVAL, script=FSDP_DRIVER)
    _assert_same_finals(resumed, fsdp_run)


# NaN on backwards 5 and 10 of epoch 0 (the ends of its two update cycles: an update after each micro-batch of 4).
# Frozen weights in bf16 beside fp32 LoRA weights, the KL term's reference forward, GRPO-Guard's objective: the
# non-finite test and the GRPO-Guard test read the same DDP and FSDP2 launches.
NONFINITE = ["eval.every=0", "model.dtype=bf16", "grpo.kl.beta=0.04", "train.gradient_accumulation=1"]
NONFINITE += ["grpo.objective=guard", "grpo.clip_range=0.2"]


@pytest.fixture(scope="module")
def nonfinite_runs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """The DDP and FSDP2 runs with NaN losses on backwards 5 and 10: each run's directory and stdout."""
    runs = {}
    for name, launcher, script in (("ddp", DDP, "tests/loss_driver.py"), ("fsdp", FSDP2, FSDP_DRIVER)):
        out = tmp_path_factory.mktemp(f"nonfinite_{name}")
        result = _launch(launcher, out, *NONFINITE, script=script, env={"FLOWGRPO_TEST_LOSS": "nan:5,10"})
        assert result.returncode == 0, result.stderr[-4000:]
        (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
        runs[name] = run_dir, result.stdout
    return runs


def test_guard_under_fsdp2_trains_like_ddp(nonfinite_runs):
    """GRPO-Guard's old means come from the rollout (Trajectory.means), not from a swap of the epoch's starting
    weights into the parameters, so FSDP2's DTensor shards are accepted: the same groups and advantages as DDP, and
    final weights equal on both ranks and within 1e-6 of DDP's (the clipped runs' tolerance). (DeepSpeed ZeRO-2, whose
    parameters are whole, passed the same check within 1e-5; not repeated here: its launch costs over a minute.)"""
    (fsdp, _), (ddp, _) = nonfinite_runs["fsdp"], nonfinite_runs["ddp"]
    for rank in range(2):
        ours, theirs = (torch.load(r / "debug" / f"epoch0_rank{rank}.pt") for r in (fsdp, ddp))
        assert all(torch.equal(ours[k], theirs[k]) for k in ("group_ids", "all_group_ids"))
        torch.testing.assert_close(ours["advantages"], theirs["advantages"], rtol=0, atol=1e-3)
    finals, expected = [_final(fsdp, r) for r in range(2)], _final(ddp, 0)
    rows = [json.loads(line) for line in (fsdp / "metrics.jsonl").read_text().splitlines()]
    # Epoch 0's two updates were dropped (NaN); epoch 1 updated after each micro-batch: its second trained off-policy,
    # and RatioNorm saw the stored sampling means differ from the current weights' (0 while nothing moved).
    assert [r["global_step"] for r in rows if "train/loss" in r] == [0, 2]
    assert rows[0]["train/mean_shift"] == 0 < rows[1]["train/mean_shift"]
    for key in expected:
        assert torch.equal(finals[0][key], finals[1][key]), key
        torch.testing.assert_close(finals[0][key], expected[key], atol=1e-6, rtol=0, msg=key)


def test_fsdp2_drops_an_update_with_a_nonfinite_sync_step_like_ddp(nonfinite_runs):
    """NaN on backwards 5 and 10 of epoch 0 (each ends one of its two cycles): both updates are dropped, and
    the gradients accumulated before them do not leak into epoch 1's updates. DDP and FSDP2 end equal. Also: frozen
    weights in bf16 (model.dtype) beside fp32 LoRA weights, the KL term's reference forward (adapter disabled)
    between a forward and its backward, and a checkpoint before the first optimizer step."""
    for run_dir, stdout in nonfinite_runs.values():
        assert "non-finite loss, step skipped" in stdout
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["global_step"] for r in rows] == [0, 2] and rows[1]["train/kl"] > 0  # moved off the reference
    for rank in range(2):
        fsdp, ddp = _final(nonfinite_runs["fsdp"][0], rank), _final(nonfinite_runs["ddp"][0], rank)
        assert all(torch.isfinite(v).all() for v in fsdp.values())
        for k in fsdp:
            torch.testing.assert_close(fsdp[k], ddp[k], atol=1e-6, rtol=0, msg=k)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--fsdp_version", "1"], "set fsdp_version: 2"),
        (["--fsdp_version", "2", "--mixed_precision", "bf16"], "launch with mixed_precision 'no'"),
    ],
)
def test_unsupported_fsdp_launches_are_refused_with_the_fix(tmp_path, monkeypatch, flags, message):
    # (On the CPU accelerate's FSDP1 plugin itself needs sync_module_states off.)
    launcher = [
        "--use_fsdp",
        *flags,
        "--fsdp_sync_module_states",
        "false",
        "--fsdp_cpu_ram_efficient_loading",
        "false",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--dynamo_backend",
        "no",
    ]
    if "--mixed_precision" not in flags:
        launcher += ["--mixed_precision", "no"]
    assert message in _refusal_in_process(launcher, tmp_path, monkeypatch)
    assert not list(tmp_path.iterdir())
