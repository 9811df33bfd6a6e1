"""The training engine end to end on CPU: resume equals an uninterrupted run, outputs, smoke runs."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from cli import run_script
from hydra import compose, initialize_config_dir
from signalling import signalling_model

from compress._logging import format_summary
from compress._stop import REPEAT_S
from compress.engine import run

ROOT = Path(__file__).resolve().parents[1]
# 32 fake 8x8 images, batch 8: 4 steps per epoch, lr x0.1 after epoch 1. Strong SWP so that stripes die during the run.
TINY = [
    "model=resnet20",
    "data=fake",
    "data.input_size=8",
    "data.num_classes=3",
    "data.train_size=32",
    "data.test_size=16",
    "data.batch_size=8",
    "optim=sgd_multistep",
    "optim.epochs=2",
    "optim.milestones=[1]",
    "prune=swp",
    "prune.alpha=0.04",
    "prune.threshold=0.95",
]


# The same run on the bundled digits (1,437 training images, 4 batches of 360): its random shifts draw from the
# global RNG, as CIFAR's and ImageNet's augmentations do, so resuming must restore that stream exactly.
DIGITS = [o for o in TINY if not o.startswith("data")] + ["data=digits", "data.input_size=8", "data.batch_size=360"]


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose("train", overrides=list(overrides))


def _weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


def _epoch_metrics(run_dir: Path, at: int | None = None) -> dict[tuple[int, str], float]:
    """{(step, tag): value} of train/loss and train/accuracy, a run's epoch lines (those at step `at` where given),
    from its TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {(e.step, tag): e.value for tag in ("train/loss", "train/accuracy") for e in events.Scalars(tag)
            if at is None or e.step == at}


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(tmp_path):
    full = run(_compose(*TINY), run_dir=tmp_path / "full")
    stopped = run(_compose(*TINY, "trainer.max_steps=4"), run_dir=tmp_path / "parts")
    assert stopped["epochs"] == 1 and stopped["steps"] == 4
    stale = tmp_path / "parts" / "checkpoints" / ".last.pt.tmp12345.0a1b2c3d"  # what a run killed while saving leaves
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))  # (a younger one may be another host's save)
    resumed = run(_compose(*TINY, "resume=true"), run_dir=tmp_path / "parts")
    assert not stale.exists()
    assert resumed["epochs"] == full["epochs"] == 2 and resumed["steps"] == full["steps"] == 8

    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "parts")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert 0 < full["stripes_kept"] < full["stripes_total"]  # the SWP path really pruned
    assert resumed["stripes_kept"] == full["stripes_kept"] and resumed["test_accuracy"] == full["test_accuracy"]
    _check_run_outputs(tmp_path / "full", full)
    # the reported accuracy is the saved weights' in eval mode (BN running statistics), counted here
    import compress
    from compress.data import build_data

    data = build_data(torch.load(tmp_path / "full" / "checkpoints" / "last.pt", weights_only=True)["config"]["data"])
    model = compress.create_model("resnet20", num_classes=3, input_size=8)
    compress.attach_skeletons(model)
    model.load_state_dict(a)
    with torch.no_grad():
        correct = sum(int((model.eval()(x).argmax(1) == y).sum()) for x, y in data.test)
    assert full["test_accuracy"] == correct / len(data.test.dataset)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_run_stopped_inside_an_epoch_resumes_where_it_stopped(tmp_path, workers):
    """max_steps=5 stops inside epoch 2 (4 batches of digits each): the checkpoint says so, the LR schedule does not
    advance, and resume trains batches 2.. of the same shuffled order and shifts (drawn in the main process, or in 2 loader
    workers seeded from the loader's generator), ending with an uninterrupted run's weights. Epoch 2's train loss and
    accuracy count its batch trained before the stop (they were this run's batches only)."""
    digits = [*DIGITS, f"data.num_workers={workers}"]
    full = run(_compose(*digits), run_dir=tmp_path / "full")
    run(_compose(*digits, "trainer.max_steps=5"), run_dir=tmp_path / "parts")
    ckpt = torch.load(tmp_path / "parts" / "checkpoints" / "last.pt", weights_only=True)
    assert (ckpt["epoch"], ckpt["epoch_batches"], ckpt["step"]) == (1, 1, 5)
    assert ckpt["scheduler"]["last_epoch"] == 1 and len(ckpt["rng_epoch_start"]) == 1
    resumed = run(_compose(*digits, "resume=true"), run_dir=tmp_path / "parts")
    assert resumed["steps"] == full["steps"] == 8 and resumed["epochs"] == 2
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "parts")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert _epoch_metrics(tmp_path / "parts", 8) == pytest.approx(_epoch_metrics(tmp_path / "full", 8), rel=1e-6)


def test_a_run_with_dropout_stopped_inside_an_epoch_resumes_to_the_uninterrupted_weights(tmp_path):
    """Dropout draws from the global RNG in every step: resume restores the checkpoint's random state after replaying
    the epoch's skipped batches (without it, a model with no dropout still matched, since skipping the batches alone
    replays the draws; with dropout the weights differed)."""
    dropout = [*TINY, "model=timm", "model.name=resnet18", "+model.kwargs.drop_rate=0.5", "data.input_size=16"]
    run(_compose(*dropout), run_dir=tmp_path / "full")
    run(_compose(*dropout, "trainer.max_steps=5"), run_dir=tmp_path / "parts")
    run(_compose(*dropout, "resume=true"), run_dir=tmp_path / "parts")
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "parts")
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_checkpoint_without_its_epoch_position_resumes_with_the_epochs_remaining_samples(tmp_path, capsys):
    """A single-process checkpoint written inside an epoch by a version before data.EpochSampler (no epoch_samples)
    cannot replay its loader's own shuffle: the epoch goes on with the samples of today's order after as many as it
    trained, and says so. The summary's seconds add up the two processes' wall times, no more."""
    began = time.perf_counter()
    run(_compose(*TINY, "trainer.max_steps=5"), run_dir=tmp_path)  # 4 batches of 8 per epoch: 1 into epoch 2
    path = tmp_path / "checkpoints" / "last.pt"
    ckpt = torch.load(path, weights_only=True)
    assert (ckpt["epoch"], ckpt["epoch_batches"], ckpt["epoch_start_sample"], ckpt["epoch_samples"]) == (1, 1, 0, 8)
    for key in ("epoch_start_sample", "epoch_samples", "batch_size", "train_size", "sha256"):
        del ckpt[key]
    first_seconds = ckpt["seconds"]
    assert 0 < first_seconds < time.perf_counter() - began
    ckpt["seconds"] = 1000.0  # the earlier processes' wall time, as the checkpoint records it
    torch.save(ckpt, path)
    capsys.readouterr()
    resumed_at = time.perf_counter()
    resumed = run(_compose(*TINY, "resume=true", "trainer.max_steps=null"), run_dir=tmp_path)
    resumed_seconds = time.perf_counter() - resumed_at
    assert "stopped inside epoch 2, 8 samples into it, by a version whose single-process order cannot be replayed" \
        in capsys.readouterr().out
    assert resumed["steps"] == 8 and resumed["epochs"] == 2
    assert 1000.0 < resumed["seconds"] <= 1000.0 + resumed_seconds


def _edit_checkpoint(path: Path, **changes) -> None:
    """Rewrite a train.py checkpoint with `changes` (None deletes the key), without its digest."""
    ckpt = torch.load(path, weights_only=True)
    for key, value in {**changes, "sha256": None}.items():
        if value is None:
            ckpt.pop(key, None)
        else:
            ckpt[key] = value
    torch.save(ckpt, path)


def test_a_run_resumed_inside_an_epoch_at_another_batch_size_trains_the_epochs_rest(tmp_path):
    """data.batch_size given on train.py's command line may change on resume: a run stopped 8 images into epoch 2
    (of 32) trains the other 24 at batch 16 (2 steps). A remainder that would leave a batch of one image is dropped
    (here made so by editing the checkpoint: a run of more processes can leave one image each), and that epoch
    trains no step. A checkpoint of another training set cannot go on inside its epoch."""
    run(_compose(*TINY, "trainer.max_steps=5"), run_dir=tmp_path / "a")
    path = tmp_path / "a" / "checkpoints" / "last.pt"
    ckpt = torch.load(path, weights_only=True)
    assert (ckpt["epoch_samples"], ckpt["batch_size"], ckpt["train_size"]) == (8, 8, 32)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.copytree(tmp_path / "a", tmp_path / "c")
    proc = run_script("train.py", *TINY, "resume=true", "trainer.max_steps=null", "data.batch_size=16",
                      f"hydra.run.dir={tmp_path / 'a'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "8 samples into it, with 1 process(es) at batch 8; this run has 1 at batch 16" in proc.stdout
    resumed = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert resumed["steps"] == 5 + 2 and resumed["epochs"] == 2
    assert torch.load(path, weights_only=True)["batch_size"] == 16

    _edit_checkpoint(tmp_path / "b" / "checkpoints" / "last.pt", epoch_samples=31, batch_size=4)  # as if at batch 4
    nothing_left = run(_compose(*TINY, "resume=true", "trainer.max_steps=null"), run_dir=tmp_path / "b")
    assert nothing_left["steps"] == 5 and nothing_left["epochs"] == 2 and nothing_left["images_per_s"] is None
    assert torch.load(tmp_path / "b" / "checkpoints" / "last.pt", weights_only=True)["epoch"] == 2  # epoch done
    # TensorBoard: the stopped run logged step 5's epoch line (its weights evaluated); the epoch with no batch left
    # does not log it again, nor NaN train metrics
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "b" / "tensorboard"))
    events.Reload()
    for tag in ("train/loss", "train/accuracy", "epoch/images_per_s", "test/accuracy", "epoch/lr"):
        points = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [step for step, _ in points] == [4, 5] and all(math.isfinite(v) for _, v in points), (tag, points)

    _edit_checkpoint(tmp_path / "c" / "checkpoints" / "last.pt", train_size=99)
    with pytest.raises(ValueError, match="inside epoch 2 of a training set of 99 images, and this one has 32"):
        run(_compose(*TINY, "resume=true"), run_dir=tmp_path / "c")


def test_a_null_batch_size_trains_at_the_loaders_default(tmp_path):
    """data.batch_size=null is build_data's default (64): the run trains, checkpoints and resumes with it."""
    null = [*TINY, "data.batch_size=null", "data.train_size=160"]
    summary = run(_compose(*null, "trainer.max_steps=2"), run_dir=tmp_path)
    ckpt = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert summary["steps"] == 2 and (ckpt["batch_size"], ckpt["epoch_samples"]) == (64, 128)
    resumed = run(_compose(*null, "resume=true", "trainer.max_steps=null"), run_dir=tmp_path)
    assert resumed["steps"] == 3 + 3  # epoch 1's last 32 images, then epoch 2


def test_checkpoint_records_the_architecture_export_rebuilds(tmp_path):
    """Checkpoints hold the model's compress_arch, so export rebuilds the model even where the config cannot say
    its class count (an imagefolder dataset: the count comes from the class folders)."""
    from compress.checkpoint import load
    from compress.export import FILES, export_checkpoint

    run(_compose(*TINY, "trainer.max_steps=2"), run_dir=tmp_path)
    path = tmp_path / "checkpoints" / "last.pt"
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["arch"] == {"name": "resnet20", "kwargs": {"num_classes": 3, "input_size": 8, "in_chans": 3}}
    ckpt["config"]["data"] = {"name": "imagefolder", "root": "/data/x", "input_size": 8}
    del ckpt["sha256"]  # edited by hand: saved without a digest, like a checkpoint from before digests
    torch.save(ckpt, path)
    export_checkpoint(path, tmp_path / "out", onnx=False, latency=False, choose_stripe_modes=False)
    assert load(tmp_path / "out" / FILES[0])(torch.randn(2, 3, 8, 8)).shape == (2, 3)


def test_train_py_resume_keeps_the_checkpoints_trainer_settings(tmp_path):
    """`python train.py resume=true` continues with the checkpoint's trainer.* (its 2 epochs, not the 160 that
    optim=sgd_multistep would give now); a trainer key on the command line (max_steps) takes the new value, and
    a resume with nothing left to train says why."""
    def train(*args):
        proc = run_script("train.py", *args, f"hydra.run.dir={tmp_path}")
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout, json.loads((tmp_path / "summary.json").read_text())

    _, first = train(*TINY, "trainer.max_steps=3")
    saved_seconds = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["seconds"]
    record = {name: (tmp_path / ".hydra" / name).read_text() for name in ("overrides.yaml", "hydra.yaml")}
    out, again = train("resume=true")
    assert again["steps"] == 3 and "trainer.max_steps=3" in out and "nothing to train" in out
    # strict JSON (no NaN); no step ran: the checkpoint's images/s and wall time carry over; still in epoch 1
    json.loads((tmp_path / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in summary.json"))
    assert again["images_per_s"] == first["images_per_s"] > 0 and again["epochs"] == first["epochs"] == 1
    assert again["seconds"] > saved_seconds > 0  # the first process's time as its checkpoint says + this one's
    other = tmp_path.parent / f"{tmp_path.name}_other.pt"
    shutil.copy(tmp_path / "checkpoints" / "last.pt", other)
    # .hydra/config.yaml holds the config the resumed run trains with, not the resume command line's defaults
    written = yaml.safe_load((tmp_path / ".hydra" / "config.yaml").read_text())
    assert written["model"]["name"] == "resnet20" and written["data"]["name"] == "fake"
    assert yaml.safe_load((tmp_path / ".hydra" / "overrides.yaml").read_text()) == ["resume=true"]
    for refused, message in [(["resume=true", "model=vgg11"], r"model=\{'name': 'vgg11'.*a resumed run keeps its"),
                             # refused after the resume was accepted (config checks, the data): the record was this
                             # command's, or the run's config with batch_size 0
                             (["resume=true", "trainer.log_every=0"], r"trainer.log_every=0 must be an int >= 1"),
                             (["resume=true", "data.batch_size=0"], r"batch_size"),
                             (TINY, r"already holds a run \(checkpoints/last.pt\); a fresh run.*Pass resume=true"),
                             ([f"resume={other}"], r"already holds a run.*resume=.*\(another checkpoint\) would")]:
        proc = run_script("train.py", *refused, f"hydra.run.dir={tmp_path}")
        assert proc.returncode != 0 and re.search(message, proc.stderr), proc.stderr[-2000:]
        kept = yaml.safe_load((tmp_path / ".hydra" / "config.yaml").read_text())  # the run's, not the refused one's
        assert kept["model"]["name"] == "resnet20" and kept["trainer"]["max_steps"] == 3
        # Hydra's record of the command that wrote the checkpoint, not the refused one's
        assert {name: (tmp_path / ".hydra" / name).read_text() for name in record} == record
    # an unreadable last.pt: the run's record comes back from best.pt
    last = tmp_path / "checkpoints" / "last.pt"
    intact = last.read_bytes()
    last.write_bytes(intact[:1000])
    proc = run_script("train.py", *TINY, f"hydra.run.dir={tmp_path}")
    # (it does not send the user to resume=true, which cannot read last.pt either)
    assert proc.returncode != 0 and re.search(r"already holds a run whose checkpoints/last.pt is unreadable .*a fresh "
                                              r"run would .*resume=<file> hydra.run.dir=<a new folder>",
                                              proc.stderr), proc.stderr[-2000:]
    assert {name: (tmp_path / ".hydra" / name).read_text() for name in record} == record
    assert yaml.safe_load((tmp_path / ".hydra" / "config.yaml").read_text())["trainer"]["max_steps"] == 3
    proc = run_script("train.py", "resume=true", f"hydra.run.dir={tmp_path}")  # resuming it: refused, same record
    best = tmp_path / "checkpoints" / "best.pt"
    assert proc.returncode != 0 and "cannot be read as a torch checkpoint" in proc.stderr, proc.stderr[-2000:]
    assert f"resume={best} hydra.run.dir=<a new folder>" in " ".join(proc.stderr.split()), proc.stderr[-2000:]
    assert {name: (tmp_path / ".hydra" / name).read_text() for name in record} == record
    last.write_bytes(intact)
    _, resumed = train("resume=true", "trainer.max_steps=null")
    assert (first["steps"], resumed["steps"], resumed["epochs"]) == (3, 8, 2)


def test_run_trains_under_a_callers_no_grad_and_refuses_another_default_dtype(tmp_path):
    """engine.run called inside torch.no_grad() failed in backward ("element 0 of tensors does not require grad"),
    and under torch.set_default_dtype(torch.float64) built a float64 model the float32 data could not enter (digits)
    or trained silently in float64 (fake data)."""
    with torch.no_grad():
        summary = run(_compose(*TINY, "trainer.max_steps=2"), run_dir=tmp_path / "nograd")
        assert not torch.is_grad_enabled()  # (the caller's mode, back after the run)
    assert summary["steps"] == 2
    first = torch.load(tmp_path / "nograd" / "checkpoints" / "last.pt", weights_only=True)
    assert first["optimizer"]["state"]  # momentum buffers: SGD stepped with gradients
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(ValueError, match=r"train: torch's default dtype is torch.float64 .*"
                                             r"torch.set_default_dtype\(torch.float32\)"):
            run(_compose(*TINY, "trainer.max_steps=2"), run_dir=tmp_path / "f64")
    finally:
        torch.set_default_dtype(torch.float32)
    assert not (tmp_path / "f64").exists()


def test_a_run_trained_without_float16_resumes_with_float16_autocast(tmp_path, monkeypatch):
    """trainer.* may change on resume, but a run trained without float16 autocast (bf16, amp=false, a CPU run)
    resumed with trainer.amp_dtype=float16 failed in GradScaler.load_state_dict ("The source state dict is empty");
    it now starts a new loss scale. (float16 autocast is CUDA-only in train.py: forced here on the CPU.)"""
    run(_compose(*TINY, "trainer.max_steps=2"), run_dir=tmp_path)
    monkeypatch.setattr("compress.engine._amp_dtype", lambda cfg, device: torch.float16)
    summary = run(_compose(*TINY, "trainer.max_steps=4", "trainer.amp_dtype=float16", "resume=true"), run_dir=tmp_path)
    assert summary["steps"] == 4
    scale = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["scaler"]["scale"]
    assert 0 < scale <= 2.0**16  # a float16 run's scale, kept for the next resume


def test_a_finished_run_resumed_with_fewer_epochs_trains_nothing_and_keeps_its_record(tmp_path):
    """`resume=true trainer.epochs=1` on a finished 2-epoch run announced an LR schedule of a 1-epoch run "going on
    at epoch 3", then trained nothing, and left trainer.epochs: 1 in .hydra/config.yaml against its checkpoints'
    2. It says only that there is nothing to train, and the record keeps the run's config."""
    cosine = [o for o in TINY if not o.startswith("optim")] + ["optim=sgd_cosine", "optim.epochs=2"]
    for args in (cosine, ["resume=true", "trainer.epochs=1"]):
        proc = run_script("train.py", *args, f"hydra.run.dir={tmp_path}")
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert "nothing to train: the checkpoint has finished 2 epochs and trainer.epochs=1" in proc.stdout
    assert "LR schedule" not in proc.stdout + proc.stderr
    assert yaml.safe_load((tmp_path / ".hydra" / "config.yaml").read_text())["trainer"]["epochs"] == 2


@pytest.mark.parametrize("optim", [["optim=sgd_cosine"], ["optim=sgd_digits", "optim.warmup_epochs=1"]])
def test_resuming_with_more_epochs_follows_the_longer_schedule(tmp_path, optim):
    """A finished 2-epoch run resumed with trainer.epochs=4 trains epoch 3 at the LR a 4-epoch run has there (cosine
    to 0 over 4 epochs, with and without warmup), not the old schedule's end nor a mix of both."""
    cosine = [o for o in TINY if not o.startswith("optim")] + optim
    run(_compose(*cosine, "optim.epochs=2"), run_dir=tmp_path / "extended")
    extended = run(_compose(*cosine, "optim.epochs=2", "trainer.epochs=4", "trainer.max_steps=10", "resume=true"),
                   run_dir=tmp_path / "extended")
    straight = run(_compose(*cosine, "optim.epochs=4", "trainer.max_steps=10"), run_dir=tmp_path / "straight")
    assert extended["steps"] == straight["steps"] == 10  # inside epoch 3: the checkpoint holds the LR it trains at
    lrs = [torch.load(tmp_path / d / "checkpoints" / "last.pt", weights_only=True)["optimizer"]["param_groups"][0]["lr"]
           for d in ("extended", "straight")]
    assert lrs[0] == pytest.approx(lrs[1], rel=1e-12) and lrs[1] > 0.01


def test_resume_takes_trainer_and_data_location_keys_and_refuses_others(tmp_path, monkeypatch, capsys):
    """On the command line of a resume, trainer.*, data.root, data.num_workers and the batch sizes take their new values (a relative
    data.root is stored absolute, so the run resumes from any directory); any other key that differs is refused, one
    equal to the checkpoint's passes. trainer.seed is not read (the checkpoint's RNG streams go on): a note, and
    the record keeps the run's seed (it recorded the new one, which changed nothing). Another data.num_workers
    changes the augmentation streams: a note says so."""
    from compress.engine import _resume_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    run(_compose(*TINY, "trainer.max_steps=1", "data.root=data"), run_dir=tmp_path / "run")
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["config"]
    assert saved["data"]["root"] == str(tmp_path / "data")
    given = {"resume", "trainer.max_steps", "data.root", "data.num_workers", "data.batch_size", "optim.lr"}
    cfg = _compose(*TINY, "resume=true", "trainer.max_steps=3", "data.root=/elsewhere", "data.num_workers=2",
                   "data.batch_size=16")
    capsys.readouterr()
    merged, _ = _resume_config(cfg, tmp_path / "run", given)
    assert (merged.trainer.max_steps, merged.data.root, merged.data.num_workers) == (3, "/elsewhere", 2)
    assert f"resume: data.num_workers {saved['data']['num_workers']} -> 2: each loader worker draws its own " \
        "augmentation stream" in capsys.readouterr().out
    assert merged.data.batch_size == 16 and saved["data"]["batch_size"] == 8
    assert merged.optim.lr == saved["optim"]["lr"] and merged.trainer.epochs == 2
    with pytest.raises(ValueError, match=r"optim.lr=0.5 \(checkpoint: 0.1\): a resumed run keeps"):
        _resume_config(_compose(*TINY, "resume=true", "optim.lr=0.5"), tmp_path / "run", given)
    capsys.readouterr()
    seeded = _compose(*TINY, "resume=true", "trainer.seed=3")
    merged, _ = _resume_config(seeded, tmp_path / "run", {"resume", "trainer.seed"})
    assert merged.trainer.seed == saved["trainer"]["seed"] == 0
    assert "resume: trainer.seed=3 is not read (the run goes on with its checkpoint's random number streams" in \
        capsys.readouterr().out
    merged, _ = _resume_config(_compose(*TINY, "resume=true", "trainer.seed=3"), tmp_path / "run", None)  # (Python)
    assert merged.trainer.seed == 0


def _check_run_outputs(run_dir: Path, summary: dict) -> None:
    written = json.loads((run_dir / "summary.json").read_text())
    assert written == pytest.approx(summary)
    for key in ("test_accuracy", "stripes_total", "stripes_kept", "macs_dense", "macs_pruned_estimate", "macs_compact",
                "params", "epochs", "seconds", "run_dir", "checkpoint"):
        assert key in summary
    assert summary["stripes_total"] == 9 * (16 + 6 * 16 + 6 * 32 + 6 * 64)  # resnet20: 19 3x3 convs
    kept = summary["stripes_kept"] / summary["stripes_total"]
    assert summary["macs_pruned_estimate"] < summary["macs_dense"] * (kept + 0.1)
    ckpt = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert ckpt["epoch"] == 2 and ckpt["step"] == 8 and ckpt["config"]["model"]["name"] == "resnet20"
    assert {"model", "optimizer", "scheduler", "scaler", "rng"} <= ckpt.keys()
    assert (run_dir / "checkpoints" / "best.pt").is_file()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


SMOKE = ["data=fake", "data.input_size=32", "data.num_classes=5", "data.train_size=4", "data.test_size=2",
         "data.batch_size=2", "trainer.max_steps=2"]


@pytest.mark.parametrize("model", ["vgg16", "timm:resnet18"])
def test_smoke_other_families(tmp_path, model):
    summary = run(_compose(f"model.name={model}", *SMOKE), run_dir=tmp_path)
    assert summary["steps"] == 2 and summary["stripes_total"] > 0 and 0 <= summary["test_accuracy"] <= 1


def test_train_py_entry_point_resnet50(tmp_path):
    cmd = [sys.executable, "train.py", "model=resnet50", *SMOKE, f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["model"] == "resnet50" and summary["steps"] == 2
    assert summary["stripes_total"] == 9 * (64 * 3 + 128 * 4 + 256 * 6 + 512 * 3) + 49 * 64
    assert (tmp_path / ".hydra" / "config.yaml").is_file() and proc.stdout.count("test accuracy") == 1
    log = (tmp_path / "train.log").read_text()  # the run's messages, with times, beside its outputs
    assert "epoch 1/" in log and "test accuracy" in log and "[INFO]" in log


@pytest.fixture
def sigterm_caught():
    """SIGTERMs this process sends itself that no handler of train.py's takes land here (a list), not in pytest's
    default action, which would end the test session."""
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda *_: seen.append(True))
    yield seen
    signal.signal(signal.SIGTERM, previous)


def test_ctrl_c_during_training_saves_the_step_and_a_second_one_stops_at_once(tmp_path, monkeypatch):
    """Ctrl-C (SIGINT) mid-epoch raised KeyboardInterrupt inside the step: every step since the last checkpoint was
    lost, with a long traceback. As SIGTERM now: the step ends, last.pt is written there, status 130; a second
    Ctrl-C stops at once (nothing saved at the step)."""
    def train(*args):  # (in this process: a KeyboardInterrupt that escapes must fail the test, not end the session)
        try:
            return run_script("train.py", *args, cwd=tmp_path / "launch")
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C escaped train.py as a KeyboardInterrupt")

    args = signalling_model(tmp_path / "launch", "sigint_net_a")
    monkeypatch.setenv("COMPRESS_TEST_SIGTERM", "3:1:::INT")
    r = train(*args, f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 130, r.stderr[-3000:]
    assert "Ctrl-C: the run stops after this step and writes last.pt there" in r.stderr
    assert "train.py stopped: SIGINT; last.pt holds step 3 (epoch 1, batch 3 of 8)" in r.stderr
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["step"] == 3
    monkeypatch.setenv("COMPRESS_TEST_SIGTERM", "3:2:::INT")
    args = signalling_model(tmp_path / "launch", "sigint_net_b")
    r = train(*args, f"hydra.run.dir={tmp_path / 'twice'}")
    assert r.returncode == 130, r.stderr[-3000:]
    assert "train.py stopped: SIGINT; resume=true continues from the run's last checkpoint" in r.stderr
    assert not (tmp_path / "twice" / "checkpoints" / "last.pt").exists()


def test_sigterm_during_training_saves_the_step_and_stops_with_status_143(tmp_path, monkeypatch, sigterm_caught):
    """A batch system's SIGTERM mid-epoch: train.py finishes the step it is in, writes last.pt at that step (no
    trainer.checkpoint_every here), says so in train.log and exits with the signal's status (143); resume=true goes
    on from that step; also when the DataLoader workers get the signal too, and when it comes twice at once (Slurm
    and torchrun's copy). A second SIGTERM seconds later stops at once, inside the step; one in an epoch's last step
    stops after the epoch's evaluation and checkpoint."""
    args = signalling_model(tmp_path / "launch", "sigterm_net_a")
    monkeypatch.setenv("COMPRESS_TEST_SIGTERM", "3")
    r = run_script("train.py", *args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path / "launch")
    assert r.returncode == 143, r.stderr[-3000:]
    assert not sigterm_caught
    # on the terminal (a batch job's output file) too: Python prints nothing for the SystemExit itself
    assert "train.py stopped: SIGTERM; last.pt holds step 3 (epoch 1, batch 3 of 8)" in r.stderr
    assert re.search(r"\[ERROR\] the run stopped: Terminated: SIGTERM; last.pt holds step 3 \(epoch 1, batch 3 of 8\); "
                     r"resume=true continues from there", (tmp_path / "run" / "train.log").read_text())
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert (ckpt["step"], ckpt["epoch"], ckpt["epoch_batches"]) == (3, 0, 3)

    monkeypatch.delenv("COMPRESS_TEST_SIGTERM")
    r = run_script("train.py", *args, "resume=true", "trainer.max_steps=5", f"hydra.run.dir={tmp_path / 'run'}",
                   cwd=tmp_path / "launch")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 5

    # Slurm signals every process of the job: the DataLoader workers ignore it, and go on loading until the stop
    monkeypatch.setenv("COMPRESS_TEST_SIGTERM", "3:1:children")
    r = run_script("train.py", *args, "data.num_workers=2", f"hydra.run.dir={tmp_path / 'workers'}",
                   cwd=tmp_path / "launch")
    assert r.returncode == 143 and not sigterm_caught, r.stderr[-3000:]
    assert torch.load(tmp_path / "workers" / "checkpoints" / "last.pt", weights_only=True)["step"] == 3

    # twice at once, as each rank of a torchrun job gets it when the batch system signals every process (the
    # launcher passes on its own): one stop at the step (it stopped at once, losing the steps since the last checkpoint)
    monkeypatch.setenv("COMPRESS_TEST_SIGTERM", "3:2")
    r = run_script("train.py", *args, f"hydra.run.dir={tmp_path / 'copies'}", cwd=tmp_path / "launch")
    assert r.returncode == 143 and not sigterm_caught, r.stderr[-3000:]
    assert torch.load(tmp_path / "copies" / "checkpoints" / "last.pt", weights_only=True)["step"] == 3

    monkeypatch.setenv("COMPRESS_TEST_SIGTERM", f"3:2::{REPEAT_S + 0.5}")  # a second one later: stop at once
    args = signalling_model(tmp_path / "launch", "sigterm_net_b")
    r = run_script("train.py", *args, f"hydra.run.dir={tmp_path / 'twice'}", cwd=tmp_path / "launch")
    assert r.returncode == 143 and not sigterm_caught
    assert not (tmp_path / "twice" / "checkpoints" / "last.pt").exists()  # stopped inside step 3: nothing saved
    assert re.search(r"\[ERROR\] the run stopped: Terminated: SIGTERM; resume=true continues from the run's last "
                     r"checkpoint, if it wrote one", (tmp_path / "twice" / "train.log").read_text())

    monkeypatch.setenv("COMPRESS_TEST_SIGTERM", "8")  # in the epoch's last step: the epoch ends as usual, then it stops
    args = signalling_model(tmp_path / "launch", "sigterm_net_c")
    r = run_script("train.py", *args, f"hydra.run.dir={tmp_path / 'end'}", cwd=tmp_path / "launch")
    assert r.returncode == 143 and not sigterm_caught
    log = (tmp_path / "end" / "train.log").read_text()
    assert "epoch 1/2 step 8" in log and "last.pt holds step 8, the end of epoch 1; resume=true continues" in log
    ckpt = torch.load(tmp_path / "end" / "checkpoints" / "last.pt", weights_only=True)
    assert (ckpt["step"], ckpt["epoch"], ckpt["epoch_batches"]) == (8, 1, 0)


def test_a_process_forked_inside_sigterm_raises_ignores_sigterm(sigterm_caught):
    """sigterm_raises' handler is inherited by forked processes (DataLoader workers), which must not raise
    Terminated on the batch system's SIGTERM (a worker that stopped failed the parent's next batch): the forked
    child ignores it and runs on (here to its normal exit, status 0)."""
    from compress._stop import Terminated, sigterm_raises

    with sigterm_raises():
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 0
            try:
                time.sleep(1.5)
            except Terminated:
                code = 7
            except BaseException:
                code = 8
            os._exit(code)
        time.sleep(0.5)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert not sigterm_caught


def test_pix_zeta_trains_a_bottleneck_resnet_with_pix_blocks(tmp_path):
    from compress.pix import PiXBlock

    cfg = _compose(*TINY, "model=resnet29_bottleneck", "pix.zeta=4", "trainer.max_steps=2")
    summary = run(cfg, run_dir=tmp_path)
    state = _weights(tmp_path)
    assert summary["steps"] == 2
    # every bottleneck's squeeze conv is a PiX predictor now (9 blocks), and the model still trained
    import compress

    model = compress.create_model("resnet29_bottleneck", num_classes=3)
    compress.apply_pix(model, 4)
    pix_names = [n for n, m in model.named_modules() if isinstance(m, PiXBlock)]
    assert len(pix_names) == 9 and all(f"{n}.weight" in state for n in pix_names)
    # the trained model is the PiX model (a PiX block's predictor weight has the squeeze conv's name and shape)
    assert {k for k in state if not k.endswith(".skeleton")} == set(model.state_dict())
    assert summary["macs_compact"] is not None  # and it compacts, PiX blocks kept


def test_init_fine_tunes_a_compact_model(tmp_path, monkeypatch):
    import compress
    from compress.stripe import StripeConv2d

    trained = run(_compose(*TINY), run_dir=tmp_path / "train")
    assert trained["stripes_kept"] < trained["stripes_total"]
    skeleton = compress.create_model("resnet20", num_classes=3, input_size=8)
    compress.attach_skeletons(skeleton)
    skeleton.load_state_dict(_weights(tmp_path / "train"))
    small = compress.compact(skeleton.eval(), threshold=0.95)
    compress.save(small, tmp_path / "small.safetensors")
    before = {n: m.weight.detach().clone() for n, m in small.named_modules() if isinstance(m, StripeConv2d)}
    assert before

    monkeypatch.chdir(tmp_path)  # init= relative to the working directory; the checkpoint keeps it absolute
    no_model = [o for o in TINY if not o.startswith("model=")]  # model= is the default resnet56: init= decides
    summary = run(_compose(*no_model, "init=small.safetensors", "trainer.max_steps=2"), run_dir=tmp_path / "ft")
    assert summary["model"] == "resnet20" and summary["stripes_total"] == 0
    masks = [m.stripe_mask() for m in small.modules() if isinstance(m, StripeConv2d)]
    kept, total = sum(int(m.sum()) for m in masks), sum(m.numel() for m in masks)
    assert summary["compact_stripes"] == {"layers": len(before), "stripes_kept": kept, "stripes_total": total}
    assert 0 < kept < total and f"{kept} / {total} kept in the compact model's {len(before)} stripe convs, out of their filters'" in \
        format_summary(summary)
    ckpt = torch.load(tmp_path / "ft" / "checkpoints" / "last.pt", weights_only=True)
    assert ckpt["config"]["init"] == str(tmp_path / "small.safetensors")
    tuned = ckpt["model"]
    changed = [n for n in before if not torch.equal(tuned[f"{n}.weight"], before[n])]
    assert changed, "fine-tuning did not update any stripe conv's kept weights"
    assert all(tuned[f"{n}.weight"].shape == before[n].shape for n in before)
    with pytest.raises(ValueError, match="predicts 3 classes and data fake has 5"):
        run(_compose(*TINY, "init=small.safetensors", "data.num_classes=5"), run_dir=tmp_path / "ft5")

    # the checkpoint holds the compact structure: with the init file gone, the run resumes and exports
    (tmp_path / "small.safetensors").rename(tmp_path / "moved.safetensors")
    resumed = run(_compose(*no_model, "init=small.safetensors", "trainer.max_steps=4", "resume=true"),
                  run_dir=tmp_path / "ft")
    assert resumed["steps"] == 4 and resumed["model"] == "resnet20"
    from compress.export import export_checkpoint

    export_checkpoint(tmp_path / "ft" / "checkpoints" / "last.pt", tmp_path / "out", onnx=False, latency=False)
    exported = compress.load(tmp_path / "out" / "model.compact.safetensors")
    x = torch.randn(2, 3, 8, 8)
    tuned = compress.load(tmp_path / "moved.safetensors")
    tuned.load_state_dict(torch.load(tmp_path / "ft" / "checkpoints" / "last.pt", weights_only=True)["model"])
    with torch.no_grad():
        torch.testing.assert_close(exported(x), tuned.eval()(x), rtol=1e-5, atol=1e-5)


def test_a_fine_tuning_run_of_stripe_mode_layers_resumes(tmp_path):
    """Resuming an init= run rebuilds the compact structure from the checkpoint's recipe (its stripe indices come
    with the weights): no forward runs before they are loaded."""
    import compress
    from compress.stripe import StripeConv2d

    skeleton = compress.create_model("resnet20", num_classes=3, input_size=8)
    compress.attach_skeletons(skeleton)
    with torch.no_grad():
        for m in skeleton.modules():
            if hasattr(m, "skeleton"):
                m.skeleton.copy_(torch.rand(m.skeleton.shape, generator=torch.Generator().manual_seed(1)) > 0.5)
    small = compress.compact(skeleton.eval(), threshold=0.5)
    for m in small.modules():
        if isinstance(m, StripeConv2d):
            m.mode = "stripe"
    compress.save(small, tmp_path / "small.safetensors")
    no_model = [o for o in TINY if not o.startswith(("model=", "prune"))]
    init = f"init={tmp_path / 'small.safetensors'}"
    assert run(_compose(*no_model, init, "trainer.max_steps=1"), run_dir=tmp_path / "ft")["steps"] == 1
    assert run(_compose(*no_model, init, "trainer.max_steps=2", "resume=true"), run_dir=tmp_path / "ft")["steps"] == 2


def test_init_naming_a_directory_or_nothing_says_which(tmp_path):
    """init= naming export.py's out directory says it is a directory and names the file in it (it said "no such
    file"); a missing file says so."""
    out = tmp_path / "exported"
    out.mkdir()
    with pytest.raises(ValueError, match=r"exported: a directory; give a compact model file.*model.compact.safetensors"):
        run(_compose(*TINY, f"init={out}"), run_dir=tmp_path / "a")
    with pytest.raises(ValueError, match=r"missing.safetensors: no such file; give a compact model file"):
        run(_compose(*TINY, f"init={tmp_path / 'missing.safetensors'}"), run_dir=tmp_path / "b")


def test_init_refuses_a_file_with_non_finite_weights(tmp_path):
    """init= of a compact file holding NaN warned (compress.load), trained, and then stopped with "the run diverged
    ... with a lower optim.lr": no learning rate helps a file that was NaN from the start; it is refused up front,
    naming the tensor, as model.weights= refuses such a file."""
    import compress

    small = compress.compact(compress.create_model("resnet20", num_classes=3, input_size=8).eval(), fold_bn=True)
    with torch.no_grad():
        small.fc.weight[0, 0] = float("nan")
    compress.save(small, tmp_path / "nan.safetensors")
    no_model = [o for o in TINY if not o.startswith("model=")]
    with pytest.warns(UserWarning, match="tensors hold NaN"), \
            pytest.raises(ValueError, match=r"init=.*nan.safetensors: the file holds NaN or inf values in fc.weight"):
        run(_compose(*no_model, f"init={tmp_path / 'nan.safetensors'}"), run_dir=tmp_path / "ft")
    assert not (tmp_path / "ft" / "checkpoints").exists()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_init_casts_a_compact_file_of_another_dtype_to_float32_and_says_so(tmp_path, monkeypatch, dtype):
    """A compact file saved in bfloat16/float16/float64 (compress.save keeps the dtype) failed with "the model's
    forward failed on one 3x8x8 image: Input type (float) and bias type (c10::BFloat16) should be the same", which
    blamed the input size; it is cast to float32, the dtype training keeps its weights in, with a note."""
    import compress
    import compress.engine as engine
    from compress.export import load_training_checkpoint

    skeleton = compress.create_model("resnet20", num_classes=3, input_size=8)
    compress.attach_skeletons(skeleton)
    compact = compress.compact(skeleton.eval(), threshold=0.0).to(dtype)
    compress.save(compact, tmp_path / "small.safetensors")
    said = []
    monkeypatch.setattr(engine, "say", lambda text, *args: said.append(text))
    no_model = [o for o in TINY if not o.startswith(("model=", "prune"))]
    init = f"init={tmp_path / 'small.safetensors'}"
    assert run(_compose(*no_model, init, "trainer.max_steps=1"), run_dir=tmp_path / "ft")["steps"] == 1
    name = str(dtype).removeprefix("torch.")
    assert any(t.startswith(f"init={tmp_path / 'small.safetensors'}: its {name} tensors were cast to float32")
               for t in said), said
    assert run(_compose(*no_model, init, "trainer.max_steps=2", "resume=true"), run_dir=tmp_path / "ft")["steps"] == 2
    model, _ = load_training_checkpoint(tmp_path / "ft" / "checkpoints" / "last.pt")
    assert {t.dtype for t in model.state_dict().values() if t.is_floating_point()} == {torch.float32}


def test_init_refuses_a_model_from_the_command_line_that_it_would_ignore(tmp_path, monkeypatch):
    """init= sets the architecture: a model= naming another one is refused (it would be ignored, and the run's
    .hydra record would name it); naming the file's own model passes."""
    import compress
    import compress.engine as engine

    skeleton = compress.create_model("resnet20", num_classes=3, input_size=8)
    compress.attach_skeletons(skeleton)
    compress.save(compress.compact(skeleton.eval(), threshold=0.0), tmp_path / "small.safetensors")
    no_model = [o for o in TINY if not o.startswith("model=")]
    init = [f"init={tmp_path / 'small.safetensors'}", "trainer.max_steps=1"]
    monkeypatch.setattr(engine, "_command_line_keys", lambda: {"model", "init", "trainer.max_steps"})
    with pytest.raises(ValueError, match=r"holds a compact resnet20, so model=resnet56 would be ignored; drop"):
        run(_compose(*no_model, "model=resnet56", *init), run_dir=tmp_path / "a")
    assert run(_compose(*no_model, "model=resnet20", *init), run_dir=tmp_path / "b")["model"] == "resnet20"
    said = []  # prune settings given with init= say that they have no effect (no skeletons are attached)
    monkeypatch.setattr(engine, "say", lambda text, *args: said.append(text))
    monkeypatch.setattr(engine, "_command_line_keys", lambda: {"init", "prune.alpha"})
    run(_compose(*no_model, "model=resnet20", *init), run_dir=tmp_path / "c")
    assert any(t.startswith("note: the prune settings have no effect with init=") for t in said)


def test_bad_checkpoint_files_are_clear_errors(tmp_path):
    """resume= and export's ckpt= read checkpoints with weights_only=True and name what is wrong with a file."""
    from compress._trainstate import load_checkpoint
    from compress.export import load_training_checkpoint

    good = tmp_path / "good.pt"
    torch.save({"model": {"w": torch.randn(2)}, "config": {}}, good)
    (tmp_path / "truncated.pt").write_bytes(good.read_bytes()[:100])
    (tmp_path / "summary.json").write_text('{"steps": 2}')
    torch.save(torch.nn.Linear(2, 2), tmp_path / "whole_model.pt")
    torch.save({"w": torch.randn(2)}, tmp_path / "state_dict.pt")
    (tmp_path / "text.pt").write_text("hello\n")
    (tmp_path / "folder.pt").mkdir()
    import compress

    compress.save(compress.create_model("resnet20", num_classes=3), tmp_path / "compact.safetensors")
    cases = {"truncated.pt": "truncated or corrupt", "summary.json": "refused it",
             "text.pt": r"is not a torch checkpoint \(it starts with b'hell'; torch.save writes a zip archive\)",
             "folder.pt": "is a directory, not a checkpoint",
             "compact.safetensors": "is a safetensors file.*fine-tune a compact model with train.py init=",
             "whole_model.pt": "never loaded here because loading them can run code",
             "state_dict.pt": r"not a train.py checkpoint \(it has no \['model', 'config'\]"}
    for name, message in cases.items():
        for read in (load_checkpoint, load_training_checkpoint):
            with pytest.raises(ValueError, match=message):
                read(tmp_path / name)
    with pytest.raises(ValueError, match=r"it has no \['optimizer'"):  # resume needs the whole training state
        run(_compose(*TINY, f"resume={good}"), run_dir=tmp_path / "run")


def test_a_flipped_byte_in_a_checkpoint_is_detected(tmp_path):
    from compress._trainstate import atomic_save, load_checkpoint

    weights = torch.randn(1000)
    path = atomic_save({"model": {"w": weights}, "config": {"lr": 0.1}}, tmp_path / "last.pt")
    assert torch.equal(load_checkpoint(path)["model"]["w"], weights) and "sha256" not in load_checkpoint(path)
    data = bytearray(path.read_bytes())
    at = data.find(weights[:4].numpy().tobytes())  # the tensor's stored bytes: the file still parses
    assert at > 0
    data[at + 2001] ^= 0x10
    path.write_bytes(bytes(data))
    assert not torch.equal(torch.load(path, weights_only=True)["model"]["w"], weights)  # torch.load does not notice
    with pytest.raises(ValueError, match="last.pt is corrupt.*SHA-256"):
        load_checkpoint(path)


def test_every_single_byte_flip_of_a_checkpoint_loads_unchanged_or_is_a_clear_error(tmp_path):
    """Flipping any one byte of a (small) checkpoint: load_checkpoint returns the saved contents or raises ValueError
    naming the file, never altered values or another exception from inside torch.load."""
    from compress._digest import digest
    from compress._trainstate import atomic_save, load_checkpoint

    saved = {"model": {"w": torch.randn(5), "n": torch.tensor(3)}, "config": {"lr": 0.1, "name": "x"}, "step": 7}
    good = atomic_save(saved, tmp_path / "good.pt").read_bytes()
    bad = tmp_path / "bad.pt"
    errors = 0
    for at in range(len(good)):
        data = bytearray(good)
        data[at] ^= 0x5A
        bad.write_bytes(bytes(data))
        try:
            ckpt = load_checkpoint(bad)
        except ValueError as err:
            assert "bad.pt" in str(err)
            errors += 1
            continue
        # (a flip inside the digest's own key name loads as a checkpoint from before digests, contents intact)
        assert digest({k: ckpt.get(k) for k in saved}) == digest(saved), f"byte {at}: loaded altered contents"
    assert errors > len(good) // 4


def test_a_complex_tensor_is_of_the_wrong_kind_even_for_a_non_float_entry():
    """check_weight_kinds refuses complex tensors outright: a complex step counter is no more floating point than
    the model's int64 one, so the float/non-float comparison alone let it through, and load_state_dict dropped its
    imaginary part without a word."""
    from compress._trainstate import check_weight_kinds

    bn = torch.nn.BatchNorm1d(3)
    weights = {k: v.clone() for k, v in bn.state_dict().items()}
    weights["weight"] = torch.randn(3)
    check_weight_kinds(bn, weights, "w.pt")  # the model's own kinds: accepted
    weights["num_batches_tracked"] = torch.tensor(complex(*torch.randn(2).tolist()), dtype=torch.complex64)
    with pytest.raises(ValueError, match=r"w.pt: tensors of the wrong kind: num_batches_tracked \(torch.complex64; "
                                         r"the model's is torch.int64\)"):
        check_weight_kinds(bn, weights, "w.pt")


def test_set_rng_state_restores_the_python_and_numpy_streams():
    """resume restores every random stream a checkpoint captured: the draws of Python's `random` (the data's
    augmentations) and NumPy after set_rng_state repeat those after rng_state, as torch's do."""
    import random

    import numpy as np

    from compress._trainstate import rng_state, set_rng_state

    random.seed(torch.randint(1 << 30, ()).item())
    np.random.seed(torch.randint(1 << 30, ()).item())
    state = rng_state()
    first = (random.random(), np.random.rand(), random.gauss(0, 1), np.random.randn(), torch.rand(2))
    set_rng_state(state)
    again = (random.random(), np.random.rand(), random.gauss(0, 1), np.random.randn(), torch.rand(2))
    assert first[:4] == again[:4] and torch.equal(first[4], again[4])


def _crash_in_step_4(monkeypatch, cfg, run_dir) -> None:
    """Run `cfg` into `run_dir` until its 4th training step raises, as a crash there would."""
    import compress.engine as engine

    real_step, calls = engine.train_step, []

    def crashing_step(*args):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("simulated crash")
        return real_step(*args)

    monkeypatch.setattr(engine, "train_step", crashing_step)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(cfg, run_dir=run_dir)
    monkeypatch.setattr(engine, "train_step", real_step)


def test_an_epoch_with_no_batch_left_after_a_resume_logs_the_batches_trained_before(tmp_path, monkeypatch, capsys):
    """A checkpoint_every save inside epoch 1 (step 3), resumed where the epoch's rest is a batch of one image,
    which is dropped: the epoch trains no step here, but its line and TensorBoard give the loss and accuracy of
    the 24 images trained before (they said NaN, and TensorBoard had none), no images/s, and no warning of a
    scheduler step before an optimizer step."""
    options = [*TINY, "trainer.checkpoint_every=3"]
    _crash_in_step_4(monkeypatch, _compose(*options), tmp_path)
    path = tmp_path / "checkpoints" / "last.pt"
    loss_sum, correct, seen = torch.load(path, weights_only=True)["epoch_sums"]
    assert seen == 24
    _edit_checkpoint(path, epoch_samples=31, batch_size=4)  # as if 31 of the 32 images were trained at batch 4
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = run(_compose(*options, "resume=true"), run_dir=tmp_path)
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert summary["steps"] == 3 + 4
    metrics = _epoch_metrics(tmp_path)
    assert metrics[(3, "train/loss")] == pytest.approx(loss_sum / seen, rel=1e-6)
    assert metrics[(3, "train/accuracy")] == pytest.approx(correct / seen, rel=1e-6)
    assert sorted(step for step, _ in metrics) == [3, 3, 7, 7]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("epoch/images_per_s")] == [7]
    assert f"epoch 1/2 step 3 lr 0.1 train loss {loss_sum / seen:.4f}" in capsys.readouterr().out


def test_checkpoint_every_lets_a_crashed_run_resume_inside_an_epoch(tmp_path, monkeypatch):
    """trainer.checkpoint_every=3 writes last.pt after step 3, inside epoch 1; a run that crashes in step 4
    resumes from there and ends with an uninterrupted run's weights."""

    full = run(_compose(*DIGITS), run_dir=tmp_path / "full")
    _crash_in_step_4(monkeypatch, _compose(*DIGITS, "trainer.checkpoint_every=3"), tmp_path / "parts")
    ckpt = torch.load(tmp_path / "parts" / "checkpoints" / "last.pt", weights_only=True)
    assert (ckpt["epoch"], ckpt["epoch_batches"], ckpt["step"]) == (0, 3, 3)
    # resumed with nothing left to train: never evaluated, no epoch's rate; summary.json says null (strict JSON)
    shutil.copytree(tmp_path / "parts", tmp_path / "idle")
    idle = run(_compose(*DIGITS, "trainer.checkpoint_every=3", "trainer.max_steps=3", "resume=true"),
               run_dir=tmp_path / "idle")
    strict = json.loads((tmp_path / "idle" / "summary.json").read_text(),
                        parse_constant=lambda c: pytest.fail(f"summary.json holds {c}"))
    assert strict == {**idle, "seconds": strict["seconds"]} and idle["steps"] == 3
    assert (idle["test_accuracy"], idle["best_test_accuracy"], idle["test_loss"], idle["images_per_s"]) == (None,) * 4
    assert "test accuracy   -  (best -)" in format_summary(idle)
    resumed = run(_compose(*DIGITS, "trainer.checkpoint_every=3", "resume=true"), run_dir=tmp_path / "parts")
    assert resumed["steps"] == full["steps"] == 8
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "parts")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert _epoch_metrics(tmp_path / "parts") == pytest.approx(_epoch_metrics(tmp_path / "full"), rel=1e-6)


def test_resume_auto_starts_afresh_until_a_checkpoint_exists_then_continues_it(tmp_path, monkeypatch, capsys):
    """A requeued job killed before its first checkpoint (4 steps per epoch, killed in step 4) starts again with
    resume=auto; killed after one, it continues, and ends with an uninterrupted run's weights."""
    full = run(_compose(*TINY), run_dir=tmp_path / "full")
    _crash_in_step_4(monkeypatch, _compose(*TINY, "resume=auto"), tmp_path / "parts")
    assert not (tmp_path / "parts" / "checkpoints" / "last.pt").exists()
    assert "resume=auto: no checkpoints/last.pt in" in capsys.readouterr().out
    _crash_in_step_4(monkeypatch, _compose(*TINY, "resume=auto", "trainer.checkpoint_every=2"), tmp_path / "parts")
    assert torch.load(tmp_path / "parts" / "checkpoints" / "last.pt", weights_only=True)["step"] == 2
    resumed = run(_compose(*TINY, "resume=auto", "trainer.checkpoint_every=2"), run_dir=tmp_path / "parts")
    assert "resume=auto: continuing" in capsys.readouterr().out
    assert resumed["steps"] == full["steps"] == 8
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "parts")
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_resume_from_a_file_into_a_new_run_dir_carries_its_best_pt(tmp_path, capsys):
    """resume=<file> into a new run dir copies the best.pt holding the checkpoint's best weights (beside a last.pt, or
    the file itself), so the new dir has one even when the resumed run never beats it; without one it says so."""
    run(_compose(*TINY, "trainer.max_steps=4"), run_dir=tmp_path / "a")
    best = tmp_path / "a" / "checkpoints" / "best.pt"
    for name, source in (("b", tmp_path / "a" / "checkpoints" / "last.pt"), ("c", best)):
        run(_compose(*TINY, "trainer.max_steps=4", f"resume={source}"), run_dir=tmp_path / name)  # trains nothing
        assert (tmp_path / name / "checkpoints" / "best.pt").read_bytes() == best.read_bytes()
        assert f"resume: copied {best}" in capsys.readouterr().out
    # a best.pt beside the file that another run wrote (its best accuracy differs) is not that checkpoint's best
    import compress.engine as engine

    real_evaluate = engine.evaluate
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "evaluate", lambda *a, **k: {**real_evaluate(*a, **k), "accuracy": 0.99})
        run(_compose(*TINY, "trainer.max_steps=4"), run_dir=tmp_path / "other")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copyfile(tmp_path / "a" / "checkpoints" / "last.pt", mixed / "last.pt")
    shutil.copyfile(tmp_path / "other" / "checkpoints" / "best.pt", mixed / "best.pt")
    capsys.readouterr()
    run(_compose(*TINY, "trainer.max_steps=4", f"resume={mixed / 'last.pt'}"), run_dir=tmp_path / "e")
    assert not (tmp_path / "e" / "checkpoints" / "best.pt").exists()
    assert "resume: no best.pt with the checkpoint's best test accuracy" in capsys.readouterr().out
    best.unlink()
    run(_compose(*TINY, "trainer.max_steps=4", f"resume={tmp_path / 'a' / 'checkpoints' / 'last.pt'}"),
        run_dir=tmp_path / "d")
    assert not (tmp_path / "d" / "checkpoints" / "best.pt").exists()
    assert "resume: no best.pt with the checkpoint's best test accuracy" in capsys.readouterr().out


@pytest.mark.parametrize("fold_bn", [True, False])
def test_init_notes_a_bn_folded_compact_model(tmp_path, monkeypatch, capsys, fold_bn):
    import compress

    skeleton = compress.create_model("resnet20", num_classes=3, input_size=8)
    compress.attach_skeletons(skeleton)
    compress.save(compress.compact(skeleton.eval(), threshold=0.0, fold_bn=fold_bn), tmp_path / "small.safetensors")
    monkeypatch.chdir(tmp_path)
    no_model = [o for o in TINY if not o.startswith("model=")]
    run(_compose(*no_model, "init=small.safetensors", "trainer.max_steps=1"), run_dir=tmp_path / "ft")
    assert ("has its BatchNorms folded" in capsys.readouterr().out) == fold_bn


def test_resume_after_a_crash_logs_each_step_once_and_best_pt_is_written_first(tmp_path, monkeypatch):
    """A run killed after its checkpoint at step 2 had logged step 3; resumed, it logs step 3 again, and TensorBoard
    (purge_step) shows each step once. best.pt is written before last.pt, so a kill between the two cannot leave a
    last.pt that claims best weights which were never written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import compress.engine as engine

    options = [*TINY, "trainer.checkpoint_every=2", "trainer.log_every=1"]
    _crash_in_step_4(monkeypatch, _compose(*options), tmp_path)
    written = []
    real_save = engine.atomic_save
    monkeypatch.setattr(engine, "atomic_save",
                        lambda obj, path: (written.append((Path(path).name, obj["step"])), real_save(obj, path))[1])
    summary = run(_compose(*options, "resume=true"), run_dir=tmp_path)
    bests = [i for i, (name, _) in enumerate(written) if name == "best.pt"]
    assert bests and all(written[i + 1] == ("last.pt", written[i][1]) for i in bests), written
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars("train/loss_step")]
    assert steps == list(range(1, summary["steps"] + 1))


def test_trainer_seed_seeds_the_data_unless_data_seed_is_given(tmp_path):
    """trainer.seed also seeds the data (shuffle order, worker seeds, fake images), so a seed sweep varies it; an
    explicit data.seed stays. The checkpoint records the seed the data used."""
    def first_batch_and_seed(*overrides):
        run_dir = tmp_path / "_".join(overrides)
        run(_compose(*TINY, "trainer.max_steps=1", *overrides), run_dir=run_dir)
        config = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["config"]
        from compress.data import build_data

        x, _ = next(iter(build_data(config["data"]).train))
        return x, config["data"]["seed"]

    x0, seed0 = first_batch_and_seed("trainer.seed=0")
    x1, seed1 = first_batch_and_seed("trainer.seed=1")
    x5, seed5 = first_batch_and_seed("trainer.seed=1", "+data.seed=5")
    assert (seed0, seed1, seed5) == (0, 1, 5)
    assert not torch.equal(x0, x1) and not torch.equal(x1, x5)


@pytest.mark.parametrize("plus", ["+", "++"])
def test_a_key_added_with_plus_to_a_fixed_group_is_refused(tmp_path, plus):
    """A misspelled key added with + (or Hydra's add-or-set ++) is refused before anything trains, and the refused
    run leaves no run dir that holds only Hydra's files."""
    proc = run_script("train.py", *TINY, "trainer.max_steps=1", f"{plus}prune.alpah=1e-5",
                      f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode != 0
    assert re.search(rf"(^|\s){re.escape(plus)}prune.alpah: prune has no key 'alpah', so it would be ignored \(its "
                     "keys: alpha,", proc.stderr)
    assert not (tmp_path / "run").exists()


def test_a_run_interrupted_before_it_wrote_anything_leaves_no_run_dir(tmp_path, monkeypatch):
    """Ctrl-C (KeyboardInterrupt, not an Exception) while a run starts: the run dir of Hydra's files only goes too."""
    from cli import _script

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(_script("train.py"), "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_script("train.py", *TINY, f"hydra.run.dir={tmp_path / 'run'}")
    assert not (tmp_path / "run").exists()


def test_train_py_notes_settings_that_have_no_effect(tmp_path):
    """pix.tau on the command line without pix.zeta adds no PiX block, optim.skeleton_weight_decay without prune=swp
    has no skeleton to decay: the run says so instead of ignoring them. (pix.tau set with Hydra's ++, which only sets
    an existing key: not refused as an added one.)"""
    dense = [o for o in TINY if not o.startswith("prune")]
    proc = run_script("train.py", *dense, "trainer.max_steps=1", "++pix.tau=0.3", "prune=none",
                      "optim.skeleton_weight_decay=0", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "note: pix.tau=0.3 has no effect without pix.zeta (no PiX blocks)" in proc.stdout
    assert "note: optim.skeleton_weight_decay=0 has no effect: this run has no skeletons (prune=none; prune=swp " \
        "attaches them)" in proc.stdout


def test_a_ranks_own_hydra_dir_is_removed_only_when_it_holds_nothing_else(tmp_path):
    """Under torchrun a rank that started in another second than rank 0 got its own Hydra run dir; it is removed when
    it holds only Hydra's start-up files, never otherwise."""
    from compress._files import remove_if_only_hydra

    def make(name, extra=None, log=""):
        d = tmp_path / name
        (d / ".hydra").mkdir(parents=True)
        for f in ("config.yaml", "hydra.yaml", "overrides.yaml"):
            (d / ".hydra" / f).write_text("a: 1\n")
        (d / "train.log").write_text(log)
        if extra:
            (d / extra).write_text("x")
        return d

    cases = {make("bare"): False, make("logged", log="[INFO] epoch 1\n"): True, make("work", "summary.json"): True}
    for d, kept in cases.items():
        remove_if_only_hydra(d, "train.log")
        assert d.exists() == kept, d.name


def test_an_emptied_run_dirs_parents_are_removed_only_inside_the_launch_dir(tmp_path, monkeypatch):
    """After removing a run dir that holds only Hydra's start-up files, the emptied folders above it go too, but
    only inside the directory the command was started in: an empty folder elsewhere (the user's) stays. A .hydra
    holding anything but .yaml files is not Hydra's start-up record: the run dir stays."""
    from compress import _files as files
    from compress._files import remove_if_only_hydra

    launch = tmp_path / "launch"
    launch.mkdir()
    monkeypatch.chdir(launch)
    monkeypatch.setattr(files, "_launch_dir", lambda: launch)  # (as Hydra reports it, with its default run dir)
    monkeypatch.setattr(files, "_named_by_hydra", lambda: True)

    def make(run_dir, name="config.yaml"):
        (run_dir / ".hydra").mkdir(parents=True)
        (run_dir / ".hydra" / name).write_text(f"seed: {torch.randint(100, ()).item()}\n")
        return run_dir

    inside = make(launch / "outputs" / "2024-01-01" / "12-00-00")
    assert remove_if_only_hydra(inside) and not (launch / "outputs").exists() and launch.is_dir()
    outside = make(tmp_path / "elsewhere" / "a" / "run")
    assert remove_if_only_hydra(outside) and not outside.exists()
    assert (tmp_path / "elsewhere" / "a").is_dir()
    notes = make(launch / "outputs" / "2024-01-02" / "12-00-00", "notes.txt")
    assert not remove_if_only_hydra(notes) and (notes / ".hydra" / "notes.txt").is_file()


def test_train_py_resumes_with_its_own_command_line_repeated(tmp_path):
    """A crashed run resumes with the command that started it (resume=auto: how requeue scripts restart a job):
    the repeated data group and its relative data.root match the checkpoint's (which holds the root made absolute),
    and data.num_workers may change with it."""
    root = tmp_path / "unused_root"  # data=fake reads no files; the root is recorded all the same
    root.mkdir()
    command = [*TINY, f"data.root={os.path.relpath(root, ROOT)}", f"hydra.run.dir={tmp_path / 'run'}"]

    def train(*extra):
        proc = run_script("train.py", *command, *extra)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads((tmp_path / "run" / "summary.json").read_text())

    assert train("trainer.max_steps=1", "resume=auto")["steps"] == 1  # no checkpoint yet: a fresh run
    resumed = train("trainer.max_steps=2", "data.num_workers=1", "resume=auto")
    assert resumed["steps"] == 2
    config = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["config"]
    assert config["data"]["root"] == str(root) and config["data"]["num_workers"] == 1


def test_a_diverged_run_stops_without_writing_over_its_checkpoints(tmp_path, monkeypatch):
    """Weights that turn NaN in epoch 2 (here made so after step 6) stop the run with an error naming the fix; last.pt
    keeps epoch 1's finite weights, so nothing trained is lost."""
    import compress.engine as engine

    real_step = engine.train_step
    steps = []

    def poisoned(s, x, y):
        out = real_step(s, x, y)
        steps.append(1)
        if len(steps) == 6:
            with torch.no_grad():
                next(s.raw.parameters()).fill_(float("nan"))
        return out

    monkeypatch.setattr(engine, "train_step", poisoned)
    evaluations = []
    real_evaluate = engine.evaluate
    monkeypatch.setattr(engine, "evaluate", lambda *a: evaluations.append(1) or real_evaluate(*a))
    # (a new run: a resume keeps optim.lr)
    message = (r"weights are not finite at step {} \(epoch 2\): the run diverged. .*checkpoints keeps the checkpoint "
               r"written before. Start a new run \(another hydra.run.dir; a resume keeps the checkpoint's optim "
               r"settings\) with a lower optim.lr \(it is 0.1\)")
    with pytest.raises(FloatingPointError, match=message.format(8)):
        run(_compose(*TINY), run_dir=tmp_path / "a")
    assert evaluations == [1]  # epoch 1's: epoch 2's NaN weights were not evaluated (nor logged)
    saved = torch.load(tmp_path / "a" / "checkpoints" / "last.pt", weights_only=True)
    assert saved["step"] == 4 and all(v.isfinite().all() for v in saved["model"].values() if v.is_floating_point())
    # a logged step's NaN loss stops the run there, not at the epoch's end
    steps.clear()
    with pytest.raises(FloatingPointError, match=message.format(7)):
        run(_compose(*TINY, "trainer.log_every=1"), run_dir=tmp_path / "b")
    assert len(steps) == 7
    # a checkpoint due at the poisoned step itself (checkpoint_every=1, no logged step first): refused, not written
    steps.clear()
    with pytest.raises(FloatingPointError, match=message.format(6)):
        run(_compose(*TINY, "trainer.checkpoint_every=1"), run_dir=tmp_path / "c")
    saved = torch.load(tmp_path / "c" / "checkpoints" / "last.pt", weights_only=True)
    assert saved["step"] == 5 and all(v.isfinite().all() for v in saved["model"].values() if v.is_floating_point())


def test_train_log_holds_the_runs_warnings_and_the_error_that_stopped_it(tmp_path):
    """train.log is the run's record: a warning shown on the terminal is in it too, and so is the error (with its
    traceback) that stopped a run which had begun; a command its config refuses leaves no run dir."""
    run_dir = tmp_path / "run"
    r = run_script("train.py", *TINY, "optim.lr=1e30", f"data.root={tmp_path / 'nowhere'}", f"hydra.run.dir={run_dir}")
    assert r.returncode == 1 and "FloatingPointError" in r.stderr
    log = (run_dir / "train.log").read_text()
    assert re.search(r"\[WARNING\] .*UserWarning: build_data: data.root='.*nowhere' has no effect", log), log
    assert re.search(r"\[ERROR\] the run stopped: FloatingPointError: train: the model's weights are not finite", log)
    assert "Traceback (most recent call last)" in log
    refused = run_script("train.py", *TINY, "optim.lr=-1", f"hydra.run.dir={tmp_path / 'refused'}")
    assert refused.returncode == 1 and not (tmp_path / "refused").exists(), refused.stderr[-1000:]
    # a warning (data.root) before the refusal (vgg11_bn cannot take 8x8 inputs) does not keep the dir either
    warned = run_script("train.py", *TINY, "model=vgg11_bn", f"data.root={tmp_path / 'nowhere'}",
                        f"hydra.run.dir={tmp_path / 'warned'}")
    assert warned.returncode == 1 and "cannot take a 3x8x8 input" in warned.stderr
    assert not (tmp_path / "warned").exists()
    # a command refused in a finished run's dir (a fresh run there) leaves that run's log as it was
    done = run_script("train.py", *TINY, "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'done'}")
    assert done.returncode == 0, done.stderr[-2000:]
    before = (tmp_path / "done" / "train.log").read_text()
    again = run_script("train.py", *TINY, f"data.root={tmp_path / 'nowhere'}", f"hydra.run.dir={tmp_path / 'done'}")
    assert again.returncode == 1 and "already holds a run" in again.stderr
    assert (tmp_path / "done" / "train.log").read_text() == before


def test_a_failed_evaluation_keeps_the_epoch_trained(tmp_path, monkeypatch):
    """An evaluation that fails (an unreadable test image) used to stop the run before last.pt was written, losing
    the epoch on every attempt: the epoch's weights are saved first (as at an epoch end without an evaluation), and
    resume goes on from the next epoch."""
    import compress.engine as engine

    real_evaluate = engine.evaluate

    def unreadable(*args, **kwargs):
        raise OSError("cannot read the image val/a/0.png (UnidentifiedImageError); remove or replace the file")

    monkeypatch.setattr(engine, "evaluate", unreadable)
    with pytest.raises(OSError, match="cannot read the image val/a/0.png"):
        run(_compose(*TINY), run_dir=tmp_path)
    saved = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert (saved["step"], saved["epoch"], saved["epoch_batches"]) == (4, 1, 0)  # epoch 1's 4 steps, finished
    # past milestone 1: the resumed epoch 2 trains at 0.1 x the LR
    assert saved["scheduler"]["last_epoch"] == 1
    assert saved["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.1 * saved["optimizer"]["param_groups"][0]["initial_lr"])
    assert not (tmp_path / "checkpoints" / "best.pt").exists()
    monkeypatch.setattr(engine, "evaluate", real_evaluate)
    cfg = _compose(*TINY, "resume=true")
    summary = run(cfg, run_dir=tmp_path)
    assert summary["steps"] == 8 and summary["epochs"] == 2 and 0 <= summary["test_accuracy"] <= 1

    # the last epoch's evaluation fails: a resume has nothing to train, and does not pass the epoch before's
    # accuracy off as the final weights' (null: never evaluated)
    calls = []

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("cannot read the image val/a/0.png")
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(engine, "evaluate", second_fails)
    with pytest.raises(OSError):
        run(_compose(*TINY), run_dir=tmp_path / "last")
    monkeypatch.setattr(engine, "evaluate", real_evaluate)
    summary = run(_compose(*TINY, "resume=true"), run_dir=tmp_path / "last")
    assert summary["steps"] == 8 and summary["test_accuracy"] is None
    assert json.loads((tmp_path / "last" / "summary.json").read_text())["test_accuracy"] is None


def test_a_runs_logs_summary_and_best_pt_say_what_it_trained(tmp_path, monkeypatch):
    """TensorBoard: each epoch's LR (not the next one's), each step's LR, the epoch's train/loss as the mean of its
    step losses (equal batches), the share of stripes kept; the summary's params are the model's, skeletons left
    out; an accuracy that only ties the best leaves best.pt at its first epoch; CPU weights stay NCHW."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import compress
    import compress.engine as engine

    real_evaluate = engine.evaluate
    monkeypatch.setattr(engine, "evaluate", lambda *args, **kwargs: {**real_evaluate(*args, **kwargs), "accuracy": 0.5})
    summary = run(_compose(*TINY, "trainer.log_every=1"), run_dir=tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    assert scalars["epoch/lr"] == pytest.approx({4: 0.1, 8: 0.01})
    assert scalars["lr"] == pytest.approx({s: 0.1 if s <= 4 else 0.01 for s in range(1, 9)})
    for end in (4, 8):
        steps = [scalars["train/loss_step"][s] for s in range(end - 3, end + 1)]
        assert scalars["train/loss"][end] == pytest.approx(sum(steps) / 4, rel=1e-5)
    assert scalars["stripes_kept/total"][8] == pytest.approx(summary["stripes_kept"] / summary["stripes_total"])
    model = compress.create_model("resnet20", num_classes=3, input_size=8)
    assert summary["params"] == sum(p.numel() for p in model.parameters())
    assert torch.load(tmp_path / "checkpoints" / "best.pt", weights_only=True)["step"] == 4
    assert all(t.is_contiguous() for t in _weights(tmp_path).values())


def test_best_pt_keeps_the_best_epoch_and_resume_continues_from_last_pt(tmp_path, monkeypatch):
    """Test accuracies 0.6, 0.4, 0.5 over three epochs: best.pt and best_test_accuracy stay at the first epoch's
    (a "best" that followed the last accuracy passed a test whose accuracy never changed), and a run stopped after
    epoch 2 resumes from last.pt (step 8), not from best.pt (step 4): it evaluates once more, not twice."""
    import compress.engine as engine

    real_evaluate = engine.evaluate
    accuracies = [0.6, 0.4, 0.5]
    monkeypatch.setattr(engine, "evaluate",
                        lambda *args, **kwargs: {**real_evaluate(*args, **kwargs), "accuracy": accuracies.pop(0)})
    run(_compose(*TINY, "optim.epochs=3", "trainer.max_steps=8"), run_dir=tmp_path)
    assert accuracies == [0.5]
    best = torch.load(tmp_path / "checkpoints" / "best.pt", weights_only=True)
    assert (best["step"], best["best_accuracy"]) == (4, 0.6)
    summary = run(_compose(*TINY, "optim.epochs=3", "resume=true"), run_dir=tmp_path)
    assert accuracies == [] and summary["steps"] == 12 and summary["best_test_accuracy"] == 0.6
    assert torch.load(tmp_path / "checkpoints" / "best.pt", weights_only=True)["step"] == 4


def test_eval_every_evaluates_every_nth_epoch_and_the_last(tmp_path):
    """trainer.eval_every=2 over 3 epochs (4 steps each) evaluates after epochs 2 and 3 (the last always), not 1."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    summary = run(_compose(*TINY, "optim.epochs=3", "trainer.eval_every=2"), run_dir=tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert summary["epochs"] == 3 and [e.step for e in events.Scalars("test/accuracy")] == [8, 12]


def test_forgetting_a_refused_commands_warnings_truncates_only_the_run_dirs_log(tmp_path):
    """warnings_in_log_files' forget() takes the warnings back out of the run dir's log (which the run lock keeps to
    one run), never out of a log elsewhere that other processes may share."""
    import logging

    from compress._logging import warnings_in_log_files

    run_dir, shared = tmp_path / "run", tmp_path / "all.log"
    run_dir.mkdir()
    (run_dir / "train.log").write_text("[t][INFO] epoch 1\n")
    handlers = [logging.FileHandler(run_dir / "train.log"), logging.FileHandler(shared)]
    logger = logging.getLogger("compress")
    for h in handlers:
        logger.addHandler(h)
    try:
        with warnings_in_log_files(True, run_dir) as forget:
            warnings.warn("a refused command's warning", stacklevel=1)
            with open(shared, "a") as f:
                f.write("another job's line\n")
            forget()
    finally:
        for h in handlers:
            logger.removeHandler(h)
            h.close()
    assert (run_dir / "train.log").read_text() == "[t][INFO] epoch 1\n"
    assert "a refused command's warning" in shared.read_text() and "another job's line" in shared.read_text()


def test_another_ranks_failure_goes_into_the_runs_log(tmp_path):
    """A DDP rank other than 0 appends its error, naming itself, to the log file of its log's name in the run dir
    (rank 0's), not to its own Hydra log elsewhere."""
    import logging

    from compress._logging import log_failure

    own, run_dir = tmp_path / "own", tmp_path / "run"
    own.mkdir()
    run_dir.mkdir()
    (run_dir / "train.log").write_text("[t][INFO] epoch 1\n")
    handler = logging.FileHandler(own / "train.log")
    handler.setFormatter(logging.Formatter("[%(levelname)s] %(message)s"))
    logger = logging.getLogger("compress")
    logger.addHandler(handler)
    try:
        try:
            raise RuntimeError("boom on rank 1")
        except RuntimeError as err:
            log_failure(err, 1, run_dir)
    finally:
        logger.removeHandler(handler)
        handler.close()
    text = (run_dir / "train.log").read_text()
    assert text.startswith("[t][INFO] epoch 1\n[ERROR] rank 1: the run stopped: RuntimeError: boom on rank 1\n")
    assert "Traceback (most recent call last)" in text and (own / "train.log").read_text() == ""


def test_images_per_s_of_a_resumed_epoch_leaves_out_the_dropped_batches():
    """A run resumed inside an epoch loads and drops the batches trained before (`skip`): the epoch's images/s
    counts only the batches it trains, not that loading (slow here: 1 s per dropped batch)."""
    import torch.nn as nn

    import compress.engine as engine

    class Loader:
        batch_size = 8

        def __len__(self):
            return 4

        def __iter__(self):
            for i in range(4):
                if i < 2:
                    time.sleep(1.0)  # a slow batch: the two skipped ones
                yield torch.randn(8, 4), torch.randint(0, 3, (8,))

    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    s = engine._Step(model, model, optimizer, torch.amp.GradScaler("cpu", enabled=False), torch.device("cpu"), None,
                     False, None)
    skipped = []
    metrics, step, done = engine.train_one_epoch(s, Loader(), 0, None, lambda *a: None, False, skip=2,
                                                 after_skip=lambda: skipped.append(True))
    assert skipped == [True] and step == 2 and done == 4
    assert metrics["images_per_s"] > 100, metrics  # 16 images trained in milliseconds; with the skip: 8 per second


def test_train_py_and_export_py_under_hydra_job_chdir_read_paths_from_the_launch_directory(tmp_path):
    """hydra.job.chdir=true runs the job inside its run dir: relative data.root, resume=<file> and export's out= still
    name paths in the directory the command ran from, and a refused command leaves no outputs/<date> behind."""
    root = tmp_path / "data"
    root.mkdir()
    chdir = [*TINY, "data.root=data", "hydra.job.chdir=true"]

    def call(script, *args):
        return run_script(script, *args, cwd=tmp_path)

    first = call("train.py", *chdir, "trainer.max_steps=1", "hydra.run.dir=runs/a")
    assert first.returncode == 0, first.stderr[-2000:]
    saved = torch.load(tmp_path / "runs/a/checkpoints/last.pt", weights_only=True)
    assert saved["config"]["data"]["root"] == str(root)
    second = call("train.py", *chdir, "trainer.max_steps=2", "hydra.run.dir=runs/b", "resume=runs/a/checkpoints/last.pt")
    assert second.returncode == 0, second.stderr[-2000:]
    assert torch.load(tmp_path / "runs/b/checkpoints/last.pt", weights_only=True)["step"] == 2
    export = call("export.py", "ckpt=runs/b/checkpoints/last.pt", "out=exported", "hydra.job.chdir=true",
                  "onnx.enabled=false", "profile.latency=false")
    assert export.returncode == 0, export.stderr[-2000:]
    assert (tmp_path / "exported" / "model.compact.safetensors").is_file()
    refused = call("train.py", *chdir, "optim.lr=nan")  # Hydra's default run dir, outputs/<date>/<time>
    assert refused.returncode != 0 and "optim.lr=nan must be a finite number > 0" in refused.stderr
    assert not (tmp_path / "outputs").exists()
    (tmp_path / "mine").mkdir()  # a folder of the user's own above a given hydra.run.dir stays, empty or not
    refused = call("train.py", "optim.lr=nan", "hydra.run.dir=mine/r1")
    assert refused.returncode != 0 and (tmp_path / "mine").is_dir() and not (tmp_path / "mine" / "r1").exists()


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(config=[1, 2]), r"'config' is a list"),
    (lambda c: c["config"].update(pix=[1]), r"config.pix is a list"),
    (lambda c: c["config"]["model"].update(kwargs=[1]), r"config.model.kwargs is a list"),
    (lambda c: c.update(arch={"name": "resnet20"}), r"'arch' is not a dict with a str 'name' and a dict 'kwargs'"),
    (lambda c: c.update(model="weights"), r"'model' is not a dict of named tensors"),
    (lambda c: c["model"].update({"fc.weight": c["model"]["fc.weight"].to(torch.int32)}),
     r"tensors of the wrong kind: fc.weight \(torch.int32; the model's is torch.float32\)"),
])
def test_a_checkpoint_edited_into_other_types_is_refused_naming_the_file(tmp_path, edit, match):
    """A checkpoint whose digest fits but whose parts are not what train.py writes (edited by hand, or by another
    tool) is a ValueError naming the file, for export and resume alike: not an AttributeError from deep inside, and
    never int weights copied into float ones (load_state_dict truncates them without a word)."""
    from compress._trainstate import DIGEST_KEY, atomic_save
    from compress.export import load_any

    run(_compose(*TINY, "trainer.max_steps=1"), run_dir=tmp_path / "run")
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    ckpt.pop(DIGEST_KEY)
    edit(ckpt)
    path = atomic_save(ckpt, tmp_path / "edited.pt")
    with pytest.raises(ValueError, match=rf"{path}.*{match}"):
        load_any(path)
    with pytest.raises(ValueError, match=rf"{path}.*{match}"):
        run(_compose(*TINY, f"resume={path}"), run_dir=tmp_path / "resumed")


@pytest.mark.filterwarnings("ignore:Validating sparse tensor invariants")
@pytest.mark.parametrize("odd", [torch.zeros(3, 3).to_sparse(), torch.empty(3, device="meta")])
def test_a_checkpoint_holding_a_sparse_or_meta_tensor_is_refused_naming_the_file(tmp_path, odd):
    """weights_only loading allows sparse and meta tensors; the digest check read their bytes and crashed."""
    from compress._trainstate import load_checkpoint

    torch.save({"model": {}, "config": {}, "extra": odd, "sha256": "0" * 64}, tmp_path / "odd.pt")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'odd.pt'} holds a (torch.sparse_coo|meta) tensor"):
        load_checkpoint(tmp_path / "odd.pt")


def test_resuming_a_checkpoint_with_non_finite_weights_is_refused(tmp_path):
    """Such a file (an older version saved diverged runs) would train a whole epoch before failing."""
    from compress._trainstate import DIGEST_KEY, atomic_save

    run(_compose(*TINY, "trainer.max_steps=2"), run_dir=tmp_path)
    path = tmp_path / "checkpoints" / "last.pt"
    state = torch.load(path, weights_only=True)
    state.pop(DIGEST_KEY)
    state["model"]["fc.weight"][0, 0] = float("inf")
    atomic_save(state, path)  # with the digest of the edited contents
    with pytest.raises(ValueError, match="resume: the checkpoint's weights hold NaN or inf values"):
        run(_compose(*TINY, "resume=true"), run_dir=tmp_path)


def test_model_weights_starts_swp_from_a_state_dict_file(tmp_path, monkeypatch):
    """model.weights=<file> (relative to the launch directory): the run starts from the file's weights (its 10-class
    head kept fresh for 3 classes), then attaches skeletons; resume does not need the file; with init= it is refused."""
    from compress.models import create_model

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(1)
    source = create_model("resnet20", num_classes=10)
    torch.save(source.state_dict(), tmp_path / "pretrained.pth")
    cfg = _compose(*TINY, "model.weights=pretrained.pth", "optim.lr=1e-9", "trainer.max_steps=1")
    run(cfg, run_dir=tmp_path / "run")
    trained = _weights(tmp_path / "run")
    for key, value in source.state_dict().items():
        if key.endswith(".weight") and value.dim() == 4:  # convs: one step at lr 1e-9 leaves them where they began
            torch.testing.assert_close(trained[key], value, rtol=0, atol=1e-6)
    assert trained["fc.weight"].shape == (3, 64)
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["config"]["model"]["weights"] \
        == str(tmp_path / "pretrained.pth")
    (tmp_path / "pretrained.pth").unlink()
    # on resume model.weights is not read, whatever the command line says, and the record keeps the file it started from
    monkeypatch.setattr("compress.engine._command_line_keys", lambda: {"resume", "trainer.max_steps", "model.weights"})
    resumed = _compose(*TINY, "resume=true", "trainer.max_steps=2", "model.weights=/nowhere/other.pth")
    assert run(resumed, run_dir=tmp_path / "run")["steps"] == 2
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["config"]["model"]["weights"] \
        == str(tmp_path / "pretrained.pth")
    with pytest.raises(ValueError, match="init and model.weights are both set"):
        run(_compose(*TINY, "model.weights=x.pth", "init=x.safetensors"), run_dir=tmp_path / "other")


def test_resume_on_class_folders_other_than_the_runs_is_refused(tmp_path, monkeypatch):
    """Another data.root with as many images but other class folders would shift the labels silently: refused."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for root, classes in (("plain", ["a", "b"]), ("renamed", ["b", "c"])):
        for split in ("train", "val"):
            for cls in classes:
                (tmp_path / root / split / cls).mkdir(parents=True)
                for i in range(4):
                    Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
                        tmp_path / root / split / cls / f"{i}.png")
    common = [*(o for o in TINY if not o.startswith("data")), "data=imagefolder", "data.input_size=8",
              "data.batch_size=4"]
    run(_compose(*common, f"data.root={tmp_path / 'plain'}", "trainer.max_steps=1"), run_dir=tmp_path / "run")
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["data_classes"] == ["a", "b"]
    monkeypatch.setattr("compress.engine._command_line_keys", lambda: {"resume", "data.root", "trainer.max_steps"})
    with pytest.raises(ValueError, match=r"resume: data.root=.*renamed has other classes than the run trained on "
                                         r"\(2 against 2; differing: a, c\), so the labels would change"):
        run(_compose(*common, f"data.root={tmp_path / 'renamed'}", "resume=true"), run_dir=tmp_path / "run")
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "plain", moved)  # a moved copy of the same data resumes
    assert run(_compose(*common, f"data.root={moved}", "resume=true", "trainer.max_steps=2"),
               run_dir=tmp_path / "run")["steps"] == 2


def test_model_weights_with_pix_loads_a_plain_or_a_pix_models_file_and_names_what_pix_replaced(tmp_path, capsys):
    """With pix.zeta, a plain model's file is loaded before PiX replaces its squeeze convs, which the run counts and
    names; a PiX model's own file is loaded into the PiX model. (A bottleneck CIFAR ResNet, pix.zeta=4.)"""
    from compress.models import create_model
    from compress.pix import apply_pix

    torch.manual_seed(2)
    plain = create_model("resnet29_bottleneck", num_classes=3)
    torch.save(plain.state_dict(), tmp_path / "plain.pth")
    common = [*TINY, "model=resnet29_bottleneck", "pix.zeta=4", "optim.lr=1e-9", "trainer.max_steps=1"]
    run(_compose(*common, f"model.weights={tmp_path / 'plain.pth'}"), run_dir=tmp_path / "a")
    said = capsys.readouterr().out
    assert re.search(r"pix.zeta=4 replaced \d+ of its \d+ tensors, in \d+ modules \(layer1.0.bn1, layer1.0.conv1, ",
                     said), said
    trained = _weights(tmp_path / "a")
    assert torch.allclose(trained["layer1.0.conv2.weight"], plain.state_dict()["layer1.0.conv2.weight"], atol=1e-6)
    # the squeeze conv's place: PiX's predictor (same name and shape, its own initial weights)
    assert not torch.allclose(trained["layer1.0.conv1.weight"], plain.state_dict()["layer1.0.conv1.weight"], atol=1e-3)

    pix_model = create_model("resnet29_bottleneck", num_classes=3)
    apply_pix(pix_model, 4, 0.5)
    torch.save(pix_model.state_dict(), tmp_path / "pix.pth")
    run(_compose(*common, f"model.weights={tmp_path / 'pix.pth'}"), run_dir=tmp_path / "b")
    assert "replaced" not in capsys.readouterr().out
    trained = _weights(tmp_path / "b")
    for key, value in pix_model.state_dict().items():
        if value.dim() == 4:
            torch.testing.assert_close(trained[key], value, rtol=0, atol=1e-6)


def test_model_weights_with_downscaling_pix_keeps_the_convs_whose_width_stays(tmp_path, capsys):
    """Downscaling (a basic-block ResNet): pix.zeta=2 rebuilds every 3x3 conv after the first (the run names them
    as replaced); at pix.zeta=1 every conv keeps its width, so the file's weights stay, under the names of the
    wrapped convs (they were all re-initialised, and called replaced)."""
    from compress.models import create_model

    torch.manual_seed(3)
    plain = create_model("resnet20", num_classes=3, input_size=8)
    torch.save(plain.state_dict(), tmp_path / "plain.pth")
    common = [*TINY, "optim.lr=1e-9", "trainer.max_steps=1", f"model.weights={tmp_path / 'plain.pth'}"]
    run(_compose(*common, "pix.zeta=1"), run_dir=tmp_path / "one")
    assert "replaced" not in capsys.readouterr().out
    trained = _weights(tmp_path / "one")
    torch.testing.assert_close(trained["layer2.1.conv2.1.weight"], plain.state_dict()["layer2.1.conv2.weight"],
                               rtol=0, atol=1e-6)
    run(_compose(*common, "pix.zeta=2"), run_dir=tmp_path / "two")
    said = capsys.readouterr().out
    assert re.search(r"pix.zeta=2 replaced 18 of its \d+ tensors, in 18 modules \(layer1.0.conv1, layer1.0.conv2, "
                     r".*the 3x3 convs after the first read 1/zeta of their inputs", said), said


def test_the_summary_counts_the_compact_models_macs_as_export_does(tmp_path, capsys):
    """summary.json's macs_compact is the MACs of the model export makes (dead filters take the next layers' input
    channels with them, which the per-layer estimate does not count), and the summary lines print it."""
    from compress.export import export_checkpoint

    cfg = _compose(*TINY, "prune.alpha=0.1", "trainer.max_steps=3")  # about 90% of the stripes die
    summary = run(cfg, run_dir=tmp_path / "run")
    report = export_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt", tmp_path / "out", onnx=False,
                               latency=False, choose_stripe_modes=False)
    assert summary["filters_dead"] > 0
    assert summary["macs_compact"] == report["compact"]["macs"] < summary["macs_pruned_estimate"]
    assert f"{summary['macs_compact'] / 1e6:.2f} M in the compact model" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["macs_compact"] == summary["macs_compact"]


def test_grouped_skeletons_train_export_and_keep_their_groups(tmp_path):
    """prune.stripe_group=4: each skeleton has one entry per 4 filters and offset; pruning drops whole groups'
    stripes, export rebuilds the grouped skeletons from the checkpoint, and every compact stripe layer's filters
    keep their offsets in aligned groups of 4 (the same function as the skeleton model)."""
    from compress import load
    from compress.export import export_checkpoint, load_training_checkpoint
    from compress.skeleton import SkeletonConv2d
    from compress.stripe import StripeConv2d

    summary = run(_compose(*TINY, "prune.stripe_group=4"), run_dir=tmp_path / "run")
    state = _weights(tmp_path / "run")
    assert state["layer1.0.conv1.skeleton"].shape == (4, 3, 3)  # 16 filters / 4
    assert 0 < summary["stripes_kept"] < summary["stripes_total"]
    skeleton, _ = load_training_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    convs = [m for m in skeleton.modules() if isinstance(m, SkeletonConv2d)]
    assert convs and all(m.stripe_group == 4 for m in convs)
    export_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt", tmp_path / "out", onnx=False, latency=False,
                      choose_stripe_modes=False)
    small = load(next((tmp_path / "out").glob("*.safetensors")))
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        for m in convs:  # export drops the stripes at the run's threshold (the last step may leave some just below)
            m.skeleton.mul_(m.skeleton.abs() > 0.95)
        torch.testing.assert_close(small(x), skeleton(x), rtol=1e-4, atol=1e-5)
    layers = [m for m in small.modules() if isinstance(m, StripeConv2d)]
    assert layers
    for m in layers:
        mask = m.stripe_mask()
        for g in range(0, mask.shape[0], 4):
            assert (mask[g:g + 4] == mask[g]).all(), (m, g)
    with pytest.raises(ValueError, match="prune.stripe_group"):
        run(_compose(*TINY, "prune.stripe_group=0"), run_dir=tmp_path / "bad")


def test_a_checkpoint_written_before_stripe_group_resumes_with_its_own_command_line(tmp_path):
    """A run's checkpoint from before prune.stripe_group existed (its config lacks the key) resumes with the command
    line that started it: the missing key is the per-filter skeleton it trained with (1), not a conflict; asking
    for another group on resume is one."""
    from compress._trainstate import DIGEST_KEY, atomic_save
    from compress.engine import _resume_config

    run(_compose(*TINY, "trainer.max_steps=2"), run_dir=tmp_path)
    path = tmp_path / "checkpoints" / "last.pt"
    state = torch.load(path, weights_only=True)
    state.pop(DIGEST_KEY, None)
    del state["config"]["prune"]["stripe_group"]
    atomic_save(state, path)
    given = {o.partition("=")[0] for o in TINY} | {"resume"}
    merged, ckpt = _resume_config(_compose(*TINY, "resume=true"), tmp_path, given)
    assert ckpt is not None and merged.prune.stripe_group == 1
    with pytest.raises(ValueError, match=r"prune.stripe_group=4 \(checkpoint: 1\)"):
        _resume_config(_compose(*TINY, "resume=true", "prune.stripe_group=4"), tmp_path,
                       given | {"prune.stripe_group"})


def test_the_run_lock_survives_write_errors_other_users_files_and_forks(tmp_path, monkeypatch):
    """A failure after the lock is taken (a full disk writing its file) releases it, so the next run in this process
    is not refused; another user's lock file that no process holds is replaced (the folder allows it); a forked child
    (a DataLoader worker) closes its copy of the descriptor, so the lock ends with the training process."""
    import errno

    import compress._files as files
    from compress.engine import RUN_LOCK, _release_run_lock, _run_locks, _take_run_lock

    def full_disk(fd, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(os, "ftruncate", full_disk)
        with pytest.raises(ValueError, match=rf"{tmp_path / 'a'}: cannot lock {RUN_LOCK} there \(.*No space left"):
            run(_compose(*TINY, "trainer.max_steps=1"), run_dir=tmp_path / "a")
    assert not _run_locks
    assert run(_compose(*TINY, "trainer.max_steps=1"), run_dir=tmp_path / "a")["steps"] == 1

    (tmp_path / "b").mkdir()
    (tmp_path / "b" / RUN_LOCK).write_text('{"pid": 1, "host": "elsewhere"}')  # as another user's killed run left it
    real_open = os.open

    def other_users(path, flags, *mode):
        if str(path).endswith(RUN_LOCK) and flags & os.O_RDWR and os.path.exists(path) and os.path.getsize(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *mode)

    monkeypatch.setattr(files.os, "open", other_users)
    assert _take_run_lock(tmp_path / "b") is None
    assert json.loads((tmp_path / "b" / RUN_LOCK).read_text())["pid"] == os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: its copy of the lock's descriptor is closed
        os._exit(0 if not _run_locks else 1)
    assert os.waitpid(pid, 0)[1] == 0
    _release_run_lock(tmp_path / "b")


def test_lock_file_locks_the_file_at_the_path_when_its_holder_recreated_it(tmp_path, monkeypatch):
    """Between lock_file's open and its flock the previous holder can release (unlink) the lock file and a third
    process create a new one: the lock then taken is on a file no longer at the path, which the next process would
    lock too. lock_file must notice and lock the file now at the path."""
    import fcntl

    from compress._files import lock_file, unlock_file

    path = tmp_path / ".lock"
    real_flock, calls = fcntl.flock, []

    def holder_recreates_it(fd, op):
        calls.append(fd)
        if len(calls) == 1:
            os.unlink(path)
            path.write_bytes(os.urandom(8))
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", holder_recreates_it)
    fd = lock_file(path)
    assert fd is not None
    try:
        assert os.path.samestat(os.fstat(fd), os.stat(path)) and len(calls) == 2
    finally:
        unlock_file(path, fd)


def test_process_alive_counts_another_users_process_as_alive(monkeypatch):
    """os.kill(pid, 0) on another user's live process raises PermissionError: that process exists (its lock or
    temporary file must be kept); only ProcessLookupError means none runs."""
    from compress import _files as files

    pid = int(torch.randint(2, 1 << 20, ()).item())

    def kill(error):
        def raising(p, sig):
            assert (p, sig) == (pid, 0)
            raise error
        return raising

    monkeypatch.setattr(files.os, "kill", kill(PermissionError(1, "Operation not permitted")))
    assert files.process_alive(pid) is True
    monkeypatch.setattr(files.os, "kill", kill(ProcessLookupError(3, "No such process")))
    assert files.process_alive(pid) is False


def test_a_run_dir_in_use_by_another_process_is_refused(tmp_path):
    """While a train.py process works in a run dir it holds a lock on .train.lock there: a second run started in the
    same dir (before the first wrote checkpoints/last.pt, which the overwrite check looks for) is refused instead of
    training beside it over the same files, also while the holder's file is still empty (being written). The lock
    is the OS's: the file of a killed run does not block the next one, and a run leaves none."""
    import signal

    from compress.engine import RUN_LOCK, _release_run_lock, _take_run_lock

    run_dir = tmp_path / "run"
    assert _take_run_lock(run_dir) is None  # a run working there (another open file of this process holds it)
    with pytest.raises(ValueError, match=rf"{run_dir} is in use by another train.py process \(pid {os.getpid()} on "
                                         r"this host\).*another hydra.run.dir"):
        run(_compose(*TINY, "trainer.max_steps=1"), run_dir=run_dir)
    assert json.loads((run_dir / RUN_LOCK).read_text())["pid"] == os.getpid()  # still the holder's
    _release_run_lock(run_dir)
    assert not (run_dir / RUN_LOCK).exists()
    # another process that has locked the file and not yet written it, then is killed
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(run_dir / RUN_LOCK)!r}, os.O_CREAT | os.O_RDWR)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(ValueError, match=rf"{run_dir} is in use by another train.py process: two runs"):
            run(_compose(*TINY, "trainer.max_steps=1"), run_dir=run_dir)
        assert not (run_dir / "checkpoints").exists()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    assert (run_dir / RUN_LOCK).exists()  # what the killed process left
    summary = run(_compose(*TINY, "trainer.max_steps=1"), run_dir=run_dir)
    assert summary["steps"] == 1 and not (run_dir / RUN_LOCK).exists()
    with pytest.raises(ValueError, match="optim.lr=nan"):  # a refused config leaves no run dir the lock created
        run(_compose(*TINY, "optim.lr=nan"), run_dir=tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_a_tensorboard_folder_that_fills_up_stops_the_logging_not_the_run(tmp_path, monkeypatch):
    """A full disk under tensorboard/ raised OSError from RunLogger before the epoch's checkpoint was written (the
    epoch's training lost, the run stopped with a bare error): one warning naming the folder, and the run trains
    to its end with its checkpoints and summary."""
    from torch.utils.tensorboard import SummaryWriter

    calls = []
    real_add_image = SummaryWriter.add_image

    def full_disk(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 3:
            raise OSError(28, "No space left on device")
        return real_add_image(self, *args, **kwargs)

    monkeypatch.setattr(SummaryWriter, "add_image", full_disk)
    with pytest.warns(RuntimeWarning, match=r"TensorBoard logging stopped: could not write into .*tensorboard "
                                            r"\(\[Errno 28\] No space left on device\); the run goes on") as caught:
        run(_compose(*TINY, "optim.epochs=2"), run_dir=tmp_path)
    assert sum("TensorBoard logging stopped" in str(w.message) for w in caught) == 1
    assert len(calls) == 4  # none after the failure
    summary = json.loads((tmp_path / "summary.json").read_text())
    saved = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert summary["epochs"] == 2 and saved["step"] == summary["steps"] == 8


def test_a_run_dir_with_only_its_best_pt_is_continued_not_overwritten(tmp_path):
    """best.pt is written before last.pt so that a run whose last.pt write failed (a full disk) or was killed keeps
    its best weights and full state; but resume=auto then started a fresh run over it and a fresh run overwrote
    best.pt without a word. The run dir's checkpoint is its last.pt, else its best.pt."""
    run(_compose(*TINY, "trainer.max_steps=4"), run_dir=tmp_path)
    best, last = tmp_path / "checkpoints" / "best.pt", tmp_path / "checkpoints" / "last.pt"
    last.unlink()  # as a failed or killed last.pt write leaves the run
    kept = best.read_bytes()
    with pytest.raises(ValueError, match=r"already holds a run \(checkpoints/best.pt\); a fresh run would overwrite"):
        run(_compose(*TINY, "trainer.max_steps=4"), run_dir=tmp_path)
    assert best.read_bytes() == kept
    with pytest.warns(UserWarning, match=r"has no checkpoints/last.pt .*continuing from best.pt, step 4"):
        run(_compose(*TINY, "resume=auto", "trainer.max_steps=6"), run_dir=tmp_path)
    assert torch.load(last, weights_only=True)["step"] == 6


def test_a_fresh_start_after_a_run_killed_before_its_first_checkpoint_logs_each_step_once(tmp_path):
    """resume=auto after a kill -9 before the first checkpoint starts afresh in the same run dir: TensorBoard showed
    the killed process's steps and the new run's both (the purge of a killed run's steps applied to resumes only)."""
    run(_compose(*TINY, "trainer.max_steps=3", "trainer.log_every=1"), run_dir=tmp_path)
    shutil.rmtree(tmp_path / "checkpoints")  # as a process killed before its first checkpoint leaves the run dir
    (tmp_path / "summary.json").unlink()
    time.sleep(1.1)  # (event files are named by the second)
    run(_compose(*TINY, "resume=auto", "trainer.max_steps=2", "trainer.log_every=1"), run_dir=tmp_path)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss_step")] == [1, 2]


def test_a_sweep_names_hydra_sweep_dir_and_reports_every_failed_job(tmp_path):
    """train.py -m: Hydra raises the first failed job's error once the sweep has run, so a second refused job left no
    trace; each job's error is printed as it fails. A sweep's run-dir messages named hydra.run.dir, which a sweep
    ignores (its jobs' dirs are hydra.sweep.dir's numbered folders)."""
    sweep = tmp_path / "S"
    r = run_script("train.py", "-m", *TINY, "trainer.max_steps=1", "optim.lr=-1,-2", f"hydra.sweep.dir={sweep}")
    assert r.returncode == 1
    for job, lr in ((0, -1), (1, -2)):
        assert re.search(rf"train.py job {job} \(.*optim.lr={lr}.*\) failed: ValueError: optim.lr={lr} must be",
                         r.stderr), r.stderr[-3000:]
    r = run_script("train.py", "-m", *TINY, "trainer.max_steps=1", f"hydra.sweep.dir={sweep}")
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_script("train.py", "-m", *TINY, "trainer.max_steps=1", "prune.alpha=5e-4", f"hydra.sweep.dir={sweep}")
    assert r.returncode == 1 and "already holds a run (checkpoints/last.pt); a fresh run would overwrite" in r.stderr
    assert "or another hydra.sweep.dir (or delete the old run)" in r.stderr and "hydra.run.dir" not in r.stderr


def test_hydras_other_job_logging_options_replace_train_py_s(tmp_path):
    """train.py's logging is an option of hydra/job_logging (conf/hydra/job_logging/train.yaml); as edits of Hydra's
    default it left a console handler without a class in hydra/job_logging=disabled, which crashed at start."""
    for option in ("disabled", "stdout"):
        r = run_script("train.py", *TINY, "trainer.max_steps=1", f"hydra/job_logging={option}",
                       f"hydra.run.dir={tmp_path / option}")
        assert r.returncode == 0, r.stderr[-2000:]
        assert not (tmp_path / option / "train.log").exists()
    r = run_script("train.py", *TINY, "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'default'}")
    assert re.match(r"\[\d{4}-\d\d-\d\d [\d:,]+\]\[INFO\] epoch 1/", (tmp_path / "default" / "train.log").read_text())


def test_a_deleted_setting_is_refused_naming_it(tmp_path):
    """~trainer.seed (a required key) failed with omegaconf's "Key 'seed' is not in struct"; ~optim.warmup_epochs
    fell back to no warmup silently. Deleting a setting is refused, naming the key and how to set it."""
    for key in ("trainer.seed", "optim.warmup_epochs"):
        r = run_script("train.py", *TINY, "trainer.max_steps=1", f"~{key}", f"hydra.run.dir={tmp_path / key}")
        assert r.returncode == 1 and re.search(rf"ValueError: ~{key}: train.py reads every setting of its config, so "
                                               rf"{key} cannot be deleted; set it instead", r.stderr), r.stderr[-2000:]
        assert not (tmp_path / key).exists()


def test_a_run_dir_hydra_cannot_create_is_one_clear_error_before_the_run(tmp_path, monkeypatch):
    """hydra.run.dir is made by Hydra before train.py runs: a '~' it does not expand made a folder named '~' in the
    working directory, and a dangling symbolic link or a read-only parent failed with chained pathlib tracebacks.
    Now (compress/_run_dir.py) each is one line naming the setting and the fix, and nothing is created."""
    import compress._run_dir as run_dir

    tilde = run_script("train.py", "model=resnet20", "hydra.run.dir='~/runs/x'", cwd=tmp_path)
    assert tilde.returncode == 1 and "hydra.run.dir=~/runs/x: Hydra does not expand '~'" in tilde.stderr
    assert f"hydra.run.dir={os.path.expanduser('~/runs/x')}" in tilde.stderr
    (tmp_path / "mnt").symlink_to(tmp_path / "not-mounted")
    dangling = run_script("train.py", "model=resnet20", "hydra.run.dir=mnt/r1", cwd=tmp_path)
    assert dangling.returncode == 1 and f"{tmp_path / 'mnt'} is a symbolic link to {tmp_path / 'not-mounted'}, " \
        "which does not exist" in dangling.stderr
    real_mkdtemp = run_dir.tempfile.mkdtemp

    nobody = run_script("train.py", "model=resnet20", "hydra.run.dir='~no_such_user_x/r'", cwd=tmp_path)
    assert nobody.returncode == 1 and "hydra.run.dir=~no_such_user_x/r: Hydra does not expand '~'" in nobody.stderr
    assert nobody.stderr.rstrip().endswith("give the full path")  # (not the same value back as the fix)
    (tmp_path / "old run").mkdir()  # an existing run dir on a read-only mount (resume=true)
    read_only = {tmp_path, tmp_path / "old run"}
    real_mkdtemp = run_dir.tempfile.mkdtemp

    def read_only_folder(*args, dir=None, **kwargs):  # (a chmod would not stop root, which CI may run as)
        if Path(dir) in read_only:
            raise PermissionError(13, "Permission denied")
        return real_mkdtemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(run_dir.tempfile, "mkdtemp", read_only_folder)
    denied = run_script("train.py", "model=resnet20", cwd=tmp_path)  # the default outputs/<date>/<time>
    assert denied.returncode == 1 and f"cannot create the run directory {tmp_path / 'outputs'}" in denied.stderr
    assert "in " + str(tmp_path) + " (Permission denied); give hydra.run.dir=<a writable directory>" in denied.stderr
    resumed = run_script("train.py", "model=resnet20", "resume=true", "hydra.run.dir=old run", cwd=tmp_path)
    assert resumed.returncode == 1 and f"cannot write into the run directory {tmp_path / 'old run'} " \
        "(Permission denied)" in resumed.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnt", "old run"] and not any((tmp_path / "old run").iterdir())


def test_a_run_dir_that_is_a_file_is_named_as_such(tmp_path, monkeypatch):
    """hydra.run.dir naming a file (or a folder under one): the error says that path is a file, not that the run
    directory cannot be written into (the probe's NotADirectoryError)."""
    from compress._run_dir import check_run_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken").write_bytes(os.urandom(16))
    for value in ("taken", "taken/r1"):
        with pytest.raises(ValueError, match=rf"^hydra.run.dir={value}: {tmp_path / 'taken'} is a file, not a folder; "
                                             r"give another hydra.run.dir$"):
            check_run_dir(value, "hydra.run.dir")
    check_run_dir("fresh/r1", "hydra.run.dir")  # creatable: no error, nothing left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_the_run_that_holds_the_dir_writes_its_own_hydra_record(tmp_path, monkeypatch):
    """Two commands started at once in one run dir both have Hydra write .hydra/ before one takes the lock; the
    holder read "its" record back from those files, which could be the refused command's (its checkpoint and
    .hydra/ then named another seed than it trained with). The record is now made from the holder's own config and
    written again once the lock is held. (The other command's write is simulated just before the lock.)"""
    from compress import engine

    real_lock = engine.lock_file

    def other_command_wrote_first(path):
        folder = path.parent / ".hydra"
        (folder / "config.yaml").write_text("someone: else\n")
        (folder / "overrides.yaml").write_text("- trainer.seed=99\n")
        return real_lock(path)

    monkeypatch.setattr(engine, "lock_file", other_command_wrote_first)
    done = run_script("train.py", *TINY, "trainer.max_steps=1", "trainer.seed=5", f"hydra.run.dir={tmp_path}",
                      cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trainer.seed=5" in (tmp_path / ".hydra" / "overrides.yaml").read_text()
    from omegaconf import OmegaConf

    assert OmegaConf.load(tmp_path / ".hydra" / "config.yaml").trainer.seed == 5
    saved = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert "trainer.seed=5" in saved["hydra_record"]["overrides.yaml"] and saved["config"]["trainer"]["seed"] == 5
