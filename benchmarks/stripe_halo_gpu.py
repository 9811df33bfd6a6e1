"""Input-stationary "halo" stripe kernel (kernels/stripe_halo.py) against the default kernel and cuDNN (H200, bf16,
channels_last, CUDA graphs) -> results/stripe_halo_reverted_h200.json."""
import json
import os
import sys

sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.getcwd() + "/tests")
from functools import partial

import torch
import torch.nn.functional as F
from test_kernels_stripe import random_layer

import kernels
from kernels import stripe_triton
from kernels.stripe import _graph_ms
from kernels.stripe_halo import halo_forward

dev = torch.device("cuda")
torch.backends.cudnn.benchmark = True
LAYERS = [("vgg_40_40_32", 256, 40, 32, 40, 0.14, False), ("vgg_40_40_32_pool", 256, 40, 32, 40, 0.14, True),
          ("vgg_40_64_16", 256, 40, 16, 64, 0.15, False), ("r56_16_16_32", 256, 16, 32, 16, 0.5, False),
          ("r56_24_32_16", 256, 24, 16, 32, 0.55, False), ("r56_64_48_8", 256, 64, 8, 48, 0.55, False),
          ("c16x32_k.3", 1024, 16, 32, 16, 0.3, False), ("c16x32_k.15", 1024, 16, 32, 16, 0.15, False),
          ("c32x16_k.3", 1024, 32, 16, 32, 0.3, False), ("c32x16_k.15", 1024, 32, 16, 32, 0.15, False),
          ("c64x8_k.3", 1024, 64, 8, 64, 0.3, False), ("c64x8_k.15", 1024, 64, 8, 64, 0.15, False),
          ("vgg64x32_k.3", 1024, 64, 32, 64, 0.3, False), ("vgg64x32_k.15", 1024, 64, 32, 64, 0.15, False)]
dt = torch.bfloat16
gen = torch.Generator().manual_seed(0)
rows = []
for name, B, C, H, N, keep, pool in LAYERS:
    w, oi, off = random_layer(N, C, (3, 3), keep, gen, dtype=torch.float32)
    w, oi, off = w.to(dev, dt), oi.to(dev), off.to(dev)
    x = torch.randn(B, C, H, H, device=dev, dtype=dt).contiguous(memory_format=torch.channels_last)
    b = torch.randn(N, device=dev, dtype=dt)
    plan = kernels.stripe_plan(oi, off, N, (3, 3))
    dense = kernels.stripe_to_dense(w, oi, off, N, (3, 3), memory_format=torch.channels_last)
    ref = F.relu(F.conv2d(x.double(), dense.double(), b.double(), 1, 1))
    if pool:
        ref = F.max_pool2d(ref, 2)
    def cudnn():
        y = torch.cudnn_convolution_relu(x, dense, b, (1, 1), (1, 1), (1, 1), 1)
        return F.max_pool2d(y, 2) if pool else y
    launch = stripe_triton.prepare(x, w, oi, off, b, plan, N, [3, 3], [1, 1], [1, 1], [1, 1], True, dense=dense, pool=pool)
    row = dict(layer=name, B=B, C=C, H=H, N=N, keep=keep, S=len(oi), cudnn_ms=round(_graph_ms(cudnn, dev, 15), 4),
               default_ms=round(_graph_ms(partial(launch, x), dev, 15), 4), halo={})
    for bm in (64, 128):
        for ch in (32, 64):
            for nw in (4, 8):
                f = partial(halo_forward, x, w, oi, off, b, N, (3, 3), (1, 1), (1, 1), True, pool, BLOCK_M=bm, CHUNK=ch,
                            num_warps=nw)
                try:
                    y = f()
                except Exception as e:
                    row["halo"][f"m{bm}_c{ch}_w{nw}"] = str(e)[:60]; continue
                err = ((y.double() - ref).norm() / ref.norm()).item()
                row["halo"][f"m{bm}_c{ch}_w{nw}"] = [round(_graph_ms(f, dev, 15), 4), err]
    ok = {k: v for k, v in row["halo"].items() if isinstance(v, list) and v[1] < 1e-2}
    best = min(ok, key=lambda k: ok[k][0]) if ok else None
    print(f"{name} S={len(oi)}: cuDNN {row['cudnn_ms']:.4f} default {row['default_ms']:.4f} halo best {best} {ok[best][0] if best else '-'} | "
          + " ".join(f"{k}={v[0] if isinstance(v, list) else v}" for k, v in row["halo"].items()), flush=True)
    bad = [k for k, v in row["halo"].items() if isinstance(v, list) and v[1] >= 1e-2]
    if bad: print("   WRONG", bad, [row["halo"][k][1] for k in bad])
    rows.append(row)
json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), open(os.environ.get("OUT", "/tmp") + "/halo_bench_h200.json", "w"), indent=1)
