"""The export flow behind export.py: training checkpoint -> compact model, ONNX and reports.

    result = export_checkpoint("outputs/.../checkpoints/last.pt", "export_dir")

writes into `out_dir`: model.compact.safetensors (compress.save), model.onnx (standard ops),
report.json, report.md and stripes.png, and returns the report dict.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from compress._checks import listed, non_finite
from compress._files import json_text, lock_file, process_alive, unlock_file
from compress._trainstate import _is_safetensors, check_weight_kinds, load_checkpoint
from compress.checkpoint import load, rebuild_for, unregistered_module
from compress.checkpoint import save as save_compact
from compress.compaction import choose_modes, compact
from compress.graphs import CUDAGraphModel
from compress.models import create_model, module_names
from compress.onnx_export import STRIPE_MODES, check_onnx, check_opset, export_onnx
from compress.pix import apply_pix
from compress.profile import measure_latencies, profile
from compress.report import compact_stripes_per_layer, plot_stripes, render_markdown, report_dict
from compress.skeleton import SkeletonConv2d, check_nonnegative, check_stripe_group, skeleton_layers
from compress.surgery import is_batch_norm, replace_module

__all__ = ["load_training_checkpoint", "load_any", "export_checkpoint", "FILES"]

ONNX_TOLERANCE = 1e-4  # the largest relative onnxruntime-vs-PyTorch difference export accepts without a warning
FILES = ("model.compact.safetensors", "model.onnx", "report.json", "report.md", "stripes.png")
EXPORT_LOCK = ".export.lock"  # in `out` while an export writes there (`_staging`)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_KNOWN_CLASSES = {"digits": 10, "cifar10": 10, "cifar100": 100, "imagenet": 1000, "fake": 10}


def _arch_from_config(cfg: dict, path: Path) -> dict:
    """create_model arguments from a training config: model name/kwargs and the data geometry."""
    if not isinstance(cfg.get("data"), dict) or not isinstance(cfg.get("model"), dict) or "name" not in cfg["data"]:
        raise ValueError(f"export: {path} holds no model and data config of a train.py run (config keys: "
                         f"{sorted(cfg)}); give a checkpoints/last.pt or best.pt of a train.py run")
    data = cfg["data"]
    num_classes = data.get("num_classes") or _KNOWN_CLASSES.get(data["name"])
    if num_classes is None:
        raise ValueError(
            f"export: {path} does not record the number of classes of data {data['name']!r}; "
            "set data.num_classes in the training config"
        )
    kwargs = {
        "num_classes": int(num_classes),
        "input_size": int(data.get("input_size") or 32),
        "in_chans": int(data.get("in_chans") or 3),
        **(cfg["model"].get("kwargs") or {}),
    }
    return {"name": cfg["model"]["name"], "kwargs": kwargs}


def load_training_checkpoint(path: str | os.PathLike) -> tuple[nn.Module, dict]:
    """(skeleton model with the trained weights, training config) from a train.py checkpoint.

    The architecture comes from the checkpoint's "arch" (model.compress_arch) when present, else
    from its config, with PiX inserted where the config's `pix.zeta` is set; every conv with a `<name>.skeleton`
    tensor becomes a SkeletonConv2d. A run that fine-tuned a compact model (`init=<file>`) is rebuilt from that
    file (`_fine_tuned`)."""
    path = Path(path)
    state = load_checkpoint(path, hint="pass ckpt=<run dir>/checkpoints/last.pt (or a compact .safetensors file)")
    cfg = state["config"]
    arch = dict(state.get("arch") or _arch_from_config(cfg, path))  # a fine-tuning run's: its compact model's
    missing = unregistered_module(arch, module_names(cfg.get("imports")))
    if missing is not None:
        raise ValueError(f"export: {path}: {missing}")
    if cfg.get("init"):  # a fine-tuning run of a compact model: its structure is that file's
        return _fine_tuned(path, state, str(cfg["init"])), cfg
    pix = cfg.get("pix") or {}
    if "pix" not in arch and pix.get("zeta") is not None:  # checkpoints whose arch predates its "pix" entry
        arch["pix"] = {"zeta": int(pix["zeta"]), "tau": float(pix.get("tau", 0.5))}
    model = architecture(arch)  # as the engine built it: PiX first, then the skeletons
    group = check_stripe_group((cfg.get("prune") or {}).get("stripe_group", 1))
    for key in state["model"]:
        if key.endswith(".skeleton"):
            name = key[: -len(".skeleton")]
            replace_module(model, name, SkeletonConv2d.from_conv(model.get_submodule(name), group))
    check_weight_kinds(model, state["model"], f"export: {path}")
    try:
        model.load_state_dict(state["model"], strict=True)
    except RuntimeError as err:
        detail = " ".join(str(err).split())
        raise ValueError(f"export: the weights in {path} do not fit {arch['name']}: {detail}") from None
    return model.eval(), cfg


def _fine_tuned(path: Path, state: dict, init: str) -> nn.Module:
    """The model of a checkpoint of `train.py init=<compact file>`: the compact model's structure (from the
    checkpoint's `init_recipe`, or for older checkpoints from the file, rebuilt by `compress.load`) with the
    checkpoint's weights."""
    if state.get("init_recipe"):
        model = rebuild_for(state["init_recipe"], state["model"], f"export: init_recipe in {path}")
    elif not Path(init).is_file():
        raise FileNotFoundError(
            f"export: {path} fine-tuned the compact model {init} (init=), whose file rebuilds its structure, and it "
            "is not there; restore it at that path, or export with ckpt=<that file> for the weights before fine-tuning"
        )
    else:
        model = load(init)
    check_weight_kinds(model, state["model"], f"export: {path}")
    try:
        model.load_state_dict(state["model"], strict=True)
    except RuntimeError as err:
        detail = " ".join(str(err).split())
        raise ValueError(f"export: the weights in {path} do not fit the compact model {init}: {detail}") from None
    return model.eval()


def architecture(arch: dict) -> nn.Module:
    """A fresh model of `arch` (a `compress_arch`): `create_model(name, **kwargs)`, with PiX inserted where `arch`
    records it ("pix": {"zeta", "tau"}, written by `compress.pix.apply_pix`)."""
    model = create_model(arch["name"], **arch["kwargs"])
    pix = arch.get("pix")
    if pix is not None:
        apply_pix(model, int(pix["zeta"]), float(pix["tau"]))
    return model


def dense_baseline(dense: nn.Module, fold_bn: bool, fuse_relu: bool) -> nn.Module:
    """The dense model a report compares the compact one with, from `dense`, a fresh `architecture(arch)` (changed
    in place): in eval, with BN folded and ReLUs fused as in the compact model. Its weights are random (only its
    shapes and speed count), and every BN weight is set to 1 first: a BN that starts at 0 (`zero_init_last` of the
    CIFAR bottleneck ResNets) would fold into an all-zero conv, which compaction removes as dead filters, leaving a
    baseline smaller than the model."""
    dense.eval()
    for m in dense.modules():
        if is_batch_norm(m) and m.weight is not None:
            nn.init.ones_(m.weight)
    return compact(dense, fold_bn=True, fuse_relu=fuse_relu) if fold_bn else dense


def load_any(path: str | os.PathLike) -> tuple[nn.Module, dict]:
    """A training checkpoint (.pt) or a compact model file (safetensors, whatever its name) -> (model, training
    config or {} for a compact file)."""
    path = Path(path)
    if path.is_file() and _is_zip(path):  # torch.save's format: a training checkpoint, even named .safetensors
        return load_training_checkpoint(path)
    if path.suffix == ".safetensors" or (path.is_file() and _is_safetensors(path)):
        return load(path), {}
    return load_training_checkpoint(path)


def _is_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def _bn_folded(model: nn.Module, arch_model: nn.Module) -> bool:
    """Whether compact `model` had its BatchNorms folded: it has none left while its architecture `arch_model` has
    some."""
    def has_bn(m: nn.Module) -> bool:
        return any(is_batch_norm(x) for x in m.modules())

    return not has_bn(model) and has_bn(arch_model)


def _output_named(out: Path, path: str | os.PathLike) -> str | None:
    """The name in FILES whose file in `out` is `path` itself (however either is spelled), or None."""
    target = Path(path).resolve()
    return next((name for name in FILES if (out / name).resolve() == target), None)


def _input_size(model: nn.Module, cfg: dict) -> tuple[int, int, int]:
    """(C, H, W) the report counts at: the training run's data.input_size (an init= run may fine-tune a compact model
    at another size than it was built for), else the size a compact file was exported at (its compaction record's
    input_size), else the architecture's."""
    kwargs = model.compress_arch["kwargs"]
    record = getattr(model, "compress_compaction", None) or {}
    size = (cfg.get("data") or {}).get("input_size") or record.get("input_size") or kwargs.get("input_size", 32)
    return int(kwargs.get("in_chans", 3)), int(size), int(size)


def _check_arguments(threshold: float | None, dtype: str, stripe_mode: str, opset: int, modes_timing: str,
                     batch_size: int, repeats: int, device: str, choose_stripe_modes: bool, cuda_graphs: bool,
                     flags: dict[str, object]) -> None:
    """Reject bad export settings before anything is computed or written, naming the config key to fix. `flags`:
    the on/off settings by config key, which must be booleans (a string such as "no" would count as true)."""
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"export: {key}={value!r}; it must be true or false")
    if threshold is not None:
        try:
            check_nonnegative(threshold=threshold)
        except ValueError:
            raise ValueError(f"export: threshold={threshold!r}; it must be a finite number >= 0, or null for the "
                             "training run's prune.threshold") from None
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"export: profile.device={device!r} is not a device; use cpu, cuda or cuda:N") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"export: profile.device={device} but this machine has no usable CUDA device; set "
                         "profile.device=cpu (or leave it null)")
    if kind != "cuda" and cuda_graphs:
        raise ValueError(f"export: profile.cuda_graphs needs a CUDA device, got device {device!r}; set "
                         "profile.device=cuda on a GPU machine or profile.cuda_graphs=false")
    if kind != "cuda" and choose_stripe_modes and modes_timing == "graph":
        raise ValueError(f"export: choose_modes_timing=graph times GPU work and needs a CUDA device, got device "
                         f"{device!r}; use choose_modes_timing=auto or eager")
    if dtype not in DTYPES:
        raise ValueError(f"export: profile.dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if stripe_mode not in STRIPE_MODES:
        raise ValueError(f"export: onnx.stripe_mode must be one of {STRIPE_MODES}, got {stripe_mode!r}")
    check_opset(opset, "export: onnx.opset")
    if modes_timing not in ("auto", "eager", "graph"):
        raise ValueError(f"export: choose_modes_timing must be auto, eager or graph, got {modes_timing!r}")
    for key, value in (("profile.batch_size", batch_size), ("profile.repeats", repeats)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"export: {key}={value!r}; it must be an int >= 1")


def export_checkpoint(
    ckpt: str | os.PathLike,
    out_dir: str | os.PathLike,
    threshold: float | None = None,
    target_macs: float | None = None,
    fold_bn: bool = True,
    channel_multiple: int | None = None,
    fuse_relu: bool = True,
    choose_stripe_modes: bool = True,
    modes_timing: str = "auto",
    onnx: bool = True,
    stripe_mode: str = "dense",
    opset: int = 17,
    device: str | None = None,
    batch_size: int = 1,
    latency: bool = True,
    repeats: int = 10,
    dtype: str = "float32",
    channels_last: bool = False,
    cuda_graphs: bool = False,
) -> dict:
    """Compact the model in `ckpt` and write FILES into `out_dir`; return the report dict.

    Args:
        threshold, target_macs: compaction settings (see compress.compact); None takes the training
            config's prune.threshold / prune.target_flops (threshold 0 without one).
        fold_bn: fold BN into convs, in the compact model and (for a fair latency) the dense baseline. A compact
            file whose BN is folded already is compared with a folded baseline whatever fold_bn says.
        channel_multiple: keep shrunk convs' channel counts a multiple of this (8 for GPU deployment); None: 1, or a
            compact file's own.
        fuse_relu: with fold_bn, fold each conv's ReLU into it (compress.compact), in the compact model and the
            dense baseline alike.
        choose_stripe_modes: time each stripe conv against its dense equivalent on `device` and keep
            the faster (compress.choose_modes); otherwise the cost model's choice stays.
        modes_timing: how choose_modes compares them: "eager" (wall time of an eager call, launch overhead
            included), "graph" (GPU time, CUDA only: for deployment in CUDA graphs or torch.compile) or "auto"
            (graph with `cuda_graphs`, else eager: the way the latency report runs the model).
        onnx, stripe_mode, opset: write model.onnx (see compress.onnx_export) and check it in
            onnxruntime against PyTorch.
        device: where latency is measured (default: cuda when available, else cpu).
        batch_size, latency, repeats: latency measurement (compress.profile).
        dtype, channels_last, cuda_graphs: how both models run for the modes choice and the latency report
            ("float32" | "bfloat16" | "float16"; channels_last activations; whole forwards replayed through
            compress.CUDAGraphModel, CUDA only, for the total latencies); the saved model stays float32.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    _check_arguments(threshold, dtype, stripe_mode, opset, modes_timing, batch_size, repeats, device, choose_stripe_modes,
                     cuda_graphs, {"fold_bn": fold_bn, "fuse_relu": fuse_relu, "choose_modes": choose_stripe_modes,
                                   "onnx.enabled": onnx, "profile.latency": latency,
                                   "profile.channels_last": channels_last, "profile.cuda_graphs": cuda_graphs})
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"export: out={out} is a file; give a directory (created if missing)")
    ancestor = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"export: cannot write out={out}: {ancestor} is "
                         f"{'a file' if not ancestor.is_dir() else 'not writable'}; give a writable directory")
    written = _output_named(out, ckpt)
    if written:
        raise ValueError(f"export: out={out} would overwrite the input {ckpt} with the new {written}; give "
                         "another out=")
    model, cfg = load_any(ckpt)
    bad = non_finite(model.state_dict())
    if bad:  # (the trainer saves none since it checks at each save; an older or edited file)
        raise ValueError(f"export: the weights in {ckpt} hold NaN or inf values in {listed(bad)} (a diverged run, or "
                         "an edited file): its model would compute NaN; export an earlier checkpoint")
    init = cfg.get("init")  # the compact file an init= run fine-tuned: the user's too, never written over
    if init is not None and _output_named(out, init):
        raise ValueError(f"export: out={out} would overwrite {init}, the compact model the run fine-tuned (init=); "
                         "give another out=")
    prune = cfg.get("prune") or {}
    # a compact model (a compact file, or an init= run that fine-tuned one) was compacted before: its stripes
    # and its record (compress_compaction) stay, and only its layout options (fold_bn, ...) can change
    before = getattr(model, "compress_compaction", None)
    if before is not None and threshold is not None:
        warnings.warn(f"export: threshold={threshold} is ignored: {ckpt} holds a compact model, whose stripes were "
                      f"chosen when it was compacted (threshold {before.get('threshold')})", stacklevel=2)
    # the layers the run gave skeletons (its prune.min_kernel_size, include, exclude): the report's stripe table
    pruned_layers = skeleton_layers(model)
    has_skeletons = bool(pruned_layers)
    if before is None and not has_skeletons:  # a training checkpoint of a run without SWP (prune=none)
        trained = f"{ckpt} was trained without skeletons (prune={prune.get('name', 'none')})"
        if target_macs is not None:
            raise ValueError(f"export: target_macs={target_macs} needs stripes to choose from, and {trained}; train "
                             "with prune=swp to prune to a MAC budget")
        if threshold is not None:
            warnings.warn(f"export: threshold={threshold} has no effect: {trained}; its convs stay dense", stacklevel=2)
    if threshold is None:
        threshold = prune.get("threshold", 0.0) if prune.get("name") == "swp" else 0.0
    if target_macs is None and has_skeletons:
        target_macs = prune.get("target_flops")
    elif target_macs is None and prune.get("target_flops") is not None:
        warnings.warn(f"export: the training config's prune.target_flops={prune['target_flops']} is ignored: the "
                      "model has no skeletons to choose stripes from", stacklevel=2)
    size = _input_size(model, cfg)
    arch_model = architecture(model.compress_arch)  # the architecture before compaction
    if before is not None and _bn_folded(model, arch_model):  # its BN folded: the dense baseline folds too
        if not fold_bn:
            warnings.warn(f"export: fold_bn=false is ignored: {ckpt} holds a compact model whose BatchNorms are folded "
                          "already; export its training checkpoint with fold_bn=false to keep them", stacklevel=2)
        fold_bn = True
    if before is not None and before.get("relu_fused") and not fuse_relu:
        warnings.warn(f"export: fuse_relu=false is ignored: {ckpt} holds a compact model with {before['relu_fused']} "
                      "ReLUs fused already; export its training checkpoint with fuse_relu=false to keep them apart",
                      stacklevel=2)
        fuse_relu = True  # the dense baseline fuses as the compact model did
    fuse_relu = fuse_relu and fold_bn
    first_multiple = int(before.get("channel_multiple", 1)) if before is not None else channel_multiple or 1
    if channel_multiple is None:
        channel_multiple = first_multiple
    elif channel_multiple != first_multiple and type(channel_multiple) is int and channel_multiple >= 1:
        # its fused stripe convs are final: they would keep the first padding (compact refuses invalid values)
        warnings.warn(f"export: channel_multiple={channel_multiple} is ignored: {ckpt} holds a compact model whose "
                      f"channels were padded to multiples of {first_multiple}; export its training checkpoint with "
                      f"channel_multiple={channel_multiple}", stacklevel=2)
        channel_multiple = first_multiple
    small = compact(model, threshold=threshold if has_skeletons else None, fold_bn=fold_bn,
                    target_macs=target_macs, input_size=size, channel_multiple=channel_multiple, fuse_relu=fuse_relu)
    # a compact file's threshold and budget are its first export's (carried in its record)
    used, budget = small.compress_compaction["threshold"], small.compress_compaction["target_macs"]
    record = small.compress_compaction
    record["input_size"] = size[1]  # what the report counts at: a re-export of the file does too
    dense = dense_baseline(arch_model, fold_bn, fuse_relu)  # its conv shapes stay: the stripes are counted over them
    if record.get("dense_macs") is not None and (before or {}).get("input_size", size[1]) != size[1]:
        # compact counted `macs` at this size (an init= run fine-tuned at another data.input_size): the dense count
        # the budget compares with too, not the first export's at its size (the record said compact > dense)
        record["dense_macs"] = profile(dense, size, latency=False).macs
    memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def deployed(m: nn.Module) -> nn.Module:
        return m.to(device=device, dtype=DTYPES[dtype], memory_format=memory_format)

    xb = torch.randn(batch_size, *size, device=device, dtype=DTYPES[dtype]).contiguous(memory_format=memory_format)
    timing = modes_timing if modes_timing != "auto" else ("graph" if cuda_graphs else "eager")
    if choose_stripe_modes:  # measured as the report runs the model; the file keeps the float32 weights
        with torch.inference_mode():
            modes = choose_modes(deployed(copy.deepcopy(small)), xb, timing=timing)
        for name, mode in modes.items():
            small.get_submodule(name).mode = mode
    # a compact file's: those its first compaction recorded (files before that record: SWP's default picks)
    stripes = compact_stripes_per_layer(small, arch_model, pruned_layers or record.get("skeleton_layers"))
    del model, arch_model  # (each as large as the dense model: not held through the ONNX export and the timing)

    with _staging(out) as stage:
        save_compact(small, stage / FILES[0])
        onnx_info = None
        if onnx:
            # onnxruntime's convolutions run neither bfloat16 nor float64, and a float16 graph can only be checked
            # against the model to float16's rounding, which the centred check magnifies where outputs spread
            # little: a compact file in one of those exports as float32 (fp16 engines, e.g. TensorRT's, are built
            # from float32 ONNX models)
            weights = next(small.parameters()).dtype
            onnx_model = copy.deepcopy(small).float() if weights != torch.float32 else small
            export_onnx(onnx_model.cpu(), stage / FILES[1], size, stripe_mode=stripe_mode, opset=opset)
            probe = torch.randn(2, *size, generator=torch.Generator().manual_seed(0), device="cpu")  # the same check every export
            err = check_onnx(stage / FILES[1], onnx_model, probe)
            if not math.isfinite(err):
                warnings.warn(f"export: the ONNX check of {out / FILES[1]} got NaN or inf: the PyTorch model or "
                              "onnxruntime outputs non-finite values on random inputs (check the model's weights and "
                              "BN statistics)", stacklevel=2)
            elif err > ONNX_TOLERANCE:
                warnings.warn(f"export: {out / FILES[1]} differs from the PyTorch model by {err:.2e} (relative) in "
                              f"onnxruntime, above {ONNX_TOLERANCE:g}; check it before deploying "
                              + ("" if stripe_mode == "dense" else "(onnx.stripe_mode=dense is the plainest export)"),
                              stacklevel=2)
            onnx_info = {"file": FILES[1], "sha256": _file_sha256(stage / FILES[1]), "stripe_mode": stripe_mode,
                         "opset": opset, "max_rel_error": err,
                         "dtype": str(next(onnx_model.parameters()).dtype).removeprefix("torch.")}
        dense, small = deployed(dense), deployed(small)
        common = {"batch_size": batch_size, "device": device, "latency": latency, "repeats": repeats,
                  "memory_format": memory_format}
        dense_prof, small_prof = profile(dense, size, **common), profile(small, size, **common)
        if latency:  # the totals again, timed side by side so that machine load hits both alike
            timed = [CUDAGraphModel(m) for m in (dense, small)] if cuda_graphs else [dense, small]
            with torch.inference_mode():
                dense_prof.latency_ms, small_prof.latency_ms = measure_latencies(timed, xb, repeats=repeats)
        report = report_dict(dense_prof, small_prof, threshold=used, stripes=stripes)
        sizes = {name: (stage / name).stat().st_size for name in FILES[:2] if (stage / name).is_file()}
        report.update(source=str(ckpt), target_macs=budget, fold_bn=fold_bn, onnx=onnx_info, file_bytes=sizes,
                      run={"dtype": dtype, "channels_last": channels_last, "cuda_graphs": cuda_graphs,
                           "modes": f"chosen by {timing} timing" if choose_stripe_modes else "cost model"})
        (stage / FILES[2]).write_text(json_text(report))
        (stage / FILES[3]).write_text(render_markdown(report))
        plot_stripes(report["stripes"], stage / FILES[4])
    return report


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _written_by_earlier_export(onnx_file: Path, report_file: Path) -> bool:
    """Whether `onnx_file` is the model.onnx the export that wrote `report_file` (beside it) made, unchanged: its
    SHA-256 as that report records it (reports before the digest: its byte count)."""
    try:
        report = json.loads(report_file.read_text())
        onnx = report.get("onnx") or {}
        if "sha256" in onnx:
            return onnx["sha256"] == _file_sha256(onnx_file)
        return bool(onnx) and report["file_bytes"][FILES[1]] == onnx_file.stat().st_size
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # no report, or not an export's
        return False


class _staging:
    """`with _staging(out) as stage:` the export's files are written into `stage`, a fresh directory inside `out`
    (created if missing), and moved into `out` only when the block succeeds; any failure leaves `out` as it was
    (the folders the export created for `out` are removed again, each if empty: what another writer put there
    meanwhile stays). A model.onnx in `out` that this export does not write (onnx off) is removed with a warning
    where an earlier export wrote it (its report beside it records the file's SHA-256): it would describe another
    model; any other model.onnx stays, with a warning. The stage is named by the process id (.export-<pid>-*): the stages of exports
    killed on this host, whose process is gone, are removed. One export at a time writes into `out` (a lock,
    EXPORT_LOCK, held from start to end): two at once mixed their files, one's model beside the other's report."""

    def __init__(self, out: Path):
        self.out = out
        self.made: list[Path] = []  # the folders this export created, outermost first
        self.lock: int | None = None  # the descriptor holding EXPORT_LOCK

    def __enter__(self) -> Path:
        try:
            out = self.out.absolute()
            for folder in reversed([d for d in (out, *out.parents) if not d.exists()]):
                folder.mkdir(exist_ok=True)
                self.made.append(folder)
            self.lock = lock_file(self.out / EXPORT_LOCK)
            if self.lock is None:
                raise ValueError(f"export: out={self.out} is in use by another export.py process: two exports into one "
                                 "folder would mix their files. Give this export another out=, or wait for that one "
                                 "to end")
            for old in self.out.glob(".export-*-*"):
                pid = old.name.split("-")[1]
                if old.is_dir() and pid.isdigit() and not process_alive(int(pid)):
                    shutil.rmtree(old, ignore_errors=True)  # a killed export's
            self.stage = Path(tempfile.mkdtemp(prefix=f".export-{os.getpid()}-", dir=self.out))
        except OSError as err:
            self._unlock()
            self._remove_made()
            raise ValueError(f"export: cannot write into out={self.out} ({err.strerror or err}); give a writable "
                             "directory") from None
        return self.stage

    def _unlock(self) -> None:
        if self.lock is not None:
            unlock_file(self.out / EXPORT_LOCK, self.lock)
            self.lock = None

    def _remove_made(self) -> None:
        for folder in reversed(self.made):  # innermost first, each only if empty: another writer's files stay
            with contextlib.suppress(OSError):
                folder.rmdir()

    def __exit__(self, kind, err, tb) -> None:
        if kind is None:
            for name in FILES:
                if (self.stage / name).exists():
                    os.replace(self.stage / name, self.out / name)
                elif name == FILES[1] and (self.out / name).is_file():
                    if _written_by_earlier_export(self.out / name, self.out / FILES[2]):
                        (self.out / name).unlink()
                        warnings.warn(f"export: removed {self.out / name}, written by an earlier export into "
                                      f"{self.out} (onnx is off now)", stacklevel=3)
                    else:
                        warnings.warn(f"export: {self.out / name} was not written by an earlier export into "
                                      f"{self.out} (or changed since): left as it is, though it does not describe "
                                      "this export's model (onnx is off)", stacklevel=3)
        shutil.rmtree(self.stage, ignore_errors=True)
        self._unlock()
        if kind is not None:
            self._remove_made()

