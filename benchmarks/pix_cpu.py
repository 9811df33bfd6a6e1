"""CPU inference benchmark: PiX ResNet-50 (zeta 4) against torchvision ResNet-50, same treatment.

fp32, 224x224, batch 1 and 8, eval + torch.inference_mode, BN folded into the convs in both models, NCHW
and channels_last (each layout applied to both). The two models run interleaved (A, B, A, B, ...) so that
load changes hit both alike; the median (and, robust to CPU steal, the min) of the repeats is reported,
with the load average before and after. With one thread (the default) the median CPU time of the thread is
recorded too (``*_cpu_ms``, ``speedup_cpu``): other jobs sharing the cores stretch wall time, not that.

    python benchmarks/pix_cpu.py [--repeats 15] [--batches 1 8] [--size 224] [--threads N] [--no-fold]
                                 [--layouts nchw channels_last] [--trials 1] [--malloc default|keep] [--compile]
                                 [--max-pools compress torch] [--out PATH]

--trials N repeats each measurement N times in a row and records every trial's medians (the row's figures
are then the medians over all N * repeats pairs), to show how far the ratio moves on a shared machine.

--malloc keep sets glibc's malloc, for the whole process and so for both models, to keep freed memory (no trim,
no mmap below 1 GiB; what MALLOC_TRIM_THRESHOLD_ / MALLOC_MMAP_THRESHOLD_ or jemalloc/tcmalloc do for a deployment).
By default glibc returns large freed blocks to the OS and the next forward's activations fault in fresh pages:
tens of thousands of 4 KiB page faults per batch-8 ResNet-50 forward on this machine. The per-forward page fault
count of each model is recorded (``*_faults``).

--compile runs both models through torch.compile (Inductor, CPU) with weight freezing
(``torch._inductor.config.freezing``: BN-folded weights prepacked for oneDNN, constant folding), the usual
recipe for CPU deployment, one static-shape compile per batch size. The PiX op enters the graph as an opaque
custom op (its C++ CPU kernel), tagged ``flexible_layout`` so that Inductor hands it its channels_last
activations instead of converting them to NCHW and back.

--max-pools compress (the default) swaps both models' stem nn.MaxPool2d for compress.pooling.MaxPool2d, as
compaction with fuse_relu (export's inference layout) does: the same values from a C++ kernel, 7.7x faster than
PyTorch's NCHW CPU max-pool at batch 1 (4.4 ms of a batch-1 forward here); --max-pools torch keeps PyTorch's pool;
--max-pools compress torch measures both (rows carry ``max_pool``).

--threads 1 (default) gives steady ratios on a shared machine (2 OpenMP threads spin on a busy core);
--threads 0 keeps torch's choice. PiX's CPU kernels (kernels/_cpu.py) run on torch's OpenMP threads too.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torchvision
from torch.nn.utils.fusion import fuse_conv_bn_eval

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).parent)]  # the repo and benchmarks/

from _host import cpu_kernels, cpu_model, positive  # noqa: E402

from compress.pix import insert_pix  # noqa: E402
from compress.pooling import fast_max_pools  # noqa: E402
from compress.surgery import conv_bn_pairs, replace_module  # noqa: E402


def fold_bn(model: nn.Module) -> nn.Module:
    """Fold every BatchNorm2d into the conv before it (eval statistics); the BN becomes Identity."""
    for conv_name, bn_name in conv_bn_pairs(model).items():
        conv, bn = model.get_submodule(conv_name), model.get_submodule(bn_name)
        replace_module(model, conv_name, fuse_conv_bn_eval(conv, bn))
        replace_module(model, bn_name, nn.Identity())
    return model


def build(pix: bool, fold: bool, channels_last: bool, max_pool: str) -> nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    if pix:
        insert_pix(model, 4)
    model.eval()
    with torch.no_grad():  # non-trivial BN statistics, so folding does real work
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    if fold:
        fold_bn(model)
    if max_pool == "compress":
        fast_max_pools(model)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def keep_freed_memory() -> None:
    """glibc malloc: never trim the heap, serve blocks below 1 GiB from it (no fresh pages per forward)."""
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not (libc.mallopt(m_trim_threshold, 2**31 - 1) and libc.mallopt(m_mmap_threshold, 2**30)):
        raise RuntimeError("--malloc keep: glibc's mallopt refused the setting (not glibc?); run with --malloc default")


def time_pair(
    models: dict[str, nn.Module], x: torch.Tensor, repeats: int
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, list[int]]]:
    """(wall, thread CPU) ms and minor page faults per forward of each model over `repeats` runs, the models
    interleaved, after 2 warm-up runs each. The thread CPU time counts only the calling thread (meaningful with 1
    torch thread); the page faults are the process's."""
    times: dict[str, list[float]] = {k: [] for k in models}
    cpu: dict[str, list[float]] = {k: [] for k in models}
    faults: dict[str, list[int]] = {k: [] for k in models}
    with torch.inference_mode():
        for _ in range(2):
            for m in models.values():
                m(x)
        for _ in range(repeats):
            for k, m in models.items():
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                c0, t0 = time.thread_time(), time.perf_counter()
                m(x)
                times[k].append((time.perf_counter() - t0) * 1e3)
                cpu[k].append((time.thread_time() - c0) * 1e3)
                faults[k].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return times, cpu, faults


def _row(channels_last: bool, max_pool: str, batch: int, ms: dict, best: dict, cpu_ms: dict, faults: dict,
         trials: list[float]) -> dict:
    """One result row from the medians (`ms`), minima, thread CPU medians and page faults of both models; printed."""
    row = {
        "layout": "channels_last" if channels_last else "nchw",
        "max_pool": max_pool,
        "batch": batch,
        "resnet50_ms": round(ms["resnet50"], 2),
        "pix_resnet50_ms": round(ms["pix_resnet50"], 2),
        "speedup": round(ms["resnet50"] / ms["pix_resnet50"], 3),
        "resnet50_min_ms": round(best["resnet50"], 2),
        "pix_resnet50_min_ms": round(best["pix_resnet50"], 2),
        "speedup_min": round(best["resnet50"] / best["pix_resnet50"], 3),
        "resnet50_faults": faults["resnet50"],
        "pix_resnet50_faults": faults["pix_resnet50"],
    }
    if len(trials) > 1:
        row["speedup_per_trial"] = trials
    if torch.get_num_threads() == 1:
        row |= {
            "resnet50_cpu_ms": round(cpu_ms["resnet50"], 2),
            "pix_resnet50_cpu_ms": round(cpu_ms["pix_resnet50"], 2),
            "speedup_cpu": round(cpu_ms["resnet50"] / cpu_ms["pix_resnet50"], 3),
        }
    print(
        f"{row['layout']:>13} {max_pool:>8} pool B={batch:<2} median: resnet50 {row['resnet50_ms']:8.2f} ms  pix "
        f"{row['pix_resnet50_ms']:8.2f} ms  speedup {row['speedup']:.3f}x | min: {row['resnet50_min_ms']:8.2f} / "
        f"{row['pix_resnet50_min_ms']:8.2f} ms  speedup {row['speedup_min']:.3f}x"
        + (f" | thread CPU: speedup {row['speedup_cpu']:.3f}x" if "speedup_cpu" in row else "")
        + (f" | per trial {trials}" if len(trials) > 1 else "")
        + f" | page faults {row['resnet50_faults']} / {row['pix_resnet50_faults']}",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=positive(), default=15)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads (default 1; 0: torch's choice)"
    )
    ap.add_argument("--no-fold", action="store_true", help="keep BatchNorm unfolded in both models")
    ap.add_argument("--layouts", nargs="+", choices=("nchw", "channels_last"), default=["nchw", "channels_last"])
    ap.add_argument("--trials", type=int, default=1, help="measure each row this many times (see above)")
    ap.add_argument("--malloc", choices=("default", "keep"), default="default",
                    help="keep: glibc malloc keeps freed memory, for both models (see above)")
    ap.add_argument("--compile", action="store_true", help="torch.compile both models, weights frozen (see above)")
    ap.add_argument("--max-pools", nargs="+", choices=("compress", "torch"), default=["compress"],
                    help="the stem max-pool of both models: compress.pooling.MaxPool2d or nn.MaxPool2d (see above)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "pix_cpu.json"))
    args = ap.parse_args()

    fold = not args.no_fold
    if args.malloc == "keep":
        keep_freed_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.compile:
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True
    load_before = os.getloadavg()
    rows = []
    for channels_last in [layout == "channels_last" for layout in args.layouts]:
        models = {  # every pool setting's pair, all interleaved
            (pool, name): build(name == "pix_resnet50", fold, channels_last, pool)
            for pool in args.max_pools for name in ("resnet50", "pix_resnet50")
        }
        if args.compile:
            models = {k: torch.compile(m, dynamic=False) for k, m in models.items()}
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        for b in args.batches:
            x = torch.randn(b, 3, args.size, args.size).contiguous(memory_format=fmt)
            times: dict[tuple, list[float]] = {k: [] for k in models}
            cpu: dict[tuple, list[float]] = {k: [] for k in models}
            faults: dict[tuple, list[int]] = {k: [] for k in models}
            trials: dict[str, list[float]] = {pool: [] for pool in args.max_pools}
            for _ in range(args.trials):
                t, c, f = time_pair(models, x, args.repeats)
                for pool in args.max_pools:
                    trials[pool].append(round(statistics.median(t[pool, "resnet50"])
                                              / statistics.median(t[pool, "pix_resnet50"]), 3))
                for k in models:
                    times[k] += t[k]
                    cpu[k] += c[k]
                    faults[k] += f[k]
            for max_pool in args.max_pools:
                ms = {name: statistics.median(times[max_pool, name]) for name in ("resnet50", "pix_resnet50")}
                best = {name: min(times[max_pool, name]) for name in ms}
                cpu_ms = {name: statistics.median(cpu[max_pool, name]) for name in ms}
                fault = {name: int(statistics.median(faults[max_pool, name])) for name in ms}
                rows.append(_row(channels_last, max_pool, b, ms, best, cpu_ms, fault, trials[max_pool]))
    result = {
        "benchmark": "PiX ResNet-50 (zeta 4) vs ResNet-50, CPU inference",
        "dtype": "float32",
        "input": [3, args.size, args.size],
        "bn_folded": fold,
        "compiled": "torch.compile, inductor freezing" if args.compile else False,
        "malloc": args.malloc,
        "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE"),  # PyTorch CPU allocator: 2 MiB huge pages
        "repeats": args.repeats,
        "statistic": "median (and min) ms per forward over the repeats, models interleaved; *_cpu_ms: median "
        "CPU time of the calling thread (1 thread only); *_faults: median minor page faults of the process per forward",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "cpu_kernels": cpu_kernels(),  # PiX and the max-pool: C++ (kernels/_cpu.py) or PyTorch
        "cpu_count": os.cpu_count(),
        "loadavg_before": [round(v, 2) for v in load_before],
        "loadavg_after": [round(v, 2) for v in os.getloadavg()],
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"wrote {args.out} (load average before {result['loadavg_before']}, after {result['loadavg_after']})"
    )


if __name__ == "__main__":
    main()
