"""Where a CPU forward of PiX ResNet-50 and ResNet-50 spends its time (issue 6): the convs both models share, the
squeeze convs PiX replaces, the PiX blocks, the max-pool and the rest (residual tails, head, Python), per forward.

Same models and treatment as benchmarks/pix_cpu.py (fp32, BN folded, eval, inference_mode), run interleaved;
each conv's forward is timed with a perf_counter wrapper (the same wrapper in both models, a few microseconds
per call; each shared conv's median is in ``shared_conv_ms``), the max-pool and the PiX blocks (their whole
forward: the C++ kernel and the Python around it) likewise, and the totals without wrappers in the same loop.
Median over the repeats.

    python benchmarks/pix_cpu_breakdown.py [--threads 2] [--batch 1] [--layout nchw] [--repeats 20]
                                           [--max-pools compress|torch] [--size 224] [--out PATH]

--max-pools as in pix_cpu.py: compress (the default) gives both models compress.pooling.MaxPool2d, export's stem
pool; torch keeps PyTorch's nn.MaxPool2d (the session-23 breakdowns ran with it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _host import cpu_kernels, cpu_model, positive  # noqa: E402
from pix_cpu import build  # noqa: E402

from compress.pix import PiXBlock  # noqa: E402


def time_modules(model: nn.Module, store: dict[str, list[float]]) -> None:
    """Wrap the forward of every Conv2d, MaxPool2d and PiXBlock of `model` to append its seconds to store[name]."""
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Conv2d, nn.MaxPool2d, PiXBlock)):
            fwd = mod.forward

            def timed(inp, fwd=fwd, name=name):
                t0 = time.perf_counter()
                out = fwd(inp)
                store[name].append(time.perf_counter() - t0)
                return out

            mod.forward = timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=positive(), default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layout", choices=("nchw", "channels_last"), default="nchw")
    ap.add_argument("--repeats", type=positive(), default=20)
    ap.add_argument("--max-pools", choices=("compress", "torch"), default="compress")
    ap.add_argument("--size", type=positive(), default=224,
                    help="input height and width (another size than 224: a check, written only with --out)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cl = args.layout == "channels_last"
    x = torch.randn(args.batch, 3, args.size, args.size).contiguous(
        memory_format=torch.channels_last if cl else torch.contiguous_format)
    names = {"resnet50": False, "pix_resnet50": True}
    timed = {k: build(p, True, cl, args.max_pools) for k, p in names.items()}  # with wrappers: the parts
    plain = {k: build(p, True, cl, args.max_pools) for k, p in names.items()}  # without: the totals
    parts: dict[str, dict[str, list[float]]] = {k: defaultdict(list) for k in names}
    for k, m in timed.items():
        time_modules(m, parts[k])
    totals: dict[str, list[float]] = {k: [] for k in names}
    with torch.inference_mode():
        for _ in range(3):
            for k in names:
                timed[k](x)
                plain[k](x)
        for store in parts.values():
            store.clear()
        for _ in range(args.repeats):
            for k in names:
                t0 = time.perf_counter()
                plain[k](x)
                totals[k].append(time.perf_counter() - t0)
                timed[k](x)
    med = {k: {n: statistics.median(v) * 1e3 for n, v in parts[k].items()} for k in names}
    kind = {k: {n: type(timed[k].get_submodule(n)) for n in med[k]} for k in names}
    shared = [n for n in med["resnet50"] if kind["resnet50"][n] is nn.Conv2d
              and kind["pix_resnet50"].get(n) is nn.Conv2d]
    rows = {}
    for k in names:
        total = statistics.median(totals[k]) * 1e3
        common = sum(med[k][n] for n in shared)
        own = sum(v for n, v in med[k].items() if n not in shared and issubclass(kind[k][n], nn.Conv2d))
        pix = sum(v for n, v in med[k].items() if kind[k][n] is PiXBlock)
        rows[k] = {"total_ms": round(total, 2), "shared_convs_ms": round(common, 2),
                   "own_convs_ms": round(own, 2), "pix_blocks_ms": round(pix, 2),
                   "maxpool_ms": round(med[k]["maxpool"], 2),
                   "rest_ms": round(total - common - own - pix - med[k]["maxpool"], 2)}
    r, p = rows["resnet50"], rows["pix_resnet50"]
    result = {
        "benchmark": "CPU forward breakdown, PiX ResNet-50 (zeta 4) vs ResNet-50 (benchmarks/pix_cpu_breakdown.py)",
        "legend": "shared_convs: the 37 convs both models have; own_convs: ResNet-50's 16 squeeze convs (none in "
                  "PiX ResNet-50); pix_blocks: PiX ResNet-50's 16 PiX blocks, whole forward; rest: total - the "
                  "parts (residual tails, head, Python); parts timed with wrappers, totals without, interleaved",
        "torch": torch.__version__, "threads": torch.get_num_threads(), "batch": args.batch,
        "layout": args.layout, "size": args.size, "repeats": args.repeats, "max_pool": args.max_pools, "cpu": cpu_model(),
        "cpu_kernels": cpu_kernels(),
        "cpu_count": os.cpu_count(), "rows": rows,
        "speedup": round(r["total_ms"] / p["total_ms"], 3),
        "speedup_without_maxpool": round((r["total_ms"] - r["maxpool_ms"]) / (p["total_ms"] - p["maxpool_ms"]), 3),
        "shared_conv_ms": {n: {k: round(med[k][n], 4) for k in names} for n in shared},
    }
    for k, row in rows.items():
        print(f"{k:>13}: " + "  ".join(f"{n} {v:.2f}" for n, v in row.items()))
    print(f"speedup {result['speedup']:.3f}x; with both models' max-pool taken out "
          f"{result['speedup_without_maxpool']:.3f}x")
    by_kind: dict[str, float] = defaultdict(float)  # PiX model minus ResNet-50, per kind of shared conv
    for n in shared:
        by_kind[n.rsplit(".", 1)[-1] if "downsample" not in n else "downsample"] += med["pix_resnet50"][n] - med["resnet50"][n]
    print("shared convs, PiX ResNet-50 minus ResNet-50 (ms): " + "  ".join(f"{k} {v:+.2f}" for k, v in by_kind.items()))
    if args.out is None and args.size != 224:  # a check: never over a committed result of the default size
        return
    out = Path(args.out) if args.out else (Path(__file__).parent / "results"
                                           / f"pix_cpu_breakdown_{args.layout}_{args.threads}threads_b{args.batch}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
