"""CPU speed of compact models against their dense models (batch 64, fp32, eval, BN folded in both).

Builds CIFAR ResNet-56 and VGG16 with Filter Skeletons, draws random SWP-like masks (a share of dead
filters per layer, the alive filters keeping a share of their stripes), zeroes the dead filters' BN as
swp_update does, compacts them (`compress.compact(..., fold_bn=True)`, per-layer mode measured by
`compress.choose_modes`) and times dense and compact side by side (interleaved runs, median). With --fuse-relu
both are compacted as export does (`fuse_relu=True`: ReLUs into their convs, VGG's pools into its stripe convs,
the other max-pools made `compress.pooling.MaxPool2d`, the C++ CPU pool).

    python benchmarks/compact_cpu.py [--repeats 15] [--batch 64] [--fuse-relu] [--out benchmarks/results/compact_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # the repo (compress, kernels) and benchmarks/ (_masks)
from _host import cpu_kernels, cpu_model, positive  # noqa: E402
from _masks import swp_like  # noqa: E402

import compress  # noqa: E402
from compress.models import create_model  # noqa: E402
from compress.stripe import StripeConv2d  # noqa: E402

# per model: (share of dead filters, share of stripes kept by alive filters) for the convs that
# feed another conv (their dead filters are removed) and for the others (residual outputs, last conv);
# drawn by _masks.swp_like (shared with stripe_models_gpu.py)
MASKS = {
    "resnet56": {"inner": (0.7, 0.4), "outer": (0.2, 0.35)},
    "vgg16": {"inner": (0.5, 0.45), "outer": (0.5, 0.45)},
}


def timed(model: nn.Module, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    model(x)
    return (time.perf_counter() - t0) * 1e3


def machine() -> dict:
    return {
        "cpu": cpu_model(),
        "cpu_kernels": cpu_kernels(),  # C++ (kernels/_cpu.py) or PyTorch
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_1m_before": Path("/proc/loadavg").read_text().split()[0],
    }


@torch.inference_mode()
def side_by_side(a: nn.Module, b: nn.Module, x: torch.Tensor, repeats: int) -> tuple[list[float], list[float]]:
    """Times (ms) of a(x) and b(x), 3 warm-up runs each, then `repeats` interleaved runs."""
    for _ in range(3):
        timed(a, x), timed(b, x)
    t_a, t_b = [], []
    for _ in range(repeats):
        t_a.append(timed(a, x))
        t_b.append(timed(b, x))
    return t_a, t_b


TOLERANCE = 1e-4  # float32 on the CPU: compaction reorders sums and folds BN (about 2e-6 seen on these models)


@torch.no_grad()
def bench(name: str, batch: int, repeats: int, seed: int, fuse_relu: bool) -> dict:
    skeleton = swp_like(name, seed, MASKS[name])
    dense = compress.compact(create_model(name, num_classes=10, input_size=32).eval(), fold_bn=True,
                             fuse_relu=fuse_relu)
    compact_model = compress.compact(skeleton, fold_bn=True, fuse_relu=fuse_relu)
    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    modes = compress.choose_modes(compact_model, x, repeats=7)
    ref, out = skeleton(x[:8]), compact_model(x[:8])
    err = float((out - ref).abs().max() / ref.abs().max())
    size = (3, 32, 32)
    p_dense = compress.profile(dense, size, latency=False)
    p_compact = compress.profile(compact_model, size, latency=False)
    t_dense, t_compact = side_by_side(dense, compact_model, x, repeats)
    stripe_layers = [m for m in compact_model.modules() if isinstance(m, StripeConv2d)]
    ms_dense, ms_compact = statistics.median(t_dense), statistics.median(t_compact)
    return {
        "model": name,
        "masks": MASKS[name],
        "dense_macs": p_dense.macs,
        "compact_macs": p_compact.macs,
        "macs_cut": round(1 - p_compact.macs / p_dense.macs, 4),
        "dense_params": p_dense.params,
        "compact_params": p_compact.params,
        "dense_ms": round(ms_dense, 2),
        "compact_ms": round(ms_compact, 2),
        "speedup": round(ms_dense / ms_compact, 3),
        "dense_ms_all": [round(t, 2) for t in t_dense],
        "compact_ms_all": [round(t, 2) for t in t_compact],
        "max_rel_error_vs_skeleton": err,
        "stripe_layers": len(stripe_layers),
        "stripe_mode_layers": sum(m.mode == "stripe" for m in stripe_layers if m.num_stripes),
        "modes": modes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=positive(), default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fuse-relu", action="store_true", help="compact both with fuse_relu=True, as export does")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "compact_cpu.json"))
    args = parser.parse_args()
    info = machine()
    results = [bench(name, args.batch, args.repeats, args.seed, args.fuse_relu) for name in MASKS]
    info["load_average_1m_after"] = Path("/proc/loadavg").read_text().split()[0]
    report = {
        "machine": info,
        "batch": args.batch,
        "dtype": "float32",
        "repeats": args.repeats,
        "protocol": "eval, BN folded in both, inference_mode, 3 warm-up runs, dense/compact interleaved, median",
        "fuse_relu": args.fuse_relu,
        "results": results,
    }
    print(f"{'model':<10} {'MACs dense':>12} {'MACs compact':>13} {'cut':>6} {'dense ms':>9} {'compact ms':>11} "
          f"{'speedup':>8}")  # fmt: skip
    for r in results:
        print(f"{r['model']:<10} {r['dense_macs']:>12,} {r['compact_macs']:>13,} {r['macs_cut']:>6.1%} "
              f"{r['dense_ms']:>9.1f} {r['compact_ms']:>11.1f} {r['speedup']:>7.2f}x")  # fmt: skip
    print(f"machine: {info}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    wrong = [r["model"] for r in results if not r["max_rel_error_vs_skeleton"] <= TOLERANCE]
    if wrong:
        raise SystemExit(f"compact_cpu.py: the compact {', '.join(wrong)} differ from their skeleton models by more "
                         f"than {TOLERANCE} (max_rel_error_vs_skeleton in {args.out})")


if __name__ == "__main__":
    main()
