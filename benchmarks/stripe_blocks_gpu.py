"""GPU benchmark of the stripe kernel on block-structured stripe masks (``prune.stripe_group``), against cuDNN.

With random per-filter masks nearly every (kernel offset, tile of output channels) block keeps a stripe, so a
tensor-core tile skips nothing (README "Not done yet"). When G consecutive filters share their kept offsets (SWP
with one skeleton decision per group of G filters), a tile of G channels computes only its kept offsets: the
LISTED route loops over each tile's kept offsets, and route (a) with its per-offset skip does too.

For each layer of ``stripe_gpu.SHAPES``, group G and keep ratio: masks drawn per (group, offset), repeated over
the group's filters; every timed config checked against F.conv2d in float64 (first 8 images, bias + ReLU);
median GPU times (CUDA graphs, rotated inputs) of cuDNN's dense conv (its best of fused and unfused ReLU), the
kernel's default config for the layer as StripeConv2d runs it ("default": with ``kernels.stripe_tile_keep``,
so the LISTED route where the groups allow) and without the tile structure ("per-filter default": the route
per-filter masks get), route (a) with the skip and BLOCK_N = G, and the LISTED route with BLOCK_N = G (a few
tilings). Speedup = dense / best stripe time; attainable = min(1/keep, dense / floor) as in
stripe_gpu.py.

    python benchmarks/stripe_blocks_gpu.py [--channels 16 32 64] [--groups 32 64] [--out results/x.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _host import require_cuda  # noqa: E402
from stripe_gpu import (  # noqa: E402
    DT,
    SHAPES,
    ceilings,
    config_name,
    cudnn_ms,
    mask_layer,
    prepare_stripe,
    time_rotated,
)

import kernels  # noqa: E402
from kernels import stripe_triton  # noqa: E402

KEEPS = (0.3, 0.15)


def block_mask(N: int, G: int, keep: float, gen: torch.Generator) -> torch.Tensor:
    """Bool (N, 3, 3): one draw per (group of G filters, offset), kept with probability `keep`, repeated over the
    group; every group keeps at least one offset (a group without any would be dead filters, which compaction
    removes before the kernel sees them)."""
    groups = -(-N // G)
    m = torch.rand(groups, 9, generator=gen) < keep
    m[torch.arange(groups), torch.randint(0, 9, (groups,), generator=gen)] = True
    return m.view(groups, 3, 3).repeat_interleave(G, 0)[:N]


def configs(C: int, N: int, G: int, dtype: torch.dtype) -> list[dict]:
    bk = stripe_triton._pow2(C, 16, 64 if dtype == torch.float32 else 128)
    bn = min(G, stripe_triton._pow2(N, 16, 256))
    out = [dict(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=bk, CHUNK=16, num_warps=4, num_stages=2, DENSE=True)]
    for bm, nw, ns in ((128, 4, 3), (128, 8, 4), (64, 4, 3), (256, 8, 3)):
        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CHUNK=16, num_warps=nw, num_stages=ns, DENSE=True,
                        LISTED=True))
    return out


def name(cfg: dict) -> str:
    return ("listed " if cfg.get("LISTED") else "") + config_name(cfg)


def run_layer(net, B, C, H, G, keep, gen, rates, bw, rows, fails):
    N = C
    mask = block_mask(N, G, keep, gen)
    w64, oi, off = mask_layer(mask, C, gen)
    S = len(oi)
    b64 = torch.randn(N, dtype=torch.float64, generator=gen).cuda() * 0.1
    x64 = torch.randn(B, C, H, H, dtype=torch.float64, generator=gen).cuda()
    plan = kernels.stripe_plan(oi, off, N, 3)
    tile_keep = kernels.stripe_tile_keep(plan, N)
    ref = F.conv2d(x64[:8], kernels.stripe_to_dense(w64, oi, off, N, 3), b64, 1, 1).relu()
    for dname in ("bf16", "fp32"):
        dt = DT[dname]
        tol = 1e-3 if dt == torch.float32 else 1e-2
        w, b = w64.to(dt), b64.to(dt)
        # the zero-filled dense weight, channels_last: cuDNN's weight and the one the layer keeps for the kernel
        kept = kernels.stripe_to_dense(w, oi, off, N, 3, memory_format=torch.channels_last)
        xs = [x64.to(dt).contiguous(memory_format=torch.channels_last) for _ in range(3)]
        dense_ms = min(cudnn_ms(xs, kept, b))
        timed = {}
        module_cfg = stripe_triton.default_config(C, N, S, 9, dt, dense_given=True, pixels=B * H * H,
                                                  tile_keep=tile_keep)  # as StripeConv2d runs it
        for label, cfg in [("default", module_cfg), ("per-filter default", None)] + [(name(c), c)
                                                                                    for c in configs(C, N, G, dt)]:
            try:
                launch = prepare_stripe(xs[0], w, oi, off, b, plan, N, cfg, kept)
                y = prepare_stripe(xs[0][:8], w, oi, off, b, plan, N, cfg, kept)(xs[0][:8])
            except Exception as e:  # a tiling over the shared-memory limit
                print(f"   skip {label}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            err = ((y.double() - ref).norm() / ref.norm()).item()
            if not err < tol:
                fails.append(dict(net=net, C=C, H=H, G=G, keep=keep, dtype=dname, config=label, rel_err=err))
            timed[label] = (time_rotated(launch, xs, graph=True), err)
        best = min(timed, key=lambda k: timed[k][0])
        macs = B * H * H * S * C
        floor_ms = max(2 * macs / rates[dname], 2 * B * C * H * H * xs[0].element_size() / bw) * 1e3
        real_keep = S / (9 * N)
        attain = min(1 / real_keep, dense_ms / floor_ms)
        sp = dense_ms / timed[best][0]
        row = dict(net=net, B=B, C=C, N=N, H=H, group=G, keep=round(real_keep, 3), stripes=S, dtype=dname,
                   layout="cl", dense_ms=round(dense_ms, 4), stripe_ms=round(timed[best][0], 4), best=best,
                   default_ms=round(timed["default"][0], 4), default_config=module_cfg,
                   per_filter_default_ms=round(timed["per-filter default"][0], 4),
                   times_ms={k: round(v[0], 4) for k, v in timed.items()},
                   max_rel_err=max(v[1] for v in timed.values()), speedup=round(sp, 2),
                   default_speedup=round(dense_ms / timed["default"][0], 2), floor_ms=round(floor_ms, 4),
                   attainable=round(attain, 2), fraction=round(sp / attain, 2))
        rows.append(row)
        print(f"{net:8s} B={B:4d} C={C:3d} H={H:2d} G={G:3d} keep={real_keep:.2f} {dname} dense {dense_ms:.4f} "
              f"best {timed[best][0]:.4f} ({best}) x{sp:.2f} default x{row['default_speedup']:.2f} "
              f"attain x{attain:.2f} frac {sp / attain:.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--channels", type=int, nargs="+", default=None, help="only the shapes of these widths")
    ap.add_argument("--groups", type=int, nargs="+", default=[32, 64], help="filters per group (capped at the width)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "stripe_blocks_gpu.json"))
    args = ap.parse_args()
    require_cuda(__file__)
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True
    gpu = torch.cuda.get_device_name()
    bw, rates = ceilings()
    gen = torch.Generator().manual_seed(0)
    rows, fails = [], []
    for net, B, C, H in SHAPES:
        if args.channels is not None and C not in args.channels:
            continue
        for G in sorted({min(g, C) for g in args.groups}):
            for keep in KEEPS:
                run_layer(net, B, C, H, G, keep, gen, rates, bw, rows, fails)
                meta = dict(gpu=gpu, torch=torch.__version__, triton=getattr(stripe_triton.triton, "__version__", "?"),
                            copy_TBps=bw / 1e12, mm_TFLOPs={k: v / 1e12 for k, v in rates.items()},
                            notes="block-structured masks (one draw per group of G filters and offset), channels_last; "
                                  "fp32 = TF32 for cuDNN and the kernel; checked vs float64 on 8 images")
                with open(args.out, "w") as f:  # after every layer: a run cut short keeps what it measured
                    json.dump({"meta": meta, "rows": rows, "correctness_failures": fails}, f, indent=1)
    print("\n| shape | G | keep | dtype | dense ms | stripe ms | route | speedup | default x | attainable | fraction |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['net']} B{r['B']} {r['C']}x{r['H']}x{r['H']} | {r['group']} | {r['keep']} | {r['dtype']} | "
              f"{r['dense_ms']:.4f} | {r['stripe_ms']:.4f} | {r['best']} | {r['speedup']:.2f} | "
              f"{r['default_speedup']:.2f} | {r['attainable']:.2f} | {r['fraction']:.2f} |")
    print(f"correctness failures: {len(fails)} {fails[:10]}")
    print(f"GPU: {gpu}")


if __name__ == "__main__":
    main()
