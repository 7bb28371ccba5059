"""Hostile inputs: every bad config, file and path stops the scripts with exit code 2, one message naming the key or
the file, no traceback, and nothing written. The scripts' ``main(argv)`` runs in this process (fast)."""

from __future__ import annotations

import hashlib
import shutil
import socket
from pathlib import Path

import pytest
import yaml
from script_helper import load_script

from flowgrpo.checkpoint import list_checkpoints
from flowgrpo.config import load_config
from flowgrpo.tiny import build_tiny_pipeline
from flowgrpo.trainer import GRPOTrainer

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny_sd3.yaml"
NOT_UTF8 = b"a red cube\n\xff\xfe caf\xe9\n"


def _script(name: str):
    return load_script(name)


SCRIPTS = {name: _script(name) for name in ("train", "export", "evaluate", "reward_server")}


def _refused(capsys, script: str, *argv: str, names: tuple[str, ...]) -> str:
    """Run a script; it must exit 2 with one error paragraph naming each of ``names``."""
    code = SCRIPTS[script].main([str(a) for a in argv])
    err = " ".join(capsys.readouterr().err.split())  # train.py wraps its message at 100 columns
    assert code == 2, err[-2000:]
    assert "Traceback" not in err and err.count("error:") == 1, err[-2000:]
    for name in names:
        assert str(name) in err, f"{name!r} not in: {err[-2000:]}"
    return err


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file and directory under ``folder`` with a hash of its content (directories: "")."""
    return {
        str(p.relative_to(folder)): hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else ""
        for p in sorted(folder.rglob("*"))
    }


# ---------------------------------------------------------------------------- train.py: configs and prompt files
@pytest.fixture
def inputs(tmp_path, monkeypatch):
    """A folder of bad input files, and the repository as working directory (the preset's relative paths)."""
    folder = tmp_path / "inputs"
    folder.mkdir()
    (folder / "not_utf8.txt").write_bytes(NOT_UTF8)
    (folder / "not_utf8.jsonl").write_bytes(b'{"prompt": "\xff"}\n')
    (folder / "not_utf8.yaml").write_bytes(b"run: {name: caf\xe9}\n")
    (folder / "a_directory").mkdir()
    (folder / "corrupt_pipeline").mkdir()
    (folder / "corrupt_pipeline" / "model_index.json").write_text("{not json")
    (folder / "hostile_rewards.py").write_text(
        "class NeedsThreshold:\n"
        "    def __init__(self, threshold, device='cpu'):\n"
        "        self.threshold = threshold\n\n"
        "    def __call__(self, images, prompts, metadata=None):\n"
        "        return images.mean(dim=(1, 2, 3)) > self.threshold\n"
    )
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.chdir(ROOT)
    return folder


BAD_TRAIN_ARGS = [  # (overrides, what the message must name); {in} is the inputs folder
    (["grpo.advantage.clip=-1"], ["grpo.advantage.clip"]),  # trained with exit 0: every advantage -1
    (["sampler.noise_level=.nan"], ["sampler.noise_level"]),  # crashed later, after creating the run directory
    (["train.lr=nan"], ["train.lr"]),
    (["train.weight_decay=-0.1"], ["train.weight_decay"]),
    (["train=5", "train.lr=1"], ["train.lr=1", "train=5"]),
    (["train.betas=[0.9]"], ["train.betas"]),
    (["train.betas=[0.9, 1.5]"], ["train.betas[1]"]),
    (["train.eps=0"], ["train.eps"]),
    (["eval.max_prompts=0"], ["eval.max_prompts"]),  # evaluated nothing, silently
    (["model.lora.alpha=0"], ["model.lora.alpha"]),
    (["model.lora.dropout=1"], ["model.lora.dropout"]),
    (["run.seed=-1"], ["run.seed"]),
    (["run.trackers=[tensorbord]"], ["run.trackers", "did you mean 'tensorboard'"]),  # a traceback from accelerate
    (["sampler.guidance_scale=-2"], ["sampler.guidance_scale"]),
    (["grpo.clip_range=1.5"], ["grpo.clip_range"]),
    (["sampler.window.max_start=99"], ["sampler.window.max_start"]),
    (["sampler.window.shift_interval=0"], ["sampler.window.shift_interval"]),
    (["rewards={remote: 1.0}"], ["remote", "url"]),
    (["rewards={json:dumps: 1.0}"], ["json:dumps"]),
    (["rewards={torch.nn:Linear: 1.0}"], ["torch.nn:Linear", "not a reward"]),
    (["rewards={hostile_rewards:NeedsThreshold: 1.0}"], ["hostile_rewards:NeedsThreshold", "threshold"]),
    (["data.train={in}/not_utf8.txt"], ["data.train", "not_utf8.txt", "UTF-8"]),
    (["data.test={in}/not_utf8.jsonl"], ["data.test", "not_utf8.jsonl"]),
    (["data.train={in}/a_directory"], ["data.train", "a_directory", "is a directory"]),
    (["model.pretrained={in}/corrupt_pipeline"], ["corrupt_pipeline/model_index.json", "not a readable model index"]),
]


@pytest.mark.parametrize("overrides, names", BAD_TRAIN_ARGS, ids=[" ".join(o) for o, _ in BAD_TRAIN_ARGS])
def test_bad_training_configs_exit_2_naming_the_key(capsys, inputs, tmp_path, overrides, names):
    runs = tmp_path / "runs"
    overrides = [o.replace("{in}", str(inputs)) for o in overrides]
    _refused(capsys, "train", "--config", TINY, f"run.output_dir={runs}", *overrides, names=tuple(names))
    assert not runs.exists()


def test_a_tracker_that_is_not_installed_is_refused_before_the_run_directory(capsys, inputs, tmp_path, monkeypatch):
    # Accelerate skips it with a debug log and the run would log to no tracker; tensorboard alone is "installed" here.
    import accelerate.tracking
    from accelerate.utils import LoggerType

    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: [LoggerType.TENSORBOARD])
    runs = tmp_path / "runs"
    args = ("train", "--config", TINY, f"run.output_dir={runs}", "run.trackers=[tensorboard, wandb]")
    _refused(capsys, *args, names=("run.trackers: wandb is not installed", "pip install wandb"))
    assert not runs.exists()
    # The trainer checks, not the config: a run's config read to evaluate or export its weights on a machine without
    # its trackers, or to sample an offline store (scripts/sample_offline.py), logs to no tracker and is not refused.
    from flowgrpo.config import load_config

    for training in (False, True):
        assert load_config(TINY, ["run.trackers=[wandb]"], training=training).run.trackers == ["wandb"]


def test_a_tracker_that_fails_to_start_leaves_no_run_directory(tmp_path, monkeypatch):
    import accelerate

    def fail(*args, **kwargs):
        raise RuntimeError("wandb: not logged in")

    monkeypatch.setattr(accelerate.Accelerator, "init_trackers", fail)
    runs = tmp_path / "runs"
    with pytest.raises(RuntimeError, match="not logged in"):
        GRPOTrainer(load_config(TINY, [f"run.output_dir={runs}", "run.progress=false"]))
    assert not runs.exists() or not any(runs.iterdir())


@pytest.mark.parametrize("name, why", [("not_utf8.yaml", "UTF-8"), ("a_directory", "is a directory")])
def test_bad_config_files_exit_2_naming_the_file(capsys, inputs, tmp_path, name, why):
    _refused(capsys, "train", "--config", inputs / name, f"run.output_dir={tmp_path / 'runs'}", names=(name, why))
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------- export.py and evaluate.py
@pytest.fixture(scope="module")
def sd3_run(tmp_path_factory):
    """A tiny SD3 pipeline saved as a local directory, and a one-epoch run on it with its checkpoint."""
    root = tmp_path_factory.mktemp("sd3_run")
    base = root / "base"
    build_tiny_pipeline("sd3", seed=0).save_pretrained(str(base))
    # The least work that writes a checkpoint.
    small = [
        "grpo.group_size=2",
        "grpo.groups_per_epoch=2",
        "sampler.batch_size=4",
        "train.batch_size=4",
        "sampler.num_steps=2",
        "eval.num_steps=2",
    ]
    config = load_config(
        TINY,
        [
            f"run.output_dir={root / 'runs'}",
            "run.epochs=1",
            "eval.every=0",
            "run.progress=false",
            f"model.pretrained={base}",
            *small,
            f"data.train={ROOT / 'configs/prompts/tiny_train.txt'}",
            f"data.test={ROOT / 'configs/prompts/tiny_test.txt'}",
        ],
    )
    trainer = GRPOTrainer(config)
    trainer.fit()
    return base, list_checkpoints(trainer.run_dir)[-1]


@pytest.fixture
def flux_config(tmp_path):
    """Another model's config (FLUX) with the run's LoRA settings: 8 of its LoRA names match SD3's."""
    path = tmp_path / "flux.yaml"
    path.write_text(
        yaml.safe_dump({"model": {"pretrained": "tiny-flux", "resolution": 32, "lora": {"rank": 4, "alpha": 8}}})
    )
    return path


@pytest.mark.parametrize("merge", [False, True], ids=["lora", "merge"])
def test_export_refuses_a_checkpoint_of_another_model(capsys, sd3_run, flux_config, tmp_path, merge):
    # It exited 0, and --merge fused the LoRA weights whose names happened to match and dropped the rest.
    _, ckpt = sd3_run
    out = tmp_path / "out"
    _refused(
        capsys,
        "export",
        "--checkpoint",
        ckpt,
        "--out",
        out,
        "--config",
        flux_config,
        *(["--merge"] * merge),
        names=(str(ckpt), "model.pretrained='tiny-flux'", "not in the checkpoint"),
    )
    assert not out.exists()


def test_evaluate_refuses_a_checkpoint_of_another_model(capsys, sd3_run, flux_config):
    _, ckpt = sd3_run
    before = _snapshot(ckpt)
    _refused(
        capsys,
        "evaluate",
        "--checkpoint",
        ckpt,
        "--config",
        flux_config,
        "--device",
        "cpu",
        f"data.test={ROOT / 'configs/prompts/tiny_test.txt'}",
        names=(str(ckpt), "model.pretrained"),
    )
    assert _snapshot(ckpt) == before  # no <checkpoint>/eval


def test_export_never_writes_over_or_into_the_base_model_or_the_checkpoint(capsys, sd3_run, tmp_path):
    # `--out <base model> --merge` replaced the base transformer's weights.
    base, ckpt = sd3_run
    before = _snapshot(base), _snapshot(ckpt)
    for out in (base, base / "transformer", base / "new", base.parent, ckpt, ckpt.parent):
        for flags in ((), ("--merge", "--overwrite")):
            _refused(capsys, "export", "--checkpoint", ckpt, "--out", out, *flags, names=(str(out),))
    assert (_snapshot(base), _snapshot(ckpt)) == before


def test_export_refuses_a_non_empty_out_and_overwrite_replaces_a_whole_earlier_export(capsys, sd3_run, tmp_path):
    _, ckpt = sd3_run
    out = tmp_path / "merged"
    assert SCRIPTS["export"].main(["--checkpoint", str(ckpt), "--out", str(out), "--merge"]) == 0
    stale = out / "transformer" / "stale.safetensors"  # what an earlier, different export may have left
    stale.write_bytes(b"old")
    before = _snapshot(out)
    _refused(capsys, "export", "--checkpoint", ckpt, "--out", out, "--merge", names=(str(out), "--overwrite"))
    _refused(capsys, "export", "--checkpoint", ckpt, "--out", out, names=(str(out), "--overwrite"))
    assert _snapshot(out) == before
    assert SCRIPTS["export"].main(["--checkpoint", str(ckpt), "--out", str(out), "--merge", "--overwrite"]) == 0
    assert not stale.exists() and (out / "model_index.json").is_file()  # replaced whole, not written over
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]  # no temporary folders left beside it
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    _refused(capsys, "export", "--checkpoint", ckpt, "--out", other, "--overwrite", names=(str(other), "todo.txt"))
    (tmp_path / "a_file").write_text("x")
    _refused(capsys, "export", "--checkpoint", ckpt, "--out", tmp_path / "a_file", names=("a_file",))
    assert (other / "todo.txt").read_text() == "mine" and (tmp_path / "a_file").read_text() == "x"


def test_export_names_missing_or_damaged_files(capsys, sd3_run, tmp_path):
    base, ckpt = sd3_run
    out = tmp_path / "out"
    _refused(
        capsys,
        "export",
        "--checkpoint",
        tmp_path / "nowhere",
        "--out",
        out,
        "--config",
        TINY,
        names=("nowhere", "does not exist"),
    )
    _refused(
        capsys,
        "export",
        "--checkpoint",
        ckpt,
        "--out",
        out,
        "--config",
        tmp_path / "missing.yaml",
        names=("missing.yaml",),
    )
    damaged = tmp_path / "run" / "checkpoints" / ckpt.name
    shutil.copytree(ckpt.parent.parent, tmp_path / "run", ignore=lambda d, names: [n for n in names if n == "eval"])
    (damaged / "adapter.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    _refused(capsys, "export", "--checkpoint", damaged, "--out", out, names=("adapter.safetensors", "damaged"))
    corrupt = tmp_path / "corrupt_base"
    shutil.copytree(base, corrupt)
    (corrupt / "model_index.json").write_text("{not json")
    config = tmp_path / "corrupt.yaml"
    config.write_text(yaml.safe_dump({"model": {"pretrained": str(corrupt), "lora": {"rank": 4, "alpha": 8}}}))
    _refused(capsys, "export", "--checkpoint", ckpt, "--out", out, "--config", config, names=("model_index.json",))
    assert not out.exists()


def test_evaluate_refuses_bad_outputs_and_settings_before_sampling(capsys, sd3_run, tmp_path):
    base, ckpt = sd3_run
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    for out in (base, base / "eval", ckpt.parent, busy):
        _refused(capsys, "evaluate", "--checkpoint", ckpt, "--out", out, "--device", "cpu", names=(str(out),))
    _refused(
        capsys, "evaluate", "--checkpoint", ckpt, "--device", "cpu", "eval.max_prompts=0", names=("eval.max_prompts",)
    )
    _refused(
        capsys,
        "evaluate",
        "--checkpoint",
        ckpt,
        "--device",
        "cpu",
        f"data.test={tmp_path}",
        names=("data.test", "is a directory"),
    )
    assert not (ckpt / "eval").exists() and (busy / "keep.txt").read_text() == "mine"


def test_evaluate_writes_a_new_report_only_with_overwrite(capsys, sd3_run, tmp_path):
    _, ckpt = sd3_run
    out = tmp_path / "report"
    argv = ["--checkpoint", str(ckpt), "--out", str(out), "--device", "cpu", "eval.max_prompts=2"]
    assert SCRIPTS["evaluate"].main(argv) == 0
    first = _snapshot(out)
    assert set(first) == {"eval.json", "eval.png"}
    _refused(capsys, "evaluate", *argv, names=(str(out), "--overwrite"))
    assert _snapshot(out) == first
    assert SCRIPTS["evaluate"].main([*argv, "--overwrite"]) == 0
    assert set(_snapshot(out)) == {"eval.json", "eval.png"}


# ---------------------------------------------------------------------------- reward_server.py's command line
def test_reward_server_command_line_errors_exit_2(capsys, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            ([], ("--reward",)),
            (["--spec", "{not json"], ("--spec", "not valid JSON")),
            (["--spec", str(tmp_path / "missing.yaml")], ("missing.yaml", "does not exist")),
            (["--reward", "brightness=high"], ("--reward brightness=high",)),
            (["--reward", "brightnes"], ("brightnes", "did you mean 'brightness'")),
            (["--reward", "remote"], ("remote", "url")),
            (["--reward", "brightness", "--host", "0.0.0.0"], ("loopback",)),
            (["--reward", "brightness", "--max-pixels", "0"], ("max_pixels",)),
            (["--reward", "brightness", "--port", "70000"], ("--port",)),
            (["--reward", "brightness", "--port", str(port)], ("cannot listen", str(port))),
        ]
        for argv, names in cases:
            _refused(capsys, "reward_server", *argv, names=names)
    assert not list(tmp_path.iterdir())
