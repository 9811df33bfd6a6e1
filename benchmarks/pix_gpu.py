"""GPU benchmark: PiX ResNet-50 (zeta 4) against ResNet-50 and the no-squeeze bound, same treatment.

The bound replaces each bottleneck's squeeze conv + BN by a channel slice (no compute, one strided read;
/work/shared/baselines/pix_bound_gpu.py): no squeeze replacement can beat it. All three models are
torchvision ResNet-50s in channels_last, 224x224, batch 64 and 256, bf16 autocast and fp32 (TF32 on for
cuDNN convs, PyTorch's default); a training step (forward, cross-entropy, backward, SGD with momentum)
and inference (eval, no_grad). Median of CUDA-event timings after warm-up. Targets: PiX >= 1.0x ResNet-50
for inference, >= 0.95x for training. Writes benchmarks/results/pix_gpu.json.

    python3 benchmarks/pix_gpu.py [--batches 64 256] [--repeats 20]
    python3 benchmarks/pix_gpu.py --cpu-smoke        # tiny sizes on CPU: checks the script, times nothing real
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from compress.pix import insert_pix  # noqa: E402
from kernels import _ext  # noqa: E402


class Slice(nn.Module):
    """The no-squeeze bound: (B, C, H, W) -> its first `width` channels, (B, width, H, W)."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, : self.width].contiguous(memory_format=torch.channels_last)


def no_squeeze(model: nn.Module) -> nn.Module:
    for layer in (model.layer1, model.layer2, model.layer3, model.layer4):
        for block in layer:
            block.conv1, block.bn1 = Slice(block.conv1.out_channels), nn.Identity()
    return model


BUILDERS = {
    "resnet50": lambda: torchvision.models.resnet50(),
    "pix_resnet50": lambda: _pix(torchvision.models.resnet50()),
    "no_squeeze_bound": lambda: no_squeeze(torchvision.models.resnet50()),
}


def _pix(model: nn.Module) -> nn.Module:
    insert_pix(model, 4)
    return model


def median_ms(fn, device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(name: str, prec: str, batch: int, size: int, device: torch.device, warmup: int, repeats: int):
    """(training step ms, inference ms) of model `name` at one precision and batch."""
    torch.manual_seed(0)
    model = BUILDERS[name]().to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=device)
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=prec == "bf16")

    def step() -> None:
        with autocast:
            loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def infer() -> None:
        with torch.no_grad(), autocast:
            model(x)

    model.train()
    train = median_ms(step, device, warmup, repeats)
    model.eval()
    inference = median_ms(infer, device, warmup, repeats)
    return train, inference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="batch 2, 64x64, 1 repeat on CPU (no JSON by default)"
    )
    ap.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/pix_gpu.json on a GPU)"
    )
    args = ap.parse_args()

    if args.cpu_smoke:
        device, args.batches, args.size, args.warmup, args.repeats = torch.device("cpu"), [2], 64, 1, 1
        kernel = "cpu path (smoke test)"
    else:
        if not torch.cuda.is_available():
            sys.exit(
                "pix_gpu.py: no CUDA device; run on a GPU machine, or pass --cpu-smoke to check the script"
            )
        device = torch.device("cuda")
        torch.backends.cudnn.benchmark = True
        kernel = "compiled CUDA extension" if _ext.load() is not None else "PyTorch fallback (no extension)"
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; kernels.pix: {kernel}")

    rows = []
    for prec in args.precisions:
        for batch in args.batches:
            ms = {n: measure(n, prec, batch, args.size, device, args.warmup, args.repeats) for n in BUILDERS}
            base = ms["resnet50"]
            row = {"precision": prec, "batch": batch}
            for n, (train, inference) in ms.items():
                row[f"{n}_train_ms"], row[f"{n}_infer_ms"] = round(train, 3), round(inference, 3)
            for n in ("pix_resnet50", "no_squeeze_bound"):
                row[f"{n}_train_speedup"] = round(base[0] / ms[n][0], 3)
                row[f"{n}_infer_speedup"] = round(base[1] / ms[n][1], 3)
            row["meets_targets"] = (
                row["pix_resnet50_infer_speedup"] >= 1.0 and row["pix_resnet50_train_speedup"] >= 0.95
            )
            rows.append(row)
            print(
                f"{prec} B={batch:<3} train ms: resnet50 {base[0]:.2f} pix {ms['pix_resnet50'][0]:.2f} "
                f"bound {ms['no_squeeze_bound'][0]:.2f} | speedup pix {row['pix_resnet50_train_speedup']:.3f}x "
                f"bound {row['no_squeeze_bound_train_speedup']:.3f}x (target >= 0.95x)\n"
                f"{'':9}infer ms: resnet50 {base[1]:.2f} pix {ms['pix_resnet50'][1]:.2f} "
                f"bound {ms['no_squeeze_bound'][1]:.2f} | speedup pix {row['pix_resnet50_infer_speedup']:.3f}x "
                f"bound {row['no_squeeze_bound_infer_speedup']:.3f}x (target >= 1.0x)",
                flush=True,
            )
    out = args.out or (None if args.cpu_smoke else str(Path(__file__).parent / "results" / "pix_gpu.json"))
    if out:
        result = {
            "benchmark": "PiX ResNet-50 (zeta 4) vs ResNet-50 vs no-squeeze bound, channels_last",
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "kernels_pix": kernel,
            "torch": torch.__version__,
            "input": [3, args.size, args.size],
            "statistic": f"median of {args.repeats} CUDA-event timings after {args.warmup} warm-up runs",
            "rows": rows,
        }
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
