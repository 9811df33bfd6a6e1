"""The training engine: config -> data + model (+ Filter Skeletons) -> SGD training with SWP -> summary.

`run(cfg, run_dir)` is what train.py calls. One process by default; under torchrun the environment
variables select DDP (gloo on CPU, NCCL on CUDA), and only rank 0 logs and writes checkpoints,
TensorBoard and summary.json (the other ranks wait at a barrier after each checkpoint).
Checkpoints (`<run_dir>/checkpoints/last.pt`, `best.pt`) are written atomically at every epoch end and
where trainer.max_steps stops a run inside an epoch, every trainer.checkpoint_every steps, and after the step at
which a SIGTERM (a batch system ending the job) stops the run (`compress._stop`); `resume=true` continues from
`<run_dir>/checkpoints/last.pt`, `resume=<path>` from that file, with the checkpoint's config (see
`_resume_config`) and, inside an epoch, from the batch after the last one trained (`_resume_mid_epoch`).

DDP details: rank r seeds its RNGs with trainer.seed + r (rank 0 = a single-process run) and DDP
copies rank 0's initial weights to all ranks. Gradients are all-reduced inside backward(), so the
SWP update (`swp_update`) runs on identical averaged gradients and identical Filter Skeletons and
zeroes the same stripes on every rank. Evaluation runs the plain model on each rank's shard of the
test set, after all ranks took rank 0's BN buffers, and counts every test sample exactly once.
A checkpoint holds every rank's RNG streams; resuming with a different world size restores them
where the rank exists and reseeds new ranks from (trainer.seed, rank, step).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import operator
import os
import random
import re
import shutil
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf, open_dict
from torch.utils.data import DistributedSampler

from compress._checks import listed, non_finite
from compress._files import atomic_write, json_text, launch_path, lock_file, remove_if_only_hydra, unlock_file
from compress._logging import RunLogger, format_summary, log_failure, progress, say, warnings_in_log_files
from compress._macs import estimate_macs
from compress._modes import evaluating
from compress._overrides import adding_overrides, command_line_overrides, require_sections, typed
from compress._stop import StepStop, Terminated
from compress._trainstate import atomic_save, check_weight_kinds, load_checkpoint, rng_state, set_rng_state
from compress.checkpoint import build_recipe, rebuild_for, unregistered_module
from compress.checkpoint import load as load_compact
from compress.compaction import check_target_macs, compact
from compress.data import MAX_SEED, build_data
from compress.export import load_training_checkpoint
from compress.models import TIMM_PREFIX, create_model, import_modules, load_weights, module_names
from compress.models._weights import read_weights, weights_problems
from compress.pix import apply_pix, check_tau
from compress.profile import profile
from compress.skeleton import (
    attach_skeletons,
    check_nonnegative,
    check_stripe_group,
    skeleton_stats,
    swp_update,
)
from compress.stripe import stripe_counts
from compress.surgery import conv_bn_pairs

__all__ = [
    "DistInfo", "setup_distributed", "build_optimizer", "build_scheduler", "check_optim",
    "train_step", "train_one_epoch", "evaluate", "run",
]  # fmt: skip

PRUNE_METHODS = ("none", "swp")
# what a checkpoint needs to be resumed (run writes them all)
RESUME_KEYS = ("model", "config", "optimizer", "scheduler", "scaler", "rng", "epoch", "step", "best_accuracy", "test")


@dataclass(frozen=True)
class DistInfo:
    """Process placement: rank, world size and the torch device this process trains on."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"trainer.device={name!r} is not a device; use auto, cpu, cuda or cuda:<index>") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"trainer.device={name!r}: training runs on auto, cpu, cuda or cuda:<index>")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"trainer.device={name} but CUDA is not available; use trainer.device=auto or cpu")
    return device


def setup_distributed(device: str = "auto") -> DistInfo:
    """Single process unless torchrun's WORLD_SIZE > 1 is set; then join the process group."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dev = _resolve_device(device)
    if world_size == 1:
        return DistInfo(0, 1, dev)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    if not torch_dist.is_initialized():
        torch_dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return DistInfo(torch_dist.get_rank(), world_size, dev)


def _stop_group(dist: DistInfo):
    """The group `StepStop` sums the ranks' SIGTERM flags over: None for one process, else a gloo group of every
    rank (the flags are CPU ints: no device sync; under NCCL a second group)."""
    if dist.world_size == 1:
        return None
    return torch_dist.group.WORLD if torch_dist.get_backend() == "gloo" else torch_dist.new_group(backend="gloo")


def _shared_run_dir(run_dir: Path, dist: DistInfo) -> Path:
    """Rank 0's run directory on every rank (Hydra's time-stamped default may differ between ranks: a rank that
    started in another second removes the directory Hydra made for it, if it holds only Hydra's files)."""
    if dist.world_size == 1:
        return run_dir
    shared = [str(run_dir)]
    torch_dist.broadcast_object_list(shared, src=0)
    if dist.rank != 0 and run_dir.resolve() != Path(shared[0]).resolve():
        remove_if_only_hydra(run_dir, "train.log")
    return Path(shared[0])


def _finish_distributed(dist: DistInfo) -> None:
    """Wait for all ranks, then leave the process group (no-op for a single process)."""
    if dist.world_size > 1:
        torch_dist.barrier()
        torch_dist.destroy_process_group()


def _seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's global RNGs from `seed` (trainer.seed + rank: numpy, which takes 32 bits, gets it
    modulo 2^32, so the top seeds run under DDP too)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_optimizer(model: nn.Module, cfg: DictConfig) -> torch.optim.Optimizer:
    """SGD over all parameters (skeletons included, as in the SWP paper) from cfg: lr, momentum, nesterov, weight_decay.

    Optional `cfg.skeleton_weight_decay` (default null: the same as weight_decay, the paper's setting)
    gives the Filter Skeletons their own weight decay, e.g. 0 so that only the SWP L1 term acts on them.
    """
    check_optim(cfg)
    params = model.parameters()
    skeleton_wd = cfg.get("skeleton_weight_decay", None)
    if skeleton_wd is not None:
        named = list(model.named_parameters())
        skeletons = [p for n, p in named if n == "skeleton" or n.endswith(".skeleton")]
        others = [p for n, p in named if not (n == "skeleton" or n.endswith(".skeleton"))]
        params = [{"params": others}, {"params": skeletons, "weight_decay": float(skeleton_wd)}]
    return torch.optim.SGD(
        params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: DictConfig, epochs: int):
    """Per-epoch LR schedule: cfg.schedule 'multistep' (milestones in epochs, gamma) or 'cosine' (to 0 at `epochs`).

    Optional `cfg.warmup_epochs` (default 0): the first W epochs run at lr * (e + 1) / (W + 1) (linear
    warmup, epoch e = 0..W-1), then the schedule runs as usual; with cosine it spans the remaining
    epochs - W. With W = 0 the schedules are exactly the plain ones.
    """
    check_optim(cfg, epochs)
    warmup = int(cfg.get("warmup_epochs", 0) or 0)
    if warmup == 0:
        if cfg.schedule == "multistep":
            return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(cfg.milestones), gamma=cfg.gamma)
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    if cfg.schedule == "multistep":
        milestones, gamma = sorted(int(m) for m in cfg.milestones), float(cfg.gamma)

        def after(e: int) -> float:
            return gamma ** sum(e >= m for m in milestones)
    else:

        def after(e: int) -> float:
            return 0.5 * (1.0 + float(np.cos(np.pi * (e - warmup) / (epochs - warmup))))

    def factor(e: int) -> float:
        return (e + 1) / (warmup + 1) if e < warmup else after(e)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass
class _Step:
    """What one optimizer step needs besides the batch."""

    model: nn.Module  # the module called in forward (maybe DDP/compiled)
    raw: nn.Module  # the plain model (skeleton names, swp_update)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    device: torch.device
    amp_dtype: torch.dtype | None
    channels_last: bool
    swp: tuple[float, float, dict[str, str]] | None  # (alpha, threshold, BN pairs) or None: swp_update's arguments


def _to_device(x: torch.Tensor, y: torch.Tensor, s: _Step) -> tuple[torch.Tensor, torch.Tensor]:
    fmt = torch.channels_last if s.channels_last else torch.contiguous_format
    return x.to(s.device, non_blocking=True, memory_format=fmt), y.to(s.device, non_blocking=True)


def _all_reduce_sum(sums: torch.Tensor) -> list[float]:
    """The element-wise sum of `sums` over all ranks, as floats (one host sync)."""
    if torch_dist.is_initialized():
        torch_dist.all_reduce(sums)
    return sums.tolist()


def train_step(s: _Step, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on a batch already on the device; returns (loss, logits), detached, unsynced.

    Under DDP, backward() returns after the gradient all-reduce, so swp_update sees the averaged
    gradients (identical on every rank) and keeps the skeletons identical across ranks.
    """
    with torch.autocast(s.device.type, dtype=s.amp_dtype, enabled=s.amp_dtype is not None):
        try:
            out = s.model(x)
        except ValueError as err:
            if "more than 1 value per channel" not in str(err):
                raise
            raise ValueError(f"a training batch of {x.shape[0]} image(s) of {tuple(x.shape[1:])} reaches a BatchNorm "
                             "with one value per channel (a 1x1 feature map), which it cannot train on; use "
                             "data.batch_size >= 2 (per process) or a larger data.input_size") from err
        except RuntimeError as err:
            if "Expected to have finished reduction" not in str(err):
                raise
            raise RuntimeError("DDP: some parameters of the model got no gradient in the last step (its forward does "
                               "not use them), and DDP waits for every parameter's; train with "
                               "trainer.find_unused_parameters=true, or remove them from the model") from err
        loss = F.cross_entropy(out, y)
    s.optimizer.zero_grad(set_to_none=True)
    s.scaler.scale(loss).backward()
    if s.swp is not None:
        s.scaler.unscale_(s.optimizer)
        swp_update(s.raw, *s.swp)
    s.scaler.step(s.optimizer)
    s.scaler.update()
    return loss.detach(), out.detach()


def _skipping(loader, skip: int, after_skip=None):
    """The batches of one pass over `loader` after its first `skip`, which are loaded and dropped (so data RNG
    streams advance as in the run that trained them); `after_skip()` runs once they are dropped."""
    batches = iter(loader)
    for _ in range(skip):
        next(batches)
    if after_skip is not None:
        after_skip()
    yield from batches


def _then(first, second):
    """A function that calls `first()` (if not None), then `second()`."""
    def both() -> None:
        if first is not None:
            first()
        second()
    return both


def train_one_epoch(s: _Step, loader, step: int, max_steps: int | None, log, show: bool, skip: int = 0,
                    after_skip=None, on_step=None, before: Sequence[float] | None = None) -> tuple[dict, int, int]:
    """One pass over `loader`, stopping right after optimizer step `max_steps` (no further batch is loaded).

    `skip`: the first `skip` batches were trained before (a run stopped in this epoch): they are loaded and
    dropped, then `after_skip()` runs (see `_skipping`). `before`: (loss * images, correct, images) of the epoch's
    batches trained before this call, summed over all ranks (a resumed epoch; the checkpoint's `epoch_sums`).
    `on_step(step, batches done, sums)` runs after each step; `sums()` gives the epoch's (loss * images, correct,
    images) so far, `before` included, summed over all ranks (a collective: every rank calls it at the same step).
    Returns ({loss, accuracy} over the epoch's batches on all ranks, `before` included, and images_per_s over this
    call's, new step, batches of the epoch done, skipped ones included). Metrics stay on the device (no host sync
    per step); `log(step, loss, batch_images)` runs after every step and returns the loss as a float on the steps
    it logs, else None.
    """
    s.model.train()
    sums = torch.zeros(3, dtype=torch.float64, device=s.device)  # loss * n, correct, n

    def with_before(here: list[float]) -> list[float]:
        return [a + b for a, b in zip(here, before or (0.0, 0.0, 0.0))]

    def epoch_sums() -> list[float]:
        return with_before(_all_reduce_sum(sums.clone()))
    start = time.perf_counter()
    done = skip

    def skipped() -> None:  # the epoch's rate counts the batches trained here, not the dropped ones' loading
        nonlocal start
        if after_skip is not None:
            after_skip()
        start = time.perf_counter()

    if max_steps is None or step < max_steps:
        batches = _skipping(loader, skip, skipped)
        bar = progress(batches, show, leave=False, desc="train", total=len(loader) - skip)
        for x, y in bar:
            x, y = _to_device(x, y, s)
            loss, out = train_step(s, x, y)
            step, done = step + 1, done + 1
            sums[0] += loss.double() * y.numel()
            sums[1] += (out.argmax(1) == y).sum()
            sums[2] += y.numel()
            logged = log(step, loss, y.numel())
            if logged is not None:
                bar.set_postfix(loss=f"{logged:.3f}")
            if on_step is not None:
                on_step(step, done, epoch_sums)
            if max_steps is not None and step >= max_steps:
                if done == len(loader):  # end the pass as an uninterrupted run does: the sampler draws its
                    next(batches, None)  # last random numbers when it runs out (no batch is loaded)
                break
    here = _all_reduce_sum(sums)
    # no batch here: a max_steps stop before it, or a resumed epoch with nothing left (EpochSampler)
    rate = here[2] / (time.perf_counter() - start) if here[2] else float("nan")
    total = with_before(here)
    if not total[2]:  # nor before
        return {"loss": float("nan"), "accuracy": float("nan"), "images_per_s": rate}, step, done
    metrics = {"loss": total[0] / total[2], "accuracy": total[1] / total[2], "images_per_s": rate, "sums": total}
    return metrics, step, done


def _real_samples(loader) -> int:
    """How many of this rank's test samples are real: the padded DistributedSampler (unshuffled) puts
    its repeated samples at the end of the shards, after the first len(range(rank, n, world)) ones."""
    sampler = loader.sampler
    if not isinstance(sampler, DistributedSampler):
        return len(loader.dataset)
    if sampler.shuffle or sampler.drop_last:
        raise ValueError("evaluate: the test loader needs an unshuffled, padded DistributedSampler")
    return len(range(sampler.rank, len(sampler.dataset), sampler.num_replicas))


def _broadcast_buffers(model: nn.Module) -> None:
    """Give every rank rank 0's buffers (BN running statistics), as DDP does before each training forward."""
    if torch_dist.is_initialized():
        for buffer in model.buffers():
            torch_dist.broadcast(buffer, src=0)


@torch.no_grad()
def evaluate(s: _Step, loader, show: bool) -> dict:
    """Mean cross-entropy and top-1 accuracy over the test set, each sample counted once over all ranks.

    Runs the plain model (no DDP collectives, no recompilation) with rank 0's BN buffers on every rank.
    """
    _broadcast_buffers(s.raw)
    s.raw.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=s.device)  # loss sum, correct, n
    left = _real_samples(loader)
    for x, y in progress(loader, show, leave=False, desc="test"):
        if left <= 0:
            break
        x, y = _to_device(x[:left], y[:left], s)
        left -= y.numel()
        with torch.autocast(s.device.type, dtype=s.amp_dtype, enabled=s.amp_dtype is not None):
            out = s.raw(x)
        sums[0] += F.cross_entropy(out.float(), y, reduction="sum").double()
        sums[1] += (out.argmax(1) == y).sum()
        sums[2] += y.numel()
    loss_sum, correct, seen = _all_reduce_sum(sums)
    return {"loss": loss_sum / max(seen, 1), "accuracy": correct / max(seen, 1)}


class _StepLog:
    """Every `every` steps: train/loss_step, lr and train/images_per_s (images of all ranks since the last log)."""

    def __init__(self, logger: RunLogger, optimizer: torch.optim.Optimizer, every: int, world_size: int):
        self.logger, self.optimizer = logger, optimizer
        self.every, self.world_size = max(every, 1), world_size
        self.restart()

    def restart(self) -> None:
        """Start a new rate window (at each epoch's start: evaluation and checkpoint writes stay out of the rate)."""
        self.images, self.since = 0, time.perf_counter()
        self.last = (-1, 0.0)  # (step, loss) of the last logged step

    def __call__(self, step: int, loss: torch.Tensor, batch_images: int) -> float | None:
        self.images += batch_images * self.world_size
        if step % self.every:
            return None
        # the global batch's mean loss (every rank logs the same steps); waits for the queued steps, so the clock
        # below is honest
        total, images = _all_reduce_sum(torch.stack([loss.double() * batch_images, loss.new_tensor(batch_images,
                                                                                                   dtype=torch.float64)]))
        value = total / images
        self.last = (step, value)
        now = time.perf_counter()
        rate = self.images / max(now - self.since, 1e-9)
        self.images, self.since = 0, now
        lr = self.optimizer.param_groups[0]["lr"]
        self.logger.scalars({"train/loss_step": value, "lr": lr, "train/images_per_s": rate}, step)
        return value


def _finite_weights(model: nn.Module) -> bool:
    """Whether every floating-point parameter and buffer of `model` is finite (one host sync)."""
    flags = [t.isfinite().all() for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True


def _peak_gpu_memory(device: torch.device) -> dict[str, float]:
    """{'epoch/peak_gpu_memory_gib': peak allocated since the last call} on CUDA (then resets it), else {}."""
    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return {"epoch/peak_gpu_memory_gib": peak}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require_int(key: str, value, least: int, null: str | None = None, note: str | None = None,
                 most: int | None = None) -> None:
    """ValueError unless `value` is an int in [`least`, `most`] (or None where `null` says what None means)."""
    if value is None and null is not None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < least or (most is not None and value > most):
        rule = (f"an int >= {least}" + (f" and <= {most}" if most is not None else "") + (f", or null ({null})" if null
                else "") + (f"; {note}" if note else ""))
        raise ValueError(f"{key}={value!r} must be {rule}")


# optim's numeric settings: (what the message says, the test); NaN and inf fail every test
_OPTIM_RANGES = {
    "lr": ("> 0", lambda v: 0 < v < math.inf),
    "momentum": ("in [0, 1)", lambda v: 0 <= v < 1),
    "weight_decay": (">= 0", lambda v: 0 <= v < math.inf),
    "gamma": ("in (0, 1] (the factor each milestone multiplies the learning rate by)", lambda v: 0 < v <= 1),
    "skeleton_weight_decay": (">= 0, or null (the same as optim.weight_decay)", lambda v: 0 <= v < math.inf),
}


def check_optim(optim: DictConfig, epochs: int | None = None, resume: bool = False) -> None:
    """ValueError naming the key unless `optim` (the optim config group) is usable: SGD, a known schedule, finite
    numbers in range, nesterov with momentum; with `epochs` (the run's length) also that the warmup and the
    milestones fall inside the run (`resume`: the run keeps its checkpoint's optim settings, so the messages name
    only trainer.epochs as the fix). `train.py` checks it before building any data; build_optimizer and
    build_scheduler check it again."""
    if optim.get("name") != "sgd":
        raise ValueError(f"optim.name={optim.get('name')!r} is not supported; use optim=sgd_multistep, "
                         "optim=sgd_cosine or optim=sgd_digits")
    if optim.get("schedule") not in ("multistep", "cosine"):
        raise ValueError(f"optim.schedule={optim.get('schedule')!r} is not supported; use 'multistep' or 'cosine'")
    if optim.schedule == "multistep" and "milestones" not in optim:
        raise ValueError("optim.schedule=multistep needs optim.milestones and optim.gamma, which this optim group "
                         "does not have; use optim=sgd_multistep (its optim.milestones and optim.gamma set the steps)")
    optional = ("skeleton_weight_decay",) + (("gamma",) if optim.schedule == "cosine" else ())  # null/absent allowed
    for key, (rule, ok) in _OPTIM_RANGES.items():
        value = optim.get(key)
        if value is None and key in optional:
            continue
        if not _is_number(value) or not ok(value):
            raise ValueError(f"optim.{key}={'null' if value is None else repr(value)} must be a finite number {rule}")
    if optim.get("nesterov") is True and optim.momentum == 0:
        raise ValueError("optim.nesterov=true needs optim.momentum > 0 (Nesterov momentum); set optim.nesterov=false "
                         "for plain SGD")
    _require_int("optim.warmup_epochs", optim.get("warmup_epochs", 0), 0, null="none")
    warmup = optim.get("warmup_epochs", 0) or 0
    values = _check_milestones(optim.get("milestones")) if optim.schedule == "multistep" else None
    if epochs is None:
        return
    longer = "pass trainer.epochs > {} (a resumed run keeps its checkpoint's optim settings)"
    if warmup and warmup >= epochs:
        raise ValueError(f"optim.warmup_epochs={warmup} must be smaller than the {epochs} epochs; "
                         + (longer.format(warmup) if resume else "set optim.warmup_epochs=0 for runs this short"))
    if optim.schedule == "multistep" and not 0 < values[0] <= values[-1] < epochs:
        example = (f"e.g. optim.milestones=[{epochs // 2},{3 * epochs // 4}]" if epochs >= 4
                   else "or optim=sgd_cosine" if epochs < 2 else "e.g. optim.milestones=[1]")
        where = f"only at epochs 1..{epochs - 1}" if epochs >= 2 else "at no epoch boundary (it has none)"
        fix = (longer.format(values[-1]) if resume else f"set milestones inside the run ({example}) or run past "
               f"epoch {values[-1]} (trainer.epochs, which is optim.epochs unless set)")
        raise ValueError(f"optim.milestones={values}: a multistep run of {epochs} epoch{'s' * (epochs != 1)} lowers the "
                         f"learning rate {where}; {fix}")


def _check_milestones(milestones) -> list[int]:
    """The multistep schedule's milestones as a list; ValueError unless they are increasing epoch numbers."""
    values = list(milestones) if isinstance(milestones, Sequence) and not isinstance(milestones, str) else None
    if not values or not all(isinstance(m, int) and not isinstance(m, bool) for m in values) or values != sorted(set(values)):
        raise ValueError(f"optim.milestones={milestones!r} must be a list of increasing epoch numbers, e.g. "
                         "optim.milestones=[80,120]")
    return values


def _check_warmup_milestones(optim: DictConfig) -> None:
    """ValueError if a multistep milestone falls inside the warmup: the learning rate would drop before it reaches
    optim.lr. Checked when a run starts (a resumed one keeps the settings it started with)."""
    warmup = optim.get("warmup_epochs", 0) or 0
    if optim.schedule == "multistep" and warmup and optim.milestones[0] <= warmup:
        raise ValueError(f"optim.milestones={list(optim.milestones)}: the first milestone must come after the "
                         f"optim.warmup_epochs={warmup} warmup epochs, or the learning rate drops before it reaches "
                         f"optim.lr; set milestones after epoch {warmup}, or a shorter warmup")


# on/off settings (data.download and data.pin_memory are checked by build_data)
BOOLEAN_KEYS = ("trainer.amp", "trainer.channels_last", "trainer.compile", "trainer.sync_bn", "trainer.dump_rank_state",
                "trainer.find_unused_parameters", "optim.nesterov")


def _check_config(cfg: DictConfig, ckpt: dict | None = None) -> None:
    """Reject settings this version cannot honour, with the fix in the message. A resumed fine-tuning run whose
    checkpoint holds its model's recipe (`init_recipe`) does not need its init= file any more."""
    if cfg.init is not None and cfg.model.get("weights") is not None:
        raise ValueError("init and model.weights are both set: a compact model carries its own weights; leave "
                         "model.weights=null")
    if cfg.init is not None and not Path(str(cfg.init)).is_file() and not (ckpt or {}).get("init_recipe"):
        what = "a directory" if Path(str(cfg.init)).is_dir() else "no such file"
        raise ValueError(f"init={cfg.init}: {what}; give a compact model file written by export.py or compress.save "
                         "(export.py writes model.compact.safetensors in its out directory)")
    if cfg.init is not None and cfg.pix.zeta is not None:
        raise ValueError("init and pix.zeta are both set: a compact model already has its PiX blocks; leave pix.zeta=null")
    if cfg.prune.name not in PRUNE_METHODS:
        raise ValueError(f"prune.name={cfg.prune.name!r} is unknown; choose one of {PRUNE_METHODS} "
                         "(prune=none|swp|swp_digits)")
    if cfg.prune.name == "swp":
        check_nonnegative(alpha=cfg.prune.alpha, threshold=cfg.prune.threshold)
        _require_int("prune.min_kernel_size", cfg.prune.min_kernel_size, 1,
                     note="convs with a smaller kernel get no skeleton")
        check_stripe_group(cfg.prune.get("stripe_group", 1))
    _require_int("pix.zeta", cfg.pix.zeta, 1, null="no PiX", note="the bottleneck width is out_channels / zeta")
    check_tau("config", cfg.pix.tau, "pix.tau")
    if cfg.prune.name == "swp" and cfg.prune.get("target_flops") is not None:
        check_target_macs(cfg.prune.target_flops, "prune.target_flops")
    # trainer.epochs is ${optim.epochs} unless set: name the key the user set
    _require_int("optim.epochs" if OmegaConf.is_interpolation(cfg.trainer, "epochs") else "trainer.epochs",
                 cfg.trainer.epochs, 1)
    _require_int("trainer.eval_every", cfg.trainer.eval_every, 1, note="the last epoch is always evaluated")
    _require_int("trainer.checkpoint_every", cfg.trainer.get("checkpoint_every"), 1, null="epoch ends only")
    _require_int("trainer.max_steps", cfg.trainer.max_steps, 1, null="no step limit")
    _require_int("trainer.log_every", cfg.trainer.log_every, 1)
    _require_int("trainer.seed", cfg.trainer.seed, 0, most=MAX_SEED)
    check_optim(cfg.optim, cfg.trainer.epochs, resume=ckpt is not None)
    if ckpt is None:
        _check_warmup_milestones(cfg.optim)
    if cfg.optim.schedule == "cosine" and ("milestones" in cfg.optim or "gamma" in cfg.optim):
        warnings.warn("optim.milestones and optim.gamma have no effect with optim.schedule=cosine (the cosine "
                      "schedule has no steps); use optim=sgd_cosine, or optim.schedule=multistep", stacklevel=2)
    if cfg.trainer.amp_dtype not in ("bfloat16", "float16"):
        raise ValueError(f"trainer.amp_dtype={cfg.trainer.amp_dtype!r}; use bfloat16 or float16")
    if cfg.prune.name == "swp" and _is_number(cfg.prune.threshold) and cfg.prune.threshold >= 1:
        raise ValueError(f"prune.threshold={cfg.prune.threshold} zeroes every stripe at the first step (skeletons "
                         "start at 1); use a small value (the paper's is 0.01)")
    for key in BOOLEAN_KEYS:  # a string such as "no" would count as true
        value = OmegaConf.select(cfg, key, default=False)
        if not isinstance(value, bool):
            raise ValueError(f"{key}={value!r}; it must be true or false")
    if cfg.trainer.compile and not cfg.trainer.compile_backend:
        raise ValueError("trainer.compile=true needs trainer.compile_backend (inductor, or aot_eager on CPU)")
    if cfg.trainer.compile and cfg.trainer.compile_backend not in torch.compiler.list_backends(exclude_tags=()):
        raise ValueError(f"trainer.compile_backend={cfg.trainer.compile_backend!r} is not a torch.compile backend; "
                         f"use inductor or aot_eager (all: {', '.join(torch.compiler.list_backends())})")


def _command_line_keys() -> set[str] | None:
    """The config keys this train.py run sets on its command line ({'resume', 'trainer.max_steps', ...}); None
    outside a Hydra app."""
    overrides = command_line_overrides()
    return None if overrides is None else {o.key_or_group for o in overrides}


FIXED_GROUPS = ("prune", "optim", "trainer", "pix")  # every key they read is in their yaml files
MODEL_KEYS = ("name", "kwargs", "weights", "source")  # what the model group may hold (kwargs: any constructor argument)


def _refuse_added_keys(cfg: DictConfig) -> None:
    """ValueError for a key added with '+' or '++' (`adding_overrides`) where nothing reads it: in a group whose keys
    all exist already (`FIXED_GROUPS`), in the model group outside model.kwargs (passed to the model's constructor),
    or at the top level. Such a key is misspelled or belongs elsewhere, and would be ignored. (Data groups differ in
    their keys: +data.seed and the like are checked by build_data.)"""
    overrides = command_line_overrides()
    for o in adding_overrides(overrides) if overrides else []:
        group, _, leaf = o.key_or_group.partition(".")
        if group == "data" and leaf:
            continue
        if not leaf:
            known = ", ".join(sorted(k for k in cfg if k != group))
            raise ValueError(f"{typed(o)}: the config has no top-level key {group!r}, so it would be ignored (its "
                             f"keys: {known}); check the spelling and the group (e.g. optim.epochs, not epochs)")
        if group in FIXED_GROUPS or (group == "model" and leaf.partition(".")[0] not in MODEL_KEYS):
            known = sorted(k for k in cfg[group] if k != leaf)
            fix = ("; model arguments go under +model.kwargs.<name> (pretrained weights: model.weights=<a local state "
                   "dict file>)" if group == "model" else "")
            raise ValueError(f"{typed(o)}: {group} has no key {leaf!r}, so it would be ignored (its keys: "
                             f"{', '.join(known)}); set existing keys without '+', and check the spelling{fix}")


def _refuse_deleted_keys() -> None:
    """ValueError for a setting deleted with '~key' (outside model.kwargs, the model constructor's optional
    arguments): train.py reads every setting of its config, so a required one then failed with omegaconf's
    "Key ... is not in struct", and an optional one fell back to a default silently."""
    for o in command_line_overrides() or []:
        if o.is_delete() and not o.is_hydra_override() and not o.key_or_group.startswith("model.kwargs."):
            key = o.key_or_group
            raise ValueError(f"~{key}: train.py reads every setting of its config, so {key} cannot be deleted; set "
                             f"it instead ({key}=<value>, or {key}=null where it takes null)")


# keys a resumed run may change besides trainer.*: where the data is read from, how many processes load it (other
# loader worker counts draw other augmentation streams), the per-process batch sizes (so that a run resumed on
# another number of processes can keep its global batch: data.EpochSampler gives the same global batches), and the
# modules imported to register models (a checkpoint's own list is never imported: `_require_model`)
RESUME_MAY_CHANGE = ("data.root", "data.num_workers", "data.batch_size", "data.eval_batch_size", "imports")
# keys a resume does not read, whatever the command line says, and why: the run's record keeps the checkpoint's
# value (a note says so)
RESUME_IGNORES = {
    "model.weights": "the run goes on from its checkpoint's weights, not the file a fresh run starts from",
    "trainer.seed": "the run goes on with its checkpoint's random number streams and data order",
}


def _may_change_on_resume(key: str) -> bool:
    return (key.startswith("trainer.") or key in RESUME_MAY_CHANGE) and key not in RESUME_IGNORES


def _compared_values(saved: DictConfig, cfg: DictConfig, key: str) -> tuple:
    """(the checkpoint's, the command line's) value at `key`, as `_plain_value`, for the resume check. A group given
    whole (data=cifar10) is compared without the keys that may change on resume (RESUME_MAY_CHANGE), and
    a data group given without a seed without the seed the run derived from trainer.seed."""
    old, new = _plain_value(saved, key), _plain_value(cfg, key)
    if isinstance(old, dict) and isinstance(new, dict):
        free = {k.partition(".")[2] for k in (*RESUME_MAY_CHANGE, *RESUME_IGNORES) if k.startswith(key + ".")}
        if key == "data" and "seed" not in new:
            free.add("seed")
        old, new = ({k: v for k, v in d.items() if k not in free} for d in (old, new))
    return old, new


def _plain_value(cfg: DictConfig, key: str):
    """The value at dotted `key` of `cfg` as plain Python (a group as a resolved dict), None if absent."""
    value = OmegaConf.select(cfg, key, default=None)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _run_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint a run dir's run continues from: checkpoints/last.pt, else its best.pt (written first, so a run
    that failed or was killed writing last.pt after it has only that one), else None."""
    for name in ("last.pt", "best.pt"):
        if (run_dir / "checkpoints" / name).is_file():
            return run_dir / "checkpoints" / name
    return None


def _resolve_auto_resume(cfg: DictConfig, run_dir: Path, dist: DistInfo) -> None:
    """`resume=auto` (for requeued jobs): becomes `resume=true` when `run_dir` holds a checkpoint
    (`_run_checkpoint`), else `resume=false` (a fresh run), in place, saying which."""
    if not isinstance(cfg.resume, str) or cfg.resume != "auto":
        return
    found = _run_checkpoint(run_dir)
    if dist.is_main:
        say(f"resume=auto: continuing {found}" if found else
            f"resume=auto: no checkpoints/last.pt in {run_dir}; starting a fresh run")
    cfg.resume = found is not None


def _restore_run_record(run_dir: Path) -> None:
    """Put the run's own config and Hydra record back into run_dir's .hydra/ (over a refused command's), from the
    first readable of its checkpoints/last.pt and best.pt; nothing where neither is readable."""
    for name in ("last.pt", "best.pt"):
        try:
            saved = load_checkpoint(run_dir / "checkpoints" / name)
        except (ValueError, FileNotFoundError):
            continue
        _record_run_config(saved["config"], run_dir, saved.get("hydra_record"))
        return


def _refuse_to_overwrite_a_run(cfg: DictConfig, run_dir: Path) -> None:
    """ValueError when `run_dir` holds a run (`_run_checkpoint`) that this command does not continue: a fresh run,
    or `resume=<file>` of another checkpoint (its best.pt included), would overwrite its checkpoints and summary.
    The refused command's config is taken out of the run's .hydra/ again (the run's own comes from last.pt, or from
    best.pt where last.pt is unreadable)."""
    existing = _run_checkpoint(run_dir)
    if existing is None:
        return
    if cfg.resume is True or (cfg.resume not in (None, False) and Path(str(cfg.resume)).resolve() == existing.resolve()):
        return
    _restore_run_record(run_dir)
    what = "a fresh run" if cfg.resume in (None, False) else f"resume={cfg.resume} (another checkpoint)"
    try:
        load_checkpoint(existing)
    except ValueError as err:  # resume=true cannot continue it either: say what can
        raise ValueError(f"{run_dir} already holds a run whose checkpoints/{existing.name} is unreadable ({err}); {what} "
                         "would overwrite its checkpoints. Continue from another checkpoint in a new run dir: "
                         f"resume=<file> {_dir_key()}=<a new folder>") from None
    raise ValueError(
        f"{run_dir} already holds a run (checkpoints/{existing.name}); {what} would overwrite its checkpoints. Pass "
        f"resume=true to continue that run, or another {_dir_key()} (or delete the old run) to start anew"
        + ("; resume=<file> continues a file in a new run dir" if cfg.resume not in (None, False) else "")
    )


def _resume_path(cfg: DictConfig, run_dir: Path) -> Path:
    """The checkpoint a resume reads: for resume=true the run dir's (`_run_checkpoint`; checkpoints/last.pt, named in
    the error, where it has none), else the file given."""
    if cfg.resume is True:
        return _run_checkpoint(run_dir) or run_dir / "checkpoints" / "last.pt"
    return Path(str(cfg.resume))


def _resume_config(cfg: DictConfig, run_dir: Path, given: set[str] | None = None) -> tuple[DictConfig, dict | None]:
    """The config to train with and the checkpoint to resume from (None for a fresh run).

    On resume the checkpoint's config is used. Only `trainer.*` and the `RESUME_MAY_CHANGE` keys may change:
    the keys in `given` (the command line's, `_command_line_keys`) take the new value, the others keep the
    checkpoint's (epochs, max_steps, ...: a crashed run resumed with just `resume=true` goes on as it was started);
    any other key or group in `given` whose value differs from the checkpoint's is a ValueError. `given=None` (a
    config built in Python, which holds every key whether meant or not) takes all of `cfg.trainer` and reports
    other differences, which it ignores.
    """
    if cfg.resume in (None, False):
        return cfg, None
    path = _resume_path(cfg, run_dir)
    try:
        ckpt = load_checkpoint(path, keys=RESUME_KEYS)
    except (ValueError, FileNotFoundError) as err:
        if path.resolve() != (run_dir / "checkpoints" / "last.pt").resolve():
            raise
        _restore_run_record(run_dir)  # the run's record back from best.pt, not the refused command's
        best = run_dir / "checkpoints" / "best.pt"
        if isinstance(err, ValueError) and best.is_file():  # (a new run dir: this one's files stay as they are)
            raise ValueError(f"{err}. To continue from this run's best.pt, start a new run dir from it: "
                             f"resume={best} {_dir_key()}=<a new folder>") from None
        raise
    if cfg.resume is True and path.name == "best.pt":
        warnings.warn(f"resume: {run_dir} has no checkpoints/last.pt (its write failed or was cut short after "
                      f"best.pt's): continuing from best.pt, step {ckpt.get('step')}", stacklevel=2)
    saved = _with_added_keys(OmegaConf.create(ckpt["config"]))
    if given is None:
        merged = OmegaConf.merge(saved, {"trainer": cfg.trainer, "resume": cfg.resume})
        for key in (k for k in RESUME_IGNORES if k.startswith("trainer.")):  # the checkpoint's, as on the command line
            OmegaConf.update(merged, key, OmegaConf.select(saved, key), merge=False)
        ignored = [k for k in saved if k not in ("trainer", "resume") and saved.get(k) != cfg.get(k)]
        if ignored:
            say(f"resume: using the checkpoint's settings for {ignored} (a config built in Python changes only "
                f"trainer.* on resume; {', '.join(RESUME_MAY_CHANGE)} change on train.py's command line)")
        _require_model(merged, saved, run_dir, ckpt)
        return merged, ckpt
    conflicts = sorted(
        k for k in given
        if k != "resume" and not k.startswith("hydra") and not _may_change_on_resume(k) and k not in RESUME_IGNORES
        and operator.ne(*_compared_values(saved, cfg, k))
    )  # fmt: skip
    if conflicts:
        _record_run_config(saved, run_dir, ckpt.get("hydra_record"))
        shown = ", ".join(f"{k}={_plain_value(cfg, k)} (checkpoint: {_plain_value(saved, k)})" for k in conflicts)
        raise ValueError(
            f"resume: {shown}: a resumed run keeps its checkpoint's model, data, prune, optim and pix settings; only "
            f"trainer.* and {', '.join(RESUME_MAY_CHANGE)} may change. Drop those overrides, or start a new run in "
            f"another {_dir_key()} (init=<compact model file> fine-tunes an exported model)"
            + ("; to lengthen the run, pass trainer.epochs=N (its LR schedule becomes an N-epoch run's)"
               if "optim.epochs" in conflicts else "")
        )
    # keys the checkpoint lacks (written by an older version) take the current defaults
    merged = OmegaConf.merge(saved, {"trainer": OmegaConf.merge(cfg.trainer, saved.get("trainer", {}))},
                             {"resume": cfg.resume})
    for key in sorted(k for k in given if _may_change_on_resume(k)):
        OmegaConf.update(merged, key, OmegaConf.select(cfg, key), merge=False)
    workers = _plain_value(saved, "data.num_workers"), _plain_value(merged, "data.num_workers")
    if "data.num_workers" in given and workers[0] != workers[1]:
        say(f"resume: data.num_workers {workers[0]} -> {workers[1]}: each loader worker draws its own augmentation "
            "stream, so from here on the random crops and flips differ from an uninterrupted run's (the data order "
            "does not)")
    for key in sorted(k for k in given if k in RESUME_IGNORES and operator.ne(*_compared_values(saved, cfg, k))):
        say(f"resume: {key}={_plain_value(cfg, key)} is not read ({RESUME_IGNORES[key]}); its record keeps "
            f"{_plain_value(saved, key)}")
    _require_model(merged, saved, run_dir, ckpt)
    return merged, ckpt


def _with_added_keys(saved: DictConfig) -> DictConfig:
    """A checkpoint's config with the keys added to its groups since it was written, at the values its version
    behaved as (so that the command line that started the run, repeated with resume=true, still matches it):
    prune.stripe_group = 1 for SWP runs (per-filter skeletons, before session 30). In place; returned."""
    prune = saved.get("prune")
    if prune is not None and prune.get("name") == "swp" and "stripe_group" not in prune:
        prune.stripe_group = 1
    return saved


def _require_model(merged: DictConfig, saved: DictConfig, run_dir: Path, ckpt: dict) -> None:
    """ValueError (the run's own record put back in its .hydra/) when the resumed run's model is not registered in
    this process, naming the module to import: only the command line's `imports` are imported, never a list a
    checkpoint names."""
    arch = ckpt.get("arch") or {"name": _model_name(merged.model)}
    missing = unregistered_module(arch, module_names(merged.get("imports")))
    if missing is not None:
        _record_run_config(saved, run_dir, ckpt.get("hydra_record"))
        raise ValueError(f"resume: {missing}")


HYDRA_RECORD = ("overrides.yaml", "hydra.yaml")  # the files of Hydra's run record a checkpoint keeps


def _record_run_config(cfg: DictConfig | dict, run_dir: Path, hydra_record: dict[str, str] | None = None) -> None:
    """In a Hydra app, Hydra wrote this command line's config into <run dir>/.hydra/config.yaml over the run's own;
    write `cfg` there instead: the config a resumed run trains with, or the run's own when this command is refused.
    `hydra_record` (a refused command): the run's own overrides.yaml and hydra.yaml, as its checkpoint holds them
    (`_hydra_record`), written back over the refused command's."""
    folder = _hydra_folder(run_dir)
    if folder is None or not folder.is_dir():
        return
    (folder / "config.yaml").write_text(OmegaConf.to_yaml(cfg if OmegaConf.is_config(cfg) else OmegaConf.create(cfg)))
    for name, text in (hydra_record or {}).items():
        if name in HYDRA_RECORD:
            (folder / name).write_text(text)


def _hydra_folder(run_dir: Path) -> Path | None:
    """Where Hydra writes this command's record in `run_dir` (<run dir>/.hydra); None outside a Hydra app or with
    hydra.output_subdir=null."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized() or not HydraConfig.get().output_subdir:
        return None
    return run_dir / HydraConfig.get().output_subdir


def _hydra_record(run_dir: Path, names: tuple[str, ...] = HYDRA_RECORD,
                  task_cfg: DictConfig | None = None) -> dict[str, str] | None:
    """The text of this command's Hydra record files `names` (config.yaml needs `task_cfg`, the config the job was
    given), as Hydra wrote them into `run_dir`'s .hydra at the job's start, made again from this command's own
    config: the files themselves may be another command's by then (two started at once in one run dir both write
    them before one is refused). None outside a Hydra app. Saved in each checkpoint (and the run lock, with
    config.yaml), so that a later command refused in this run dir can put them back."""
    from hydra.core.hydra_config import HydraConfig

    if _hydra_folder(run_dir) is None:
        return None
    hydra_cfg = HydraConfig.instance().cfg  # ({"hydra": ...}, what Hydra's hydra.yaml holds)
    texts = {"hydra.yaml": OmegaConf.to_yaml(hydra_cfg), "overrides.yaml": OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task)}
    if task_cfg is not None:
        texts["config.yaml"] = OmegaConf.to_yaml(task_cfg)
    return {name: texts[name] for name in names if name in texts}


def _write_hydra_record(run_dir: Path, record: dict[str, str]) -> None:
    """`record` (`_hydra_record`'s texts) written into `run_dir`'s .hydra, where Hydra keeps one."""
    folder = _hydra_folder(run_dir)
    if folder is not None and folder.is_dir():
        for name, text in record.items():
            (folder / name).write_text(text)


def _dir_key() -> str:
    """The setting that places the run dir, for messages: hydra.sweep.dir for a multirun's job (its dir is a numbered
    folder of the sweep's, and hydra.run.dir has no effect there), else hydra.run.dir."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    return "hydra.sweep.dir" if multirun else "hydra.run.dir"


def _hydra_run_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        raise ValueError("engine.run needs run_dir=... when called outside a Hydra app (train.py)")
    return Path(HydraConfig.get().runtime.output_dir)


def _amp_dtype(cfg: DictConfig, device: torch.device) -> torch.dtype | None:
    """Autocast dtype on CUDA when trainer.amp is on ('bfloat16' or 'float16'); None (fp32) on CPU."""
    if not cfg.trainer.amp or device.type != "cuda":
        return None
    return getattr(torch, cfg.trainer.amp_dtype)


def _sync_bn(raw: nn.Module, cfg: DictConfig, dist: DistInfo) -> nn.Module:
    """`raw` with SyncBatchNorm layers when trainer.sync_bn and world_size > 1 (CUDA only)."""
    if not cfg.trainer.sync_bn or dist.world_size == 1:
        return raw
    if dist.device.type != "cuda":
        raise ValueError(
            "trainer.sync_bn=true needs CUDA: PyTorch's SyncBatchNorm has no CPU (gloo) path; set trainer.sync_bn=false"
        )
    return nn.SyncBatchNorm.convert_sync_batchnorm(raw)


def _training_model(raw: nn.Module, cfg: DictConfig, dist: DistInfo) -> nn.Module:
    """What the training step calls: `raw`, in DDP when world_size > 1, through torch.compile when trainer.compile."""
    model = raw
    if dist.world_size > 1:
        device_ids = [dist.device] if dist.device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(
            raw, device_ids=device_ids, gradient_as_bucket_view=True,
            find_unused_parameters=bool(cfg.trainer.get("find_unused_parameters", False)))
    if cfg.trainer.compile:
        model = torch.compile(model, backend=cfg.trainer.compile_backend)
    return model


def _plain(value):
    """`value` with OmegaConf containers turned into dicts and lists (checkpoints load with weights_only=True)."""
    return json.loads(json.dumps(value, default=lambda v: OmegaConf.to_container(v, resolve=True)))


def _refuse_a_model_init_overrides(cfg: DictConfig, init_name: str) -> None:
    """ValueError when the command line picks a model (model=, model.name=, model.kwargs...) other than the one the
    init= file holds: the file sets the architecture, so that choice would be ignored, and the run's record would
    name a model it did not train."""
    asked = _model_name(cfg.model)
    if asked != init_name or cfg.model.get("kwargs"):
        raise ValueError(f"init={cfg.init} holds a compact {init_name}, so model={asked}"
                         + (f" with model.kwargs={dict(cfg.model.kwargs)}" if cfg.model.get("kwargs") else "")
                         + " would be ignored; drop the model settings (the init file sets the architecture)")


def _model_name(model_cfg: DictConfig) -> str:
    """The registry name `model_cfg` asks for. The `timm` model config (`source: timm`) takes timm
    names with or without the `timm:` prefix, so `model=timm model.name=resnet18` builds timm's
    resnet18, not the registry's torchvision one."""
    name = str(model_cfg.name)
    if model_cfg.get("source") == "timm" and not name.startswith(TIMM_PREFIX):
        return TIMM_PREFIX + name
    return name


def _check_input_size(raw: nn.Module, data, device: torch.device, name: str) -> None:
    """One eval forward of a random image of the data's size, so that a model that cannot take it fails here with
    the data key named (not at the first training step with a bare shape error), and one whose logits are not the
    data's classes or whose stem takes other channels (a builder of your own that ignores num_classes or in_chans) is
    refused. Another error in the forward (not about sizes) is named as the model `name`'s."""
    gen = torch.Generator().manual_seed(0)  # a private generator: the check never moves the training RNG streams
    x = torch.randn(1, data.in_chans, data.input_size, data.input_size, generator=gen, device="cpu").to(device)
    try:
        with evaluating(raw), torch.no_grad():
            logits = raw(x)
    except (RuntimeError, ValueError, AssertionError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0].rstrip(".")  # (the messages below add their own)
        channels = re.search(r"to have (\d+) channels, but got (\d+) channels", first)
        if channels and int(channels[2]) == data.in_chans:  # PyTorch's conv error: the stem takes other channels
            raise ValueError(
                f"the model's first layer takes {channels[1]} input channels and the data gives {data.in_chans} "
                f"(data.in_chans={data.in_chans}): {first}. A model builder must use its in_chans argument"
            ) from err
        size = f"{data.in_chans}x{data.input_size}x{data.input_size}"
        if not re.search(r"size|shape|dimension|channel|match|mat1|mat2|kernel|stride|padding", first, re.IGNORECASE):
            raise ValueError(f"the model {name}'s forward failed on one {size} image: {type(err).__name__}: "
                             f"{first}") from err
        raise ValueError(
            f"the model cannot take a {size} input (data.input_size="
            f"{data.input_size}): {first}. Use a data.input_size the model allows (timm models with a fixed size take "
            f"+model.kwargs.img_size=<size>)"
        ) from err
    if not (isinstance(logits, torch.Tensor) and tuple(logits.shape) == (1, data.num_classes)):
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"the model gives {shape} for one image, not (1, {data.num_classes}): logits of the data's "
                         f"{data.num_classes} classes; a model builder must use its num_classes argument")


def _patterns(value) -> list[str] | None:
    """prune.include / prune.exclude as a list of fnmatch patterns (one pattern may be given as a string)."""
    if value is None:
        return None
    return [str(value)] if isinstance(value, str) else [str(v) for v in value]


def _build_model(cfg: DictConfig, data, ckpt: dict | None = None, announce: bool = True) -> nn.Module:
    """The model to train: a compact model file (`init=`, fine-tuned as it is: its stripe convs train
    their kept weights; on resume its structure comes from the checkpoint's `init_recipe`), or a fresh registry
    model, starting from `model.weights` when given, with PiX applied when `pix.zeta` is set. `announce`: say what
    was loaded (the main process)."""
    if cfg.init is not None:
        recipe = (ckpt or {}).get("init_recipe")
        if recipe:  # (its weights come from the checkpoint, which resume checks)
            model = rebuild_for(recipe, ckpt["model"], f"resume: init_recipe of {cfg.init}")
        else:
            model = load_compact(str(cfg.init))
            bad = non_finite(model.state_dict())
            if bad:
                raise ValueError(f"init={cfg.init}: the file holds NaN or inf values in {listed(bad)}; fine-tune a "
                                 "compact model of finite weights (export an earlier checkpoint of its run)")
            dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in model.state_dict().values()
                             if t.is_floating_point() and t.dtype != torch.float32})
            if dtypes:  # (a bfloat16 model's conv met float32 images: "Input type (float) and bias type ... differ")
                model.float()
                if announce:
                    say(f"init={cfg.init}: its {' and '.join(dtypes)} tensors were cast to float32, the dtype training "
                        "keeps its weights in (trainer.amp sets the compute dtype on a GPU)")
        classes = model.compress_arch["kwargs"].get("num_classes")
        if classes is not None and classes != data.num_classes:
            raise ValueError(
                f"init={cfg.init}: the compact model predicts {classes} classes and data {cfg.data.name} has "
                f"{data.num_classes}; fine-tune it on data with {classes} classes (its classifier is kept as it is)"
            )
        return model
    kwargs = dict(cfg.model.get("kwargs", {}))
    from_data = sorted(set(kwargs) & {"num_classes", "input_size", "in_chans"})
    if from_data:
        raise ValueError(f"model.kwargs.{from_data[0]}: the data sets it (data.{from_data[0]}); remove it from "
                         "model.kwargs and set it in the data group, or pick another data=")
    try:
        raw = create_model(_model_name(cfg.model), num_classes=data.num_classes, input_size=data.input_size,
                           in_chans=data.in_chans, **kwargs)
    except TypeError as err:  # a keyword the model's constructor does not take
        if not any(f"'{key}'" in str(err) for key in kwargs):  # an error of the builder's own code: as it is
            raise
        raise ValueError(f"model.kwargs={kwargs}: {cfg.model.name} does not take them ({err}); check the "
                         "constructor's arguments, or drop model.kwargs") from None
    if cfg.model.get("weights") is not None and ckpt is None:  # a resumed run has its checkpoint's weights
        return _start_from_weights(raw, cfg, announce)
    if cfg.pix.zeta is not None:
        apply_pix(raw, cfg.pix.zeta, float(cfg.pix.tau))
    return raw


@torch.no_grad()
def _start_from_weights(raw: nn.Module, cfg: DictConfig, announce: bool) -> nn.Module:
    """`raw` (PiX applied where `pix.zeta` says) with the weights of the `model.weights` file: a PiX model's own
    weights, or a plain model's loaded before PiX goes in (rebuilding the layers whose width it changes), whose
    tensors PiX replaced the run then counts and names."""
    path, zeta = cfg.model.weights, cfg.pix.zeta
    state = read_weights(path)
    plain = copy.deepcopy(raw) if zeta is not None else None
    if zeta is not None:
        apply_pix(raw, zeta, float(cfg.pix.tau))
    replaced = []
    if zeta is not None and weights_problems(raw, state)[1] is not None:  # not the PiX model's: the plain model's
        raw = plain
        try:
            fresh = load_weights(raw, path, state)
        except ValueError as err:
            raise ValueError(f"{err} (with pix.zeta={zeta} the file may also hold the weights of a PiX model of that "
                             "zeta; a PiX model's file of another zeta fits neither)") from None
        before = {k: v for k, v in raw.state_dict(keep_vars=True).items() if k in state and k not in fresh}
        apply_pix(raw, zeta, float(cfg.pix.tau))
        # the file's tensors the PiX model still holds (some under new names: downscaling wraps convs), by identity
        held = {id(t) for t in [*raw.parameters(), *raw.buffers()]}
        replaced = sorted(k for k, v in before.items() if id(v) not in held)
    else:
        fresh = load_weights(raw, path, state)
    modules = sorted({k.rpartition(".")[0] for k in replaced})
    if announce:
        say(f"model.weights: started from {path}"
            + (f"; {', '.join(fresh)} kept as initialised (the file's classifier has another shape, or none)"
               if fresh else "")
            + (f"; pix.zeta={zeta} replaced {len(replaced)} of its {len(state)} tensors, in {len(modules)} modules "
               f"({', '.join(modules[:4])}{', ...' if len(modules) > 4 else ''}): the layers whose width PiX changes "
               "are built anew (in bottleneck models PiX takes the squeeze convs' place; in basic-block ResNets and "
               "VGGs the 3x3 convs after the first read 1/zeta of their inputs)" if replaced else ""))
    return raw


def _absolute_paths(cfg: DictConfig) -> None:
    """Make `init`, `model.weights`, `data.root` and a `resume=<file>` absolute, in place, against the directory train.py was
    launched from (not the run dir `hydra.job.chdir=true` moves into): saved with the run, they let resume and export
    find the files from any working directory. An empty one (an unset shell variable) would name the launch
    directory: a ValueError."""
    for key in ("init", "model.weights", "data.root", "resume"):
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if isinstance(value, str) and not value.strip():
            raise ValueError(f"{key}={value!r} is empty (an unset shell variable?): give a path, or leave {key} out")
    if cfg.init is not None:
        cfg.init = str(launch_path(cfg.init))
    if cfg.model.get("weights") is not None:
        cfg.model.weights = str(launch_path(cfg.model.weights))
    if "root" in cfg.data and not OmegaConf.is_missing(cfg.data, "root") and cfg.data.root is not None:
        cfg.data.root = str(launch_path(cfg.data.root))
    if isinstance(cfg.resume, str) and cfg.resume != "auto":
        cfg.resume = str(launch_path(cfg.resume))


def run(cfg: DictConfig, run_dir: str | os.PathLike | None = None) -> dict:
    """Train as `cfg` says, writing checkpoints/, tensorboard/ and summary.json under `run_dir`.

    `run_dir` defaults to Hydra's output directory. Returns the summary dict (see README). Runs with gradients
    enabled whatever the caller's grad mode; refuses a default dtype other than float32 (the models would be built
    in it while the data stays float32).
    """
    require_sections(cfg, {"trainer": ("max_steps", int), "pix": ("zeta", int)}, "train")
    if torch.get_default_dtype() != torch.float32:
        raise ValueError(f"train: torch's default dtype is {torch.get_default_dtype()} (torch.set_default_dtype), so "
                         "the model would be built in it while the data stays float32; call "
                         "torch.set_default_dtype(torch.float32) first (trainer.amp sets the training precision)")
    start = time.perf_counter()
    dist = setup_distributed(cfg.trainer.device)
    run_dir = _shared_run_dir(Path(run_dir) if run_dir is not None else _hydra_run_dir(), dist)
    began = []  # set by _run once the run writes its results
    with _run_lock(run_dir, dist, cfg), warnings_in_log_files(dist.is_main, run_dir) as forget_warnings:
        try:
            with torch.enable_grad():  # (a caller's torch.no_grad() would leave the loss without a graph)
                return _run(cfg, run_dir, dist, start, lambda: began.append(True))
        except BaseException as err:
            if began:
                log_failure(err, dist.rank, run_dir)
            else:  # a command its config refuses leaves the run dir's log and .hydra record as they were (a fresh
                forget_warnings()  # dir is then removed)
                if dist.is_main:
                    _restore_run_record(run_dir)
            raise


RUN_LOCK = ".train.lock"  # in a run dir while a train.py process works in it: {"pid", "host", "hydra": its record}
_run_locks: dict[Path, int] = {}  # run dir -> the open descriptor holding its RUN_LOCK (rank 0)


def _close_inherited_locks() -> None:
    """In a forked child (a DataLoader worker): close the run locks' descriptors it inherited, so that the lock ends
    with the training process (a lock lasts while any descriptor of its open file does)."""
    for fd in _run_locks.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _run_locks.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_locks)


@contextlib.contextmanager
def _run_lock(run_dir: Path, dist: DistInfo, task_cfg: DictConfig | None = None):
    """Hold `run_dir` for this run (rank 0 creates RUN_LOCK, every rank learns whether it could): a second train.py
    started in the same dir while this one works would otherwise train beside it (its checkpoints/last.pt is not
    written yet at first), both would write the same checkpoints, logs and .hydra record, and one run's results
    would be lost. The lock is the OS's (`_files.lock_file`): it ends with its process, kill -9 included, so a
    killed run's dir resumes at once. The refused command puts the holder's .hydra record back over its own. A run
    dir the lock had to create is removed again if the run leaves it empty (a command refused by its config)."""
    created = dist.is_main and not run_dir.exists()
    refused, error = None, None
    if dist.is_main:
        try:
            refused = _take_run_lock(run_dir, task_cfg)
        except OSError as err:  # the other ranks must learn it too, or they would wait in the broadcast below
            _release_run_lock(run_dir)  # if it was taken before the error
            refused, error = f"{run_dir}: cannot lock {RUN_LOCK} there ({err}); give a writable {_dir_key()}", err
    if dist.world_size > 1:
        shared = [refused]
        torch_dist.broadcast_object_list(shared, src=0)
        refused = shared[0]
    if refused:
        raise ValueError(refused) from error
    try:
        yield
    finally:
        if dist.is_main:
            _release_run_lock(run_dir)
        if created:
            with contextlib.suppress(OSError):
                run_dir.rmdir()  # only if empty


def _take_run_lock(run_dir: Path, task_cfg: DictConfig | None = None) -> str | None:
    """Lock RUN_LOCK in run_dir and write this process's {"pid", "host", "hydra"} into it, and its Hydra record
    into .hydra (another command started at the same time may have written its own there); None when this process
    holds it, else the refusal message (naming the holder where its file says who it is), the holder's record put
    back into .hydra. `task_cfg`: the config the job was given (its config.yaml)."""
    path, host = run_dir / RUN_LOCK, socket.gethostname()
    record = _hydra_record(run_dir, ("config.yaml", *HYDRA_RECORD), task_cfg) or {}
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = lock_file(path)
    if fd is None:
        holder, who = {}, ""
        for _ in range(20):  # (its holder may be between taking the lock and writing the file: a moment)
            try:
                holder = json.loads(path.read_text())
                who = f" (pid {int(holder['pid'])} on {'this host' if holder['host'] == host else holder['host']})"
                break
            except (OSError, ValueError, KeyError, TypeError):
                holder, who = {}, ""
                time.sleep(0.1)
        _write_hydra_record(run_dir, holder.get("hydra") or {})  # the running run's record, not this command's
        return (f"{run_dir} is in use by another train.py process{who}: two runs in one directory would overwrite "
                f"each other's checkpoints, logs and .hydra record. Give this run another {_dir_key()}, or wait for "
                "that one to end (resume=true continues it)")
    _run_locks[run_dir] = fd  # released by _release_run_lock whatever happens next
    os.ftruncate(fd, 0)  # a killed run's file: its lock went with its process
    os.write(fd, json.dumps({"pid": os.getpid(), "host": host, "hydra": record}).encode())
    _write_hydra_record(run_dir, record)
    return None


def _release_run_lock(run_dir: Path) -> None:
    fd = _run_locks.pop(run_dir, None)
    if fd is not None:
        unlock_file(run_dir / RUN_LOCK, fd)


def _run(cfg: DictConfig, run_dir: Path, dist: DistInfo, start: float, began: Callable[[], None]) -> dict:
    """`run`'s work, with the run dir held (`_run_lock`); calls `began()` once the run writes its results."""
    _refuse_added_keys(cfg)
    _refuse_deleted_keys()
    import_modules(cfg.get("imports"), launch_path("."))  # your own models' modules, before any model is built
    _absolute_paths(cfg)  # as the checkpoint holds them, so that the same command line resumes
    _resolve_auto_resume(cfg, run_dir, dist)
    _refuse_to_overwrite_a_run(cfg, run_dir)
    given = _command_line_keys()
    cfg, ckpt = _resume_config(cfg, run_dir, given)
    _check_config(cfg, ckpt)
    hydra_record = _hydra_record(run_dir) if dist.is_main else None  # this command's, kept in its checkpoints
    if ckpt is None and "seed" not in cfg.data:  # trainer.seed also seeds the data order, worker seeds, fake data
        with open_dict(cfg):
            cfg.data.seed = cfg.trainer.seed
    if ckpt is not None and dist.is_main:
        _record_run_config(cfg, run_dir)
    _seed_everything(cfg.trainer.seed + dist.rank)

    data = build_data(cfg.data, rank=dist.rank, world_size=dist.world_size)
    if ckpt is not None and ckpt.get("data_classes") and data.classes and ckpt["data_classes"] != data.classes:
        if dist.is_main:
            _record_run_config(ckpt["config"], run_dir, ckpt.get("hydra_record"))
        differ = sorted(set(ckpt["data_classes"]) ^ set(data.classes))[:5]
        raise ValueError(f"resume: data.root={cfg.data.get('root')} has other classes than the run trained on "
                         f"({len(data.classes)} against {len(ckpt['data_classes'])}; "
                         + (f"differing: {', '.join(differ)}" if differ else "in another order")
                         + "), so the labels would change; give the data.root of the run's data")
    raw = _build_model(cfg, data, ckpt, announce=dist.is_main)
    # notes after the model is built: a command refused before (an init= file that does not load) leaves no run dir
    if cfg.init is not None and ckpt is None and dist.is_main and any(k.startswith("prune") for k in given or ()):
        say(f"note: the prune settings have no effect with init={cfg.init}: a compact model fine-tunes its kept "
            "stripes, and no skeletons are attached")
    if "pix.tau" in (given or ()) and cfg.pix.zeta is None and dist.is_main:
        say(f"note: pix.tau={cfg.pix.tau} has no effect without pix.zeta (no PiX blocks"
            + (f" are added; init={cfg.init} keeps its own)" if cfg.init is not None else ")"))
    if "optim.skeleton_weight_decay" in (given or ()) and (cfg.prune.name != "swp" or cfg.init is not None) \
            and dist.is_main:
        say(f"note: optim.skeleton_weight_decay={cfg.optim.skeleton_weight_decay} has no effect: this run has no "
            "skeletons (" + (f"init={cfg.init} fine-tunes a compact model)" if cfg.init is not None else
                             f"prune={cfg.prune.name}; prune=swp attaches them)"))
    if cfg.init is not None and ckpt is None and dist.is_main and (getattr(raw, "compress_compaction", None) or {}).get("fold_bn"):
        say(
            f"note: init={cfg.init} has its BatchNorms folded into its convs (export's default fold_bn=true), so it "
            "fine-tunes without BN and can diverge at a from-scratch learning rate; lower optim.lr, or export with "
            "fold_bn=false to fine-tune with BN"
        )
    arch = _plain(raw.compress_arch)  # in each checkpoint: export rebuilds the model from it
    if cfg.init is not None and ckpt is None and any(k == "model" or k.startswith("model.") for k in given or ()):
        _refuse_a_model_init_overrides(cfg, arch["name"])
    # a fine-tuning run's structure, so that resume and export need not find the init= file again
    init_recipe = json.dumps(build_recipe(raw)) if cfg.init is not None else None
    swp = None
    if cfg.prune.name == "swp" and cfg.init is None:
        include, exclude = _patterns(cfg.prune.include), _patterns(cfg.prune.exclude)
        # a random image of the data's size finds direct weight reads in a forward fx cannot trace
        example = torch.randn(1, data.in_chans, data.input_size, data.input_size,
                              generator=torch.Generator().manual_seed(0), device="cpu")
        if not attach_skeletons(raw, cfg.prune.min_kernel_size, include, exclude, example,
                                cfg.prune.get("stripe_group", 1)):
            raise ValueError(
                f"SWP: no conv of {cfg.model.name} gets a skeleton with prune.include={include}, "
                f"prune.exclude={exclude}, prune.min_kernel_size={cfg.prune.min_kernel_size}; check the patterns "
                "against the model's module names (print(model)), or train with prune=none"
            )
        # dead filters' BN channels, found by data flow once (before SyncBatchNorm, which keeps the names)
        swp = (float(cfg.prune.alpha), float(cfg.prune.threshold), conv_bn_pairs(raw))
    raw = _sync_bn(raw, cfg, dist)
    threshold = swp[1] if swp else 0.0
    channels_last = bool(cfg.trainer.channels_last) and dist.device.type == "cuda"
    raw.to(dist.device, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    if ckpt is None:  # a resumed model ran on this input size before (a rebuilt init= model holds no stripes yet)
        _check_input_size(raw, data, dist.device, arch["name"])
    model = _training_model(raw, cfg, dist)

    epochs = int(cfg.trainer.epochs)
    amp_dtype = _amp_dtype(cfg, dist.device)
    optimizer = build_optimizer(raw, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, epochs)
    scaler = torch.amp.GradScaler(dist.device.type, enabled=amp_dtype == torch.float16)
    s = _Step(model, raw, optimizer, scaler, dist.device, amp_dtype, channels_last, swp)
    generator = getattr(data.train, "generator", None)

    first_epoch, step, best, test = 0, 0, -1.0, {"loss": float("nan"), "accuracy": float("nan")}
    seconds_before, train = 0.0, {"images_per_s": float("nan")}  # of the processes before a resume
    # a run stopped mid-epoch: its first epoch starts at sample `first_sample` of the epoch's order, and its first
    # `skip` batches from there were trained before (see _resume_mid_epoch)
    first_sample, skip, after_skip, before = 0, 0, None, None
    if ckpt is not None:
        check_weight_kinds(raw, ckpt["model"], f"resume: {_resume_path(cfg, run_dir)}")
        try:
            raw.load_state_dict(ckpt["model"])
        except RuntimeError as err:
            detail = " ".join(str(err).split())[:800]
            raise ValueError(f"resume: the checkpoint's weights do not fit the model its config builds "
                             f"({cfg.model.name}): {detail}") from None
        if not _finite_weights(raw):
            raise ValueError("resume: the checkpoint's weights hold NaN or inf values (written by a version that saved "
                             "diverged runs, or edited); resume an earlier checkpoint, or start anew")
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler = _resumed_scheduler(scheduler, optimizer, cfg.optim, ckpt, epochs, dist)
        if ckpt["scaler"]:  # (empty from a run without float16 autocast: a float16 resume starts a new scale)
            scaler.load_state_dict(ckpt["scaler"])
        first_epoch, step, best, test = ckpt["epoch"], ckpt["step"], ckpt["best_accuracy"], ckpt["test"]
        seconds_before = float(ckpt.get("seconds", 0.0))  # checkpoints before these keys: this process only
        train = {"images_per_s": float("nan") if ckpt.get("images_per_s") is None else ckpt["images_per_s"]}
        first_sample, skip, after_skip = _resume_mid_epoch(ckpt, generator, dist, int(cfg.trainer.seed), data.train)
        # the metric sums of the epoch's batches trained before (checkpoints before this key: none, the epoch's
        # line then counts this run's batches only)
        before = ckpt.get("epoch_sums") if int(ckpt.get("epoch_batches", 0)) else None

    ckpt_dir = run_dir / "checkpoints"
    if dist.is_main:  # temporary files of checkpoint writes that a killed run left behind (atomic_save)
        for stale in ckpt_dir.glob(".*.pt.tmp*"):
            stale.unlink(missing_ok=True)
        if ckpt is not None and cfg.resume is not True and best >= 0:
            _carry_best_checkpoint(Path(str(cfg.resume)), best, ckpt_dir)
    # events a killed process logged after its checkpoint (or, starting afresh, before its first) are dropped: this
    # run logs those steps again
    logger = RunLogger(run_dir / "tensorboard", dist.is_main, purge_step=step + 1)
    began()
    input_shape = (data.in_chans, data.input_size, data.input_size)
    max_steps = cfg.trainer.max_steps
    log_step = _StepLog(logger, optimizer, int(cfg.trainer.log_every), dist.world_size)

    def save(epoch: int, done: int, at: int, epoch_rng: dict, rng: dict, is_best: bool, logged: bool = True,
             sums: list[float] | None = None) -> None:
        """Write last.pt (and best.pt) at step `at`, after `done` batches of `epoch` (all: the epoch is over), with
        this rank's RNG streams `rng` (see the loop) and those of the epoch's start `epoch_rng`; `logged`: the
        epoch's line and metrics were logged at `at` (not so for trainer.checkpoint_every's saves); `sums`: the
        epoch's (loss * images, correct, images) so far over all ranks (see train_one_epoch), kept for a resume
        inside it."""
        partial = done < len(data.train)
        batch = data.train.batch_size  # per process (the loader's: data.batch_size=null means its default)
        epoch_start = data.train.sampler.start  # the sample of the epoch's order this run started it at
        state = {
            "model": raw.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "epoch": epoch if partial else epoch + 1,  # the epoch to go on with
            "epoch_batches": done if partial else 0,  # its batches already trained (per process, from epoch_start_sample)
            # a partial epoch: where this run started it in its order, and how many of its order are trained
            "epoch_start_sample": epoch_start if partial else 0,
            "epoch_samples": epoch_start + done * batch * dist.world_size if partial else 0,
            "epoch_sums": sums if partial else None,  # the partial epoch's metric sums: a resume counts them in
            "batch_size": batch,
            "train_size": len(data.train.dataset),
            "data_classes": data.classes,  # label order: a resume on other class folders is refused
            "step": at,
            "logged_step": at if logged else None,
            "best_accuracy": best,
            "test": test,
            "rng": _gather_rng(rng, dist),
            # a partial epoch: every rank's RNG streams at its start, so that resume replays its batch order
            "rng_epoch_start": _gather_rng(epoch_rng, dist) if partial else None,
            "world_size": dist.world_size,
            "arch": arch,
            "init_recipe": init_recipe,
            "hydra_record": hydra_record,
            "config": OmegaConf.to_container(cfg, resolve=True),
            "seconds": seconds_before + time.perf_counter() - start,  # wall time of the run so far, resumes included
            "images_per_s": None if np.isnan(train["images_per_s"]) else train["images_per_s"],  # the last epoch's
        }
        if not _finite_weights(raw):  # never write a diverged model over the checkpoints (every rank stops alike)
            raise diverged(at, epoch)
        if dist.is_main:  # best.pt first: a run killed between the two writes still has its best weights
            if is_best:
                atomic_save(state, ckpt_dir / "best.pt")
            atomic_save(state, ckpt_dir / "last.pt")
        if dist.world_size > 1:
            torch_dist.barrier()  # the checkpoint is on disk before any rank goes on

    def diverged(at: int, epoch: int) -> FloatingPointError:
        return FloatingPointError(
            f"train: the model's weights are not finite at step {at} (epoch {epoch + 1}): the run diverged. "
            + (f"{ckpt_dir} keeps the checkpoint written before" if (ckpt_dir / "last.pt").is_file()
               else "No checkpoint was written")
            + f". Start a new run (another {_dir_key()}; a resume keeps the checkpoint's optim settings) with a lower "
            f"optim.lr (it is {cfg.optim.lr:g})" + (f" or prune.alpha (it is {swp[0]:g})" if swp else "")
            + (", or train with trainer.amp=false" if amp_dtype is not None else "")
        )

    every = cfg.trainer.get("checkpoint_every")

    def on_step(at: int, done: int, sums: Callable[[], list[float]]) -> None:
        """After each step: at a logged step whose loss is not finite, a stop if the weights are not finite either
        (a diverged run stops there, not at the epoch's end; a loss that overflowed in a step GradScaler skipped
        is no divergence). Inside an epoch (the epoch's end and a max_steps stop save anyway): last.pt every
        trainer.checkpoint_every steps, and at the step a SIGTERM stops the run (every rank asks `stop` at the same
        steps). The logged loss is all-reduced, the weights are DDP's: every rank decides alike."""
        logged_at, loss = log_step.last
        if logged_at == at and not math.isfinite(loss) and not _finite_weights(raw):
            raise diverged(at, epoch)
        if done == len(data.train) or (max_steps is not None and at >= max_steps):
            return
        stopping = stop.due()
        if stopping or (every and at % every == 0):
            save(epoch, done, at, epoch_rng, rng_state(generator), is_best=False, logged=False, sums=sums())
        if stopping:
            raise Terminated(f"last.pt holds step {at} (epoch {epoch + 1}, batch {done} of {len(data.train)}); "
                             "resume=true continues from there", stop.signum)

    epochs_trained = first_epoch + (1 if skip or first_sample else 0)  # the last epoch trained in (finished or not), 1-based
    if _say_if_nothing_to_train(first_epoch, epochs, step, max_steps, dist) and ckpt is not None and dist.is_main:
        _record_run_config(ckpt["config"], run_dir)  # the run's config: this command changed nothing
    epoch_bar = progress(range(first_epoch, epochs), dist.is_main, desc="epochs")
    with StepStop(_stop_group(dist)) as stop:  # SIGTERM, Ctrl-C: the run stops after a step (see on_step), not inside it
        for epoch in epoch_bar:
            if max_steps is not None and step >= max_steps:
                break
            data.train.sampler.set_epoch(epoch, first_sample)
            epoch_rng = ckpt["rng_epoch_start"][dist.rank] if skip else rng_state(generator)
            log_step.restart()
            if skip:  # the step log's rate, too, starts after the dropped batches
                after_skip = _then(after_skip, log_step.restart)
            train, step, done = train_one_epoch(s, data.train, step, max_steps, log_step, dist.is_main, skip, after_skip,
                                                on_step, before)
            first_sample, skip, after_skip, before, epochs_trained = 0, 0, None, None, epoch + 1
            partial = done < len(data.train)  # stopped by max_steps inside the epoch: resume goes on from batch `done`
            # inside an epoch, the streams right after the last step (an uninterrupted run loads the next batch from
            # there); evaluating would move them (a DataLoader draws its iterator's seed from the global RNG)
            rng = rng_state(generator) if partial else None
            stopping = max_steps is not None and step >= max_steps
            # the rate is NaN only where no batch ran here (a resumed epoch with none left, EpochSampler); the loss
            # and accuracy are those of the epoch's batches, any trained before a resume included (a NaN loss is not)
            ran, trained = not np.isnan(train["images_per_s"]), "sums" in train
            # such an epoch at the step whose epoch line the checkpoint's run logged: those weights were evaluated there
            logged_before = not ran and ckpt is not None and step == ckpt.get("logged_step")
            evaluated = ((epoch + 1) % cfg.trainer.eval_every == 0 or epoch + 1 == epochs or stopping) and not logged_before
            if ran and not math.isfinite(train["loss"]) and not _finite_weights(raw):
                raise diverged(step, epoch)  # before evaluating and logging weights that are not numbers
            if evaluated:
                try:
                    test = evaluate(s, data.test, dist.is_main)
                except Exception:
                    if dist.world_size == 1:  # (under DDP the other ranks are inside the evaluation's collectives)
                        # keep what the epoch trained (an unreadable test image would otherwise cost it on every
                        # attempt): last.pt as at an epoch end without an evaluation, then stop
                        if not partial:
                            _step_schedule(scheduler)
                        test = {"loss": float("nan"), "accuracy": float("nan")}  # these weights were not evaluated
                        save(epoch, done, step, epoch_rng, rng or rng_state(generator), is_best=False, logged=False,
                             sums=train.get("sums"))
                    raise
                if dist.is_main and not math.isfinite(float(test["loss"])):  # (finite weights: checked at each save)
                    say(f"note: the test loss after epoch {epoch + 1} is not finite: the eval-mode outputs overflow "
                        "(weights or BatchNorm statistics grown too large), so the run is diverging; a new run with a lower "
                        f"optim.lr (it is {cfg.optim.lr:g})" + (f" or prune.alpha (it is {swp[0]:g})" if swp else ""))
            lr = optimizer.param_groups[0]["lr"]
            if not partial:
                _step_schedule(scheduler)
            stats = skeleton_stats(raw, threshold)
            macs_dense, macs_pruned = estimate_macs(raw, input_shape, threshold)
            if not logged_before:  # each step once in TensorBoard; no NaN train metrics of an epoch with no batch
                logger.scalars(
                    ({"train/loss": train["loss"], "train/accuracy": train["accuracy"]} if trained else {})
                    | ({"epoch/images_per_s": train["images_per_s"]} if ran else {})
                    | {"epoch/lr": lr, "macs/pruned_estimate": macs_pruned}
                    | _peak_gpu_memory(dist.device)
                    | ({"test/loss": test["loss"], "test/accuracy": test["accuracy"]} if evaluated else {}),
                    step,
                )
                logger.skeletons(raw, stats, threshold, step)
            is_best = evaluated and test["accuracy"] > best
            best = max(best, test["accuracy"]) if evaluated else best
            if dist.is_main and not logged_before:
                kept = stats["stripes_kept"] / max(stats["stripes_total"], 1)
                say(
                    f"epoch {epoch + 1}/{epochs} step {step} lr {lr:.4g} train loss {train['loss']:.4f} "
                    f"acc {train['accuracy']:.4f} | test acc " + (f"{test['accuracy']:.4f}" if evaluated else "-")
                    + (f" | stripes kept {kept:.1%}" if stats["stripes_total"] else ""),
                    epoch_bar.write,
                )
            save(epoch, done, step, epoch_rng, rng or rng_state(generator), is_best, sums=train.get("sums"))
            if stopping:
                break
            if epoch + 1 < epochs and stop.due(now=True):  # a SIGTERM during the epoch's last step or evaluation
                raise Terminated(f"last.pt holds step {step}, the end of epoch {epoch + 1}; resume=true continues "
                                 "from there", stop.signum)
    logger.close()
    if cfg.trainer.dump_rank_state:  # debug/tests: every rank's final weights, skeletons and buffers
        atomic_save({"model": raw.state_dict(), "step": step}, run_dir / f"rank{dist.rank}_state.pt")

    stats = skeleton_stats(raw, threshold)
    macs_dense, macs_pruned = estimate_macs(raw, input_shape, threshold)
    last = ckpt_dir / "last.pt"
    macs_compact = _compact_macs(last, threshold, input_shape) if stats["layers"] and dist.is_main and last.is_file() \
        else None
    evaluated = not np.isnan(test["accuracy"])  # no evaluation in this run or its checkpoint: null, not NaN / -1
    summary = {
        "test_accuracy": test["accuracy"] if evaluated else None,
        "best_test_accuracy": best if best >= 0 else None,
        "test_loss": test["loss"] if evaluated else None,
        "stripes_total": stats["stripes_total"],
        "stripes_kept": stats["stripes_kept"],
        "filters_dead": stats["filters_dead"],
        "skeleton_layers": len(stats["layers"]),
        "macs_dense": macs_dense,
        "macs_pruned_estimate": macs_pruned,
        "macs_compact": macs_compact,
        "params": sum(p.numel() for n, p in raw.named_parameters() if not n.endswith("skeleton")),
        # a fine-tuned compact model (init=): its stripe convs' stripes, which fine-tuning keeps as they are
        **({"compact_stripes": stripe_counts(raw)} if cfg.init is not None else {}),
        "epochs": epochs_trained,
        "steps": step,
        "seconds": seconds_before + time.perf_counter() - start,
        "images_per_s": None if np.isnan(train["images_per_s"]) else train["images_per_s"],  # None: no epoch's rate
        "world_size": dist.world_size,
        "model": arch["name"],  # an init= run's model is the compact file's, whatever model= says
        "data": cfg.data.name,
        "device": str(dist.device),
        "run_dir": str(run_dir),
        "checkpoint": str(ckpt_dir / "last.pt") if (ckpt_dir / "last.pt").is_file() else None,  # None: none written
    }
    if dist.is_main:
        atomic_write(run_dir / "summary.json", lambda tmp: tmp.write_text(json_text(summary)))
        say(format_summary(summary))
    _finish_distributed(dist)
    return summary


def _compact_macs(ckpt: Path, threshold: float, input_shape: tuple[int, int, int]) -> int | None:
    """MACs, for one input, of the compact model of the checkpoint `ckpt` at the run's SWP threshold: what export
    makes of it unless prune.target_flops raises the threshold. Counted on the CPU, the model loaded as export loads
    it. None, with a note, when compaction fails (export then says why); its warnings repeat the run's."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, _ = load_training_checkpoint(ckpt)
            return profile(compact(model, threshold=threshold), input_shape, latency=False).macs
    except Exception as err:  # the run's outputs are written; the count is only a figure for the summary
        say(f"note: the compact model's MACs were not counted: compaction failed ({type(err).__name__}: {err}); "
            f"python export.py ckpt={ckpt} names the problem")
        return None


def _restore_rng(states: list[dict], generator: torch.Generator | None, dist: DistInfo, seed: int, step: int):
    """Each rank takes its own saved RNG streams; a rank the checkpoint has none for (it was written by
    fewer ranks) is reseeded from (seed, rank, step): deterministic and unlike every other rank's streams."""
    if dist.rank < len(states):
        set_rng_state(states[dist.rank], generator)
        return
    derived = int(np.random.SeedSequence([seed, dist.rank, step]).generate_state(1)[0])
    _seed_everything(derived)
    if generator is not None:
        generator.manual_seed(derived)


def _carry_best_checkpoint(resumed: Path, best: float, ckpt_dir: Path) -> None:
    """`resume=<file>` into a new run dir: copy the best.pt that holds the checkpoint's best weights (the file itself
    when it is a best.pt, else the best.pt beside it) into `ckpt_dir`, so that the new run's best.pt exists even
    when it never beats `best`; say so when no such file is found."""
    source = resumed if resumed.name == "best.pt" else resumed.parent / "best.pt"
    target = ckpt_dir / "best.pt"
    if target.exists() and target.resolve() == source.resolve():
        return
    try:
        found = source.is_file() and load_checkpoint(source, keys=("best_accuracy",))["best_accuracy"] == best
    except (ValueError, FileNotFoundError):  # unreadable or foreign: not the best weights
        found = False
    if found:
        atomic_write(target, lambda tmp: shutil.copyfile(source, tmp))
        say(f"resume: copied {source} (test accuracy {best:.4f}) to {target}; it is replaced when this run beats it")
    else:
        say(f"resume: no best.pt with the checkpoint's best test accuracy {best:.4f} beside {resumed}; this run's "
            f"best.pt is written at its first evaluation that beats it")


def _resume_mid_epoch(ckpt: dict, generator: torch.Generator | None, dist: DistInfo, seed: int,
                      loader) -> tuple[int, int, object]:
    """Restore the RNG streams for resuming `ckpt` with the training `loader`; returns (the sample of its epoch's
    order to start at, batches to skip from there, what to run once they are skipped).

    A checkpoint written inside an epoch (`epoch_batches` > 0) by as many processes at the same per-process batch
    size restores the streams of that epoch's start, so the data loader draws the same batch order and
    augmentations, and the streams of the checkpoint once the batches trained before are dropped: training goes on
    as if never stopped. With another number of processes or batch size the epoch goes on with the samples of its
    order not yet trained (`data.EpochSampler`), and the checkpoint's streams (its augmentations then differ from an
    uninterrupted run's)."""
    def restore(states: list[dict]) -> None:
        _restore_rng(states, generator, dist, seed, int(ckpt["step"]))

    done = int(ckpt.get("epoch_batches", 0))
    if not done:
        restore(ckpt["rng"])
        return 0, 0, None
    saved_world, size = int(ckpt.get("world_size", 1)), len(loader.dataset)
    saved_size = ckpt.get("train_size", size)  # checkpoints before this key: unknown
    if saved_size != size:
        raise ValueError(
            f"resume: the checkpoint stopped inside epoch {ckpt['epoch'] + 1} of a training set of {saved_size} "
            f"images, and this one has {size}: the rest of that epoch is defined on the same images only. Give the "
            "data.root of the checkpoint's data, or resume a checkpoint written at an epoch's end"
        )
    # checkpoints before these keys: their data config's batch size (that config may leave it to build_data)
    saved_batch = int(ckpt.get("batch_size") or ckpt["config"]["data"].get("batch_size") or loader.batch_size)
    start = int(ckpt.get("epoch_start_sample", 0))
    # a single process's order before EpochSampler (the loader's own shuffle) cannot be replayed: go on with the
    # samples of today's order after as many as were trained (DistributedSampler's order is EpochSampler's)
    replayable = "epoch_samples" in ckpt or saved_world > 1
    if replayable and (saved_world, saved_batch) == (dist.world_size, loader.batch_size):
        restore(ckpt["rng_epoch_start"])
        return start, done, lambda: restore(ckpt["rng"])
    trained = int(ckpt.get("epoch_samples", start + done * saved_batch * saved_world))
    if dist.is_main:
        why = (f"with {saved_world} process(es) at batch {saved_batch}; this run has {dist.world_size} at batch "
               f"{loader.batch_size}" if replayable else "by a version whose single-process order cannot be replayed")
        say(f"resume: the checkpoint stopped inside epoch {ckpt['epoch'] + 1}, {trained} samples into it, {why}, so "
            "that epoch goes on with its remaining samples in new batches")
    restore(ckpt["rng"])
    return trained, 0, None


def _resumed_scheduler(scheduler, optimizer: torch.optim.Optimizer, optim_cfg: DictConfig, ckpt: dict, epochs: int,
                       dist: DistInfo):
    """The LR schedule a resumed run goes on with: the checkpoint's when trainer.epochs is the checkpoint's, else that
    of a run of the new `epochs` length, at the checkpoint's epoch (cosine's length and a warmup-cosine's follow
    `epochs`; multistep milestones are absolute epochs), so that the LR never comes from a mix of both."""
    saved_epochs = int(ckpt["config"].get("trainer", {}).get("epochs", epochs))
    if saved_epochs == epochs:
        scheduler.load_state_dict(ckpt["scheduler"])
        return scheduler
    if dist.is_main and ckpt["epoch"] < epochs:  # (else nothing is trained: `_say_if_nothing_to_train` says so)
        say(f"resume: trainer.epochs {saved_epochs} -> {epochs}: the LR schedule is that of a {epochs}-epoch run, "
              f"going on at epoch {ckpt['epoch'] + 1}")
    for group in optimizer.param_groups:  # back to the base LR, then the new schedule's steps up to the epoch
        group["lr"] = group["initial_lr"]
    fresh = build_scheduler(optimizer, optim_cfg, epochs)
    _step_schedule(fresh, int(ckpt["epoch"]))
    return fresh


def _step_schedule(scheduler, times: int = 1) -> None:
    """`scheduler.step()` `times` times without PyTorch's warning that no optimizer step came first: none is meant
    (a schedule replayed on resume; an epoch whose batches all ran before a resume)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler.step\(\)` before", UserWarning)
        for _ in range(times):
            scheduler.step()


def _say_if_nothing_to_train(first_epoch: int, epochs: int, step: int, max_steps: int | None, dist: DistInfo) -> bool:
    """Whether a (resumed) run trains no step, its epochs or its max_steps already reached; the main process says
    why."""
    if first_epoch >= epochs:
        reason = (f"the checkpoint has finished {first_epoch} epochs and trainer.epochs={epochs}; pass a larger "
                  "trainer.epochs to train on")
    elif max_steps is not None and step >= max_steps:
        reason = (f"the checkpoint is at step {step} and trainer.max_steps={max_steps}; pass a larger "
                  "trainer.max_steps (or trainer.max_steps=null) to train on")
    else:
        return False
    if dist.is_main:
        say(f"nothing to train: {reason}")
    return True


def _gather_rng(state: dict, dist: DistInfo) -> list[dict]:
    """This rank's RNG `state` from every rank (index = rank), so that each rank resumes its own streams."""
    if dist.world_size == 1:
        return [state]
    states: list = [None] * dist.world_size
    torch_dist.all_gather_object(states, state)
    return states
