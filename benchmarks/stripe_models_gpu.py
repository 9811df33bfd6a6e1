"""GPU speed of whole compact models against their dense models (issue 5).

Models: CIFAR ResNet-56 and VGG16 (32x32, 10 classes, batch 256), torchvision ResNet-18 and ResNet-50
(224x224, 1000 classes, batch 128). Mask variants per model:
- "random": SWP-like random masks (benchmarks/_masks.swp_like with RANDOM_MASKS below: a share of dead filters,
  the alive filters keeping a share of their stripes);
- "grouped": the same, drawn per group of --stripe-group filters (prune.stripe_group), so that tiles of output
  channels share their kept offsets (the kernel's LISTED route);
- "real": the skeleton masks of a real SWP run on the bundled digits data (benchmarks/masks/<model>_digits.json,
  written by --save-masks), applied to a fresh seeded model (speed does not depend on the weight values).

Both sides get the same treatment: dense = compress.compact(plain model, fold_bn=True), compact =
compress.compact(skeleton model, fold_bn=True); eval, bf16 weights and activations, channels_last,
torch.inference_mode, cudnn.benchmark on. Each StripeConv2d's stripe/dense mode is measured on the device
(compress.choose_modes on the bf16 CUDA model with a real batch), once per way of running: the eager timings
use the modes chosen by eager wall time (timing="eager", launch overhead included), the CUDA-graph timings those
chosen by GPU time (timing="graph"); the cost-model default (without choose_modes) is timed too where it
differs. Times: CUDA events around one forward after a synchronize (eager, launch overhead included), warm-up,
then dense and compact interleaved, median; and the same with each model captured once in a CUDA graph
(compress.CUDAGraphModel) and replayed (launch overhead removed; *_call_ms: a whole wrapper call, input copy and
output clone included, what a user of CUDAGraphModel waits for). Backward: one training step
of each model (the same BN-folded models, so no BatchNorm in either; fp32 weights, bf16 autocast,
channels_last, train mode, StripeConv2d weights trainable), forward and backward timed apart, eager and with the
forward and the backward each replayed from a CUDA graph (torch.cuda.make_graphed_callables; the compact model
in the modes chosen by GPU time, as for the graphed inference). Eager steps run stripe-mode layers through cuDNN
(StripeConv2d._cuda_training_in_dense_mode), and so do compiled ones (--train-compile: both models through
torch.compile, inductor; result ``train_compiled``); the graphed ones through the kernel and its Triton backward.
Correctness, in fp32 on the device on a few images (cuDNN's and cuBLAS's TF32 off; the Triton stripe kernel computes
float32 in TF32), as max |a - b| / max |b|: the compact model with every layer in dense mode against the skeleton
model (``max_rel_error_fp32``: the function itself, at most TOLERANCE_FP32) and, in the timed modes, each stripe
conv's output against a float64 conv of its own input (``max_rel_error_fp32_layers``: the kernel, at most
TOLERANCE_TF32_LAYER); the script exits with an error after writing its JSON where either is exceeded. Recorded
too: the compact model in the timed modes against the skeleton model, in fp32 (``max_rel_error_fp32_modes``: TF32
rounding compounds over the layers, 0.07-1.3% on an H200 in session 44) and in bf16
(``max_rel_error_timed_vs_fp32_skeleton``). The models' BN statistics are calibrated on random images
(`_masks.calibrate_bn`), so that their outputs depend on the input and a wrong layer shows.

    python benchmarks/stripe_models_gpu.py                       # on a GPU: all models (meant to take < 3 min on
                                                                 # an H200, Triton JIT compiles of a first run included)
    python benchmarks/stripe_models_gpu.py --models resnet56 vgg16 --no-graphs --out results/x.json
    python benchmarks/stripe_models_gpu.py --cpu-smoke           # CPU check of the whole flow (tiny sizes, < 1 min)
    python benchmarks/stripe_models_gpu.py --save-masks RUN_DIR/checkpoints/last.pt   # -> benchmarks/masks/
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # the repo (compress, kernels) and benchmarks/ (_masks)
from _masks import apply_masks, calibrate_bn, load_masks, masks_from_checkpoint, save_masks, swp_like  # noqa: E402

import compress  # noqa: E402
import kernels  # noqa: E402
from compress.models import create_model  # noqa: E402
from compress.stripe import StripeConv2d  # noqa: E402

MASK_DIR = Path(HERE) / "masks"
CIFAR = {"num_classes": 10, "input_size": 32}
IMAGENET = {"num_classes": 1000, "input_size": 224}
# (share of dead filters, share of stripes kept by the alive filters) in the convs whose dead filters compaction
# removes ("inner") and in the others ("outer": residual outputs, the stem of torchvision ResNets); MACs cut at
# seed 0: ResNet-56 58.5%, VGG16 73.0%, ResNet-18 67.8%, ResNet-50 57.4% (its 1x1 convs get no skeleton)
RANDOM_MASKS = {
    "resnet56": {"inner": (0.3, 0.6), "outer": (0.1, 0.6)},
    "vgg16": {"inner": (0.3, 0.55), "outer": (0.3, 0.55)},
    "resnet18": {"inner": (0.4, 0.55), "outer": (0.1, 0.55)},
    "resnet50": {"inner": (0.7, 0.4), "outer": (0.1, 0.4)},
}
# the "grouped" variant's shares (of groups of --stripe-group filters): lower than RANDOM_MASKS' so that, with
# fewer dead filters in narrow layers (a 16-channel layer is one group of 32), the MACs cut reaches the targets';
# at seed 0 and 32 filters per group: ResNet-56 52.9%, VGG16 73.5%, ResNet-18 (224 px) 62.2%
GROUPED_MASKS = {
    "resnet56": {"inner": (0.3, 0.45), "outer": (0.1, 0.45)},
    "vgg16": {"inner": (0.35, 0.4), "outer": (0.35, 0.4)},
    "resnet18": {"inner": (0.4, 0.45), "outer": (0.1, 0.45)},
    "resnet50": RANDOM_MASKS["resnet50"],
}
MODELS = {
    "resnet56": {"kwargs": CIFAR, "batch": 256, "real": "resnet56_digits.json"},
    "vgg16": {"kwargs": CIFAR, "batch": 256, "real": "vgg16_digits.json"},
    "resnet18": {"kwargs": IMAGENET, "batch": 128, "real": "resnet18_digits.json"},
    "resnet50": {"kwargs": IMAGENET, "batch": 128, "real": None},
}
# issue 5: (MACs cut at least, speedup at least, speedup goal)
TARGETS = {"vgg16": (0.70, 2.0, 2.5), "resnet56": (0.50, 1.4, 1.6)}
SMOKE = {"batch": {"cifar": 4, "imagenet": 2}, "input_size": {"cifar": 32, "imagenet": 64}}


# ---------------------------------------------------------------------------------------------------- models
def build_skeleton(name: str, variant: str, seed: int, kwargs: dict, stripe_group: int = 32,
                   mask_file: str | None = None) -> tuple[nn.Module, dict] | None:
    """(skeleton model, mask info) for `variant` "random", "grouped" (random masks drawn per group of
    `stripe_group` filters, as prune.stripe_group trains them) or "real"; None (with a message) when the real mask
    file is missing."""
    if variant in ("random", "grouped"):
        group, shares = (stripe_group, GROUPED_MASKS[name]) if variant == "grouped" else (1, RANDOM_MASKS[name])
        return swp_like(name, seed, shares, stripe_group=group, **kwargs), {
            "random": shares,
            "seed": seed,
            "stripe_group": group,
        }
    file = mask_file or MODELS[name]["real"]
    if file is None:
        print(f"skip {name}/real: no real masks for {name} (no SWP run of it)", flush=True)
        return None
    path = MASK_DIR / file if mask_file is None else Path(mask_file).resolve()
    if not path.is_file():
        print(
            f"skip {name}/real: no mask file {path}; make it with: python train.py model={name} "
            "hydra.run.dir=<run dir> && python benchmarks/stripe_models_gpu.py --save-masks "
            "<run dir>/checkpoints/last.pt",
            flush=True,
        )
        return None
    masks, meta = load_masks(path)
    if meta["model"] != name:
        raise ValueError(f"{path} holds masks of {meta['model']}, not {name}")
    torch.manual_seed(seed)
    model = calibrate_bn(apply_masks(create_model(name, **kwargs), masks), kwargs["input_size"], seed)
    info = {
        "file": str(path.relative_to(Path(HERE).parent)),
        "source": meta.get("source"),
        "run": meta.get("run"),
        "threshold": meta.get("threshold"),
        "summary": meta.get("summary"),
        "trained_input_size": (meta.get("model_kwargs") or {}).get("input_size"),  # what trained_compact_macs counts at
    }
    return model, info


def stripe_layers(model: nn.Module) -> list[StripeConv2d]:
    return [m for m in model.modules() if isinstance(m, StripeConv2d) and m.num_stripes]


def modes_of(model: nn.Module) -> dict[str, str]:
    return {n: m.mode for n, m in model.named_modules() if isinstance(m, StripeConv2d) and m.num_stripes}


def set_modes(model: nn.Module, modes: dict[str, str]) -> None:
    for n, mode in modes.items():
        model.get_submodule(n).mode = mode


def _route_ms(route: dict) -> dict[str, float]:
    """The timings (ms) of a kernels.stripe_route result, rounded; modes it did not offer left out."""
    return {k: round(v, 4) for k, v in route.items() if k.endswith("_ms") and v is not None}


def layer_rows(model: nn.Module, eager: dict, graph: dict) -> dict[str, dict]:
    """Per stripe layer: shape, keep ratio and choose_modes' measurements (ms), eager and GPU time."""
    rows = {}
    for name, m in model.named_modules():
        if name not in eager:
            continue
        kh, kw = m.kernel_size
        rows[name] = {"C": m.in_channels, "N": m.out_channels, "keep": round(m.num_stripes / (m.out_channels * kh * kw), 3),
                      "eager_ms": _route_ms(eager[name])}
        if name in graph:
            rows[name]["gpu_ms"] = _route_ms(graph[name])
    return rows


# fp32 on the device: the compact model with every layer in dense mode against the skeleton model, and each stripe
# conv (whose kernel computes float32 in TF32, README) against float64 on its own input (the issue's TF32 bound)
TOLERANCE_FP32 = 1e-4
TOLERANCE_TF32_LAYER = 1e-3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).abs().max() / ref.abs().max())


def stripe_layer_error(model: nn.Module, x: torch.Tensor) -> float:
    """The largest `rel_err` over the model's stripe-mode layers of a forward of x: each layer's output against a
    float64 conv (+ bias, ReLU, pool) of the input it got."""
    errs = []

    def check(layer: StripeConv2d, args: tuple, out: torch.Tensor) -> None:
        ref = F.conv2d(args[0].double(), layer.dense_weight().double(),
                       None if layer.bias is None else layer.bias.double(), layer.stride, layer.padding,
                       layer.dilation)
        ref = ref.relu() if layer.relu else ref
        errs.append(rel_err(out, F.max_pool2d(ref, 2, ceil_mode=layer.pool_ceil) if layer.pool else ref))

    hooks = [m.register_forward_hook(check) for m in stripe_layers(model) if m.mode == "stripe"]
    try:
        model(x)
    finally:
        for h in hooks:
            h.remove()
    return max(errs, default=0.0)


# ---------------------------------------------------------------------------------------------------- timing
class Clock:
    """ms of fn(): CUDA events after a synchronize (so launch overhead counts, as in eager latency), or wall time
    on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1)


def interleaved(fns: dict, clock: Clock, warmup: int, repeats: int) -> dict[str, list[float]]:
    """{key: [ms] * repeats}: `warmup` untimed runs of each, then the fns in turn `repeats` times."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            times[k].append(clock(fn))
    return times


def cuda_graph(model: nn.Module, x: torch.Tensor) -> compress.CUDAGraphModel:
    """`model` wrapped in compress.CUDAGraphModel with model(x) captured (the wrapper checks a replay against the
    eager call)."""
    wrapped = compress.CUDAGraphModel(model)
    wrapped.capture(x)
    return wrapped


def train_times(
    models: dict[str, nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    clock: Clock,
    warmup: int,
    repeats: int,
    amp: torch.dtype | None,
) -> dict[str, dict[str, float]]:
    """{key: {"forward_ms", "backward_ms"}} medians of one training step each (interleaved): forward + loss,
    then loss.backward() timed apart; grads set to None before each step."""
    dev = x.device.type
    times = {k: {"forward": [], "backward": []} for k in models}
    for i in range(warmup + repeats):
        for k, model in models.items():
            model.zero_grad(set_to_none=True)
            box = {}

            def fwd(model=model, box=box):
                with torch.autocast(dev, dtype=amp, enabled=amp is not None):
                    box["loss"] = F.cross_entropy(model(x).float(), y)

            t_f = clock(fwd)
            t_b = clock(lambda box=box: box["loss"].backward())
            if i >= warmup:
                times[k]["forward"].append(t_f)
                times[k]["backward"].append(t_b)
    return {k: {f"{p}_ms": round(statistics.median(v), 3) for p, v in t.items()} for k, t in times.items()}


def graphed_for_training(model: nn.Module, x: torch.Tensor, amp: torch.dtype | None) -> nn.Module:
    """`model` (in train mode, changed in place) with its forward and its backward each captured in a CUDA graph
    (torch.cuda.make_graphed_callables, which warms up on a side stream first): a call replays the forward graph,
    loss.backward() the backward graph; the loss and the gradient accumulation stay eager."""
    with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None, cache_enabled=False):
        # allow_unused_input: a layer that kept no stripe never reads its weight
        return torch.cuda.make_graphed_callables(model, (x,), allow_unused_input=True)


def train_result(tr: dict, amp: torch.dtype | None, macs_dense: int, macs_small: int) -> dict:
    d_b, c_b = tr["dense"]["backward_ms"], tr["compact"]["backward_ms"]
    return {
        "dtype": "fp32 weights, bf16 autocast" if amp else "fp32",
        "dense": tr["dense"],
        "compact": tr["compact"],
        "backward_speedup": round(d_b / c_b, 3),
        "backward_time_per_kept_mac_vs_dense": round((c_b / macs_small) / (d_b / macs_dense), 3),
    }


# ---------------------------------------------------------------------------------------------------- bench
def bench(name: str, variant: str, args, device: torch.device) -> dict | None:
    smoke = args.cpu_smoke
    kind = "cifar" if MODELS[name]["kwargs"] is CIFAR else "imagenet"
    kwargs = dict(MODELS[name]["kwargs"])
    batch = MODELS[name]["batch"] if kind == "cifar" else args.imagenet_batch
    if kind == "cifar" and args.cifar_batch:
        batch = args.cifar_batch
    if smoke:
        batch, kwargs["input_size"] = SMOKE["batch"][kind], SMOKE["input_size"][kind]
    size = (3, kwargs["input_size"], kwargs["input_size"])
    built = build_skeleton(name, variant, args.seed, kwargs, args.stripe_group, args.mask_file)
    if built is None:
        return None
    t_start = time.perf_counter()
    skeleton, mask_info = built
    torch.manual_seed(args.seed)
    dense = compress.compact(create_model(name, **kwargs).eval(), fold_bn=True, fuse_relu=args.fuse_relu)
    small = compress.compact(skeleton, fold_bn=True, channel_multiple=args.channel_multiple, fuse_relu=args.fuse_relu)
    p_dense = compress.profile(dense, size, latency=False)
    p_small = compress.profile(small, size, latency=False)
    cost_modes = modes_of(small)
    dense32, small32 = copy.deepcopy(dense), copy.deepcopy(small)  # fp32 copies: correctness and training

    dtype = torch.float32 if smoke else torch.bfloat16
    fmt = torch.channels_last
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(batch, *size, generator=gen).to(device=device, dtype=dtype).contiguous(memory_format=fmt)
    dense.to(device=device, dtype=dtype, memory_format=fmt)
    small.to(device=device, dtype=dtype, memory_format=fmt)
    small_cost = copy.deepcopy(small)  # cost-model modes
    small_graph = copy.deepcopy(small)  # modes chosen by GPU time, for the CUDA-graph timings
    clock = Clock(device)
    t_choose = time.perf_counter()
    with torch.inference_mode():
        routes_eager, routes_graph = {}, {}  # per layer: stripe and dense ms as choose_modes measured them
        modes = compress.choose_modes(small, x, repeats=args.choose_repeats, timing="eager",
                                      report=routes_eager)  # + Triton compiles
        graph_modes = (compress.choose_modes(small_graph, x, repeats=args.choose_repeats, timing="graph",
                                             report=routes_graph) if args.graphs else None)
    t_choose = time.perf_counter() - t_choose
    set_modes(small32, modes)

    # correctness (module docstring): fp32 on the device, TF32 off but in Triton; and the bf16 compact model
    n_check = 8 if kind == "cifar" else 4
    xc = torch.randn(n_check, *size, generator=gen)
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    skeleton.to(device)  # outside inference_mode: parameters made there could never train again
    small32.to(device).eval()
    try:
        with torch.inference_mode():
            ref = skeleton(xc.to(device))
            xc32 = xc.to(device).contiguous(memory_format=fmt)
            err_modes = rel_err(small32(xc32), ref)
            err_layers = stripe_layer_error(small32, xc32)
            set_modes(small32, dict.fromkeys(modes, "dense"))
            err32 = rel_err(small32(xc32), ref)
            set_modes(small32, modes)
            err_lp = rel_err(small(xc.to(device=device, dtype=dtype).contiguous(memory_format=fmt)), ref)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    del skeleton
    if not err32 <= TOLERANCE_FP32:
        print(f"   WRONG {name}/{variant}: compact model (dense mode) differs from the skeleton model by {err32:.1e}")
    if not err_layers <= TOLERANCE_TF32_LAYER:
        print(f"   WRONG {name}/{variant}: a stripe-mode layer differs from float64 by {err_layers:.1e} (fp32)")

    # inference, eager
    fns = {"dense": partial(dense, x), "compact": partial(small, x)}
    cost_differs = cost_modes != modes
    if cost_differs:
        fns["compact_cost_model"] = partial(small_cost, x)
    with torch.inference_mode():
        eager = interleaved(fns, clock, args.warmup, args.repeats)
    med = {k: statistics.median(v) for k, v in eager.items()}
    result = {
        "model": name,
        "variant": variant,
        "masks": mask_info,
        "batch": batch,
        "input_size": list(size),
        "dense_macs": p_dense.macs,
        "compact_macs": p_small.macs,
        "macs_cut": round(1 - p_small.macs / p_dense.macs, 4),
        "dense_params": p_dense.params,
        "compact_params": p_small.params,
        "stripe_layers": len(stripe_layers(small)),
        "pool_fused": small.compress_compaction["pool_fused"],
        "stripe_mode_layers": sum(m == "stripe" for m in modes.values()),
        "stripe_mode_layers_graph": sum(m == "stripe" for m in graph_modes.values()) if graph_modes else None,
        "stripe_mode_layers_cost_model": sum(m == "stripe" for m in cost_modes.values()),
        "gemm_mode_layers": sum(m == "gemm" for m in modes.values()),
        "gemm_mode_layers_graph": sum(m == "gemm" for m in graph_modes.values()) if graph_modes else None,
        "max_rel_error_fp32": err32,
        "max_rel_error_fp32_layers": err_layers,
        "max_rel_error_fp32_modes": err_modes,
        "max_rel_error_timed_vs_fp32_skeleton": err_lp,  # the timed (bf16 on a GPU) compact model
        "eager": {
            "dense_ms": round(med["dense"], 4),
            "compact_ms": round(med["compact"], 4),
            "speedup": round(med["dense"] / med["compact"], 3),
            "compact_cost_model_ms": round(med.get("compact_cost_model", med["compact"]), 4),
            "speedup_cost_model": round(med["dense"] / med.get("compact_cost_model", med["compact"]), 3),
            "cost_model_modes_differ": cost_differs,
            "all_ms": {k: [round(t, 4) for t in v] for k, v in eager.items()},
        },
        "modes": modes,
        "graph_modes": graph_modes,
        "layers": layer_rows(small, routes_eager, routes_graph),
        "choose_modes_seconds": round(t_choose, 2),
    }

    # inference, CUDA graphs
    if args.graphs:
        try:
            with torch.inference_mode():
                wrapped = {"dense": cuda_graph(dense, x), "compact": cuda_graph(small_graph, x)}
                g_fns = {k: w.capture(x).replay for k, w in wrapped.items()}
                g_fns.update({f"{k}_call": partial(w, x) for k, w in wrapped.items()})
                graphed = interleaved(g_fns, clock, args.warmup, args.repeats)
            g = {k: statistics.median(v) for k, v in graphed.items()}
            result["graphed"] = {
                "dense_ms": round(g["dense"], 4),
                "compact_ms": round(g["compact"], 4),
                "speedup": round(g["dense"] / g["compact"], 3),
                "dense_call_ms": round(g["dense_call"], 4),
                "compact_call_ms": round(g["compact_call"], 4),
                "call_speedup": round(g["dense_call"] / g["compact_call"], 3),
                "all_ms": {k: [round(t, 4) for t in v] for k, v in graphed.items()},
            }
            del g_fns, wrapped
        except Exception as err:  # report and go on: the eager numbers stand
            result["graphed"] = {"error": f"{type(err).__name__}: {err}"}
            print(f"   {name}/{variant}: CUDA graph failed: {type(err).__name__}: {err}", flush=True)
    del dense, small, small_cost, small_graph, fns

    # training step (fine-tuning the compact model): fp32 weights, bf16 autocast
    if args.backward:
        amp = None if smoke else torch.bfloat16
        for m in (dense32, small32):
            m.to(device=device, memory_format=fmt).train()
            m.requires_grad_(True)
        xt = torch.randn(batch, *size, generator=gen).to(device).contiguous(memory_format=fmt)
        yt = torch.randint(0, kwargs["num_classes"], (batch,), generator=gen).to(device)
        tr = train_times(
            {"dense": dense32, "compact": small32},
            xt,
            yt,
            clock,
            max(1, args.warmup // 2),
            args.bwd_repeats,
            amp,
        )
        result["train"] = train_result(tr, amp, p_dense.macs, p_small.macs)
        if args.graphs:  # the same step replayed from CUDA graphs, the compact model in its GPU-time modes
            try:
                small_g = copy.deepcopy(small32)
                set_modes(small_g, graph_modes)
                graphed = {k: graphed_for_training(m, xt, amp) for k, m in (("dense", dense32), ("compact", small_g))}
                tr = train_times(graphed, xt, yt, clock, max(1, args.warmup // 2), args.bwd_repeats, amp)
                result["train_graphed"] = train_result(tr, amp, p_dense.macs, p_small.macs)
            except Exception as err:  # noqa: BLE001 - reported, the eager numbers stand
                result["train_graphed"] = {"error": f"{type(err).__name__}: {err}"}
                print(f"   {name}/{variant}: graphed training step failed: {type(err).__name__}: {err}", flush=True)
        if args.train_compile:  # the same step with both models through torch.compile (inductor); warm-up compiles
            # (modes need no setting: compiled training steps run dense mode, StripeConv2d._cuda_training_in_dense_mode)
            compiled = {"dense": torch.compile(dense32), "compact": torch.compile(small32)}
            tr = train_times(compiled, xt, yt, clock, max(2, args.warmup // 2), args.bwd_repeats, amp)
            result["train_compiled"] = train_result(tr, amp, p_dense.macs, p_small.macs)
            del compiled
    del dense32, small32
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    return result


# ---------------------------------------------------------------------------------------------------- report
def print_table(results: list[dict]) -> None:
    hdr = (f"{'model':<9} {'masks':<7} {'batch':>5} {'MACs dense':>11} {'compact':>10} {'cut':>6} {'params':>13} "
           f"{'stripe':>7} | {'eager ms dense/compact':>23} {'speedup':>7} {'(cost)':>7} | "
           f"{'graphed ms d/c, stripe':>24} {'speedup':>7} | {'bwd ms dense/compact':>21} {'bwd/MAC':>7} "
           f"{'graphed bwd ms d/c':>19} {'bwd/MAC':>7} {'err fp32':>8} {'layers':>8}")  # fmt: skip
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        e, g, t, tg = r["eager"], r.get("graphed", {}), r.get("train"), r.get("train_graphed", {})
        gs = (
            f"{g['dense_ms']:>7.3f}/{g['compact_ms']:<7.3f} {r['stripe_mode_layers_graph']:>3}/{r['stripe_layers']:<3} "
            f"{g['speedup']:>6.2f}x"
            if "speedup" in g
            else f"{'failed' if 'error' in g else 'off':>24} {'':>7}"
        )
        ts = (
            f"{t['dense']['backward_ms']:>10.3f}/{t['compact']['backward_ms']:<10.3f} "
            f"{t['backward_time_per_kept_mac_vs_dense']:>6.2f}x"
            if t
            else f"{'off':>21} {'':>7}"
        )
        tgs = (
            f"{tg['dense']['backward_ms']:>9.3f}/{tg['compact']['backward_ms']:<9.3f} "
            f"{tg['backward_time_per_kept_mac_vs_dense']:>6.2f}x"
            if "dense" in tg
            else f"{'failed' if 'error' in tg else 'off':>19} {'':>7}"
        )
        params = f"{r['dense_params'] / 1e6:.2f}M/{r['compact_params'] / 1e6:.2f}M"
        print(
            f"{r['model']:<9} {r['variant']:<7} {r['batch']:>5} {r['dense_macs'] / 1e6:>10.1f}M "
            f"{r['compact_macs'] / 1e6:>9.1f}M {r['macs_cut']:>6.1%} {params:>13} "
            f"{r['stripe_mode_layers']:>3}/{r['stripe_layers']:<3} | {e['dense_ms']:>11.3f}/{e['compact_ms']:<11.3f} "
            f"{e['speedup']:>6.2f}x {e['speedup_cost_model']:>6.2f}x | {gs} | {ts} {tgs} {r['max_rel_error_fp32']:>8.1e} "
            f"{r['max_rel_error_fp32_layers']:>8.1e}"
        )
    print(
        "stripe = StripeConv2d layers in stripe mode / all with stripes (choose_modes on the device: by eager wall "
        "time for the eager columns, by GPU time for the graphed ones); (cost) = "
        "eager speedup with the cost model's modes; bwd/MAC = backward time per kept MAC, compact vs dense (eager, "
        "then with forward and backward replayed from CUDA graphs); err fp32 = the compact model in dense mode against "
        "the skeleton model, layers = the largest error of a stripe-mode layer against float64 (fp32, TF32 kernel)"
    )
    for r in results:
        tc = r.get("train_compiled")
        if tc:
            print(
                f"{r['model']}/{r['variant']} training step with torch.compile: forward+backward ms dense "
                f"{tc['dense']['forward_ms']}+{tc['dense']['backward_ms']}, compact "
                f"{tc['compact']['forward_ms']}+{tc['compact']['backward_ms']}; backward per kept MAC "
                f"{tc['backward_time_per_kept_mac_vs_dense']:.2f}x"
            )
    for r in results:
        trained = (
            ((r["masks"].get("run") or {}).get("trained_compact_macs")) if r["variant"] == "real" else None
        )
        if trained:
            size, trained_size = r["input_size"][-1], r["masks"].get("trained_input_size")
            why = (f"counted at {trained_size} px, this row at {size} px: not comparable" if trained_size not in
                   (None, size) else "its dead filters' BN holds tiny nonzero values that compaction keeps where the "
                   "next conv pads")
            print(
                f"{r['model']}/real: masks of {r['masks']['file']} on a fresh model: {r['compact_macs'] / 1e6:.2f} M "
                f"MACs; the trained checkpoint's own compaction: {trained / 1e6:.2f} M ({why})"
            )
    for r in results:
        if r["model"] not in TARGETS:
            continue
        cut, low, goal = TARGETS[r["model"]]

        def verdict(x: float, low: float = low, goal: float = goal) -> str:
            return "goal met" if x >= goal else "target met" if x >= low else "below target"

        got = [f"eager {r['eager']['speedup']:.2f}x ({verdict(r['eager']['speedup'])})"]
        if "speedup" in r.get("graphed", {}):
            got.append(f"graphed {r['graphed']['speedup']:.2f}x ({verdict(r['graphed']['speedup'])})")
        note = "" if r["macs_cut"] >= cut else " [MACs cut below the target's]"
        print(
            f"target {r['model']}/{r['variant']}: >= {cut:.0%} MACs cut (has {r['macs_cut']:.1%}) -> >= {low}x "
            f"(goal {goal}x): {', '.join(got)}{note}"
        )


def device_slug(name: str) -> str:
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]?)\b", name)
    return m.group(1).lower() if m else re.sub(r"\W+", "_", name.lower()).strip("_")


def meta_info(device: torch.device, args) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
            "threads": torch.get_num_threads()}  # fmt: skip
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version())  # fmt: skip
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


# ---------------------------------------------------------------------------------------------------- main
def save_masks_cli(ckpt: str, out: str | None) -> Path:
    masks, meta = masks_from_checkpoint(ckpt)
    data = (meta.get("run") or {}).get("data") or "run"
    path = Path(out) if out else MASK_DIR / f"{meta['model']}_{data}.json"
    save_masks(masks, meta, path)
    s = json.loads(path.read_text())["summary"]
    print(
        f"wrote {path} ({path.stat().st_size / 1024:.1f} KiB): {meta['model']}, {s['layers']} layers, "
        f"{s['stripes_kept']}/{s['stripes_total']} stripes kept, {s['filters_dead']} dead filters, "
        f"threshold {meta['threshold']}"
    )
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--variants", nargs="+", choices=("random", "grouped", "real"), default=["random", "real"])
    p.add_argument("--mask-file", default=None,
                   help="the 'real' variant's mask file instead of benchmarks/masks/<model>_digits.json (one model)")
    p.add_argument("--stripe-group", type=int, default=32,
                   help="filters per skeleton entry in the 'grouped' variant (default 32)")
    p.add_argument("--imagenet-batch", type=int, default=128, help="batch of ResNet-18/50 (default 128)")
    p.add_argument("--cifar-batch", type=int, default=None, help="batch of ResNet-56/VGG16 (default 256)")
    p.add_argument("--repeats", type=int, default=30, help="timed forwards per model (median)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--bwd-repeats", type=int, default=10, help="timed training steps per model (median)")
    p.add_argument(
        "--choose-repeats", type=int, default=10, help="repeats per layer in compress.choose_modes"
    )
    p.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time under CUDA graphs (default: on with CUDA)",
    )
    p.add_argument(
        "--backward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time a training step's forward and backward (default: on)",
    )
    p.add_argument("--train-compile", action="store_true",
                   help="also time the training step with both models through torch.compile (result: train_compiled)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fuse-relu", action="store_true",
                   help="compress.compact(fuse_relu=True) for both models: each conv's ReLU in its epilogue "
                        "(and in the compact model a 2x2 max-pool after a stripe conv's ReLU)")
    p.add_argument("--eager-op", action="store_true",
                   help="A/B: run stripe-mode layers through the op (kernels.stripe_conv2d) in eager inference and "
                        "in choose_modes, as before StripeConv2d kept a prepared launcher")
    p.add_argument("--channel-multiple", type=int, default=8,
                   help="compress.compact(channel_multiple=...): 8 keeps shrunk convs on cuDNN's tensor-core path")
    p.add_argument(
        "--out",
        default=None,
        help="JSON file (default on a GPU: benchmarks/results/stripe_models_gpu_<gpu>.json; none on CPU)",
    )
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="run the whole flow on the CPU at tiny sizes (batch 4/2, 1-2 repeats, fp32, no graphs)",
    )
    p.add_argument(
        "--save-masks",
        metavar="CKPT",
        default=None,
        help="write the skeleton masks of a train.py checkpoint to benchmarks/masks/ and exit",
    )
    p.add_argument(
        "--masks-out", default=None, help="file for --save-masks (default masks/<model>_<data>.json)"
    )
    args = p.parse_args(argv)
    if args.mask_file and len(args.models) != 1:
        p.error("--mask-file holds one model's masks: give it with a single --models")
    return args


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.save_masks:
        save_masks_cli(args.save_masks, args.masks_out)
        return None
    if args.cpu_smoke:
        device = torch.device("cpu")
        args.repeats, args.warmup, args.bwd_repeats, args.choose_repeats = 2, 1, 1, 1
        args.graphs = False
    else:
        if not torch.cuda.is_available():
            sys.exit("stripe_models_gpu.py needs a CUDA GPU; use --cpu-smoke to check the flow on the CPU")
        device = torch.device("cuda")
        torch.backends.cudnn.benchmark = True
        if args.graphs is None:
            args.graphs = True
    if args.eager_op:  # no launcher: StripeConv2d and stripe_route fall back to the op
        kernels.prepare_stripe_conv2d = kernels.stripe.prepare_stripe_conv2d = lambda *a, **k: None
    info = meta_info(device, args)
    info["eager_op"] = args.eager_op
    print(f"# {info.get('gpu', info.get('cpu'))}, torch {info['torch']}", flush=True)
    if args.cpu_smoke:
        # the smoke checks the flow, not speed: one thread (OpenMP with 2 threads on a busy 2-core machine can
        # stall each small parallel op for ~0.1 s); restored at the end
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    results = []
    try:
        for name in args.models:
            for variant in args.variants:
                r = bench(name, variant, args, device)
                if r is not None:
                    results.append(r)
                    print(f"   {name}/{variant}: eager {r['eager']['speedup']:.2f}x"
                          + (f", graphed {r['graphed']['speedup']:.2f}x" if "speedup" in r.get("graphed", {}) else "")
                          + f" ({r['seconds']} s)", flush=True)  # fmt: skip
    finally:
        torch.set_num_threads(info["threads"])
    total = round(time.perf_counter() - t0, 1)
    print()
    print_table(results)
    if args.cpu_smoke:
        print("(CPU smoke: fp32 on the CPU at tiny sizes; the speedups and targets above mean nothing here)")
    print(f"total {total} s")
    report = {
        "meta": {
            **info,
            "dtype": "float32" if args.cpu_smoke else "bfloat16",
            "layout": "channels_last",
            "cpu_smoke": args.cpu_smoke,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "bwd_repeats": args.bwd_repeats,
            "channel_multiple": args.channel_multiple,
            "fuse_relu": args.fuse_relu,
            "protocol": "dense = compact(plain, fold_bn=True), compact = compact(skeleton, fold_bn=True, "
            "channel_multiple=<channel_multiple>); eval, "
            "inference_mode, cudnn.benchmark; choose_modes on the device; eager: CUDA events around one "
            "forward after a synchronize (launch overhead included); graphed: one CUDA graph replay; "
            "dense and compact interleaved, median; train: fp32 weights + bf16 autocast, train mode, "
            "forward+loss and backward timed apart, eager and (train_graphed) with each model's forward and backward "
            "captured by torch.cuda.make_graphed_callables",
            "total_seconds": total,
        },
        "results": results,
    }
    out = args.out
    if out is None and not args.cpu_smoke:
        out = os.path.join(HERE, "results", f"stripe_models_gpu_{device_slug(info['gpu'])}.json")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out}")
    wrong = [f"{r['model']}/{r['variant']}" for r in results
             if not (r["max_rel_error_fp32"] <= TOLERANCE_FP32 and r["max_rel_error_fp32_layers"] <= TOLERANCE_TF32_LAYER)]
    if wrong:
        raise SystemExit(f"stripe_models_gpu.py: compact models differ from their skeleton models by more than "
                         f"{TOLERANCE_FP32} in dense mode, or a stripe-mode layer from float64 by more than "
                         f"{TOLERANCE_TF32_LAYER} (fp32): {', '.join(wrong)}; their timings are not of the right "
                         "function")
    return report


if __name__ == "__main__":
    main()
