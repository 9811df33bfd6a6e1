"""The training engine: config -> data + model (+ Filter Skeletons) -> SGD training with SWP -> summary.

`run(cfg, run_dir)` is what train.py calls. One process by default; under torchrun the environment
variables select DDP (gloo on CPU, NCCL on CUDA), and only rank 0 logs and writes checkpoints.
Checkpoints (`<run_dir>/checkpoints/last.pt`, `best.pt`) are written atomically at every epoch end;
`resume=true` continues from `<run_dir>/checkpoints/last.pt`, `resume=<path>` from that file.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from compress._logging import RunLogger, format_summary, progress
from compress._macs import estimate_macs
from compress._trainstate import atomic_save, load_checkpoint, rng_state, set_rng_state
from compress.data import build_data
from compress.models import create_model
from compress.skeleton import attach_skeletons, check_nonnegative, skeleton_stats, swp_update

__all__ = ["DistInfo", "setup_distributed", "build_optimizer", "build_scheduler", "train_one_epoch", "evaluate", "run"]

PRUNE_METHODS = ("none", "swp")


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
    device = torch.device(name)
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


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_optimizer(model: nn.Module, cfg: DictConfig) -> torch.optim.Optimizer:
    """SGD over all parameters (skeletons included, as in the SWP paper) from cfg: lr, momentum, nesterov, weight_decay."""
    if cfg.name != "sgd":
        raise ValueError(f"optim.name={cfg.name!r} is not supported; use optim=sgd_multistep or optim=sgd_cosine")
    return torch.optim.SGD(
        model.parameters(), lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: DictConfig, epochs: int):
    """Per-epoch LR schedule: cfg.schedule 'multistep' (milestones in epochs, gamma) or 'cosine' (to 0 at `epochs`)."""
    if cfg.schedule == "multistep":
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(cfg.milestones), gamma=cfg.gamma)
    if cfg.schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    raise ValueError(f"optim.schedule={cfg.schedule!r} is not supported; use 'multistep' or 'cosine'")


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
    swp: tuple[float, float] | None  # (alpha, threshold) or None


def _to_device(x: torch.Tensor, y: torch.Tensor, s: _Step) -> tuple[torch.Tensor, torch.Tensor]:
    fmt = torch.channels_last if s.channels_last else torch.contiguous_format
    return x.to(s.device, non_blocking=True, memory_format=fmt), y.to(s.device, non_blocking=True)


def _all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    if not torch_dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch_dist.all_reduce(t)
    return t.tolist()


def train_one_epoch(s: _Step, loader, step: int, max_steps: int | None, log, show: bool) -> tuple[dict, int]:
    """One pass over `loader` (or until `max_steps` optimizer steps); returns ({loss, accuracy}, new step)."""
    s.model.train()
    loss_sum, correct, seen = 0.0, 0.0, 0.0
    bar = progress(loader, show, leave=False, desc="train")
    for x, y in bar:
        if max_steps is not None and step >= max_steps:
            break
        x, y = _to_device(x, y, s)
        with torch.autocast(s.device.type, dtype=s.amp_dtype, enabled=s.amp_dtype is not None):
            out = s.model(x)
            loss = F.cross_entropy(out, y)
        s.optimizer.zero_grad(set_to_none=True)
        s.scaler.scale(loss).backward()
        if s.swp is not None:
            s.scaler.unscale_(s.optimizer)
            swp_update(s.raw, *s.swp)
        s.scaler.step(s.optimizer)
        s.scaler.update()
        step += 1
        batch_loss = float(loss.detach())
        loss_sum += batch_loss * y.numel()
        correct += float((out.argmax(1) == y).sum())
        seen += y.numel()
        log(step, batch_loss)
        bar.set_postfix(loss=f"{batch_loss:.3f}")
    loss_sum, correct, seen = _all_reduce_sum([loss_sum, correct, seen], s.device)
    return {"loss": loss_sum / max(seen, 1), "accuracy": correct / max(seen, 1)}, step


@torch.no_grad()
def evaluate(s: _Step, loader, show: bool) -> dict:
    """Mean cross-entropy and top-1 accuracy over `loader` (summed over ranks under DDP)."""
    s.model.eval()
    loss_sum, correct, seen = 0.0, 0.0, 0.0
    for x, y in progress(loader, show, leave=False, desc="test"):
        x, y = _to_device(x, y, s)
        with torch.autocast(s.device.type, dtype=s.amp_dtype, enabled=s.amp_dtype is not None):
            out = s.model(x)
        loss_sum += float(F.cross_entropy(out.float(), y, reduction="sum"))
        correct += float((out.argmax(1) == y).sum())
        seen += y.numel()
    loss_sum, correct, seen = _all_reduce_sum([loss_sum, correct, seen], s.device)
    return {"loss": loss_sum / max(seen, 1), "accuracy": correct / max(seen, 1)}


def _check_config(cfg: DictConfig) -> None:
    """Reject settings this version cannot honour, with the fix in the message."""
    if cfg.pix.zeta is not None:
        raise ValueError(f"pix.zeta={cfg.pix.zeta}: PiX is not yet supported by train.py; leave pix.zeta=null")
    if cfg.init is not None:
        raise ValueError(f"init={cfg.init}: starting from a compact model is not yet supported; leave init=null")
    if cfg.prune.name not in PRUNE_METHODS:
        raise ValueError(f"prune.name={cfg.prune.name!r} is unknown; choose one of {PRUNE_METHODS} (prune=none|swp)")
    if cfg.prune.name == "swp":
        check_nonnegative(alpha=cfg.prune.alpha, threshold=cfg.prune.threshold)
    if cfg.trainer.epochs < 1:
        raise ValueError(f"trainer.epochs={cfg.trainer.epochs} must be >= 1")


def _resume_config(cfg: DictConfig, run_dir: Path) -> tuple[DictConfig, dict | None]:
    """The config to train with and the checkpoint to resume from (None for a fresh run).

    On resume the checkpoint's config is used, except the `trainer` node (epochs, max_steps, device
    ... may change); other differences are reported and ignored.
    """
    if cfg.resume in (None, False):
        return cfg, None
    path = run_dir / "checkpoints" / "last.pt" if cfg.resume is True else Path(str(cfg.resume))
    ckpt = load_checkpoint(path)
    saved = OmegaConf.create(ckpt["config"])
    merged = OmegaConf.merge(saved, {"trainer": cfg.trainer, "resume": cfg.resume})
    ignored = [k for k in saved if k not in ("trainer", "resume") and saved.get(k) != cfg.get(k)]
    if ignored:
        print(f"resume: using the checkpoint's settings for {ignored} (only trainer.* may change on resume)")
    return merged, ckpt


def _hydra_run_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        raise ValueError("engine.run needs run_dir=... when called outside a Hydra app (train.py)")
    return Path(HydraConfig.get().runtime.output_dir)


def _amp_dtype(cfg: DictConfig, device: torch.device) -> torch.dtype | None:
    """Autocast dtype on CUDA when trainer.amp is on ('bfloat16' or 'float16'); None (fp32) on CPU."""
    if not cfg.trainer.amp or device.type != "cuda":
        return None
    if cfg.trainer.amp_dtype not in ("bfloat16", "float16"):
        raise ValueError(f"trainer.amp_dtype={cfg.trainer.amp_dtype!r}; use bfloat16 or float16")
    return getattr(torch, cfg.trainer.amp_dtype)


def run(cfg: DictConfig, run_dir: str | os.PathLike | None = None) -> dict:
    """Train as `cfg` says, writing checkpoints/, tensorboard/ and summary.json under `run_dir`.

    `run_dir` defaults to Hydra's output directory. Returns the summary dict (see README).
    """
    start = time.perf_counter()
    run_dir = Path(run_dir) if run_dir is not None else _hydra_run_dir()
    cfg, ckpt = _resume_config(cfg, run_dir)
    _check_config(cfg)
    dist = setup_distributed(cfg.trainer.device)
    _seed_everything(cfg.trainer.seed)

    data = build_data(cfg.data, rank=dist.rank, world_size=dist.world_size)
    raw = create_model(
        cfg.model.name,
        num_classes=data.num_classes,
        input_size=data.input_size,
        in_chans=data.in_chans,
        **cfg.model.get("kwargs", {}),
    )
    swp = None
    if cfg.prune.name == "swp":
        attach_skeletons(raw, cfg.prune.min_kernel_size, cfg.prune.include, cfg.prune.exclude)
        swp = (float(cfg.prune.alpha), float(cfg.prune.threshold))
    threshold = swp[1] if swp else 0.0
    channels_last = bool(cfg.trainer.channels_last) and dist.device.type == "cuda"
    raw.to(dist.device, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    model = raw
    if dist.world_size > 1:
        model = nn.parallel.DistributedDataParallel(raw, device_ids=[dist.device] if dist.device.type == "cuda" else None)
    if cfg.trainer.compile:
        model = torch.compile(model)

    epochs = int(cfg.trainer.epochs)
    amp_dtype = _amp_dtype(cfg, dist.device)
    optimizer = build_optimizer(raw, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, epochs)
    scaler = torch.amp.GradScaler(dist.device.type, enabled=amp_dtype == torch.float16)
    s = _Step(model, raw, optimizer, scaler, dist.device, amp_dtype, channels_last, swp)
    generator = getattr(data.train, "generator", None)

    first_epoch, step, best, test = 0, 0, -1.0, {"loss": float("nan"), "accuracy": float("nan")}
    if ckpt is not None:
        raw.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        set_rng_state(ckpt["rng"][dist.rank] if dist.rank < len(ckpt["rng"]) else ckpt["rng"][0], generator)
        first_epoch, step, best, test = ckpt["epoch"], ckpt["step"], ckpt["best_accuracy"], ckpt["test"]

    ckpt_dir = run_dir / "checkpoints"
    logger = RunLogger(run_dir / "tensorboard", dist.is_main)
    input_shape = (data.in_chans, data.input_size, data.input_size)
    max_steps = cfg.trainer.max_steps
    log_every = max(int(cfg.trainer.log_every), 1)

    def log_step(step: int, loss: float) -> None:
        if step % log_every == 0:
            logger.scalars({"train/loss_step": loss, "lr": optimizer.param_groups[0]["lr"]}, step)

    epoch = first_epoch
    epoch_bar = progress(range(first_epoch, epochs), dist.is_main, desc="epochs")
    for epoch in epoch_bar:
        if hasattr(data.train.sampler, "set_epoch"):
            data.train.sampler.set_epoch(epoch)
        train, step = train_one_epoch(s, data.train, step, max_steps, log_step, dist.is_main)
        stopping = max_steps is not None and step >= max_steps
        evaluated = (epoch + 1) % cfg.trainer.eval_every == 0 or epoch + 1 == epochs or stopping
        if evaluated:
            test = evaluate(s, data.test, dist.is_main)
        lr = optimizer.param_groups[0]["lr"]
        scheduler.step()
        stats = skeleton_stats(raw, threshold)
        macs_dense, macs_pruned = estimate_macs(raw, input_shape, threshold)
        logger.scalars(
            {"train/loss": train["loss"], "train/accuracy": train["accuracy"], "epoch/lr": lr, "macs/pruned_estimate": macs_pruned}
            | ({"test/loss": test["loss"], "test/accuracy": test["accuracy"]} if evaluated else {}),
            step,
        )
        logger.skeletons(raw, stats, threshold, step)
        is_best = evaluated and test["accuracy"] > best
        best = max(best, test["accuracy"]) if evaluated else best
        if dist.is_main:
            kept = stats["stripes_kept"] / max(stats["stripes_total"], 1)
            epoch_bar.write(
                f"epoch {epoch + 1}/{epochs} step {step} lr {lr:.4g} train loss {train['loss']:.4f} "
                f"acc {train['accuracy']:.4f} | test acc {test['accuracy']:.4f} | stripes kept {kept:.1%}"
            )
        state = {
            "model": raw.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "epoch": epoch + 1,
            "step": step,
            "best_accuracy": best,
            "test": test,
            "rng": _gather_rng(generator, dist),
            "config": OmegaConf.to_container(cfg, resolve=True),
        }
        if dist.is_main:
            atomic_save(state, ckpt_dir / "last.pt")
            if is_best:
                atomic_save(state, ckpt_dir / "best.pt")
        if stopping:
            break
    logger.close()

    stats = skeleton_stats(raw, threshold)
    macs_dense, macs_pruned = estimate_macs(raw, input_shape, threshold)
    summary = {
        "test_accuracy": test["accuracy"],
        "best_test_accuracy": best,
        "test_loss": test["loss"],
        "stripes_total": stats["stripes_total"],
        "stripes_kept": stats["stripes_kept"],
        "filters_dead": stats["filters_dead"],
        "skeleton_layers": len(stats["layers"]),
        "macs_dense": macs_dense,
        "macs_pruned_estimate": macs_pruned,
        "params": sum(p.numel() for n, p in raw.named_parameters() if not n.endswith("skeleton")),
        "epochs": epoch + 1 if epochs > first_epoch else first_epoch,
        "steps": step,
        "seconds": time.perf_counter() - start,
        "model": cfg.model.name,
        "data": cfg.data.name,
        "device": str(dist.device),
        "run_dir": str(run_dir),
        "checkpoint": str(ckpt_dir / "last.pt"),
    }
    if dist.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(format_summary(summary))
    return summary


def _gather_rng(generator: torch.Generator | None, dist: DistInfo) -> list[dict]:
    """RNG states of every rank (index = rank), so that each rank resumes its own streams."""
    state = rng_state(generator)
    if dist.world_size == 1:
        return [state]
    states: list = [None] * dist.world_size
    torch_dist.all_gather_object(states, state)
    return states
