"""Export a trained model: `python export.py ckpt=<run dir>/checkpoints/last.pt [key=value ...]`.

Compacts the model and writes model.compact.safetensors, model.onnx, report.md, report.json and
stripes.png into `out` (default: the Hydra run directory, with Hydra's .hydra/ record; given `out`, Hydra's run
directory is a folder in the system's temporary directory, and it is removed again after the export, as it is when
the export fails); prints the dense-vs-compact table.
Config: conf/export.yaml.
"""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import compress._run_dir  # noqa: F401  (registers conf/export.yaml's run-dir resolver before Hydra composes)
from compress._files import launch_path, remove_if_only_hydra
from compress._overrides import adding_overrides, command_line_overrides, require_sections, typed
from compress.export import FILES, export_checkpoint
from compress.models import import_modules
from compress.report import render_markdown


@hydra.main(config_path="conf", config_name="export", version_base=None)
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    out = launch_path(cfg.out) if cfg.out is not None else run_dir
    try:
        export(cfg, out)
    except BaseException:
        remove_if_only_hydra(run_dir)  # a failed export leaves no run dir of Hydra's files only
        raise
    if out.resolve() != run_dir.resolve():  # given `out`, the run dir holds only Hydra's start-up files
        remove_if_only_hydra(run_dir)  # (export has no log file: conf/export.yaml)


def _refuse_added_keys(cfg: DictConfig) -> None:
    """ValueError for a key added with '+' or '++' on the command line (`adding_overrides`): export reads only
    conf/export.yaml's keys, so an added one (a misspelling such as +profile.batchsize) would be ignored."""
    added = adding_overrides(command_line_overrides() or [])
    if added:
        known = ", ".join(sorted(str(k) for k in cfg if k not in {a.key_or_group for a in added}))
        what = "is not an export setting, so it" if len(added) == 1 else "are not export settings, so they"
        raise ValueError(f"export: {', '.join(typed(a) for a in added)} {what} would be ignored (settings: "
                         f"{known}; profile.* and onnx.* have their own keys, see conf/export.yaml); set existing keys "
                         "without '+', and check the spelling")


def export(cfg: DictConfig, out: Path) -> None:
    """Run the export of `cfg` into `out` and print the dense-vs-compact table."""
    require_sections(cfg, {"onnx": ("enabled", bool), "profile": ("latency", bool)}, "export")
    _refuse_added_keys(cfg)
    if OmegaConf.is_missing(cfg, "ckpt"):
        raise ValueError("export: give ckpt=<a train.py checkpoint (<run dir>/checkpoints/last.pt or best.pt) or a "
                         "compact model file>")
    import_modules(cfg.imports, launch_path("."))  # modules that register your own models
    report = export_checkpoint(
        launch_path(cfg.ckpt),
        out,
        threshold=cfg.threshold,
        target_macs=cfg.target_macs,
        fold_bn=cfg.fold_bn,
        channel_multiple=cfg.channel_multiple,
        fuse_relu=cfg.fuse_relu,
        choose_stripe_modes=cfg.choose_modes,
        modes_timing=cfg.choose_modes_timing,
        onnx=cfg.onnx.enabled,
        stripe_mode=cfg.onnx.stripe_mode,
        opset=cfg.onnx.opset,
        device=cfg.profile.device,
        batch_size=cfg.profile.batch_size,
        latency=cfg.profile.latency,
        repeats=cfg.profile.repeats,
        dtype=cfg.profile.dtype,
        channels_last=cfg.profile.channels_last,
        cuda_graphs=cfg.profile.cuda_graphs,
    )
    print(render_markdown(report).split("\n## Per layer")[0])
    written = [name for name in FILES if (out / name).is_file() and (name != "model.onnx" or report["onnx"])]
    print(f"wrote {', '.join(written)} to {out}")  # (a model.onnx of the user's own, with onnx off, stays unnamed)


if __name__ == "__main__":
    main()
