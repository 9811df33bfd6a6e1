"""GPU training throughput: images/s on 1 and N GPUs (DDP via torchrun), dense vs Filter Skeletons.

Each configuration runs the engine's own training step (compress.engine.train_step: autocast forward,
cross-entropy, backward with the DDP all-reduce, swp_update for skeletons, SGD with momentum) in a
fresh `torchrun --standalone --nproc_per_node=N` job: ResNet-50 (224x224, 1000 classes) and ResNet-56
(32x32, 10 classes), batch 128 per GPU, bf16 autocast, channels_last. Data is fake: one random batch
that stays on the GPU, so the numbers are the training step alone, without data loading.
Skeleton runs use the paper's SWP settings (alpha 1e-5, threshold 0.01): every step pays for the
skeleton product and the SWP update, and nothing is pruned yet, so the step does the same conv work.

Targets (issue 7): ResNet-50 on 2 GPUs >= 1.8x one GPU; skeleton step <= 1.10x the dense step.
Writes benchmarks/results/train_gpu.json and prints a table naming the GPUs.

    python3 benchmarks/train_gpu.py [--gpus 1 2] [--models resnet50 resnet56] [--compile]
    python3 benchmarks/train_gpu.py --cpu-smoke   # tiny sizes, 2 CPU processes on gloo: checks the script only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

MODELS = {  # name: (input size, classes)
    "resnet50": (224, 1000),
    "resnet56": (32, 10),
}
SMOKE_SIZES = {"resnet50": 32, "resnet56": 8}
SWP = (1e-5, 0.01)  # the paper's alpha, threshold


# ---- worker (one rank of a torchrun job) ---------------------------------------------------------


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as torch_dist
    from omegaconf import OmegaConf

    from compress import engine
    from compress.models import create_model
    from compress.skeleton import attach_skeletons

    dist = engine.setup_distributed("cpu" if args.cpu else "cuda")
    torch.manual_seed(0)
    size, classes = args.size, MODELS[args.model][1]
    raw = create_model(args.model, num_classes=classes, input_size=size)
    skeleton = args.mode.startswith("skeleton")
    if skeleton:
        attach_skeletons(raw)
    cuda = dist.device.type == "cuda"
    fmt = torch.channels_last if cuda else torch.contiguous_format
    raw.to(dist.device, memory_format=fmt)
    cfg = OmegaConf.create({"trainer": {"compile": args.mode.endswith("compiled"), "compile_backend": args.backend}})
    model = engine._training_model(raw, cfg, dist)
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler(dist.device.type, enabled=False)
    amp = torch.bfloat16 if cuda else None
    step = engine._Step(model, raw, optimizer, scaler, dist.device, amp, cuda, SWP if skeleton else None)
    x = torch.randn(args.batch, 3, size, size, device=dist.device).contiguous(memory_format=fmt)
    y = torch.randint(0, classes, (args.batch,), device=dist.device)

    def timed(steps: int) -> float:
        if cuda:
            torch.cuda.synchronize()
        if dist.world_size > 1:
            torch_dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            loss, _ = engine.train_step(step, x, y)
        float(loss)  # waits for the queued steps
        return time.perf_counter() - start

    raw.train()
    timed(args.warmup)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dist.device)
    seconds = [timed(args.steps) for _ in range(args.repeats)]
    step_s = statistics.median(seconds) / args.steps
    names = [None] * dist.world_size
    name = torch.cuda.get_device_name(dist.device) if cuda else "cpu"
    if dist.world_size > 1:
        torch_dist.all_gather_object(names, name)
    else:
        names = [name]
    if dist.is_main:
        result = {
            "model": args.model, "mode": args.mode, "gpus": dist.world_size, "batch_per_gpu": args.batch,
            "input_size": size, "step_ms": step_s * 1e3, "images_per_s": dist.world_size * args.batch / step_s,
            "step_ms_all_repeats": [s / args.steps * 1e3 for s in seconds],
            "peak_memory_gib": torch.cuda.max_memory_allocated(dist.device) / 2**30 if cuda else None,
            "devices": names,
        }  # fmt: skip
        Path(args.result_file).write_text(json.dumps(result))
    engine._finish_distributed(dist)


# ---- driver --------------------------------------------------------------------------------------


def _launch(args: argparse.Namespace, model: str, mode: str, gpus: int, size: int, result_file: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
           str(Path(__file__).resolve()), "--worker", "--model", model, "--mode", mode, "--size", str(size),
           "--batch", str(args.batch), "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--repeats", str(args.repeats), "--backend", args.backend, "--result-file", str(result_file)]  # fmt: skip
    if args.cpu_smoke:
        cmd.append("--cpu")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if args.cpu_smoke else "4")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{model} {mode} on {gpus} GPU(s) failed:\n{proc.stderr[-4000:]}")
    return json.loads(result_file.read_text())


def _table(rows: list[dict]) -> str:
    dense = {(r["model"], r["gpus"], r["mode"].endswith("compiled")): r for r in rows if r["mode"].startswith("dense")}
    one = {(r["model"], r["mode"]): r for r in rows if r["gpus"] == 1}
    lines = [f"{'model':<9} {'mode':<18} {'GPUs':>4} {'batch/GPU':>9} {'step ms':>8} {'images/s':>9} "
             f"{'vs dense':>8} {'vs 1 GPU':>8} {'peak GiB':>8}"]  # fmt: skip
    for r in rows:
        base = dense.get((r["model"], r["gpus"], r["mode"].endswith("compiled")))
        single = one.get((r["model"], r["mode"]))
        vs_dense = f"{r['step_ms'] / base['step_ms']:.3f}x" if base else "-"
        vs_one = f"{r['images_per_s'] / single['images_per_s']:.2f}x" if single else "-"
        peak = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
        lines.append(f"{r['model']:<9} {r['mode']:<18} {r['gpus']:>4} {r['batch_per_gpu']:>9} {r['step_ms']:>8.1f} "
                     f"{r['images_per_s']:>9.0f} {vs_dense:>8} {vs_one:>8} {peak:>8}")  # fmt: skip
    return "\n".join(lines)


def _driver(args: argparse.Namespace) -> None:
    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("train_gpu.py needs CUDA GPUs; use --cpu-smoke to check the script on a CPU")
    if not args.cpu_smoke and max(args.gpus) > torch.cuda.device_count():
        raise SystemExit(f"--gpus {args.gpus}: only {torch.cuda.device_count()} GPU(s) visible")
    modes = ["dense", "skeleton"] + (["dense-compiled", "skeleton-compiled"] if args.compile else [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            size = SMOKE_SIZES[model] if args.cpu_smoke else MODELS[model][0]
            for gpus in args.gpus:
                for mode in modes:
                    rows.append(_launch(args, model, mode, gpus, size, Path(tmp) / f"{model}_{mode}_{gpus}.json"))
                    print(f"{model} {mode} x{gpus}: {rows[-1]['images_per_s']:.0f} images/s", flush=True)
    devices = sorted({d for r in rows for d in r["devices"]})
    table = _table(rows)
    precision = "fp32 (CPU smoke: numbers mean nothing)" if args.cpu_smoke else "bf16 autocast, channels_last"
    print(f"\ndevices: {', '.join(devices)}; torch {torch.__version__}; {precision}\n{table}")
    result = {
        "devices": devices, "torch": torch.__version__, "cpu_smoke": args.cpu_smoke,
        "settings": {"precision": "bf16 autocast" if not args.cpu_smoke else "fp32", "channels_last": not args.cpu_smoke,
                     "data": "fake, one random batch resident on the device", "swp": {"alpha": SWP[0], "threshold": SWP[1]},
                     "warmup": args.warmup, "steps": args.steps, "repeats": args.repeats, "compile_backend": args.backend},
        "rows": rows, "table": table,
    }  # fmt: skip
    out = Path(args.out or ROOT / "benchmarks" / "results" / ("train_cpu_smoke.json" if args.cpu_smoke else "train_gpu.json"))
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2], help="world sizes to run (default 1 2)")
    ap.add_argument("--batch", type=int, default=128, help="batch per GPU")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20, help="steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is reported")
    ap.add_argument("--compile", action="store_true", help="also run dense and skeleton through torch.compile")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (with --compile)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU (gloo): checks the script only")
    ap.add_argument("--out", help="JSON path (default benchmarks/results/train_gpu.json)")
    # worker-only arguments (set by the driver)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cpu_smoke and not args.worker:
        args.batch, args.warmup, args.steps, args.repeats = 2, 1, 2, 1
        args.backend = "aot_eager" if args.backend == "inductor" else args.backend
    _worker(args) if args.worker else _driver(args)


if __name__ == "__main__":
    main()
