"""benchmarks/_masks.py and benchmarks/stripe_models_gpu.py on the CPU: mask extraction from a train.py
checkpoint, the mask file round trip, applying masks to a fresh model, and the benchmark's --cpu-smoke path."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from compress import compact
from compress.models import create_model
from compress.skeleton import SkeletonConv2d
from compress.surgery import conv_bn_pairs

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
import _masks  # noqa: E402
import stripe_models_gpu  # noqa: E402

MASKS = {"inner": (0.5, 0.5), "outer": (0.2, 0.5)}


def _fake_run(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A train.py-style checkpoint (model state dict + resolved config) of a resnet20 with random skeletons,
    some entries just below the SWP threshold 0.01 (dropped) and some just above (kept)."""
    model = _masks.swp_like("resnet20", seed=3, masks=MASKS)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SkeletonConv2d):
                fs = m.skeleton
                small = (torch.rand(fs.shape, generator=gen) < 0.2) & (fs != 0)
                fs[small] = torch.where(torch.rand(fs.shape, generator=gen) < 0.5, 0.005, 0.02)[small]
    config = {
        "model": {"name": "resnet20"},
        "data": {"name": "digits"},
        "prune": {"name": "swp", "alpha": 1e-3, "threshold": 0.01},
        "optim": {"epochs": 1},
        "trainer": {"seed": 0},
    }
    ckpt = tmp_path / "run" / "checkpoints" / "last.pt"
    ckpt.parent.mkdir(parents=True)
    torch.save({"model": model.state_dict(), "config": config, "epoch": 1, "step": 1}, ckpt)
    return ckpt, model


def test_masks_from_checkpoint_round_trip_and_apply(tmp_path):
    ckpt, trained = _fake_run(tmp_path)
    expected = {
        n: m.skeleton.detach().abs() > 0.01
        for n, m in trained.named_modules()
        if isinstance(m, SkeletonConv2d)
    }
    masks, meta = _masks.masks_from_checkpoint(ckpt)
    assert meta["model"] == "resnet20" and meta["threshold"] == 0.01 and meta["run"]["data"] == "digits"
    assert masks.keys() == expected.keys() and all(torch.equal(masks[n], expected[n]) for n in masks)

    path = stripe_models_gpu.save_masks_cli(str(ckpt), str(tmp_path / "resnet20_digits.json"))
    assert path.stat().st_size < 20_000
    loaded, meta2 = _masks.load_masks(path)
    assert meta2["summary"]["stripes_kept"] == sum(int(m.sum()) for m in expected.values())
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[n], expected[n]) for n in loaded)

    fresh = _masks.apply_masks(create_model("resnet20", num_classes=10, input_size=32), loaded)
    applied = _masks.skeleton_masks(fresh)
    assert applied.keys() == expected.keys() and all(torch.equal(applied[n], expected[n]) for n in applied)
    pairs = conv_bn_pairs(fresh)
    for name, mask in applied.items():  # dead filters' BN zeroed, as swp_update does in training
        dead = ~mask.flatten(1).any(1)
        bn = fresh.get_submodule(pairs[name])
        assert not bn.weight[dead].any() and not bn.bias[dead].any()
    # the fresh model compacts to the same layer shapes as the trained one with its dead filters' BN zeroed
    ref = _masks.apply_masks(create_model("resnet20", num_classes=10, input_size=32), expected)
    shapes = [
        {n: tuple(p.shape) for n, p in compact(m, fold_bn=True).named_parameters()} for m in (fresh, ref)
    ]
    assert shapes[0] == shapes[1]


def test_apply_masks_rejects_wrong_names_and_shapes():
    masks = {"conv1": torch.ones(16, 3, 3, dtype=torch.bool)}
    _masks.apply_masks(create_model("resnet20", num_classes=10, input_size=32), masks)
    with pytest.raises(ValueError, match="not eligible"):
        _masks.apply_masks(create_model("resnet20", num_classes=10, input_size=32), {"nope": masks["conv1"]})
    with pytest.raises(ValueError, match="shape"):
        _masks.apply_masks(
            create_model("resnet20", num_classes=10, input_size=32), {"conv1": masks["conv1"][:8]}
        )


def test_committed_resnet56_masks_apply_exactly():
    path = BENCH / "masks" / "resnet56_digits.json"
    masks, meta = _masks.load_masks(path)
    assert meta["model"] == "resnet56" and len(masks) == meta["summary"]["layers"] == 55
    model = _masks.apply_masks(create_model("resnet56", num_classes=10, input_size=32), masks)
    applied = _masks.skeleton_masks(model)
    assert applied.keys() == masks.keys() and all(torch.equal(applied[n], masks[n]) for n in masks)
    assert sum(int(m.sum()) for m in applied.values()) == meta["summary"]["stripes_kept"]


def test_cpu_smoke_writes_report(tmp_path):
    out = tmp_path / "smoke.json"
    threads = torch.get_num_threads()
    stripe_models_gpu.main(["--cpu-smoke", "--models", "resnet56", "--variants", "real", "--out", str(out)])
    assert torch.get_num_threads() == threads
    report = json.loads(out.read_text())
    assert report["meta"]["cpu_smoke"] and len(report["results"]) == 1
    r = report["results"][0]
    assert r["model"] == "resnet56" and r["variant"] == "real"
    assert r["max_rel_error_fp32"] < 1e-5 and r["macs_cut"] > 0.5
    # the layer check ran on the stripe-mode layers (exact float32 on the CPU)
    assert r["stripe_mode_layers"] > 0 and 0 < r["max_rel_error_fp32_layers"] < 1e-5
    assert r["max_rel_error_fp32_modes"] < 1e-5
    assert (BENCH.parent / r["masks"]["file"]).is_file()
    assert r["eager"]["dense_ms"] > 0 and r["train"]["compact"]["backward_ms"] > 0 and "graphed" not in r


def test_pix_cpu_benchmark_trials(tmp_path):
    """benchmarks/pix_cpu.py at a tiny size: --trials records one ratio per trial, the row's figures pool them;
    --malloc is recorded with each model's page faults per forward. (A process of its own: --malloc keep changes
    glibc's malloc settings for the whole process; --malloc default skips only that call.)"""
    import subprocess

    out = tmp_path / "pix_cpu.json"
    r = subprocess.run([sys.executable, str(BENCH / "pix_cpu.py"), "--size", "32", "--batches", "1", "--repeats", "2",
                        "--trials", "3", "--layouts", "nchw", "--malloc", "keep", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert result["malloc"] == "keep"
    assert row["layout"] == "nchw" and row["batch"] == 1 and len(row["speedup_per_trial"]) == 3
    assert all(v > 0 for v in row["speedup_per_trial"]) and row["resnet50_ms"] > 0 and row["pix_resnet50_ms"] > 0
    assert row["resnet50_faults"] >= 0 and row["pix_resnet50_faults"] >= 0


def test_calibrated_masked_models_show_a_wrong_layer():
    """swp_like calibrates BN statistics, so that the compact model check of the benchmarks (max |compact -
    skeleton| / max |skeleton| of the logits) sees a 1% change of one stripe conv's weights; with BN's default
    statistics the masked VGG16's logits hardly depended on the input (the check passed with the convs zeroed)."""
    from compress.stripe import StripeConv2d

    skeleton = _masks.swp_like("vgg16", 0, {"inner": (0.6, 0.3), "outer": (0.3, 0.5)})
    compact_model = compact(skeleton, fold_bn=True, fuse_relu=True)
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = skeleton(x)
        assert float((compact_model(x) - ref).abs().max() / ref.abs().max()) < 1e-4
        assert float((ref - ref.mean(0)).abs().max() / ref.abs().max()) > 0.05  # the logits depend on the input
        layer = [m for m in compact_model.modules() if isinstance(m, StripeConv2d) and m.num_stripes][5]
        layer.weight.mul_(1.01)
        assert float((compact_model(x) - ref).abs().max() / ref.abs().max()) > 1e-3


GPU_SCRIPTS = ["compact_profile_gpu", "kernels_gpu", "pix_ncu_gpu", "pix_profile_gpu", "stripe_eager_gpu", "stripe_blocks_gpu", "stripe_bwd_gpu", "stripe_gpu", "stripe_narrow_stages_gpu",
               "stripe_ncu_gpu", "stripe_small_gpu", "stripe_stem_gpu", "stripe_swap_gpu", "stripe_tiles_gpu",
               "stripe_tma_probe_gpu", "unroll_probe_gpu"]


@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_gpu_benchmarks_without_cuda_say_so(script, monkeypatch):
    """Run on a machine without CUDA, each GPU benchmark stops at once with a message naming itself (not a
    traceback from deep inside its first timing), and importing it leaves the process's TF32 settings alone
    (kernels_gpu.py turned them off on import, for the rest of a test run)."""
    import importlib

    def tf32_settings():
        backends = torch.backends
        return (backends.cudnn.conv.fp32_precision, backends.cudnn.rnn.fp32_precision,
                backends.cuda.matmul.fp32_precision)

    before = tf32_settings()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", [f"{script}.py"])
    module = importlib.import_module(script)
    with pytest.raises(SystemExit, match=rf"{script}.py times GPU kernels and needs a CUDA device; none was found"):
        module.main()
    assert tf32_settings() == before


def test_pix_cpu_breakdown_runs(tmp_path):
    """benchmarks/pix_cpu_breakdown.py at 64x64, one repeat: it runs (it had crashed since pix_cpu.build took a
    max-pool argument) and finds each model's parts."""
    import subprocess

    out = tmp_path / "breakdown" / "b.json"  # a folder it has to make
    r = subprocess.run([sys.executable, str(BENCH / "pix_cpu_breakdown.py"), "--threads", "1", "--repeats", "1",
                        "--size", "64", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert result["max_pool"] == "compress" and result["size"] == 64
    r50, pix = result["rows"]["resnet50"], result["rows"]["pix_resnet50"]
    # each model's parts are found: ResNet-50's squeeze convs and no PiX block, PiX ResNet-50's PiX blocks and no
    # squeeze conv; both have the 37 shared convs and the (compress) stem pool
    assert r50["own_convs_ms"] > 0 and r50["pix_blocks_ms"] == 0 and pix["pix_blocks_ms"] > 0 and pix["own_convs_ms"] == 0
    assert all(row["shared_convs_ms"] > 0 and row["maxpool_ms"] > 0 and row["total_ms"] > 0 for row in (r50, pix))
    assert len(result["shared_conv_ms"]) == 37
    from kernels import _cpu

    assert result["cpu_kernels"] == ("C++" if _cpu.lib() is not None else "PyTorch")  # which path "ours" took


def test_check_runs_leave_the_committed_results_alone(tmp_path):
    """stripe_cpu.py --quick and pix_cpu_breakdown.py at another --size are checks: without --out they write no
    JSON (they overwrote benchmarks/results/stripe_cpu.json and pix_cpu_breakdown_nchw_1threads_b1.json); a repeat
    count of 0 is refused by the parser (it failed after the models were built)."""
    import subprocess

    results = BENCH / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.iterdir()}
    for cmd in (["stripe_cpu.py", "--quick", "--batch", "2", "--repeats", "1", "--threads", "1"],
                ["pix_cpu_breakdown.py", "--threads", "1", "--repeats", "1", "--size", "32"]):
        r = subprocess.run([sys.executable, str(BENCH / cmd[0]), *cmd[1:]], capture_output=True, text=True,
                           timeout=300, cwd=tmp_path)
        assert r.returncode == 0 and "wrote" not in r.stdout, r.stdout + r.stderr
    assert {p.name: p.stat().st_mtime_ns for p in results.iterdir()} == before
    r = subprocess.run([sys.executable, str(BENCH / "max_pool_cpu.py"), "--repeats", "0"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "argument --repeats: invalid positive int value: '0'" in r.stderr
