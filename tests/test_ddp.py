"""DDP on CPU through the real torchrun entry point (gloo, 2 processes): every rank ends with the same
skeletons and weights, equal (within float tolerance) to one process with the same global batch, and
checkpoints resume across world sizes, inside an epoch too.

Model: timm's tiny `test_resnet` with GroupNorm (1 group) instead of BatchNorm. GroupNorm normalises
each sample on its own, so 2 ranks x batch 2 compute exactly what 1 process x batch 4 computes (BN
without SyncBN would use per-rank batch statistics, and PyTorch's SyncBatchNorm has no CPU path).
The 8 fake training images make 2 global batches per epoch.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli import run_script
from hydra import compose, initialize_config_dir
from signalling import signalling_model

from compress.engine import run

ROOT = Path(__file__).resolve().parents[1]
THRESHOLD = 0.999
# SWP strong enough to zero most stripes within 2 steps (most FS gradients are exactly 0 at 16x16
# input, so those stripes only follow the L1 term and fall under the threshold together).
BASE = [
    "model=timm",
    "model.name=timm:test_resnet",
    "+model.kwargs.norm_layer=groupnorm1",
    "data=fake",
    "data.input_size=16",
    "data.num_classes=3",
    "data.train_size=8",
    "data.test_size=7",  # odd: one rank's test shard is padded; evaluation must count 7 samples
    "optim=sgd_multistep",
    "optim.epochs=3",
    "optim.milestones=[2]",
    "prune=swp",
    "prune.alpha=0.01",
    f"prune.threshold={THRESHOLD}",
    "trainer.dump_rank_state=true",
    "trainer.amp=false",  # on a GPU machine, float32 as on the CPU (bfloat16 autocast rounds 1 x 4 and 2 x 2 apart)
]
PER_RANK = "data.batch_size=2"  # x 2 ranks = the single-process batch of 4
SINGLE = "data.batch_size=4"


def _torchrun(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "train.py", *overrides, f"hydra.run.dir={run_dir}"]  # fmt: skip
    # torchrun leaves a torchelastic_* folder in TMPDIR per call: keep it inside the test's own tmp_path
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(run_dir.parent)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _run_here(run_dir: Path, *overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return run(compose("train", overrides=[*BASE, *overrides]), run_dir=run_dir)


def _state(run_dir: Path, rank: int = 0) -> dict:
    return torch.load(run_dir / f"rank{rank}_state.pt", weights_only=True, map_location="cpu")["model"]


def _assert_same(a: dict, b: dict, exact: bool) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), key
        else:
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)


def _loss_steps(run_dir: Path) -> dict[int, float]:
    """{step: train/loss_step} of a run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {e.step: e.value for e in events.Scalars("train/loss_step")}


def _masks(state: dict) -> dict:
    return {k: v.abs() > THRESHOLD for k, v in state.items() if k.endswith("skeleton")}


@pytest.fixture
def one_thread():
    """In-process runs on one thread: the 2-core CI box is shared with the torchrun processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_torchrun_two_ranks_match_one_process_and_resume_across_world_sizes(tmp_path, one_thread):
    # 2 ranks x batch 2 and 1 process x batch 4: the same global batch, 2 steps per epoch, 3 epochs.
    # The 2 ranks stop inside epoch 2 (max_steps=3) and resume: they end with the weights of an uninterrupted 2-rank
    # run, bit-identical (same ranks, same reduction order).
    per_rank, single = [*BASE, PER_RANK], [*BASE, SINGLE]
    parts, full = tmp_path / "parts", tmp_path / "full"
    _torchrun(parts, *per_rank, "trainer.max_steps=3")
    ckpt = torch.load(parts / "checkpoints" / "last.pt", weights_only=True)
    assert (ckpt["epoch"], ckpt["epoch_batches"], ckpt["world_size"]) == (1, 1, 2)
    assert len(ckpt["rng_epoch_start"]) == len(ckpt["rng"]) == 2
    assert (ckpt["epoch_start_sample"], ckpt["epoch_samples"]) == (0, 4)  # 1 batch x 2 images x 2 ranks
    partial = tmp_path / "partial.pt"
    shutil.copy(parts / "checkpoints" / "last.pt", partial)
    _torchrun(parts, *per_rank, "resume=true", "trainer.max_steps=null")
    _torchrun(full, *per_rank, "trainer.log_every=1")
    for rank in (0, 1):
        _assert_same(_state(parts, rank), _state(full, rank), exact=True)
    assert json.loads((parts / "summary.json").read_text())["steps"] == 6

    # Every rank ends with the same weights, skeletons and buffers, bit for bit; one process with the same global
    # batch ends with them within float tolerance (the same masks exactly).
    rank0 = _state(full, 0)
    _assert_same(rank0, _state(full, 1), exact=True)
    _assert_same(_masks(rank0), _masks(_state(full, 1)), exact=True)
    ref = _run_here(tmp_path / "single", SINGLE, "trainer.log_every=1")
    _assert_same(rank0, _state(tmp_path / "single"), exact=False)
    _assert_same(_masks(rank0), _masks(_state(tmp_path / "single")), exact=True)
    summary = json.loads((full / "summary.json").read_text())  # written by rank 0 only
    assert summary["world_size"] == 2 and summary["steps"] == ref["steps"] == 6
    assert 0 < summary["stripes_kept"] == ref["stripes_kept"] < summary["stripes_total"]  # SWP really pruned
    # Exact evaluation: 7 test samples over 2 ranks (one padded shard) count as 7.
    assert round(summary["test_accuracy"] * 7, 6).is_integer()
    assert summary["test_accuracy"] == ref["test_accuracy"]
    assert summary["test_loss"] == pytest.approx(ref["test_loss"], rel=1e-4)
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == ["best.pt", "last.pt"]
    # the per-step loss logged is the global batch's (both ranks'), as one process at batch 4 logs it
    ranks, one = _loss_steps(full), _loss_steps(tmp_path / "single")
    assert len(ranks) == 6 and ranks.keys() == one.keys()
    assert all(ranks[k] == pytest.approx(one[k], rel=1e-4) for k in ranks), (ranks, one)

    # 2 -> 1 inside an epoch: one process at batch 4 trains the epoch's 4 samples the 2 ranks had left, in the
    # global batch they would have formed (data.EpochSampler), and ends with the 2-rank run's weights (rank 1's RNG
    # streams are dropped). train.py's own command line, in this process: data.batch_size may change on resume.
    one = run_script("train.py", *single, f"resume={partial}", "trainer.max_steps=null",
                     f"hydra.run.dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert one["world_size"] == 1 and one["steps"] == 3 + 1 + 2  # the epoch's last global batch, then epoch 3
    _assert_same(_state(tmp_path / "one"), rank0, exact=False)
    _assert_same(_masks(_state(tmp_path / "one")), _masks(rank0), exact=True)

    # 1 -> 2 inside an epoch: a single-process checkpoint at step 3 goes on on 2 ranks at batch 2 (the same global
    # batch) and gives the weights of the uninterrupted single-process run.
    _run_here(tmp_path / "single_parts", SINGLE, "trainer.max_steps=3")
    resumed = tmp_path / "resumed"
    _torchrun(resumed, *per_rank, f"resume={tmp_path / 'single_parts' / 'checkpoints' / 'last.pt'}",
              "trainer.max_steps=null")
    _assert_same(_state(resumed, 0), _state(resumed, 1), exact=True)
    _assert_same(_state(resumed, 0), _state(tmp_path / "single"), exact=False)
    assert json.loads((resumed / "summary.json").read_text())["steps"] == 6


def test_a_sigterm_that_reaches_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """Rank 0 alone gets SIGTERM in step 3 (a batch system's signal reaches the ranks at different steps, or not all
    of them): both ranks stop after step 4, where every rank learns of it (compress._stop), with last.pt at step 4
    holding both ranks' RNG streams; no rank waits for ever in a collective the other never joins."""
    launch = tmp_path / "launch"
    args = signalling_model(launch, "ddp_sigterm_net")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"),
           *args, "data.batch_size=4", f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path), "COMPRESS_TEST_SIGTERM": "3"}
    # a session of its own: ranks stuck in a collective (the failure this test is for) are killed with torchrun
    proc = subprocess.Popen(cmd, cwd=launch, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    log = (tmp_path / "run" / "train.log").read_text()
    assert "the run stopped: Terminated: SIGTERM; last.pt holds step 4 (epoch 1, batch 4 of 8)" in log, err[-4000:]
    assert "rank 1: the run stopped: Terminated: SIGTERM; last.pt holds step 4" in log
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert (ckpt["step"], ckpt["epoch_batches"], ckpt["world_size"], len(ckpt["rng"])) == (4, 4, 2, 2)


def test_compile_runs_skeleton_convs_and_matches_eager(tmp_path, one_thread):
    # aot_eager traces forward and backward (skeleton products included) in seconds on a CPU;
    # the default backend, inductor, is the one meant for GPUs.
    steps = ["data.batch_size=8", "trainer.max_steps=2", "optim.epochs=2", "optim.milestones=[1]"]
    from torch._dynamo.utils import counters

    eager = _run_here(tmp_path / "eager", *steps)
    counters.clear()
    compiled = _run_here(tmp_path / "compiled", *steps, "trainer.compile=true", "trainer.compile_backend=aot_eager")
    assert counters["stats"]["unique_graphs"] > 0  # dynamo traced the model: the run was compiled
    _assert_same(_state(tmp_path / "eager"), _state(tmp_path / "compiled"), exact=False)
    assert compiled["stripes_kept"] == eager["stripes_kept"] < compiled["stripes_total"]



class _WithUnused(torch.nn.Module):
    """A model whose forward leaves `spare` unused."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.spare = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x)


def test_ddp_with_unused_parameters_names_the_setting(tmp_path):
    """DDP waits for a gradient of every parameter: a model whose forward skips some fails at its second step with
    an error naming trainer.find_unused_parameters, and trains with it (a one-process gloo group, in-process)."""
    from omegaconf import OmegaConf

    import compress.engine as engine

    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        dist = engine.DistInfo(rank=0, world_size=2, device=torch.device("cpu"))  # world_size > 1: wrap in DDP
        x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
        for find in (False, True):
            cfg = OmegaConf.create({"trainer": {"compile": False, "find_unused_parameters": find}})
            raw = _WithUnused()
            model = engine._training_model(raw, cfg, dist)
            optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
            s = engine._Step(model, raw, optimizer, torch.amp.GradScaler("cpu", enabled=False), dist.device, None,
                             False, None)
            engine.train_step(s, x, y)
            if find:
                engine.train_step(s, x, y)
            else:
                with pytest.raises(RuntimeError, match=r"DDP: some parameters of the model got no gradient in the "
                                   r"last step .* train with trainer.find_unused_parameters=true"):
                    engine.train_step(s, x, y)
    finally:
        torch.distributed.destroy_process_group()
