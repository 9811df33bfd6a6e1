"""Where a PiX ResNet-50 step spends its time on a GPU, against ResNet-50 (the numbers behind README's PiX notes).

Per model (torchvision ResNet-50, and the same with `insert_pix(model, 4)`), channels_last 224x224, bf16
autocast, for a training step (forward, cross-entropy, backward, SGD with momentum) and for inference:
wall ms per iteration (synchronised), host enqueue ms per iteration (the Python/C++ time to queue the work,
measured without a synchronize), the summed time of the CUDA kernels per iteration (torch.profiler), and the
PiX model's top kernels.

    python3 benchmarks/pix_profile_gpu.py [--batch 64] [--top 14]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torchvision
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from _host import require_cuda  # noqa: E402

from compress.pix import insert_pix  # noqa: E402


def per_iteration(fn, top: int) -> None:
    """Print wall, host-enqueue and summed-kernel ms per iteration of fn (and its `top` kernels if top > 0)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / 20 * 1e3
    t = time.perf_counter()
    for _ in range(20):
        fn()
    host = (time.perf_counter() - t) / 20 * 1e3
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / 5 / 1e3
    print(f"wall {wall:.2f} ms/it, host enqueue {host:.2f} ms/it, GPU kernels {gpu:.2f} ms/it, "
          f"kernels/it {sum(e.count for e in events) / 5:.0f}", flush=True)
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"   {e.key[:80]:80s} {e.self_device_time_total / 5 / 1e3:7.3f} ms/it  x{e.count / 5:.0f}")


def profile_model(name: str, batch: int, top: int) -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    if name == "pix":
        insert_pix(model, 4)
    model = model.to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(batch, 3, 224, 224, device=dev).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=dev)

    def step() -> None:
        with torch.autocast("cuda", torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def infer() -> None:
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
            model(x)

    for fn, mode in ((step, "train"), (infer, "eval")):
        model.train(mode == "train")
        print(f"{name} {mode}: ", end="")
        per_iteration(fn, top if name == "pix" else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--top", type=int, default=14, help="top kernels of the PiX model to list")
    args = ap.parse_args()
    require_cuda(__file__)
    torch.backends.cudnn.benchmark = True
    warnings.filterwarnings("ignore", module="torch.profiler")  # its per-cycle notice would split the lines
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, batch {args.batch}, bf16, channels_last")
    for name in ("resnet50", "pix"):
        profile_model(name, args.batch, args.top)


if __name__ == "__main__":
    main()
