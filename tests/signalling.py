"""A model that sends its own process SIGTERM, as a batch system would, at a known training step (tests only)."""

from pathlib import Path

# SIGTERM during the forward of training step $COMPRESS_TEST_SIGTERM, counted in this process (on rank 0 only;
# "K:2" sends it twice, back to back; "K:2::S" S seconds apart; "K:1:children" first to the DataLoader workers, from
# another process; "K:1:::INT" sends SIGINT, as Ctrl-C does, instead)
MODULE = """
import os
import signal
import subprocess
import time

import torch
import torch.nn as nn

import compress


class Net(nn.Module):
    def __init__(self, num_classes, in_chans):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(in_chans, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, num_classes)
        self.steps = 0

    def forward(self, x):
        if self.training and torch.is_grad_enabled():
            self.steps += 1
            at, times, children, gap, name = (os.environ.get("COMPRESS_TEST_SIGTERM", "0") + "::::").split(":")[:5]
            if self.steps == int(at) and os.environ.get("RANK", "0") == "0":
                if children:  # as Slurm signals every process of a job: the DataLoader workers too, from outside
                    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
                        kids = f.read().split()
                    workers = [k for k in kids if open(f"/proc/{k}/comm").read().strip() == "pt_data_worker"]
                    assert workers
                    subprocess.run(["kill", "-TERM", *workers], check=True)
                    time.sleep(0.5)  # they would be gone by now
                for i in range(int(times or 1)):
                    time.sleep(float(gap or 0) if i else 0)
                    os.kill(os.getpid(), getattr(signal, "SIG" + (name or "TERM")))
        return self.head(self.body(x).mean((2, 3)))


@compress.register_model
def {name}(num_classes=10, in_chans=3):
    return Net(num_classes, in_chans)
"""
# 64 fake 8x8 images, batch 8: 8 steps per epoch (in one process)
ARGS = ["data=fake", "data.input_size=8", "data.num_classes=3", "data.train_size=64", "data.test_size=8",
        "data.batch_size=8", "optim=sgd_multistep", "optim.epochs=2", "optim.milestones=[1]", "prune=swp"]


def signalling_model(folder: Path, name: str) -> list[str]:
    """train.py's arguments for the signalling model, registered as `name` by a module of that name written to
    `folder` (run train.py from there: imports= looks in the launch directory first)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(MODULE.replace("{name}", name))
    return [*ARGS, f"imports=[{name}]", f"model.name={name}"]
