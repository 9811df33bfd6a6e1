"""Pieces of the training engine against hand computations: one SWP step (float64), the optimizer and schedule
settings, an epoch's metrics, the step log, the skeleton heatmap, CPU precision."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from omegaconf import OmegaConf

from compress import engine
from compress._logging import skeleton_heatmap
from compress.skeleton import SkeletonConv2d

MULTISTEP = yaml.safe_load((Path(__file__).resolve().parents[1] / "conf" / "optim" / "sgd_multistep.yaml").read_text())


def _optim(**changes) -> OmegaConf:
    return OmegaConf.create({**MULTISTEP, **changes})


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    conv = SkeletonConv2d.from_conv(nn.Conv2d(2, 3, 3, padding=1))
    with torch.no_grad():
        conv.skeleton.copy_(torch.rand(conv.skeleton.shape) + 0.5)
    return nn.Sequential(conv, nn.Flatten(), nn.Linear(48, 4))


def test_the_top_seed_seeds_every_rank():
    """trainer.seed = 2^32 - 1 (allowed) on rank 1 of a DDP run: numpy refused seed + rank, so every rank but rank 0
    died with numpy's error."""
    import numpy as np

    from compress.engine import _seed_everything

    _seed_everything(2**32 - 1 + 1)
    drawn = np.random.rand(3)
    _seed_everything(0)
    assert np.array_equal(drawn, np.random.rand(3))  # numpy: modulo 2^32


def test_one_swp_step_is_sgd_with_the_l1_term_on_the_skeletons():
    """train_step with SWP: every parameter moves by -lr * grad, the skeletons by -lr * (grad + alpha * sign(FS))."""
    model = _net()
    ref = _net().double()
    x, y = torch.randn(5, 2, 4, 4), torch.randint(0, 4, (5,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = engine._Step(model, model, optimizer, torch.amp.GradScaler("cpu", enabled=False), torch.device("cpu"),
                        None, False, (0.3, 0.0, {}))
    engine.train_step(step, x, y)
    F.cross_entropy(ref(x.double()), y).backward()
    with torch.no_grad():
        for (name, got), want in zip(model.named_parameters(), ref.parameters()):
            term = 0.3 * want.sign() if name.endswith("skeleton") else 0
            torch.testing.assert_close(got.double(), want - 0.1 * (want.grad + term), rtol=1e-5, atol=1e-6)


def test_optimizer_and_schedule_take_their_settings():
    """nesterov and momentum reach every group (skeletons in their own); gamma and warmup shape the multistep LRs."""
    model = _net()
    optimizer = engine.build_optimizer(model, _optim(nesterov=True, momentum=0.8, skeleton_weight_decay=0.0))
    assert len(optimizer.param_groups) == 2
    assert all(g["nesterov"] and g["momentum"] == 0.8 for g in optimizer.param_groups)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [1e-4, 0.0]
    for warmup, want in ((0, [0.1, 0.1, 0.05, 0.025, 0.025]), (1, [0.05, 0.1, 0.05, 0.025, 0.025])):
        optimizer = engine.build_optimizer(model, _optim())
        scheduler = engine.build_scheduler(optimizer, _optim(gamma=0.5, milestones=[2, 3], warmup_epochs=warmup), 5)
        lrs = []
        for _ in range(5):
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()  # (no gradients: nothing moves)
            scheduler.step()
        assert lrs == pytest.approx(want), warmup
    with pytest.raises(ValueError, match=r"lowers the learning rate only at epochs 1..1"):
        engine.check_optim(_optim(milestones=[0, 1]), epochs=2)


@pytest.mark.parametrize("warmup, want", [(0, [0.1, 0.075, 0.025]),  # lr (1 + cos(pi e / 3)) / 2, e = 0, 1, 2
                                          (1, [0.05, 0.1, 0.075, 0.025])])  # lr / 2, then cosine over epochs 1..3
def test_cosine_schedule_by_hand(warmup, want):
    """The cosine schedule's epoch LRs (with warmup: the default digits recipe) against hand computation; only
    their relation to other runs was tested (a T_max off by one, or a cosine that ignored the warmup, passed)."""
    model = _net()
    optimizer = engine.build_optimizer(model, _optim())
    scheduler = engine.build_scheduler(optimizer, _optim(schedule="cosine", warmup_epochs=warmup), len(want))
    lrs = []
    for _ in want:
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx(want)


def test_a_resumed_runs_optim_errors_name_only_trainer_epochs():
    """A resumed run keeps its checkpoint's optim settings, so a too-short trainer.epochs is fixed by a longer one,
    not by the optim change the fresh-run message suggests (which resume refuses)."""
    fix = r"pass trainer.epochs > {} \(a resumed run keeps its checkpoint's optim settings\)"
    with pytest.raises(ValueError, match=r"warmup_epochs=2 must be smaller than the 2 epochs; " + fix.format(2)):
        engine.check_optim(_optim(milestones=[3], warmup_epochs=2), epochs=2, resume=True)
    with pytest.raises(ValueError, match=r"lowers the learning rate only at epochs 1..2; " + fix.format(3)):
        engine.check_optim(_optim(milestones=[2, 3]), epochs=3, resume=True)
    with pytest.raises(ValueError, match=r"set optim.warmup_epochs=0 for runs this short"):
        engine.check_optim(_optim(milestones=[3], warmup_epochs=2), epochs=2)


def test_an_epochs_metrics_weigh_each_batch_by_its_images():
    """Batches of 8 and 3 images (lr 0: nothing changes): the epoch's loss and accuracy are those of all 11."""
    torch.manual_seed(1)
    model = nn.Linear(6, 3)
    x, y = torch.randn(11, 6), torch.randint(0, 3, (11,))
    step = engine._Step(model, model, torch.optim.SGD(model.parameters(), lr=0.0),
                        torch.amp.GradScaler("cpu", enabled=False), torch.device("cpu"), None, False, None)
    metrics, steps, done = engine.train_one_epoch(step, [(x[:8], y[:8]), (x[8:], y[8:])], 0, None,
                                                  lambda *args: None, False)
    with torch.no_grad():
        logits = model(x).double()
    assert (steps, done) == (2, 2)
    assert metrics["loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-6)
    assert metrics["accuracy"] == pytest.approx((logits.argmax(1) == y).double().mean().item())


def test_the_step_log_writes_every_nth_step():
    logged = []

    class Logger:
        def scalars(self, values, step):
            logged.append((step, values))

    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.3)
    log = engine._StepLog(Logger(), optimizer, 3, 1)
    returned = [log(step, torch.tensor(3.0), 2) for step in range(1, 8)]
    assert [step for step, _ in logged] == [3, 6]
    assert returned == [None, None, 3.0, None, None, 3.0, None]
    assert logged[0][1]["train/loss_step"] == 3.0 and logged[0][1]["lr"] == 0.3


def test_skeleton_heatmap_shows_kept_stripes_by_magnitude():
    conv = SkeletonConv2d.from_conv(nn.Conv2d(2, 3, 2))
    fs = torch.tensor([[[0.5, -0.04], [1.0, 0.2]], [[0.0, 0.06], [-0.8, 0.3]], [[0.01, 0.02], [0.03, -2.0]]])
    with torch.no_grad():
        conv.skeleton.copy_(fs)
    img = skeleton_heatmap(conv, 0.05, scale=2)
    kept = fs.abs().flatten(1) * (fs.abs().flatten(1) > 0.05)
    assert img.shape == (6, 8)
    torch.testing.assert_close(img[::2, ::2], kept / 2.0)
    torch.testing.assert_close(img[1::2, 1::2], kept / 2.0)


def test_cpu_trains_in_float32():
    cfg = OmegaConf.create({"trainer": {"amp": True, "amp_dtype": "bfloat16"}})
    assert engine._amp_dtype(cfg, torch.device("cpu")) is None
    assert engine._amp_dtype(cfg, torch.device("cuda")) is torch.bfloat16
