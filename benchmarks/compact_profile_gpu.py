"""Where a compact model's GPU time goes, against its dense model (the numbers behind README's notes on
whole-model speed).

For one model and mask variant (as `stripe_models_gpu.py` builds them: dense = compact(plain, fold_bn=True),
compact = compact(skeleton, fold_bn=True, channel_multiple=8), bf16, channels_last, eval, every StripeConv2d in
dense mode, which is what `choose_modes` picks on an H200 today):

1. the CUDA kernels of one forward of each (torch.profiler, per-kernel time per forward);
2. CUDA-graph time of both with each conv + bias + ReLU run as ONE cuDNN call (`compact(..., fuse_relu=True)`:
   `torch.cudnn_convolution_relu`), against the unfused models. The committed outputs
   (results/compact_profile_vgg16_*_h200.txt) come from this script's first form (commit 542cffd), which fused
   the VGG `features` by hand with the same cuDNN call, before compaction could.

    python3 benchmarks/compact_profile_gpu.py [--model vgg16] [--variant real] [--batch 256] [--top 12]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _host import require_cuda  # noqa: E402
from pix_gpu import median_ms  # noqa: E402
from stripe_models_gpu import MODELS, build_skeleton, cuda_graph  # noqa: E402

import compress  # noqa: E402
from compress.models import create_model  # noqa: E402
from compress.stripe import StripeConv2d  # noqa: E402


def build(name: str, variant: str, side: str, device: torch.device, fuse_relu: bool) -> nn.Module:
    kwargs = MODELS[name]["kwargs"]
    if side == "dense":
        torch.manual_seed(0)
        model = compress.compact(create_model(name, **kwargs).eval(), fold_bn=True, fuse_relu=fuse_relu)
    else:
        skeleton, _ = build_skeleton(name, variant, 0, kwargs)
        model = compress.compact(skeleton.eval(), fold_bn=True, channel_multiple=8, fuse_relu=fuse_relu)
    for m in model.modules():
        if isinstance(m, StripeConv2d):
            m.mode = "dense"
    return model.to(device).to(torch.bfloat16).to(memory_format=torch.channels_last).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="vgg16", choices=["vgg16"])
    ap.add_argument("--variant", default="real", choices=["random", "real"])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    require_cuda(__file__)
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.model}/{args.variant}, batch "
          f"{args.batch}, bf16, channels_last, StripeConv2d in dense mode")
    x = torch.randn(args.batch, 3, 32, 32, device=dev, dtype=torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    graphed = {}
    for side in ("dense", "compact"):
        model = build(args.model, args.variant, side, dev, fuse_relu=False)
        fused_model = build(args.model, args.variant, side, dev, fuse_relu=True)
        with torch.inference_mode():
            for _ in range(20):
                model(x)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    model(x)
                torch.cuda.synchronize()
            events = prof.key_averages()
            total = sum(e.self_device_time_total for e in events) / 10 / 1e3
            print(f"== {side}: GPU kernels {total:.3f} ms per forward")
            for e in sorted(events, key=lambda e: -e.self_device_time_total)[: args.top]:
                print(f"   {e.key[:88]:88s} {e.self_device_time_total / 10 / 1e3:7.4f} ms  x{e.count / 10:.0f}")
            ref = model(x).float()
            graphed[(side, "unfused")] = median_ms(cuda_graph(model, x), dev, 10, 50)
            err = ((fused_model(x).float() - ref).norm() / ref.norm()).item()
            graphed[(side, "fused")] = median_ms(cuda_graph(fused_model, x), dev, 10, 50)
        fused = fused_model.compress_compaction["relu_fused"]
        print(f"   {fused} conv+bias+ReLU fused (rel. error vs unfused {err:.1e})")
    print("CUDA-graph ms per forward, dense / compact (speedup):")
    for kind in ("unfused", "fused"):
        d, c = graphed[("dense", kind)], graphed[("compact", kind)]
        print(f"   {kind:8s} {d:.4f} / {c:.4f} ({d / c:.2f}x)")


if __name__ == "__main__":
    main()
