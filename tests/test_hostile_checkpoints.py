"""Checkpoints and run directories against hostile or unlucky input: malicious pickles, concurrent trainers on one
run, changed model settings on resume, ``latest`` picking the wrong run, damaged files, full disks, bad paths.
Every refusal is a CheckpointError naming the file or key (scripts: exit code 2), and nothing is written."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flowgrpo.checkpoint as checkpoint_module
from flowgrpo.checkpoint import (
    CheckpointError,
    CheckpointParts,
    RunLock,
    check_model_matches,
    create_run_dir,
    list_checkpoints,
    lora_mismatch,
    open_run_dir,
    read_rng_state,
    resolve_resume,
)
from flowgrpo.config import load_config
from flowgrpo.trainer import GRPOTrainer

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny_sd3.yaml"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
QUIET = ["run.progress=false", "eval.every=0"]


def _config(output_dir: Path, *overrides: str):
    return load_config(TINY, [f"run.output_dir={output_dir}", *QUIET, *overrides])


def _trainer(output_dir: Path, *overrides: str) -> GRPOTrainer:
    return GRPOTrainer(_config(output_dir, *overrides))


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


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished run of 2 epochs with a checkpoint after each (copied by the tests that change it)."""
    out = tmp_path_factory.mktemp("trained")
    trainer = _trainer(out, "run.epochs=2", "checkpoint.every=1")
    trainer.fit()
    return trainer.run_dir


def _copy(run: Path, out: Path) -> Path:
    copy = out / run.name
    shutil.copytree(run, copy)
    return copy


class _Payload:
    """Unpickling this creates ``marker``: what an attacker's code would do (it could as well delete files)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _plant(file: Path, marker: Path) -> None:
    torch.save({"torch": _Payload(marker)}, file)


def _unwrapped(text: str) -> str:
    """The scripts wrap messages at 100 columns (also at hyphens): paths come back whole without whitespace."""
    return "".join(text.split())


def _train_cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "scripts/train.py", "--config", str(TINY), *QUIET, *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)


# ---------------------------------------------------------------- defect 1: loading runs no code
@pytest.mark.parametrize("target", ["rng_rank0.pt", "optimizer.pt"])
def test_a_malicious_pickle_in_a_checkpoint_is_refused_and_never_runs(trained, tmp_path, target):
    run = _copy(trained, tmp_path)
    checkpoint = run / "checkpoints" / "epoch-00002"
    marker = tmp_path / "pwned"
    if target == "rng_rank0.pt":  # an old-format RNG file, as a shared checkpoint of an earlier release has
        (checkpoint / "rng_rank0.json").unlink()
    _plant(checkpoint / target, marker)
    with pytest.raises(CheckpointError, match=rf"{target}.*(could run code|weights_only|Unsupported)"):
        _trainer(tmp_path, "run.epochs=3", f"run.resume={checkpoint}")
    assert not marker.exists()
    # A run directory or `latest` skips it (with a warning) and resumes the previous, sound checkpoint.
    assert resolve_resume(str(run), str(tmp_path), "tiny-sd3", warn=lambda m: None).name == "epoch-00001"
    assert not marker.exists()


def test_rng_states_are_plain_json_and_old_pickled_ones_still_load(trained, tmp_path):
    run = _copy(trained, tmp_path)
    checkpoint = run / "checkpoints" / "epoch-00001"
    states = read_rng_state(checkpoint, 0)
    json.loads((checkpoint / "rng_rank0.json").read_text())  # plain JSON
    assert not list(checkpoint.glob("*.pt")) or [p.name for p in checkpoint.glob("*.pt")] == ["optimizer.pt"]
    # A checkpoint of an earlier release: the same states pickled by torch.save (numpy arrays, tuples).
    (checkpoint / "rng_rank0.json").unlink()
    torch.save(states, checkpoint / "rng_rank0.pt")
    legacy = read_rng_state(checkpoint, 0)
    assert torch.equal(legacy["torch"], states["torch"]) and legacy["python"] == states["python"]
    assert legacy["numpy"][0] == "MT19937" and (legacy["numpy"][1] == states["numpy"][1]).all()
    resumed = _trainer(tmp_path, "run.epochs=2", f"run.resume={checkpoint}")
    assert resumed.state.epoch == 1 and torch.equal(torch.get_rng_state(), states["torch"])


# ---------------------------------------------------------------- defect 4: one trainer per run directory
def test_a_second_trainer_on_a_locked_run_is_refused(trained, tmp_path):
    run = _copy(trained, tmp_path)
    first = _trainer(tmp_path, "run.epochs=3", f"run.resume={run}")  # holds the run until its fit() ends
    with pytest.raises(CheckpointError, match=rf"{run.name} is in use by another training process \(pid {os.getpid()}"):
        _trainer(tmp_path, "run.epochs=3", "run.resume=latest")
    first.run_lock.release()
    _trainer(tmp_path, "run.epochs=3", "run.resume=latest").run_lock.release()  # free again


def test_resume_latest_on_a_run_in_use_exits_2_and_writes_nothing(trained, tmp_path):
    run = _copy(trained, tmp_path)
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.name != ".lock"}
    lock = RunLock(run)
    lock.acquire()  # another trainer, as far as the script can tell
    try:
        result = _train_cli(f"run.output_dir={tmp_path}", "run.epochs=3", "run.resume=latest")
    finally:
        lock.release()
    assert result.returncode == 2, result.stderr[-3000:]
    assert str(run) in _unwrapped(result.stderr) and "inusebyanothertrainingprocess" in _unwrapped(result.stderr)
    assert "Traceback" not in result.stderr
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.name != ".lock"} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [run.name]


def _make_run_dir(args) -> str:
    output_dir, barrier = args
    barrier.wait()  # every process creates its directory at the same instant, with the same time stamp
    return str(create_run_dir(output_dir, "race", stamp="20260101-000000"))


def test_run_directories_created_at_the_same_instant_are_distinct(tmp_path):
    context = multiprocessing.get_context("fork")
    with context.Manager() as manager:
        barrier = manager.Barrier(4)
        with context.Pool(4) as pool:
            made = pool.map(_make_run_dir, [(tmp_path, barrier)] * 4)
    assert len(set(made)) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"race-20260101-000000{s}" for s in ("", "-1", "-2", "-3")]


def test_open_run_dir_creates_and_locks_a_run_and_refuses_a_second_holder(tmp_path, monkeypatch):
    from accelerate import Accelerator

    import flowgrpo.checkpoint.run_dir as run_dir_module

    acc, config = Accelerator(), _config(tmp_path / "runs")
    path, lock = open_run_dir(acc, config, None)
    assert path.parent == tmp_path / "runs" and path.name.startswith("tiny-sd3-") and lock is not None and lock.held
    assert (path / "config.yaml").read_text() == config.to_yaml()
    with pytest.raises(CheckpointError, match=rf"{path.name} is in use by another training process"):
        open_run_dir(acc, config, path)
    lock.release()
    again, lock = open_run_dir(acc, config, path)  # an existing run (a resume): locked, its config.yaml kept
    assert again == path and lock.held
    lock.release()
    # A failure after creating a new run directory removes it again.

    def full_disk(run_dir, *args):
        raise CheckpointError(f"cannot write {run_dir}/config.yaml: No space left on device (simulated)")

    monkeypatch.setattr(run_dir_module, "write_run_config", full_disk)
    with pytest.raises(CheckpointError, match="config.yaml: No space left"):
        open_run_dir(acc, _config(tmp_path / "new"), None)
    assert list((tmp_path / "new").iterdir()) == []


# ---------------------------------------------------------------- defect 5: what the weights mean is fixed
@pytest.mark.parametrize(
    "override, key, old, new",
    [
        ("model.lora.alpha=16", "model.lora.alpha", "8.0", "16.0"),
        ("model.lora.rank=8", "model.lora.rank", "4", "8"),
        ("model.pretrained=tiny-sd3", "model.pretrained", "'tiny-sd3-taesd'", "'tiny-sd3'"),
        ("model.lora.target_modules=[attn.to_q]", "model.lora.target_modules", "['attn.add_k_proj'", "['attn.to_q']"),
    ],
)
def test_resume_refuses_settings_that_change_what_the_weights_mean(trained, tmp_path, override, key, old, new):
    run = _copy(trained, tmp_path)
    config_before = (run / "config.yaml").read_text()
    with pytest.raises(CheckpointError) as info:
        _trainer(tmp_path, "run.epochs=3", f"run.resume={run}", override)
    message = " ".join(str(info.value).split())
    assert f"{key}: checkpoint {old}" in message and f"config {new}" in message and "start a new run" in message
    assert (run / "config.yaml").read_text() == config_before
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("config")) == ["config.yaml"]


def test_lora_weights_of_another_shape_are_refused_by_the_check_export_makes_too(trained, tmp_path):
    from safetensors.torch import load_file, save_file

    expected = {"a.lora_A.weight": (4, 8), "a.lora_B.weight": (8, 4)}
    assert lora_mismatch(expected, dict(expected)) == []
    problems = lora_mismatch(expected, {"a.lora_A.weight": (4, 9), "b.lora_A.weight": (4, 8)})
    assert problems == [
        "1 of the model's 2 LoRA weights are not in the checkpoint (e.g. a.lora_B.weight)",
        "1 of the checkpoint's 2 are not in the model (e.g. b.lora_A.weight)",
        "1 differ in shape (e.g. a.lora_A.weight: (4, 9) saved, (4, 8) in the model)",
    ]
    # Resuming loads through the same check: a weight of another shape (same name, same recorded settings).
    run = _copy(trained, tmp_path)
    file = run / "checkpoints" / "epoch-00002" / "adapter.safetensors"
    weights = load_file(str(file))
    name = sorted(weights)[0]
    weights[name] = torch.zeros(weights[name].shape[0] + 1, *weights[name].shape[1:])
    save_file(weights, str(file))
    with pytest.raises(CheckpointError, match=rf"1 differ in shape \(e.g. {name}: "):
        _trainer(tmp_path, "run.epochs=3", f"run.resume={file.parent}")


def test_export_side_check_names_another_models_config(trained):
    checkpoint = list_checkpoints(trained)[-1]
    check_model_matches(checkpoint, _config(trained.parent))  # the run's own settings
    flux = load_config(None, ["model.pretrained=tiny-flux", "model.lora.rank=4", "model.lora.alpha=8"])
    with pytest.raises(CheckpointError, match=r"model.pretrained: checkpoint 'tiny-sd3-taesd', config 'tiny-flux'"):
        check_model_matches(checkpoint, flux)
    # "default" targets resolve through the checkpoint's model family: the explicit list of the same is fine.
    state = json.loads((checkpoint / "state.json").read_text())
    targets = state["trained_on"]["model.lora.target_modules"]
    same = _config(trained.parent, f"model.lora.target_modules={json.dumps(targets[::-1])}")
    check_model_matches(checkpoint, same)


def test_resume_warns_about_recipe_changes_and_keeps_every_attempts_config(trained, tmp_path, capsys):
    run = _copy(trained, tmp_path)
    first = (run / "config.yaml").read_text()
    resumed = _trainer(tmp_path, "run.epochs=3", f"run.resume={run}", "grpo.group_size=2", "grpo.groups_per_epoch=8")
    out = capsys.readouterr().out
    assert "warning: resuming with settings that differ" in out
    assert "grpo.group_size: 4 -> 2" in out and "grpo.groups_per_epoch: 4 -> 8" in out and "run.epochs" not in out
    resumed.fit()
    assert (run / "config.yaml").read_text() == first  # the first attempt's
    (later,) = run.glob("config-resume-*.yaml")
    assert "group_size: 2" in later.read_text()
    checkpoint = list_checkpoints(run)[-1]
    assert checkpoint.name == "epoch-00003" and "group_size: 2" in (checkpoint / "config.yaml").read_text()


# ---------------------------------------------------------------- defect 7: which run `latest` means
def _fake_run(trained: Path, out: Path, name: str, written_at: float | None) -> Path:
    """A copy of ``trained`` named ``name`` whose checkpoints say they were written at ``written_at``."""
    run = out / name
    shutil.copytree(trained, run)
    for checkpoint in list_checkpoints(run):
        state = json.loads((checkpoint / "state.json").read_text())
        if written_at is None:
            state.pop("written_at")
        else:
            state["written_at"] = written_at
        (checkpoint / "state.json").write_text(json.dumps(state))
    return run


def test_latest_matches_the_run_name_exactly_and_orders_by_what_runs_recorded(trained, tmp_path):
    older = _fake_run(trained, tmp_path, "tiny-20260101-000000", 1_000.0)
    newer = _fake_run(trained, tmp_path, "tiny-20250101-000000", 2_000.0)  # an older stamp, resumed more recently
    other = _fake_run(trained, tmp_path, "tiny-sd3-20270101-000000", 3_000.0)  # another run name
    _fake_run(trained, tmp_path, "tiny-notastamp", 4_000.0)
    os.utime(older, (5_000_000_000, 5_000_000_000))  # e.g. plot.py wrote into it: its folder time is newest
    assert resolve_resume("latest", str(tmp_path), "tiny") == newer / "checkpoints" / "epoch-00002"
    assert resolve_resume("latest", str(tmp_path), "tiny-sd3") == other / "checkpoints" / "epoch-00002"
    # Checkpoints of earlier releases recorded no time: the run's stamp orders them.
    _fake_run(trained, tmp_path, "old-20240101-000000", None)
    late = _fake_run(trained, tmp_path, "old-20240102-000000", None)
    assert resolve_resume("latest", str(tmp_path), "old").parent.parent == late
    with pytest.raises(CheckpointError, match="no run named 'tin'"):
        resolve_resume("latest", str(tmp_path), "tin")


# ---------------------------------------------------------------- defect 8: damaged files, full disks, bad paths
def test_damaged_checkpoints_name_the_file_and_latest_falls_back(trained, tmp_path):
    run = _copy(trained, tmp_path)
    newest = run / "checkpoints" / "epoch-00002"
    weights = newest / "adapter.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # an interrupted copy
    warnings: list[str] = []
    assert resolve_resume("latest", str(tmp_path), "tiny-sd3", warn=warnings.append).name == "epoch-00001"
    assert any(str(weights) in w for w in warnings) and any("newest complete and loadable" in w for w in warnings)
    with pytest.raises(CheckpointError, match=rf"cannot read {weights}.*damaged"):
        resolve_resume(str(newest), str(tmp_path), "tiny-sd3")
    with pytest.raises(CheckpointError, match=rf"cannot read {weights}"):
        checkpoint_module.read_weights(newest)  # what export and evaluate read
    (newest / "state.json").write_text("{not json")
    (run / "checkpoints" / "epoch-00001" / "rng_rank0.json").write_text('{"format": 1}')
    with pytest.raises(CheckpointError, match=r"no loadable checkpoint \(2 damaged: .*state.json.*rng_rank0.json"):
        resolve_resume(str(run), str(tmp_path), "tiny-sd3", warn=warnings.append)


def test_a_damaged_checkpoint_given_to_the_script_exits_2_naming_the_file(trained, tmp_path):
    run = _copy(trained, tmp_path)
    checkpoint = run / "checkpoints" / "epoch-00002"
    (checkpoint / "optimizer.pt").write_bytes(b"\0" * 64)
    result = _train_cli(f"run.output_dir={tmp_path}", "run.epochs=3", f"run.resume={checkpoint}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert str(checkpoint / "optimizer.pt") in _unwrapped(result.stderr)
    assert "Traceback" not in result.stderr


def test_a_full_disk_at_start_leaves_no_run_directory(tmp_path, monkeypatch):
    real_write = Path.write_text

    def full_disk(self, *args, **kwargs):
        if self.name.startswith(".tmp-config"):
            raise OSError(28, "No space left on device")
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(CheckpointError, match=r"cannot write .*config.yaml: .*No space left on device; the disk is"):
        _trainer(tmp_path / "runs", "run.epochs=1")
    assert list((tmp_path / "runs").iterdir()) == []


@pytest.mark.parametrize(
    "error, meaning",
    [  # what torch's zip writer raises when the disk fills up (or a quota, or the file-size limit, is hit)
        (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1024 vs 978"), "the disk is full"),
        (OSError(errno.EFBIG, "File too large"), "File too large; the file is larger than the filesystem allows"),
    ],
)
def test_a_full_disk_during_a_checkpoint_names_the_file(tmp_path, monkeypatch, error, meaning):
    trainer = _trainer(tmp_path, "run.epochs=1", "checkpoint.every=0")

    def failed_write(*args, **kwargs):
        raise error

    monkeypatch.setattr(torch, "save", failed_write)
    with pytest.raises(CheckpointError, match=rf"cannot write .*epoch-00001/optimizer.pt: .*{meaning}"):
        checkpoint_module.save_checkpoint(_parts(trainer), 1)
    assert list((trainer.run_dir / "checkpoints").iterdir()) == []  # no temporary left behind


def test_an_output_dir_that_is_a_file_is_named(tmp_path):
    not_a_dir = tmp_path / "runs"
    not_a_dir.write_text("")
    with pytest.raises(CheckpointError, match=rf"run.output_dir='{not_a_dir}': cannot create it"):
        _trainer(not_a_dir, "run.epochs=1")


# ---------------------------------------------------------------- issue 28: a resume writes only into its own run
def _state(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file and folder under ``folder`` (and the folder itself): its modification time and content."""
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
        for p in [folder, *sorted(folder.rglob("*"))]
    }


def test_resuming_a_copied_checkpoint_starts_a_new_run_and_writes_nothing_beside_the_copy(trained, tmp_path):
    outside = tmp_path / "D"  # e.g. /tmp or a home folder: the copied checkpoint's grandparent
    checkpoint = outside / "ckcopy" / "ck"
    shutil.copytree(trained / "checkpoints" / "epoch-00002", checkpoint)
    (outside / "curves.png").write_bytes(b"someone else's plot")
    (outside / "metrics.jsonl").write_text('{"epoch": 7}\n')
    (outside / "eval").mkdir()
    (outside / "eval" / "epoch00005.json").write_text("{}")
    before = _state(outside)
    runs = tmp_path / "runs"
    resumed = _trainer(runs, "run.epochs=3", f"run.resume={checkpoint}")
    assert resumed.run_dir.parent == runs and resumed.run_dir.name.startswith("tiny-sd3-")
    assert resumed.state.epoch == 2
    resumed.fit()
    assert _state(outside) == before  # nothing written, moved or created beside the copy (no .lock, no config)
    assert list_checkpoints(resumed.run_dir)[-1].name == "epoch-00003"
    assert [json.loads(row)["epoch"] for row in (resumed.run_dir / "metrics.jsonl").read_text().splitlines()] == [2]
    assert json.loads((resumed.run_dir / "run.json").read_text())["resumed_from"] == str(checkpoint)
    assert sorted(p.name for p in resumed.run_dir.glob("config*.yaml")) == ["config.yaml"]
    # The new run's checkpoints belong to it: resuming one of them continues that run in place.
    again = _trainer(runs, "run.epochs=4", f"run.resume={list_checkpoints(resumed.run_dir)[-1]}")
    assert again.run_dir == resumed.run_dir
    again.run_lock.release()


def test_a_checkpoint_copied_into_another_runs_folder_does_not_resume_into_that_run(trained, tmp_path):
    other = _copy(trained, tmp_path / "other")  # another run: its own identity, config.yaml, metrics.jsonl, ...
    (other / "run.json").write_text(json.dumps({"run_id": "another-run"}))
    foreign = other / "checkpoints" / "epoch-00005"
    shutil.copytree(trained / "checkpoints" / "epoch-00002", foreign)  # trained's, dropped into the other run
    before = _state(other)
    runs = tmp_path / "runs"
    resumed = _trainer(runs, "run.epochs=3", f"run.resume={foreign}")
    assert resumed.run_dir.parent == runs and resumed.state.epoch == 2
    resumed.run_lock.release()
    assert _state(other) == before  # its later output was not set aside, no lock, no config-resume-*.yaml


@pytest.mark.parametrize("failure", ["lora_shape", "optimizer"])
def test_a_refused_resume_leaves_nothing_behind(trained, tmp_path, monkeypatch, failure):
    run = _copy(trained, tmp_path / "copies")
    (run / ".lock").unlink(missing_ok=True)
    outside = tmp_path / "D"
    checkpoint = outside / "ckcopy" / "ck"
    shutil.copytree(run / "checkpoints" / "epoch-00002", checkpoint)
    if failure == "lora_shape":
        from safetensors.torch import load_file, save_file

        for folder in (checkpoint, run / "checkpoints" / "epoch-00002"):
            weights = load_file(str(folder / "adapter.safetensors"))
            name = sorted(weights)[0]
            weights[name] = torch.zeros(weights[name].shape[0] + 1, *weights[name].shape[1:])
            save_file(weights, str(folder / "adapter.safetensors"))
    else:  # a failure only loading finds (after the run directory is chosen)
        import flowgrpo.checkpoint.save as save_module

        def refuse(*args, **kwargs):
            raise CheckpointError("optimizer.pt: parameter groups differ (simulated)")

        monkeypatch.setattr(save_module, "load_optimizer", refuse)
    # In its own run a resume locks the run before loading (its lock file comes and goes: the folder's time
    # changes); beside a copied checkpoint nothing is touched at all.
    files = lambda: {k: v for k, v in _state(run).items() if k != "."}  # noqa: E731
    before, before_run = _state(outside), files()
    runs = tmp_path / "runs"
    for resume in (checkpoint, run / "checkpoints" / "epoch-00002"):  # a copied checkpoint, then one in its run
        with pytest.raises(CheckpointError):
            _trainer(runs, "run.epochs=3", f"run.resume={resume}")
        assert _state(outside) == before and files() == before_run  # no .lock, no config-resume-*.yaml
        assert not runs.exists() or list(runs.iterdir()) == []  # no new run left behind


@pytest.mark.parametrize(
    "code, meaning",
    [
        (errno.EFBIG, r"File too large; the file is larger than the filesystem allows .*ulimit -f"),
        (errno.ENOSPC, r"No space left on device; the disk is full"),
        (errno.EDQUOT, r"Disk quota exceeded; the disk quota is exceeded"),
        (errno.EROFS, r"Read-only file system; the filesystem is read-only"),
        (errno.EIO, r"Input/output error; check the folder's permissions and free space"),
    ],
)
def test_a_failed_write_says_what_its_errno_means(tmp_path, monkeypatch, code, meaning):
    real_write = Path.write_text

    def refuse(self, *args, **kwargs):
        if self.name.startswith(".tmp-"):
            raise OSError(code, os.strerror(code))
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", refuse)
    target = tmp_path / "state.json"
    with pytest.raises(CheckpointError, match=rf"^cannot write {target}: {meaning}") as info:
        checkpoint_module.write_text(target, "{}")
    if code != errno.ENOSPC:
        assert "disk is full" not in str(info.value)
    assert list(tmp_path.iterdir()) == []
