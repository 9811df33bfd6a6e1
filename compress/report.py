"""Dense-vs-compact reports: a markdown table, a JSON dict and a PNG of the stripes kept per layer.

    data = report_dict(dense, compact, threshold=0.01, stripes=stripes_per_layer(model, 0.01))
    text = render_markdown(data)
    plot_stripes(data["stripes"], "stripes.png")
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch.nn as nn

from compress.profile import ProfileReport, compare
from compress.skeleton import SkeletonConv2d, eligible_convs
from compress.stripe import MODES, StripeConv2d

__all__ = ["stripes_per_layer", "compact_stripes_per_layer", "report_dict", "render_markdown", "plot_stripes"]


def stripes_per_layer(model: nn.Module, threshold: float = 0.0) -> dict[str, dict]:
    """{layer: {"kept", "total"}} stripes for every SkeletonConv2d (|skeleton| > threshold) and
    StripeConv2d (its stripes out of out_channels * kh * kw, and its "mode") of `model`."""
    stripes = {}
    for name, m in model.named_modules():
        if isinstance(m, SkeletonConv2d):
            mask = m.stripe_mask(threshold)
            stripes[name] = {"kept": int(mask.sum()), "total": mask.numel()}
        elif isinstance(m, StripeConv2d):
            stripes[name] = {"kept": m.num_stripes, "total": m.out_channels * m.kernel_size[0] * m.kernel_size[1],
                             "mode": m.mode}
    return stripes


def compact_stripes_per_layer(compact: nn.Module, dense: nn.Module,
                              layers: Sequence[str] | None = None) -> dict[str, dict]:
    """{layer: {"kept", "total"}} of a compact model: over `layers` (the convs that had skeletons, where the training
    model says; else, for a compact file, the convs of `dense`, the uncompacted architecture, that SWP gives a
    skeleton by default), total = the dense conv's out_channels * kh * kw and kept = the compact layer's stripes (a
    StripeConv2d's, or every stripe of the filters a plain conv kept; 0 where the layer is gone); a StripeConv2d's
    entry also has its "mode"."""
    stripes = {}
    for name in eligible_convs(dense) if layers is None else layers:
        conv = dense.get_submodule(name)
        try:
            layer = compact.get_submodule(name)
        except AttributeError:
            layer = None
        if isinstance(layer, StripeConv2d):
            kept = layer.num_stripes
        elif isinstance(layer, nn.Conv2d):
            kept = layer.out_channels * layer.kernel_size[0] * layer.kernel_size[1]
        else:
            kept = 0
        stripes[name] = {"kept": kept, "total": conv.out_channels * conv.kernel_size[0] * conv.kernel_size[1]}
        if isinstance(layer, StripeConv2d):
            stripes[name]["mode"] = layer.mode
    return stripes


def report_dict(
    dense: ProfileReport, compact: ProfileReport, threshold: float | None, stripes: dict | None = None
) -> dict:
    """JSON-ready report: {"threshold", "dense", "compact" (ProfileReport.to_dict()), "comparison"
    (compare rows), "stripes" ({layer: {"kept", "total"} and, for a stripe conv, "mode"})}."""
    return {
        "threshold": threshold,
        "dense": dense.to_dict(),
        "compact": compact.to_dict(),
        "comparison": compare(dense, compact),
        "stripes": stripes or {},
    }


def _count(v: float | None) -> str:
    if v is None:
        return "-"
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(v) >= scale:
            return f"{v / scale:.2f} {unit}"
    return f"{v:.0f}"


def _bytes(v: float | None) -> str:
    if v is None:
        return "-"
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(v) >= scale:
            return f"{v / scale:.2f} {unit}"
    return f"{v:.0f} B"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} ms"


_TOTALS = {
    "params": ("params", _count),
    "macs": ("MACs", _count),
    "weight_bytes": ("weight bytes", _bytes),
    "activation_bytes_max": ("largest activation", _bytes),
    "activation_bytes_sum": ("sum of activations", _bytes),
    "latency_ms": ("latency", _ms),
}


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def render_markdown(report: dict) -> str:
    """Markdown with the totals side by side and a per-layer table (layers with MACs or params).

    `report` is a `report_dict` result (also after a JSON round trip)."""
    dense, compact = report["dense"], report["compact"]
    timed = dense.get("latency_ms") is not None
    threshold = report.get("threshold")
    lines = [
        "# Dense vs compact",
        "",
        f"Input {'x'.join(map(str, dense['input_size']))}, one input for counts; "
        + (f"latency: median at batch {dense['batch_size']} on {dense['device']}. " if timed else "latency not measured. ")
        + "MACs are multiply-adds (FLOPs = 2 MACs), counted by "
        f"the '{dense.get('convention', 'layers')}' convention of compress.profile. "
        f"Stripe threshold: {'-' if threshold is None else format(threshold, '.6g')}.",
        "",
    ]
    run = report.get("run")
    if run:
        lines[-1:-1] = [
            f"Both models ran in {run['dtype']}, {'channels_last' if run['channels_last'] else 'NCHW'}"
            f"{', total latency through CUDA graphs (compress.CUDAGraphModel)' if run['cuda_graphs'] else ''}; "
            f"stripe modes: {run['modes']}.",
        ]
    rows = []
    for row in report["comparison"]:
        label, fmt = _TOTALS[row["metric"]]
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}x"
        rows.append([label, fmt(row["dense"]), fmt(row["compact"]), ratio])
    lines += _table(["", "dense", "compact", "compact / dense"], rows)
    stripes = report.get("stripes") or {}
    if stripes:
        kept = sum(s["kept"] for s in stripes.values())
        total = sum(s["total"] for s in stripes.values())
        lines += ["", f"Stripes kept: {kept} / {total} ({kept / max(total, 1):.1%}) in {len(stripes)} layers (totals: "
                  "out_channels x kh x kw of each layer as the stripe table has it; export's table takes the dense "
                  "model's layers, all their filters)."]
        modes = [s["mode"] for s in stripes.values() if "mode" in s]
        if modes:
            counts = ", ".join(f"{modes.count(m)} {m}" for m in MODES if m in modes)
            lines[-1] += f" Stripe convs by mode: {counts}." + (
                " A dense-mode layer runs PyTorch's dense conv (cuDNN on CUDA) on its zero-filled weight (cut to the"
                " window of offsets that holds its stripes): it does that conv's work, not the kept-stripe MACs counted here."
                if "dense" in modes else "")
    sizes = report.get("file_bytes")
    if sizes:  # what deployment ships (the weight bytes above count stripe indices as the module holds them, int64)
        lines += ["", "Files: " + ", ".join(f"{name} {_bytes(n)}" for name, n in sizes.items()) + "."]
    onnx = report.get("onnx")
    if onnx:
        dtype = f", {onnx['dtype']}" if "dtype" in onnx else ""  # (reports written before it was recorded: none)
        lines += ["", f"ONNX: {onnx['file']} (opset {onnx['opset']}{dtype}, stripe convs as {onnx['stripe_mode']}); "
                      f"largest relative difference from PyTorch in onnxruntime {onnx['max_rel_error']:.2e}."]
    lines += ["", "## Per layer", ""]
    compact_layers = {row["name"]: row for row in compact["layers"]}
    rows = []
    for d in dense["layers"]:
        if not (d["macs"] or d["params"]):
            continue
        c = compact_layers.get(d["name"])
        s = stripes.get(d["name"])
        rows.append([
            f"`{d['name']}`",
            c["type"] if c else "removed",
            _count(d["macs"]),
            _count(c["macs"]) if c else "0",
            _count(d["params"]),
            _count(c["params"]) if c else "0",
            f"{s['kept']}/{s['total']}" if s else "-",
            s.get("mode", "-") if s else "-",
            _ms(d["latency_ms"]),
            _ms(c["latency_ms"]) if c else "-",
        ])
    lines += _table(
        ["layer", "compact type", "MACs dense", "MACs compact", "params dense", "params compact",
         "stripes kept", "mode", "latency dense", "latency compact"],
        rows,
    )
    return "\n".join(lines) + "\n"


def plot_stripes(stripes: dict[str, dict[str, int]], path: str | os.PathLike) -> Path:
    """Bar chart (PNG) of the fraction of stripes kept per layer, in model order. No layers (a model trained without
    skeletons, prune=none): the figure says so instead of showing empty axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(stripes)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.22 * len(names) + 2), 4))
    if names:
        kept = [stripes[n]["kept"] / max(stripes[n]["total"], 1) for n in names]
        ax.bar(range(len(names)), kept, color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=90, fontsize=6)
        ax.set_ylim(0, 1)
        ax.set_ylabel("fraction of stripes kept")
        total = sum(s["total"] for s in stripes.values())
        ax.set_title(f"Stripes kept per layer ({sum(s['kept'] for s in stripes.values())} / {total} in all)")
    else:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "No stripe-pruned layers: the model was trained without skeletons (prune=none)",
                ha="center", va="center")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
