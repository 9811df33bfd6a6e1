"""GPU benchmark of the Triton stripe-conv kernel against cuDNN's dense conv (same dtype and layout).

1. Ceilings measured in this run: device copy bandwidth (bytes read + written) and the tensor-core matmul rate
   (bf16, and TF32 for float32).
2. Correctness of every shape/keep/dtype/layout against F.conv2d in float64 with the masked dense weight
   (on the first 8 images of the batch), with bias and fused ReLU.
3. Median times (CUDA events over CUDA-graph replays of 3 calls on rotated input sets: GPU time, no launch
   overhead) of cuDNN dense (cudnn.benchmark on, zero-filled
   dense weight; the faster of conv + bias + ReLU as one call, ``torch.cudnn_convolution_relu``, and F.conv2d
   followed by an in-place ReLU, both recorded) and of the stripe kernel (a few tile configs per layer, best
   kept), at keep 0.5/0.3/0.15 with random stripe masks, and with the masks of a real SWP run (ResNet-56 on
   digits, on the CIFAR shapes: rows `mask = real:<layer>`); the floor = max(kept MACs at the measured
   tensor-core rate, in+out bytes at the copy bandwidth) and the fraction of the attainable speedup min(1/keep,
   dense/floor), keep being the mask's share of kept stripes. The stripe kernel runs as a compact model's layer runs it in inference: prepared once per
   input shape (``stripe_triton.prepare``; until 2026-11-21 it was prepared on every timed call, which made the
   narrow layers' times host-bound), and the DENSE route (``kernels.stripe_reads_dense``) reads the dense weight
   kept with the layer (``dense=``) instead of building it per call.

    python benchmarks/stripe_gpu.py [--quick] [--real-only] [--channels 16 32 64] [--out results/stripe_gpu_h200.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _host import require_cuda  # noqa: E402

import kernels  # noqa: E402
from kernels import stripe_triton  # noqa: E402
from kernels.stripe import _graph_ms  # noqa: E402

SHAPES = [  # (net, B, C=N, H)
    ("cifar", 1024, 16, 32), ("cifar", 1024, 32, 16), ("cifar", 1024, 64, 8), ("vgg", 1024, 64, 32),
    ("vgg", 1024, 128, 16), ("vgg", 1024, 256, 8), ("vgg", 1024, 512, 4),
    ("imagenet", 128, 64, 56), ("imagenet", 128, 128, 28), ("imagenet", 128, 256, 14), ("imagenet", 128, 512, 7),
]
KEEPS = (0.5, 0.3, 0.15)
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def random_layer(N, C, keep, gen, device="cuda"):
    m = torch.rand(N, 3, 3, generator=gen) < keep
    nz = m.permute(1, 2, 0).nonzero()
    w = torch.randn(len(nz), C, generator=gen, dtype=torch.float64) / (C * 9 * keep) ** 0.5
    return w.to(device), nz[:, 2].contiguous().to(device), nz[:, :2].contiguous().to(device)


def mask_layer(mask, C, gen, device="cuda"):
    """The stripes of a boolean skeleton mask (N, 3, 3) in canonical order, random weights over C channels."""
    nz = mask.permute(1, 2, 0).nonzero()
    keep = max(float(mask.float().mean()), 1.0 / mask.numel())
    w = torch.randn(len(nz), C, generator=gen, dtype=torch.float64) / (C * 9 * keep) ** 0.5
    return w.to(device), nz[:, 2].contiguous().to(device), nz[:, :2].contiguous().to(device)


def real_masks(path):
    """(layer, mask) from a real SWP run's mask file (benchmarks/_masks.py format): per CIFAR width (16, 32, 64)
    the layer keeping the most stripes, and for width 64 also the one at the median."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _masks import load_masks

    masks, _ = load_masks(path)
    picked = []
    for width in (16, 32, 64):
        cands = sorted((int(m.sum()), k) for k, m in masks.items() if tuple(m.shape) == (width, 3, 3) and m.any())
        names = [cands[-1][1]] + ([cands[len(cands) // 2][1]] if width == 64 else [])
        picked += [(k, masks[k]) for k in names]
    return picked


def time_rotated(fn, inputs, reps=25, graph=False):
    """Median ms per call over groups of len(inputs) calls (rotating inputs so the L2 holds none of them).
    graph (tensor inputs): the group is captured once in a CUDA graph and replayed (GPU time only, no launch
    overhead; ``kernels.stripe._graph_ms``, the clock of ``stripe_route``)."""
    def group():
        for a in inputs:
            fn(a)

    if graph:
        return _graph_ms(group, inputs[0].device, reps, calls=1) / len(inputs)
    group()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        group()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / len(inputs))
    return statistics.median(ts)


def cudnn_ms(xs, wd, b) -> tuple[float, float]:
    """GPU ms of cuDNN's dense 3x3 conv (stride 1, padding 1) with bias and ReLU on the inputs `xs`: (conv then
    an in-place ReLU, ``torch.cudnn_convolution_relu`` as one call)."""
    unfused = time_rotated(lambda a: F.conv2d(a, wd, b, 1, 1).relu_(), xs, graph=True)
    fused = time_rotated(lambda a: torch.cudnn_convolution_relu(a, wd, b, (1, 1), (1, 1), (1, 1), 1), xs, graph=True)
    return unfused, fused


def ceilings():
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = time_rotated(lambda _: y.copy_(x), [0], reps=20)
    bw = 2 * x.numel() / (ms * 1e-3)
    rates = {}
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a = torch.randn(8192, 8192, device="cuda").to(dt)
        b = torch.randn(8192, 8192, device="cuda").to(dt)
        torch.backends.cuda.matmul.allow_tf32 = True
        ms = time_rotated(lambda _, a=a, b=b: a @ b, [0], reps=10)
        rates[name] = 2 * 8192 ** 3 / (ms * 1e-3)
    rates["fp16"] = rates["bf16"]
    return bw, rates


def candidates(C, N, dtype):
    """Route (b) one-hot and gather configs, route (a) dense-tile configs and, up to 64 channels, route (c) im2col
    configs; the best per layer is kept."""
    p2 = stripe_triton._pow2
    bk = p2(C, 16, 64 if dtype == torch.float32 else 128)
    bns = sorted({p2(N, 16, 32), p2(N, 16, 64), p2(N, 16, 128)})
    out = []
    for bn in bns:
        for ch in (16, 32):
            out.append(dict(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=bk, CHUNK=ch, num_warps=4 if bn <= 64 else 8,
                            num_stages=2, DENSE=False))
    out.append(dict(BLOCK_M=256, BLOCK_N=p2(N, 16, 64), BLOCK_K=bk, CHUNK=32, num_warps=8, num_stages=2,
                    DENSE=False))
    out.append(dict(BLOCK_M=64, BLOCK_N=bns[0], BLOCK_K=bk, CHUNK=16, num_warps=4, num_stages=3, DENSE=False))
    for bm, bn, nw in ((128, p2(N, 16, 64), 4), (128, p2(N, 16, 128), 8), (256, p2(N, 16, 64), 8)):
        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CHUNK=16, num_warps=nw, num_stages=3, DENSE=True))
    if C >= 16:  # route (a) over every offset without the per-offset skip (software-pipelined)
        for bm, bn, nw in ((128, p2(N, 16, 64), 4), (128, p2(N, 16, 128), 8), (64, p2(N, 16, 128), 4)):
            out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CHUNK=16, num_warps=nw, num_stages=3, DENSE=True,
                            NOSKIP=True))
    if C <= 64:  # route (c), im2col columns (reads the kept dense weight)
        for bk, nw in ((32, 4), (32, 8), (64, 4)):
            out.append(dict(BLOCK_M=128, BLOCK_N=p2(N, 16, 64), BLOCK_K=bk, CHUNK=16, num_warps=nw, num_stages=3,
                            IM2COL=True))
    if C >= 64:  # route (b) with the gather reduction
        for bm, nw, ns in ((64, 4, 2), (128, 8, 2), (128, 8, 3)):
            for ch in (32, 64):
                out.append(dict(BLOCK_M=bm, BLOCK_N=p2(N, 16, 128), BLOCK_K=bk, CHUNK=ch, num_warps=nw,
                                num_stages=ns, DENSE=False, GATHER=True))
        if N >= 256:  # 256 output channels per program (stripe_triton._gather_tiles)
            for bm, nw, ns in ((64, 4, 2), (128, 8, 3)):
                out.append(dict(BLOCK_M=bm, BLOCK_N=256, BLOCK_K=bk, CHUNK=64, num_warps=nw, num_stages=ns,
                                DENSE=False, GATHER=True))
    return out


def route_name(cfg: dict) -> str:
    return ("c" if cfg.get("IM2COL") else ("a-noskip" if cfg.get("NOSKIP") else "a") if cfg.get("DENSE")
            else "b-gather" if cfg.get("GATHER") else "b")


def config_name(cfg: dict) -> str:
    return (f"{route_name(cfg)} m{cfg['BLOCK_M']} n{cfg['BLOCK_N']} k{cfg['BLOCK_K']} ch{cfg['CHUNK']} "
            f"w{cfg['num_warps']} s{cfg['num_stages']}")


def prepare_stripe(x, w, oi, off, b, plan, N, cfg, kept):
    """The kernel's launcher for inputs like x, with `cfg` (None: the default), prepared once as StripeConv2d
    prepares it for inference (route, tiles, weight operand), given `kept` (the layer's channels_last dense
    weight) where that route reads it."""
    reads = stripe_triton.reads_dense(cfg) if cfg is not None else kernels.stripe_reads_dense(x, w, N, 3, 1, 1)
    return stripe_triton.prepare(x, w, oi, off, b, plan, N, [3, 3], [1, 1], [1, 1], [1, 1], True, cfg,
                                 dense=kept if reads else None)


def run_stripe(x, w, oi, off, b, plan, N, cfg, kept):
    return prepare_stripe(x, w, oi, off, b, plan, N, cfg, kept)(x)


def _dense_bwd(a, g, wd):
    return torch.ops.aten.convolution_backward(g, a, wd, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                               [True, True, False])


def _stripe_bwd(a, g, w, oi, off, plan, N):
    """The op's backward as the op runs it (Triton pieces where its rule picks them, cuDNN for the rest)."""
    return torch.ops.compress.stripe_conv2d_backward(g, a, w, oi, off, plan, N, [3, 3], [1, 1], [1, 1], [1, 1],
                                                     True, True)


def _cudnn_bwd(a, g, w, oi, off, N):
    from kernels.stripe import _backward_dense

    wd = kernels.stripe_to_dense(w, oi, off, N, 3, memory_format=torch.channels_last)
    return _backward_dense(g, a, wd, oi, off, [1, 1], [1, 1], [1, 1], True, True)


def run_case(net, B, C, H, keep, w64, oi, off, x64, gen, rates, bw, rows, fails, mask="random"):
    """Check and time one layer: stripes (w64 (S, C) float64, out_index oi, offset off), output channels N = C."""
    N = C
    b64 = torch.randn(N, dtype=torch.float64, generator=gen).cuda() * 0.1
    plan = kernels.stripe_plan(oi, off, N, 3)
    S = len(oi)
    wd64 = kernels.stripe_to_dense(w64, oi, off, N, 3)
    ref = F.conv2d(x64[:8], wd64, b64, 1, 1).relu()
    for dname, layout in (("bf16", "cl"), ("fp16", "cl"), ("fp32", "cl"), ("fp32", "nchw"), ("bf16", "nchw")):
        dt = DT[dname]
        fmt = torch.channels_last if layout == "cl" else torch.contiguous_format
        w, b = w64.to(dt), b64.to(dt)
        kept = kernels.stripe_to_dense(w, oi, off, N, 3, memory_format=torch.channels_last)
        tol = 1e-3 if dt == torch.float32 else 1e-2
        cands = candidates(C, N, dt)
        xs8 = x64[:8].to(dt).contiguous(memory_format=fmt)
        errs = []
        firsts = {route_name(c): c for c in reversed(cands)}
        for cfg in firsts.values():  # the first config of each route
            y = run_stripe(xs8, w, oi, off, b, plan, N, cfg, kept)
            errs.append(((y.double() - ref).norm() / ref.norm()).item())
        err = max(errs)
        ok = err < tol and all(e == e for e in errs)
        if not ok:
            fails.append((net, C, H, keep, dname, layout, err))
        timed = (dname, layout) in (("bf16", "cl"), ("fp32", "cl"), ("fp32", "nchw"))
        if not timed:
            continue
        xs = [x64.to(dt).contiguous(memory_format=fmt) for _ in range(3)]
        wd = wd64.to(dt).contiguous(memory_format=fmt)
        unfused_ms, fused_ms = cudnn_ms(xs, wd, b)
        dense_ms = min(unfused_ms, fused_ms)  # cuDNN's best: conv + bias + ReLU in one call, or three
        best, tuned = None, {}
        tune = cands if layout == "cl" else [next(r["config"] for r in rows[::-1]
                                                  if r["C"] == C and r["H"] == H and r["keep"] == keep
                                                  and r["mask"] == mask and r["dtype"] == dname
                                                  and r["layout"] == "cl")]
        for cfg in tune:
            try:
                run_stripe(xs[0], w, oi, off, b, plan, N, cfg, kept)
            except Exception as e:  # e.g. a tile config over the shared-memory limit
                print(f"   skip {cfg}: {type(e).__name__}", flush=True)
                continue
            ms = time_rotated(prepare_stripe(xs[0], w, oi, off, b, plan, N, cfg, kept), xs, graph=True)
            tuned[config_name(cfg)] = round(ms, 4)
            if best is None or ms < best[0]:
                best = (ms, cfg)
        def_ms = time_rotated(prepare_stripe(xs[0], w, oi, off, b, plan, N, None, kept), xs, graph=True)
        if best is None or def_ms < best[0]:  # the default (what StripeConv2d runs) beat every tuned candidate
            reads = kernels.stripe_reads_dense(xs[0], w, N, 3, 1, 1)
            pixels = stripe_triton.out_pixels(xs[0], [3, 3], [1, 1], [1, 1], [1, 1])
            best = (def_ms, stripe_triton.default_config(C, N, S, 9, dt, dense_given=reads, pixels=pixels))
        yb = run_stripe(xs8, w, oi, off, b, plan, N, best[1], kept)  # the timed config is checked too
        err = max(err, ((yb.double() - ref).norm() / ref.norm()).item())
        if not err < tol:
            fails.append((net, C, H, keep, dname, layout, err, best[1]))
        macs = B * H * H * S * C
        esz = xs[0].element_size()
        floor_ms = max(2 * macs / rates[dname], 2 * B * C * H * H * esz / bw) * 1e3
        attain = min(9 * N / S, dense_ms / floor_ms) if S else dense_ms / floor_ms  # the mask's own keep (a random
        # one's differs from `keep` by a few percent; runs before 2026-11-28 used `keep`)
        sp = dense_ms / best[0]
        row = dict(net=net, B=B, C=C, N=N, H=H, keep=keep, mask=mask, stripes=S, dtype=dname, layout=layout,
                   dense_ms=round(dense_ms, 4), dense_unfused_ms=round(unfused_ms, 4),
                   dense_fused_ms=round(fused_ms, 4), stripe_ms=round(best[0], 4),
                   stripe_default_ms=round(def_ms, 4), config=best[1], tuned_ms=tuned,
                   route=route_name(best[1]),
                   speedup=round(sp, 2),
                   floor_ms=round(floor_ms, 4), attainable=round(attain, 2),
                   fraction=round(sp / attain, 2), rel_err=err)
        if (keep == 0.3 or mask != "random") and layout == "cl":
            g = torch.randn(B, N, H, H, device="cuda", dtype=dt).contiguous(memory_format=fmt)
            db_ms = time_rotated(functools.partial(_dense_bwd, g=g, wd=wd), xs, reps=10, graph=True)
            sb_ms = time_rotated(functools.partial(_stripe_bwd, g=g, w=w, oi=oi, off=off, plan=plan, N=N),
                                 xs, reps=10, graph=True)
            cb_ms = time_rotated(functools.partial(_cudnn_bwd, g=g, w=w, oi=oi, off=off, N=N), xs, reps=10,
                                 graph=True)
            row.update(dense_bwd_ms=round(db_ms, 4), stripe_bwd_triton_ms=round(sb_ms, 4),
                       stripe_bwd_cudnn_ms=round(cb_ms, 4),
                       bwd_time_per_kept_mac_vs_dense=round(min(sb_ms, cb_ms) / db_ms / (S / (9 * N)), 2))
            print(f"   backward: dense {db_ms:.4f} ms  stripe op {sb_ms:.4f} ms  stripe via cudnn "
                  f"{cb_ms:.4f} ms", flush=True)
        rows.append(row)
        print(f"{net:8s} B={B:4d} C={C:3d} H={H:2d} keep={keep:.2f} {dname} {layout:4s} "
              f"dense {dense_ms:7.4f}  stripe {best[0]:7.4f} ({row['route']}; def {def_ms:7.4f})  x{sp:5.2f}  "
              f"floor {floor_ms:7.4f}  attain x{attain:5.2f}  frac {sp / attain:4.2f}  err {err:.1e}",
              flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--real-masks", default=os.path.join(os.path.dirname(__file__), "masks", "resnet56_digits.json"),
                    help="mask file of a real SWP run (benchmarks/masks/*.json); '' to skip those rows")
    ap.add_argument("--real-only", action="store_true", help="only the rows with real masks")
    ap.add_argument("--channels", type=int, nargs="+", default=None, help="only the shapes of these widths")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "stripe_gpu.json"))
    args = ap.parse_args()
    require_cuda(__file__)
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True
    gpu = torch.cuda.get_device_name()
    bw, rates = ceilings()
    print(f"# {gpu}: copy {bw / 1e12:.2f} TB/s, bf16 mm {rates['bf16'] / 1e12:.0f} TFLOP/s, "
          f"tf32 mm {rates['fp32'] / 1e12:.0f} TFLOP/s", flush=True)
    gen = torch.Generator().manual_seed(0)
    shapes = [] if args.real_only else SHAPES[:2] if args.quick else SHAPES
    shapes = [sh for sh in shapes if args.channels is None or sh[2] in args.channels]
    rows, fails = [], []
    for net, B, C, H in shapes:
        x64 = torch.randn(B, C, H, H, dtype=torch.float64, generator=gen).cuda()
        for keep in KEEPS:
            w64, oi, off = random_layer(C, C, keep, gen)
            run_case(net, B, C, H, keep, w64, oi, off, x64, gen, rates, bw, rows, fails)
    for layer, mask in (real_masks(args.real_masks) if args.real_masks else []):
        C = mask.shape[0]
        if args.channels is not None and C not in args.channels:
            continue
        net, B, _, H = next(sh for sh in SHAPES if sh[0] == "cifar" and sh[2] == C)
        x64 = torch.randn(B, C, H, H, dtype=torch.float64, generator=gen).cuda()
        w64, oi, off = mask_layer(mask, C, gen)
        run_case(net, B, C, H, round(float(mask.float().mean()), 3), w64, oi, off, x64, gen, rates, bw, rows, fails,
                 mask=f"real:{layer}")
    meta = dict(gpu=gpu, torch=torch.__version__, triton=getattr(stripe_triton.triton, "__version__", "?"),
                copy_TBps=bw / 1e12, mm_TFLOPs={k: v / 1e12 for k, v in rates.items()},
                notes="fp32 = TF32 tensor cores (RN-rounded operands) for both cuDNN and the stripe kernel; "
                      "correctness on the first 8 images vs float64, bias+ReLU fused; random stripe masks, and real:<layer> "
                      "rows with the masks of a real SWP run (benchmarks/masks/resnet56_digits.json)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows, "correctness_failures": fails}, f, indent=1)
    print("\n| shape | keep | dtype | layout | dense ms | stripe ms | route | speedup | attainable | fraction |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['net']} B{r['B']} {r['C']}x{r['H']}x{r['H']} | {r['keep']} | {r['dtype']} | {r['layout']} | "
              f"{r['dense_ms']:.4f} | {r['stripe_ms']:.4f} | {r['route']} | {r['speedup']:.2f} | {r['attainable']:.2f} | "
              f"{r['fraction']:.2f} |")
    print(f"correctness failures: {len(fails)} {fails[:10]}")
    print(f"GPU: {gpu}")


if __name__ == "__main__":
    main()
