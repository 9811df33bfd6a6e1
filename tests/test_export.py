"""ONNX export of compact models (onnxruntime vs PyTorch) and the export flow / export.py on a
training checkpoint written by hand in the engine's format."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from cli import run_script
from randomize import random_bn_

import compress
from compress.checkpoint import load
from compress.compaction import compact
from compress.export import FILES, export_checkpoint, load_any
from compress.models import create_model
from compress.onnx_export import FixedAdaptiveAvgPool2d, ShiftAddConv2d, check_onnx, export_onnx
from compress.pix import PiXBlock, apply_pix
from compress.profile import profile
from compress.skeleton import SkeletonConv2d, attach_skeletons
from compress.stripe import StripeConv2d

ROOT = Path(__file__).resolve().parents[1]


def _skeleton_model(name: str, keep: float = 0.5, seed: int = 0, pix: int | None = None, **kwargs) -> nn.Module:
    """`name` (with PiX at zeta `pix` if given, inserted first as the engine does) with skeletons (about `keep` of
    the stripes kept, two dead filters per layer) and random BN statistics; conv/linear weights keep create_model's
    random init, so outputs vary with the input."""
    g = torch.Generator().manual_seed(seed)
    model = create_model(name, **kwargs)
    if pix is not None:
        apply_pix(model, pix)
    attach_skeletons(model)
    with torch.no_grad():
        for pname, t in model.named_parameters():
            if pname.endswith("skeleton"):
                t.copy_((torch.rand(t.shape, generator=g) < keep) * (0.5 + torch.rand(t.shape, generator=g)))
                t[:2] = 0
    return random_bn_(model, g).eval()


def _assert_same_function(got: torch.Tensor, want: torch.Tensor) -> None:
    """got == want to 1e-5 of max|want|, and the batch-centred outputs (the input-dependent part) to 1e-4."""
    assert float(want.std(0).max()) > 1e-3 * float(want.abs().max()), "test output barely depends on the input"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    centred = want - want.mean(0)
    torch.testing.assert_close(got - got.mean(0), centred, rtol=0, atol=1e-4 * float(centred.abs().max()))


@pytest.mark.parametrize(
    "name, keep",
    [("resnet56", 0.3), ("vgg16", 0.7), ("resnet18", 0.4), pytest.param("resnet50", 0.5, marks=pytest.mark.slow)],
)
def test_onnx_of_compact_model_matches_pytorch(name, keep, tmp_path):
    skeleton = _skeleton_model(name, keep, input_size=32)  # torchvision ResNet-50 at 32x32 for speed
    small = compact(skeleton)
    assert any(isinstance(m, StripeConv2d) for m in small.modules())
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = skeleton(x)
        _assert_same_function(small(x), want)
    path = export_onnx(small, tmp_path / "m.onnx", (3, 32, 32))
    assert check_onnx(path, skeleton, x) <= 1e-4


def test_check_onnx_warns_when_the_output_ignores_the_input(tmp_path):
    """A model whose output is the same for every input (zero conv weights: only biases reach it) passes any check
    of its outputs; check_onnx says that its comparison proves little then."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5)).eval()
    with torch.no_grad():
        model[0].weight.zero_()
    path = export_onnx(model, tmp_path / "flat.onnx", (3, 8, 8))
    with pytest.warns(UserWarning, match=r"check_onnx: the model gives \(nearly\) the same output for each of the 3"):
        assert check_onnx(path, model, torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))) <= 1e-4
    # a compact model whose budget left a layer on the only path without stripes: the warning names it (and the layer
    # before, whose filters all became dead)
    skeleton = nn.Sequential(SkeletonConv2d(3, 4, 3), nn.ReLU(), SkeletonConv2d(4, 4, 3, bias=True), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5)).eval()
    with torch.no_grad():
        skeleton[2].skeleton.zero_()
    small = compact(skeleton)
    cut = export_onnx(small, tmp_path / "cut.onnx", (3, 8, 8))
    with pytest.warns(UserWarning, match=r"check_onnx: the model gives \(nearly\) the same output .* its stripe convs 0, 2 "
                                         r"kept no stripe \(their output is their bias alone"):
        check_onnx(cut, small, torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(2)))
    with torch.no_grad():
        model[0].weight.normal_()
    live = export_onnx(model, tmp_path / "live.onnx", (3, 8, 8))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="check_onnx")
        assert check_onnx(live, model, torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(1))) <= 1e-4


def test_onnx_of_a_train_mode_model_uneven_pools_and_check_onnx_sees_biases(tmp_path):
    """export_onnx of a model left in train mode exports its BN statistics as they are (its probe forward runs a
    copy in eval mode); an adaptive pool whose windows do not divide the map (7 from 14x10) exports as fixed windows;
    check_onnx sees a wrong output bias (a constant offset the batch-centred error leaves out)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(7),
                          nn.Flatten(), nn.Linear(8 * 49, 5))
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1), model[1].running_var.uniform_(0.5, 2)
    model.train()
    x = torch.randn(4, 3, 14, 10)
    path = export_onnx(model, tmp_path / "m.onnx", (3, 14, 10))
    assert check_onnx(path, model, x) <= 1e-4
    with torch.no_grad():
        model[5].bias += 1.0
    assert check_onnx(path, model, x) > 1e-2


def test_check_onnx_feeds_a_float16_graph_its_dtype(tmp_path):
    """export_onnx writes a float16 model as a float16 graph; check_onnx feeds it float16 inputs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).half().eval()
    x = torch.randn(2, 3, 12, 12).half()
    assert check_onnx(export_onnx(model, tmp_path / "h.onnx", (3, 12, 12)), model, x) < 1e-2


@pytest.mark.parametrize("stride, padding, dilation", [(1, 1, 1), (2, 1, 1), (2, 2, 2), (1, 0, 1)])
def test_shift_add_conv_equals_stripe_conv(stride, padding, dilation):
    conv = nn.Conv2d(5, 7, 3, stride=stride, padding=padding, dilation=dilation, bias=True)
    mask = torch.rand(7, 3, 3) < 0.5
    mask[3] = False  # a dead filter: its output is the bias only
    stripe = StripeConv2d.from_dense(conv, mask).eval()
    x = torch.randn(2, 5, 11, 9)
    with torch.no_grad():
        torch.testing.assert_close(ShiftAddConv2d(stripe)(x), stripe(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel, stride, padding, dilation", [((1, 3), 1, (0, 1), 1), ((3, 1), (2, 1), (1, 0), 1),
                                                               ((3, 3), (1, 2), (1, 2), (1, 2))])
def test_shift_add_conv_of_non_square_geometry_and_a_fused_ceil_pool(kernel, stride, padding, dilation):
    """The shift-add form against F.conv2d on the masked weight where height and width differ in kernel, stride,
    padding or dilation (each swapped in turn crashed or shifted it), and with the ReLU and the 2x2 ceil-mode pool
    fused on an odd map (a floor pool gave 4x4 where the stripe conv gives 5x5)."""
    gen = torch.Generator().manual_seed(0)
    conv = nn.Conv2d(5, 6, kernel, stride=stride, padding=padding, dilation=dilation).double()
    mask = torch.rand(6, *conv.kernel_size, generator=gen) < 0.6
    stripe = StripeConv2d.from_dense(conv, mask).eval()
    x = torch.randn(2, 5, 9, 10, generator=gen, dtype=torch.float64)
    masked = conv.weight * mask.unsqueeze(1)
    want = F.conv2d(x, masked, conv.bias, conv.stride, conv.padding, conv.dilation)
    with torch.no_grad():
        torch.testing.assert_close(ShiftAddConv2d(stripe)(x), want, rtol=1e-12, atol=1e-12)
        dense, kept = nn.Conv2d(5, 6, 3, padding=1).double(), torch.rand(6, 3, 3, generator=gen) < 0.6
        square = StripeConv2d.from_dense(dense, kept)
        square.relu, square.pool, square.pool_ceil = True, True, True
        odd = torch.randn(2, 5, 9, 9, generator=gen, dtype=torch.float64)
        fused = ShiftAddConv2d(square.eval())(odd)
        want = F.max_pool2d(F.conv2d(odd, dense.weight * kept.unsqueeze(1), dense.bias, padding=1).relu(), 2,
                            ceil_mode=True)
        assert fused.shape == want.shape == (2, 6, 5, 5)
        torch.testing.assert_close(fused, want, rtol=1e-12, atol=1e-12)


def test_onnx_export_of_an_op_torch_onnx_lacks_says_how_to_export_without_it(tmp_path):
    """An op torch.onnx cannot express (antialiased resizing here) gives an error naming the op and the way out,
    not torch.onnx's graph dump."""

    class Resized(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return nn.functional.interpolate(self.conv(x), scale_factor=0.5, mode="bilinear", antialias=True)

    with pytest.raises(ValueError, match=r"cannot export this model at input size \(3, 16, 16\) \(opset 17\): "
                                         r"Exporting the operator 'aten::_upsample_bilinear2d_aa'.*onnx.enabled=false"):
        export_onnx(Resized().eval(), tmp_path / "m.onnx", (3, 16, 16))
    # a BN without running statistics (torch.onnx fails an assert after printing the graph) and a float64 model
    # (onnxruntime has no float64 conv on the CPU) are named before torch.onnx runs
    no_stats = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False)).eval()
    with pytest.raises(ValueError, match=r"export_onnx: 1: a BatchNorm without running statistics .*onnx.enabled=false"):
        export_onnx(no_stats, tmp_path / "m.onnx", (3, 16, 16))
    conv = nn.Sequential(nn.Conv2d(3, 4, 3)).eval()  # arguments named before torch.onnx runs
    for kwargs, message in [({"opset": 99}, r"opset=99; use an opset from 13 to"),
                            ({"input_size": (16, 16)}, r"input_size must be \(C, H, W\) of one image.*\(16, 16\)"),
                            ({"input_size": (1, 3, 16, 16)}, "input_size must be"), ({"input_size": 16}, "input_size")]:
        with pytest.raises(ValueError, match=message):
            export_onnx(conv, tmp_path / "m.onnx", **{"input_size": (3, 16, 16), **kwargs})
    with pytest.raises(ValueError, match=r"the model \(ReLU\) has no parameters"):
        export_onnx(nn.ReLU(), tmp_path / "m.onnx", (3, 16, 16))
    for dtype in (torch.float64, torch.bfloat16):
        with pytest.raises(ValueError, match=rf"export_onnx: the model is {str(dtype)[6:]}.*\.float\(\)"):
            export_onnx(nn.Sequential(nn.Conv2d(3, 4, 3)).to(dtype), tmp_path / "m.onnx", (3, 16, 16))
    assert not (tmp_path / "m.onnx").exists()


class _TwoHeads(nn.Module):
    """A compact-able net returning (logits, {"features": pooled, "map": a feature map}): several outputs."""

    def __init__(self, num_classes: int = 10, in_chans: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(in_chans, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        f = self.bn(self.conv(x)).relu()
        pooled = f.mean((2, 3))
        return self.fc(pooled), {"features": pooled, "map": f}


@compress.register_model
def _test_two_heads_net(num_classes=10, in_chans=3):
    return _TwoHeads(num_classes, in_chans)


def test_onnx_of_a_model_with_several_outputs(tmp_path):
    """A model returning a tuple/dict of tensors: export_onnx gave only the first output a dynamic batch, and
    check_onnx (so export.py with ONNX on) failed with "too many values to unpack". Each tensor is an output now
    ("output", "output1", ...; batch dynamic in all), compared one by one; an output torch.onnx cannot take (a
    dataclass) is named before it runs, and a file with other outputs than the model is refused."""
    import dataclasses

    model = create_model("_test_two_heads_net", num_classes=4, input_size=8)
    compress.attach_skeletons(model)
    random_bn_(model, torch.Generator().manual_seed(0))
    small = compact(model.eval(), fold_bn=True)
    path = export_onnx(small, tmp_path / "m.onnx", (3, 8, 8))
    import onnx

    assert [o.name for o in onnx.load(str(path)).graph.output] == ["output", "output1", "output2"]
    assert check_onnx(path, small, torch.randn(3, 3, 8, 8)) < 1e-5  # (exported at batch 1: checked at 3)
    with torch.no_grad():  # an error in the last output alone is seen
        wrong = copy.deepcopy(small)
        wrong.conv.bias += 1.0
    assert check_onnx(path, wrong, torch.randn(3, 3, 8, 8)) > 1e-2
    with pytest.raises(ValueError, match=r"m.onnx has 3 outputs and the model returns 1 tensors"):
        check_onnx(path, nn.Sequential(small.conv, nn.Flatten()), torch.randn(3, 3, 8, 8))


    class WithScalar(nn.Module):  # an output without the batch dimension: compared as it is, no "flat" warning
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            y = self.conv(x)
            return y.mean((2, 3)), y.sum()

    scalar = WithScalar().eval()
    scalar_path = export_onnx(scalar, tmp_path / "s.onnx", (3, 8, 8))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="check_onnx")
        assert check_onnx(scalar_path, scalar, torch.randn(3, 3, 8, 8)) < 1e-5

    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return Output(self.conv(x))

    with pytest.raises(ValueError, match=r"export_onnx: the model returns Output; ONNX export takes a tensor, or a "
                                         r"tuple, list or dict of tensors.*onnx.enabled=false"):
        export_onnx(Wrapped().eval(), tmp_path / "d.onnx", (3, 8, 8))
    assert not (tmp_path / "d.onnx").exists()
    compress.save(small, tmp_path / "small.safetensors")
    export_checkpoint(tmp_path / "small.safetensors", tmp_path / "out", latency=False)  # (checks its ONNX file)
    assert "onnxruntime" in (tmp_path / "out" / FILES[3]).read_text()


def test_onnx_shift_mode_uses_no_stripe_ops(tmp_path):
    import onnx

    convs = [nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.Conv2d(8, 6, 3, padding=2, dilation=2)]
    model = nn.Sequential(
        StripeConv2d.from_dense(convs[0], torch.rand(8, 3, 3) < 0.4), nn.ReLU(),
        StripeConv2d.from_dense(convs[1], torch.rand(6, 3, 3) < 0.6),
    ).eval()  # fmt: skip
    path = export_onnx(model, tmp_path / "m.onnx", (3, 16, 16), stripe_mode="shift")
    graph = onnx.load(str(path)).graph
    assert all(node.domain in ("", "ai.onnx") for node in graph.node)  # standard ops only
    weights = {init.name: list(init.dims) for init in graph.initializer}
    convs = [node for node in graph.node if node.op_type == "Conv"]
    assert len(convs) == 2 and all(weights[node.input[1]][2:] == [1, 1] for node in convs)  # 1x1 convs
    assert {"Slice", "Gather"} <= {node.op_type for node in graph.node}
    assert check_onnx(path, model, torch.randn(4, 3, 16, 16)) <= 1e-4


def test_bad_stripe_mode_is_clear(tmp_path):
    with pytest.raises(ValueError, match="stripe_mode must be one of"):
        export_onnx(nn.Sequential(nn.Conv2d(3, 3, 1)), tmp_path / "m.onnx", (3, 4, 4), stripe_mode="sparse")


# ---- export flow on a training checkpoint ---------------------------------------------------------------


@pytest.fixture(scope="module")
def training_checkpoint(tmp_path_factory):
    """A resnet20 skeleton checkpoint with the keys and config layout of compress.engine."""
    model = _skeleton_model("resnet20", keep=0.5, seed=1, num_classes=10, input_size=32)
    config = {
        "model": {"name": "resnet20", "kwargs": {}},
        "data": {"name": "digits", "input_size": 32, "batch_size": 64},
        "prune": {"name": "swp", "alpha": 1e-5, "threshold": 0.01, "target_flops": None,
                  "min_kernel_size": 2, "include": None, "exclude": None},
    }  # fmt: skip
    path = tmp_path_factory.mktemp("run") / "checkpoints" / "last.pt"
    path.parent.mkdir()
    torch.save({"model": model.state_dict(), "config": config, "epoch": 1, "step": 10}, path)
    return path, model


def test_the_dense_baseline_is_folded_and_fused_as_the_compact_model(tmp_path):
    """The report's dense baseline gets the compact model's treatment: BN folded and each conv's ReLU fused (a
    baseline left unfused ran separate ReLUs: a speedup that was not the pruning's)."""
    model = _skeleton_model("vgg11", num_classes=10, input_size=32)
    config = {"model": {"name": "vgg11", "kwargs": {}}, "data": {"name": "digits", "input_size": 32, "batch_size": 8},
              "prune": {"name": "swp", "alpha": 1e-5, "threshold": 0.01, "target_flops": None}}
    path = tmp_path / "last.pt"
    torch.save({"model": model.state_dict(), "config": config, "epoch": 1, "step": 1}, path)
    data = export_checkpoint(path, tmp_path / "out", onnx=False, latency=False, choose_stripe_modes=False)
    dense = [row["type"] for row in data["dense"]["layers"]]
    assert "ReLU" not in dense and "BatchNorm2d" not in dense and dense.count("Conv2dReLU") == 8  # vgg11's 8 convs


def test_export_of_a_swp_pix_run_keeps_pix_and_a_full_dense_baseline(tmp_path):
    """A SWP + PiX checkpoint (CIFAR resnet29_bottleneck, zeta 4; config as compress.engine writes it, no "arch"):
    export rebuilds PiX before the skeletons, the compact model keeps the PiX blocks and computes the skeleton
    model's function, and the dense baseline is the whole PiX architecture (its MACs those of a fresh PiX model:
    the zero-initialised last BNs of this family must not fold into convs that compaction removes)."""
    model = _skeleton_model("resnet29_bottleneck", keep=0.5, seed=3, pix=4, num_classes=10, input_size=32)
    config = {
        "model": {"name": "resnet29_bottleneck", "kwargs": {}},
        "data": {"name": "fake", "input_size": 32, "num_classes": 10, "batch_size": 64},
        "prune": {"name": "swp", "alpha": 1e-5, "threshold": 0.01, "target_flops": None},
        "pix": {"zeta": 4, "tau": 0.5},
    }  # fmt: skip
    path = tmp_path / "last.pt"
    torch.save({"model": model.state_dict(), "config": config, "epoch": 1, "step": 10}, path)
    report = export_checkpoint(path, tmp_path / "out", latency=False, choose_stripe_modes=False)
    small = load(tmp_path / "out" / FILES[0])
    assert sum(isinstance(m, PiXBlock) for m in small.modules()) == 9
    assert small.compress_arch["pix"] == {"zeta": 4, "tau": 0.5}
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        _assert_same_function(small(x), model(x))
    fresh = create_model("resnet29_bottleneck", num_classes=10, input_size=32)
    apply_pix(fresh, 4)
    assert report["dense"]["macs"] == profile(fresh.eval(), (3, 32, 32), latency=False).macs
    assert report["compact"]["macs"] < 0.7 * report["dense"]["macs"]
    assert report["onnx"]["max_rel_error"] <= 1e-4


def test_export_of_a_fine_tuning_run_rebuilds_the_compact_structure(training_checkpoint, tmp_path):
    """A checkpoint of `train.py init=<compact file>` holds a compact model's weights: export rebuilds that file's
    structure, so the exported model computes the fine-tuned function; without the file the error names it."""
    _, skeleton = training_checkpoint
    small = compact(skeleton, fold_bn=True)
    init = tmp_path / "init.safetensors"
    compress.save(small, init)
    with torch.no_grad():
        for prm in small.parameters():
            prm.mul_(1.5)  # "fine-tuned" weights, unlike the init file's
    config = {"model": {"name": "resnet20", "kwargs": {}}, "data": {"name": "digits", "input_size": 32},
              "prune": {"name": "none"}, "init": str(init)}  # fmt: skip
    path = tmp_path / "last.pt"
    torch.save({"model": small.state_dict(), "config": config, "epoch": 1, "step": 3}, path)
    report = export_checkpoint(path, tmp_path / "out", onnx=False, latency=False, choose_stripe_modes=False)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        _assert_same_function(load(tmp_path / "out" / FILES[0])(x), small.eval()(x))
    # stripes counted over the dense layers, as for the init file itself (also the layers it kept whole)
    from_init = export_checkpoint(init, tmp_path / "out_init", onnx=False, latency=False, choose_stripe_modes=False)
    assert report["stripes"] == from_init["stripes"] and len(report["stripes"]) == 19
    init.unlink()
    with pytest.raises(FileNotFoundError, match="init.safetensors"):
        export_checkpoint(path, tmp_path / "out2", onnx=False, latency=False)


def test_a_checkpoint_without_skeletons_says_what_its_options_do(tmp_path):
    """A prune=none run's checkpoint: threshold= warns that it changes nothing, target_macs= is refused pointing at
    prune=swp (not at the training checkpoint the user gave); a hand-made file without a run's config is refused
    naming what it lacks (a KeyError before)."""
    model = create_model("resnet20", num_classes=10, input_size=32)
    config = {"model": {"name": "resnet20", "kwargs": {}}, "data": {"name": "digits", "input_size": 32},
              "prune": {"name": "none"}}
    path = tmp_path / "last.pt"
    torch.save({"model": model.state_dict(), "config": config, "epoch": 1, "step": 1}, path)
    with pytest.warns(UserWarning, match=r"threshold=0.5 has no effect: .*last.pt was trained without skeletons "
                                         r"\(prune=none\); its convs stay dense"):
        export_checkpoint(path, tmp_path / "a", threshold=0.5, onnx=False, latency=False, choose_stripe_modes=False)
    with pytest.raises(ValueError, match=r"target_macs=0.5 needs stripes to choose from, and .* \(prune=none\); "
                                         r"train with prune=swp"):
        export_checkpoint(path, tmp_path / "b", target_macs=0.5, onnx=False, latency=False)
    torch.save({"model": model.state_dict(), "config": {}}, path)
    with pytest.raises(ValueError, match=r"holds no model and data config of a train.py run \(config keys: \[\]\)"):
        export_checkpoint(path, tmp_path / "c", onnx=False, latency=False)


def test_a_killed_exports_staging_folder_is_removed_by_the_next_export(training_checkpoint, tmp_path):
    """An export stages its files in <out>/.export-<pid>-*; one killed mid-way left that folder (the size of the
    files) for good. The next export into the same out removes the stages of processes that are gone, not those of
    a live one."""
    path, _ = training_checkpoint
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, live = tmp_path / f".export-{int(gone.stdout)}-abc", tmp_path / f".export-{os.getpid()}-xyz"
    for stage in (dead, live):
        stage.mkdir()
        (stage / "model.compact.safetensors").write_bytes(b"partial")
    export_checkpoint(path, tmp_path, onnx=False, latency=False, choose_stripe_modes=False)
    assert not dead.exists() and live.is_dir()
    assert (tmp_path / "model.compact.safetensors").is_file()


def test_an_export_into_an_out_another_export_writes_is_refused(training_checkpoint, tmp_path):
    """Two exports into one out at once left one's model beside the other's report (both exiting 0); while one
    holds out's lock the other is refused, naming the folder, and writes nothing. The lock goes with its export."""
    from compress._files import lock_file, unlock_file
    from compress.export import EXPORT_LOCK

    path, _ = training_checkpoint
    out = tmp_path / "X"
    out.mkdir()
    fd = lock_file(out / EXPORT_LOCK)  # another export, running
    try:
        with pytest.raises(ValueError, match=rf"out={re.escape(str(out))} is in use by another export.py process"):
            export_checkpoint(path, out, onnx=False, latency=False, choose_stripe_modes=False)
        assert sorted(p.name for p in out.iterdir()) == [EXPORT_LOCK]
    finally:
        unlock_file(out / EXPORT_LOCK, fd)
    export_checkpoint(path, out, onnx=False, latency=False, choose_stripe_modes=False)
    assert (out / "model.compact.safetensors").is_file() and not (out / EXPORT_LOCK).exists()


def test_a_training_checkpoint_named_safetensors_is_read_as_one(training_checkpoint, tmp_path):
    """Files are recognised by their content: a torch.save training checkpoint renamed *.safetensors exports (its
    error once suggested the very command that failed)."""
    path, skeleton = training_checkpoint
    renamed = tmp_path / "ck.safetensors"
    renamed.write_bytes(path.read_bytes())
    model, cfg = load_any(renamed)
    assert cfg["model"]["name"] == "resnet20"
    assert model.state_dict().keys() == skeleton.state_dict().keys()


def test_export_flow(training_checkpoint, tmp_path):
    path, skeleton = training_checkpoint
    report = export_checkpoint(path, tmp_path, latency=False, choose_stripe_modes=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(FILES)
    small = load(tmp_path / FILES[0])
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = skeleton(x)
        _assert_same_function(small(x), want)
    assert report["onnx"]["max_rel_error"] <= 1e-4
    assert check_onnx(tmp_path / FILES[1], skeleton, x) <= 1e-4
    data = json.loads((tmp_path / FILES[2]).read_text())
    assert data["threshold"] == 0.01
    for side in ("dense", "compact"):
        for key in ("params", "macs", "weight_bytes", "activation_bytes", "latency_ms", "device", "layers"):
            assert key in data[side], (side, key)
        assert set(data[side]["activation_bytes"]) == {"max", "sum"}
        assert {"params", "macs", "weight_bytes", "activation_bytes"} <= set(data[side]["layers"][0])
    assert data["dense"]["macs"] == 40551040  # resnet20 at 32x32, conv + linear
    kept = sum(s["kept"] for s in data["stripes"].values()) / sum(s["total"] for s in data["stripes"].values())
    assert 0.3 < kept < 0.6
    assert data["compact"]["macs"] < 0.6 * data["dense"]["macs"]
    text = (tmp_path / FILES[3]).read_text()
    ratio = data["compact"]["macs"] / data["dense"]["macs"]  # compact / dense: below 1 (its inverse read as growth)
    assert f"| MACs | 40.55 M | {data['compact']['macs'] / 1e6:.2f} M | {ratio:.3f}x |" in text
    pruned = next(name for name, s in data["stripes"].items() if s["kept"] < s["total"])
    assert re.search(rf"\| `{re.escape(pruned)}` \| StripeConv2d \|", text)  # the compact layer's type, not the dense's
    n_kept, n_total = (sum(s[key] for s in data["stripes"].values()) for key in ("kept", "total"))
    assert f"Stripes kept: {n_kept} / {n_total} ({n_kept / n_total:.1%}) in {len(data['stripes'])} layers (totals: " in text
    assert data["file_bytes"] == {name: (tmp_path / name).stat().st_size for name in FILES[:2]}  # the ONNX file too
    assert (tmp_path / FILES[4]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the compact file exported again reports the same stripes, over the dense layers (two filters per layer died)
    again = export_checkpoint(tmp_path / FILES[0], tmp_path / "again", onnx=False, latency=False,
                              choose_stripe_modes=False)  # modes by the cost model, as above (timed ones vary)
    assert again["stripes"] == data["stripes"]
    # asked not to fold, it still compares the (folded) compact file with a folded dense baseline
    with pytest.warns(UserWarning, match="fold_bn=false is ignored"):
        unfolded = export_checkpoint(tmp_path / FILES[0], tmp_path / "again2", onnx=False, latency=False,
                                     fold_bn=False)
    assert unfolded["dense"]["params"] == again["dense"]["params"] == data["dense"]["params"]
    # the input file is never the output; an ONNX file of an earlier export is not left beside a new model
    before = (tmp_path / FILES[0]).read_bytes()
    with pytest.raises(ValueError, match="would overwrite the input"):
        export_checkpoint(tmp_path / FILES[0], tmp_path, onnx=False, latency=False)
    assert (tmp_path / FILES[0]).read_bytes() == before
    named_as_output = tmp_path / "other" / FILES[2]  # inputs are known by content: any output name could be one
    named_as_output.parent.mkdir()
    named_as_output.write_bytes(before)
    with pytest.raises(ValueError, match="would overwrite the input .*report.json with the new report.json"):
        export_checkpoint(named_as_output, named_as_output.parent, onnx=False, latency=False)
    assert named_as_output.read_bytes() == before
    with pytest.warns(UserWarning, match="removed .*model.onnx, written by an earlier export"):
        export_checkpoint(path, tmp_path, onnx=False, latency=False, choose_stripe_modes=False)
    assert not (tmp_path / FILES[1]).exists()
    # a model.onnx of the user's own (not the one the report beside it records) is never deleted
    (tmp_path / FILES[1]).write_bytes(b"the user's own file")
    with pytest.warns(UserWarning, match="model.onnx was not written by an earlier export .*left as it is"):
        export_checkpoint(path, tmp_path, onnx=False, latency=False, choose_stripe_modes=False)
    assert (tmp_path / FILES[1]).read_bytes() == b"the user's own file"


def test_export_warns_when_onnxruntime_disagrees(training_checkpoint, tmp_path, monkeypatch):
    import compress.export as export_module

    path, _ = training_checkpoint
    monkeypatch.setattr(export_module, "check_onnx", lambda *args: 2e-4)  # just above the 1e-4 tolerance
    with pytest.warns(UserWarning, match=r"differs from the PyTorch model by 2.00e-04 \(relative\) in onnxruntime"):
        export_checkpoint(path, tmp_path, latency=False, choose_stripe_modes=False)
    assert "onnxruntime 2.00e-04" in (tmp_path / FILES[3]).read_text()
    monkeypatch.setattr(export_module, "check_onnx", lambda *args: 5e-5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_checkpoint(path, tmp_path / "close", latency=False, choose_stripe_modes=False)
    assert not [w for w in caught if "onnxruntime" in str(w.message)]  # within the tolerance: no warning
    monkeypatch.setattr(export_module, "check_onnx", lambda *args: float("nan"))
    with pytest.warns(UserWarning, match="got NaN or inf"):
        export_checkpoint(path, tmp_path / "nan", latency=False, choose_stripe_modes=False)


def test_export_refuses_weights_with_nan_or_inf(training_checkpoint, tmp_path):
    """A checkpoint or compact file with NaN weights (an older version saved diverged runs; an edited file) exported
    without a word when ONNX was off: its model computes NaN. export refuses it, naming the tensor, as resume does."""
    path, model = training_checkpoint
    state = torch.load(path, weights_only=True)
    state["model"]["layer1.0.conv1.weight"][0, 0, 0, 0] = float("inf")
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"bad.pt hold NaN or inf values in layer1.0.conv1.weight .*export an earlier"):
        export_checkpoint(tmp_path / "bad.pt", tmp_path / "out", latency=False, onnx=False)
    assert not (tmp_path / "out" / FILES[0]).exists()
    small = compact(model.eval(), fold_bn=True)
    with torch.no_grad():
        small.fc.bias[0] = float("nan")
    compress.save(small, tmp_path / "bad.safetensors")
    with pytest.warns(UserWarning, match="tensors hold NaN"), pytest.raises(ValueError, match=r"in fc.bias"):
        export_checkpoint(tmp_path / "bad.safetensors", tmp_path / "out", latency=False, onnx=False)


def test_export_lets_the_skeleton_model_and_the_architecture_go_before_onnx_and_timing(training_checkpoint, tmp_path,
                                                                                      monkeypatch):
    """export held the loaded skeleton model and the rebuilt architecture (each the dense model's size) to its end,
    through the ONNX export and the profiles. Both are released once the compact model, the dense baseline and the
    stripe counts exist."""
    import gc
    import weakref

    import compress.export as export_module

    held = []

    def recording(real):
        def recorded(*args, **kwargs):
            out = real(*args, **kwargs)
            held.append(weakref.ref(out[0] if isinstance(out, tuple) else out))
            return out
        return recorded

    for name in ("load_any", "architecture"):
        monkeypatch.setattr(export_module, name, recording(getattr(export_module, name)))
    real_export_onnx = export_module.export_onnx

    def checked(*args, **kwargs):
        gc.collect()
        assert len(held) >= 2 and all(ref() is None for ref in held)
        return real_export_onnx(*args, **kwargs)

    monkeypatch.setattr(export_module, "export_onnx", checked)
    path, _ = training_checkpoint
    report = export_checkpoint(path, tmp_path, latency=False, choose_stripe_modes=False)
    assert report["onnx"]["max_rel_error"] < 1e-4


def test_latencies_and_compact_figures_land_on_their_own_side(training_checkpoint, tmp_path, monkeypatch):
    """The side-by-side timing's two latencies go to their own models (stubbed here: each model's parameter count),
    and report.md's per-layer rows show each side's MACs."""
    import compress.export as export_module
    from compress.report import _count

    path, _ = training_checkpoint
    monkeypatch.setattr(export_module, "measure_latencies",
                        lambda models, x, repeats: [float(sum(p.numel() for p in m.parameters())) for m in models])
    report = export_checkpoint(path, tmp_path, onnx=False, repeats=1, choose_stripe_modes=False)
    assert report["dense"]["latency_ms"] == report["dense"]["params"] != report["compact"]["latency_ms"]
    assert report["compact"]["latency_ms"] == report["compact"]["params"]
    text = (tmp_path / FILES[3]).read_text()
    compact_layers = {row["name"]: row for row in report["compact"]["layers"]}
    name = "layer2.0.conv1"
    row = next(line for line in text.splitlines() if line.startswith(f"| `{name}` |")).split(" | ")
    dense_macs = next(r["macs"] for r in report["dense"]["layers"] if r["name"] == name)
    assert row[2:4] == [_count(dense_macs), _count(compact_layers[name]["macs"])]
    assert compact_layers[name]["macs"] < dense_macs


def _export_with_config(path, tmp_path, group: str, key: str, value, **entries) -> dict:
    """export_checkpoint (no ONNX, no timing, cost-model modes) of the training checkpoint at `path` with its
    config's `group.key` set to `value` (and the checkpoint's `entries`), written as tmp_path/last.pt; the outputs go
    to tmp_path/out."""
    state = torch.load(path, weights_only=True)
    state["config"][group][key] = value
    state.update(entries)
    torch.save(state, tmp_path / "last.pt")
    return export_checkpoint(tmp_path / "last.pt", tmp_path / "out", onnx=False, latency=False,
                             choose_stripe_modes=False)


def test_report_tables_give_each_side_its_own_values_and_stripes_per_layer_takes_the_threshold(tmp_path,
                                                                                                 monkeypatch):
    """report.md's per-layer row: the dense and compact MACs, params and latencies in their own columns; sizes in
    binary units; plot_stripes draws the kept fractions; stripes_per_layer counts |skeleton| above the threshold."""
    import matplotlib.axes

    from compress.report import _bytes, plot_stripes, render_markdown, report_dict, stripes_per_layer
    from compress.skeleton import SkeletonConv2d

    dense = profile(nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 4, 3)), (3, 8, 8), latency=False)
    small = profile(nn.Sequential(nn.Conv2d(3, 5, 3, bias=False), nn.Conv2d(5, 4, 3)), (3, 8, 8), latency=False)
    for i, (d, c) in enumerate(zip(dense.layers, small.layers)):
        d.latency_ms, c.latency_ms = 1.0 + i, 10.0 + i
    text = render_markdown(report_dict(dense, small, threshold=None, stripes={"0": {"kept": 10, "total": 72}}))
    row = next(line for line in text.splitlines() if line.startswith("| `0` |")).strip("| ").split(" | ")
    assert row == ["`0`", "Conv2d", "7.78 K", "4.86 K", "224", "135", "10/72", "-", "1.000 ms", "10.000 ms"]
    assert (_bytes(3 * 2**20), _bytes(1536), _bytes(5 * 2**30), _bytes(1000)) == ("3.00 MiB", "1.50 KiB", "5.00 GiB",
                                                                                 "1000 B")
    heights = []
    real_bar = matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", lambda ax, x, h, **kw: (heights.extend(h), real_bar(ax, x, h, **kw))[1])
    plot_stripes({"a": {"kept": 3, "total": 12}, "b": {"kept": 9, "total": 9}}, tmp_path / "s.png")
    assert heights == [0.25, 1.0]
    texts = []
    monkeypatch.setattr(matplotlib.axes.Axes, "text", lambda ax, x, y, t, **kw: texts.append(t))
    plot_stripes({}, tmp_path / "none.png")  # prune=none: a message, not empty axes
    assert heights == [0.25, 1.0] and texts and "prune=none" in texts[0] and (tmp_path / "none.png").is_file()
    conv = SkeletonConv2d.from_conv(nn.Conv2d(3, 4, 3))
    with torch.no_grad():
        conv.skeleton.copy_(torch.linspace(-1, 1, 36).view(conv.skeleton.shape))
    kept = stripes_per_layer(nn.Sequential(conv), 0.5)["0"]["kept"]
    assert kept == int((conv.skeleton.abs() > 0.5).sum()) and 0 < kept < 36


def test_export_with_fold_bn_false_keeps_bn_and_fuses_no_relu(training_checkpoint, tmp_path):
    """fold_bn=false (to fine-tune with BN): the compact model keeps its BNs and, with nothing folded, fuses no ReLU
    (fuse_relu needs fold_bn), and it computes the skeleton model's function."""
    path, skeleton = training_checkpoint
    export_checkpoint(path, tmp_path, fold_bn=False, onnx=False, latency=False, choose_stripe_modes=False)
    small = load(tmp_path / FILES[0])
    assert small.compress_compaction["fold_bn"] is False and small.compress_compaction["relu_fused"] == 0
    assert any(isinstance(m, nn.BatchNorm2d) for m in small.modules())
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _assert_same_function(small(x), skeleton(x))


def test_export_takes_the_training_runs_flops_budget(training_checkpoint, tmp_path):
    """A run trained with prune.target_flops exports at that budget when target_macs is not given."""
    report = _export_with_config(training_checkpoint[0], tmp_path, "prune", "target_flops", 0.3)
    assert report["target_macs"] == 0.3 and report["compact"]["macs"] <= 0.3 * report["dense"]["macs"]


def test_export_script(training_checkpoint, tmp_path):
    """export.py from another working directory, out= given: the files land in out, and the run dir Hydra made
    (outputs/export/<date>/<time>/ with only its .hydra record) is removed again with the folders it leaves empty."""
    path, _ = training_checkpoint
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "export.py"), f"++ckpt={path}", "out=out", "threshold=0.9",
         "choose_modes=false", "++profile.repeats=2"],  # ++: Hydra's force-override of an existing key
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert "| MACs |" in proc.stdout and "compact / dense" in proc.stdout
    data = json.loads((out / "report.json").read_text())
    assert data["threshold"] == 0.9 and data["compact"]["macs"] < 0.5 * data["dense"]["macs"]
    assert data["compact"]["latency_ms"] > 0 and data["dense"]["latency_ms"] > 0
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    failed = run_script("export.py", cwd=tmp_path)  # no ckpt=, into the default run dir: a clear error, no dir left
    assert failed.returncode != 0 and "export: give ckpt=<a train.py checkpoint" in failed.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    added = run_script("export.py", f"ckpt={path}", "+profile.batchsize=64", cwd=tmp_path)  # a misspelt key, added
    assert added.returncode != 0 and "export: +profile.batchsize is not an export setting" in added.stderr
    forced = run_script("export.py", f"ckpt={path}", "++profile.batchsize=64", cwd=tmp_path)  # forced in: refused too
    assert forced.returncode != 0 and "export: ++profile.batchsize is not an export setting" in forced.stderr
    section = run_script("export.py", f"ckpt={path}", "onnx=false", cwd=tmp_path)  # (an AttributeError before)
    assert section.returncode != 0 and "export: onnx=false sets the whole onnx section, which holds settings of its " \
        "own; set one of them instead, e.g. onnx.enabled=false" in section.stderr
    top = run_script("export.py", f"ckpt={path}", "+thresh=1", cwd=tmp_path)  # the list of settings leaves it out
    assert top.returncode != 0 and "export: +thresh is not an export setting" in top.stderr
    assert re.search(r"settings: [^)]*target_macs, threshold;", top.stderr) and ", thresh," not in top.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    helped = run_script("export.py", "--help", cwd=tmp_path)  # export's keys only, not train.py's groups beside them
    assert helped.returncode == 0 and "ckpt: ???" in helped.stdout and "target_macs:" in helped.stdout
    assert "Configuration groups" not in helped.stdout and "resnet50" not in helped.stdout, helped.stdout


def test_export_with_out_runs_from_a_read_only_working_directory(training_checkpoint, tmp_path, monkeypatch):
    """Given out=, Hydra's run dir holds only its record of the command (removed after the export): it goes to the
    system's temporary folder (compress/_run_dir.py), so that an export works from a folder it cannot write (a
    container's read-only working directory), where Hydra's default outputs/export/... failed before anything ran.
    Without out= the run dir is the output: a read-only launch folder is one clear error."""
    import tempfile

    path, _ = training_checkpoint
    read_only = tmp_path / "ro"
    read_only.mkdir()
    real_mkdir = Path.mkdir

    def refuse_inside_read_only(self, *args, **kwargs):  # (a chmod would not stop root, which CI may run as)
        if read_only in Path(self).absolute().parents:
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refuse_inside_read_only)
    real_mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, dir=None, **k: real_mkdtemp(*a, dir=dir, **k)
                        if Path(dir) != read_only else refuse_inside_read_only(read_only / "probe"))
    before = set(Path(tempfile.gettempdir()).glob(f"compress-export-{os.getpid()}-*"))
    done = run_script("export.py", f"ckpt={path}", f"out={tmp_path / 'out'}", "choose_modes=false",
                      "profile.latency=false", "onnx.enabled=false", cwd=read_only)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "out" / "report.json").is_file() and list(read_only.iterdir()) == []
    assert set(Path(tempfile.gettempdir()).glob(f"compress-export-{os.getpid()}-*")) == before  # removed again
    refused = run_script("export.py", f"ckpt={path}", "choose_modes=false", cwd=read_only)
    assert refused.returncode == 1 and f"cannot create the run directory {read_only / 'outputs'}" in refused.stderr
    shown = run_script("export.py", "--cfg", "hydra", "--resolve", f"ckpt={path}", cwd=read_only)  # (no `out` key
    assert shown.returncode == 0 and "outputs/export/" in shown.stdout, shown.stderr  # there: it failed to resolve)


def test_export_sweep_with_one_fixed_out_is_refused(training_checkpoint, tmp_path):
    """export.py -m of several jobs with one fixed out= wrote every job's files into it, each over the last (the
    last job's report alone remained): refused before anything is written, naming a per-job out. A per-job out
    (an interpolation, or out itself swept) runs."""
    path, _ = training_checkpoint
    fixed = run_script("export.py", "-m", f"ckpt={path}", "out=X", "threshold=0.1,0.2", cwd=tmp_path)
    assert fixed.returncode == 1 and "every job of this sweep would write its files into out=X" in fixed.stderr
    assert "out='X/${hydra:job.num}'" in fixed.stderr and list(tmp_path.iterdir()) == []
    per_job = run_script("export.py", "-m", f"ckpt={path}", "out=X/${hydra:job.num}", "threshold=0.1,0.2",
                         "choose_modes=false", "profile.latency=false", "onnx.enabled=false",
                         "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert per_job.returncode == 0, per_job.stderr[-3000:]
    assert [json.loads((tmp_path / "X" / str(i) / "report.json").read_text())["threshold"] for i in (0, 1)] == [0.1, 0.2]


def test_exports_started_in_one_second_get_run_dirs_of_their_own():
    """The default out dir is named to the microsecond: named to the second, two exports started together wrote one
    dir, the second's files over the first's."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        dirs = [compose(config_name="export", return_hydra_config=True).hydra.run.dir for _ in range(2)]
    assert dirs[0] != dirs[1] and all(d.startswith("outputs/export/") for d in dirs), dirs


def _export_deployed(training_checkpoint, tmp_path, device: str, cuda_graphs: bool) -> dict:
    """export in bf16 channels_last (and through CUDA graphs): the report says how the models ran, the file keeps
    float32 weights computing the skeleton model's function."""
    path, skeleton = training_checkpoint
    report = export_checkpoint(path, tmp_path, onnx=False, device=device, batch_size=4, repeats=2,
                               dtype="bfloat16", channels_last=True, cuda_graphs=cuda_graphs)  # fmt: skip
    timing = "graph" if cuda_graphs else "eager"
    assert report["run"] == {"dtype": "bfloat16", "channels_last": True, "cuda_graphs": cuda_graphs,
                             "modes": f"chosen by {timing} timing"}  # fmt: skip
    assert report["dense"]["latency_ms"] > 0 and report["compact"]["latency_ms"] > 0
    assert report["dense"]["weight_bytes"] == 2 * report["dense"]["params"]  # measured in bf16 (BN folded)
    text = (tmp_path / "report.md").read_text()
    assert "Both models ran in bfloat16, channels_last" in text
    assert ("CUDA graphs" in text) == cuda_graphs
    small = load(tmp_path / FILES[0])
    assert all(p.dtype == torch.float32 for p in small.parameters())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        _assert_same_function(small(x), skeleton(x))
    return report


def test_export_runs_models_as_deployed(training_checkpoint, tmp_path):
    _export_deployed(training_checkpoint, tmp_path, "cpu", cuda_graphs=False)


@pytest.mark.cuda
def test_export_through_cuda_graphs(training_checkpoint, tmp_path):
    _export_deployed(training_checkpoint, tmp_path, "cuda", cuda_graphs=True)


def test_export_deployment_options_are_checked(training_checkpoint, tmp_path):
    path, _ = training_checkpoint
    with pytest.raises(ValueError, match="profile.dtype must be one of"):
        export_checkpoint(path, tmp_path, dtype="int8")
    bad = [({"device": "cpu", "cuda_graphs": True}, "cuda_graphs needs a CUDA device"),
           ({"stripe_mode": "bogus"}, "onnx.stripe_mode must be one of"), ({"opset": 12}, "onnx.opset=12; use an opset from 13"),
           ({"opset": 99}, r"onnx.opset=99; use an opset from 13 to \d+"),
           ({"modes_timing": "gpu"}, "choose_modes_timing must be"), ({"batch_size": 0}, "profile.batch_size=0"),
           ({"repeats": -1}, "profile.repeats=-1"), ({"batch_size": True}, "profile.batch_size=True; it must be an int"),
           ({"threshold": -1.0}, r"export: threshold=-1.0; it must be a finite number >= 0")]
    for kwargs, message in bad:  # refused before anything is written
        with pytest.raises(ValueError, match=message):
            export_checkpoint(path, tmp_path / "bad", **kwargs)
        assert not (tmp_path / "bad").exists()
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ValueError, match="is a file; give a directory"):
        export_checkpoint(path, tmp_path / "file")
    with pytest.raises(ValueError, match=r"cannot write out=.*file/sub: .*file is a file"):
        export_checkpoint(path, tmp_path / "file" / "sub")
    assert (tmp_path / "file").read_text() == "mine"


def test_export_device_settings_are_checked_before_any_work(training_checkpoint, tmp_path, monkeypatch):
    """Settings the machine cannot run are refused up front (before compaction and mode timing), naming the key."""
    import compress.export as export_module

    path, _ = training_checkpoint
    monkeypatch.setattr(export_module, "compact", lambda *a, **k: pytest.fail("compacted before the check"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for kwargs, message in [({"device": "cuda"}, r"profile.device=cuda but this machine has no usable CUDA device"),
                            ({"device": "tpu"}, r"profile.device='tpu' is not a device"),
                            ({"device": "cpu", "modes_timing": "graph"}, r"choose_modes_timing=graph .* needs a CUDA")]:
        with pytest.raises(ValueError, match=message):
            export_checkpoint(path, tmp_path / "bad", **kwargs)
        assert not (tmp_path / "bad").exists()


def test_a_failed_export_leaves_the_out_dir_as_it_was(training_checkpoint, tmp_path, monkeypatch):
    """Every file goes into `out` only once the whole export succeeded: a failure late in the flow (here the ONNX
    check) leaves an earlier export's files as they were, and removes an out dir it created (and its new parents)."""
    import compress.export as export_module

    path, _ = training_checkpoint
    out = tmp_path / "out"
    export_checkpoint(path, out, latency=False, choose_stripe_modes=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(*args):
        raise RuntimeError("onnxruntime failed")

    monkeypatch.setattr(export_module, "check_onnx", broken)
    with pytest.raises(RuntimeError, match="onnxruntime failed"):
        export_checkpoint(path, out, threshold=0.9, latency=False, choose_stripe_modes=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with pytest.raises(RuntimeError, match="onnxruntime failed"):
        export_checkpoint(path, tmp_path / "new" / "out", latency=False, choose_stripe_modes=False)
    assert not (tmp_path / "new").exists()  # out and the folder above it, both created by the export
    # a folder it created that another export wrote into meanwhile keeps that export's files
    from compress.export import _staging

    with pytest.raises(RuntimeError, match="failed"), _staging(tmp_path / "exports" / "run1"):
        (tmp_path / "exports" / "run2").mkdir()
        (tmp_path / "exports" / "run2" / "m.safetensors").write_text("another export's")
        raise RuntimeError("failed")
    assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == ["run2"]
    assert (tmp_path / "exports" / "run2" / "m.safetensors").read_text() == "another export's"


def test_report_counts_the_stripes_of_the_exported_model(training_checkpoint, tmp_path):
    """A layer whose every filter compaction removes (the next conv reads none of its channels) reports 0 kept
    stripes, whatever its skeleton kept; the counts are those of the compact file exported again."""
    path, skeleton = training_checkpoint
    model = copy.deepcopy(skeleton)
    with torch.no_grad():
        model.layer1[0].conv2.skeleton.zero_()  # conv1's filters then feed nothing
    assert int(model.layer1[0].conv1.stripe_mask(0.01).sum()) > 0
    state = torch.load(path, weights_only=True)
    state["model"] = model.state_dict()
    dead = tmp_path / "dead.pt"
    torch.save(state, dead)
    report = export_checkpoint(dead, tmp_path / "out", onnx=False, latency=False, choose_stripe_modes=False)
    assert report["stripes"]["layer1.0.conv1"]["kept"] == 0
    again = export_checkpoint(tmp_path / "out" / FILES[0], tmp_path / "again", onnx=False, latency=False,
                              choose_stripe_modes=False)
    assert again["stripes"] == report["stripes"]
    size = (tmp_path / "out" / FILES[0]).stat().st_size  # the file deployment ships, in the report
    assert report["file_bytes"] == {FILES[0]: size}
    assert f"Files: {FILES[0]} " in (tmp_path / "out" / FILES[3]).read_text()
    assert size < report["compact"]["weight_bytes"]  # stripe indices stored narrow (int8/int16), held as int64


def test_report_counts_the_stripes_of_the_layers_the_run_gave_skeletons(tmp_path):
    """A run with prune.min_kernel_size=1 and prune.exclude: the report's stripe table covers the convs that had
    skeletons (1x1 ones included, the excluded one not), not those SWP would pick by default; so does the export of
    its compact file (whose compaction record names them)."""
    g = torch.Generator().manual_seed(0)
    model = create_model("resnet29_bottleneck", num_classes=10, input_size=32)
    names = attach_skeletons(model, min_kernel_size=1, exclude=["layer1.0.conv2"])
    with torch.no_grad():
        for name in names:
            sk = model.get_submodule(name).skeleton
            sk.copy_((torch.rand(sk.shape, generator=g) < 0.6).float())
    random_bn_(model, g).eval()
    config = {"model": {"name": "resnet29_bottleneck", "kwargs": {}},
              "data": {"name": "fake", "input_size": 32, "num_classes": 10, "batch_size": 64},
              "prune": {"name": "swp", "alpha": 1e-5, "threshold": 0.01, "target_flops": None, "min_kernel_size": 1,
                        "exclude": ["layer1.0.conv2"]}}
    path = tmp_path / "last.pt"
    torch.save({"model": model.state_dict(), "config": config, "epoch": 1, "step": 10}, path)
    report = export_checkpoint(path, tmp_path / "out", onnx=False, latency=False, choose_stripe_modes=False)
    assert sorted(report["stripes"]) == sorted(names)
    assert "layer1.0.conv1" in report["stripes"] and "layer1.0.conv2" not in report["stripes"]
    convs = {name: model.get_submodule(name) for name in names}
    assert sum(s["total"] for s in report["stripes"].values()) == sum(
        c.out_channels * c.kernel_size[0] * c.kernel_size[1] for c in convs.values())
    again = export_checkpoint(tmp_path / "out" / FILES[0], tmp_path / "again", onnx=False, latency=False,
                              choose_stripe_modes=False)  # the compact file: the same layers (its record keeps them)
    assert again["stripes"] == report["stripes"]


def test_report_names_each_stripe_convs_mode(training_checkpoint, tmp_path, monkeypatch):
    """report.json gives each stripe conv's mode (here as a stubbed choose_modes picks them) and report.md shows it
    per layer, counts the modes and says what a dense-mode layer executes."""
    import compress.export as export_module

    path, _ = training_checkpoint
    picked = {}

    def choose(model, x, timing):
        names = [n for n, m in model.named_modules() if isinstance(m, StripeConv2d)]
        picked.update({n: "dense" if i == 1 else "stripe" for i, n in enumerate(names)})
        return dict(picked)

    monkeypatch.setattr(export_module, "choose_modes", choose)
    report = export_checkpoint(path, tmp_path / "out", onnx=False, latency=False)
    assert len(picked) > 2
    assert {n: s["mode"] for n, s in report["stripes"].items() if "mode" in s} == picked
    dense = next(n for n, m in picked.items() if m == "dense")
    text = (tmp_path / "out" / FILES[3]).read_text()
    assert f"Stripe convs by mode: {len(picked) - 1} stripe, 1 dense." in text
    assert "it does that conv's work, not the kept-stripe MACs" in text
    row = next(line for line in text.splitlines() if line.startswith(f"| `{dense}` |"))
    assert row.split(" | ")[7] == "dense"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_compact_file_kept_in_a_dtype_onnxruntime_cannot_run_exports_a_float32_onnx_model(
        training_checkpoint, tmp_path, dtype):
    """A compact file saved in bfloat16 or float64 (compress.save keeps the dtype): its ONNX model is float32 and
    matches the float32 copy of the file's model; the re-saved file keeps the file's dtype; report.md says which."""
    import onnxruntime as ort

    path, _ = training_checkpoint
    export_checkpoint(path, tmp_path / "a", onnx=False, latency=False, choose_stripe_modes=False)
    held = tmp_path / "held.safetensors"
    compress.save(load(tmp_path / "a" / FILES[0]).to(dtype), held)
    report = export_checkpoint(held, tmp_path / "b", latency=False, choose_stripe_modes=False)
    assert report["onnx"]["dtype"] == "float32" and report["onnx"]["max_rel_error"] < 1e-4
    assert next(load(tmp_path / "b" / FILES[0]).parameters()).dtype == dtype
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    session = ort.InferenceSession(str(tmp_path / "b" / FILES[1]), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"input": x.numpy()})
    with torch.no_grad():
        want = load(held).float().eval()(x)
    torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    assert "(opset 17, float32, stripe convs as" in (tmp_path / "b" / FILES[3]).read_text()


def test_exporting_a_compact_file_again_keeps_its_compaction_record(training_checkpoint, tmp_path):
    """Re-profiling a compact file (any name) keeps what chose its stripes (threshold, dense MACs) and counts the
    ReLUs fused in both passes; a threshold given then is ignored with a warning."""
    path, _ = training_checkpoint
    first = export_checkpoint(path, tmp_path / "a", onnx=False, latency=False, choose_stripe_modes=False)
    record = load(tmp_path / "a" / FILES[0]).compress_compaction
    assert record["threshold"] == 0.01 and record["relu_fused"] > 0
    renamed = tmp_path / "model.bin"  # a compact file is recognised by its content, not its name
    renamed.write_bytes((tmp_path / "a" / FILES[0]).read_bytes())
    with pytest.warns(UserWarning, match=r"threshold=0.5 is ignored: .*model.bin holds a compact model"):
        again = export_checkpoint(renamed, tmp_path / "b", threshold=0.5, onnx=False, latency=False)
    assert again["threshold"] == first["threshold"] == 0.01
    kept = load(tmp_path / "b" / FILES[0]).compress_compaction
    assert (kept["threshold"], kept["relu_fused"], kept["dense_macs"]) == (0.01, record["relu_fused"],
                                                                           record["dense_macs"])
    assert "Stripe threshold: 0.01." in (tmp_path / "b" / FILES[3]).read_text()
    budgeted = export_checkpoint(path, tmp_path / "d", target_macs=0.5, onnx=False, latency=False,
                                 choose_stripe_modes=False)
    budget = load(tmp_path / "d" / FILES[0]).compress_compaction
    again = export_checkpoint(tmp_path / "d" / FILES[0], tmp_path / "e", onnx=False, latency=False,
                              choose_stripe_modes=False)  # the budget that chose its stripes and its MACs stay told
    assert again["target_macs"] == budgeted["target_macs"] == 0.5
    assert load(tmp_path / "e" / FILES[0]).compress_compaction["macs"] == budget["macs"] == again["compact"]["macs"]
    with pytest.warns(UserWarning) as caught:  # its BN folded and ReLUs fused already: those settings cannot undo it
        ignored = export_checkpoint(renamed, tmp_path / "c", fold_bn=False, fuse_relu=False, onnx=False,
                                    latency=False, choose_stripe_modes=False)
    said = " ".join(str(w.message) for w in caught)
    assert "fold_bn=false is ignored: " in said and "fuse_relu=false is ignored: " in said
    assert load(tmp_path / "c" / FILES[0]).compress_compaction["fold_bn"]
    # its fused stripe convs keep the first padding, so another channel multiple would be recorded but not applied
    with pytest.warns(UserWarning, match=r"channel_multiple=8 is ignored: .*model.bin holds a compact model whose "
                                         r"channels were padded to multiples of 1"):
        export_checkpoint(renamed, tmp_path / "f", channel_multiple=8, onnx=False, latency=False,
                          choose_stripe_modes=False)
    assert load(tmp_path / "f" / FILES[0]).compress_compaction["channel_multiple"] == 1
    # ... and the dense baseline is the one a plain re-export compares with (BN folded, ReLUs fused)
    assert [(r["name"], r["type"]) for r in ignored["dense"]["layers"]] == \
        [(r["name"], r["type"]) for r in again["dense"]["layers"]]


@pytest.mark.parametrize("key,kwargs", [("fold_bn", {"fold_bn": "no"}), ("onnx.enabled", {"onnx": "off"}),
                                        ("profile.latency", {"latency": 0})])
def test_on_off_settings_must_be_booleans(training_checkpoint, tmp_path, key, kwargs):
    """"no" or 0 would count as true (or be taken as false silently); nothing is written."""
    path, _ = training_checkpoint
    with pytest.raises(ValueError, match=f"export: {key}=.*; it must be true or false"):
        export_checkpoint(path, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_a_training_budget_does_not_block_exporting_a_model_without_skeletons(training_checkpoint, tmp_path):
    """A fine-tuning run (init=) whose config carries prune.target_flops exports, with a warning that the budget does
    not apply (there are no skeletons to choose stripes from)."""
    _, skeleton = training_checkpoint
    small = compact(skeleton, fold_bn=False)
    init = tmp_path / "init.safetensors"
    compress.save(small, init)
    config = {"model": {"name": "resnet20", "kwargs": {}}, "data": {"name": "digits", "input_size": 32},
              "prune": {"name": "swp", "threshold": 0.01, "target_flops": 0.5}, "init": str(init)}  # fmt: skip
    path = tmp_path / "last.pt"
    torch.save({"model": small.state_dict(), "config": config, "epoch": 1, "step": 3}, path)
    with pytest.warns(UserWarning, match=r"prune.target_flops=0.5 is ignored: the model has no skeletons"):
        report = export_checkpoint(path, tmp_path / "out", onnx=False, latency=False, choose_stripe_modes=False)
    assert report["target_macs"] is None


def test_onnx_of_a_pix_model_at_the_lowest_opset(tmp_path):
    """Opset 13, export's lowest: PiX (group split, max/mean pick) and shift-mode stripes match onnxruntime."""
    model = compact(_skeleton_model("resnet29_bottleneck", keep=0.5, seed=4, pix=4, num_classes=10), fold_bn=True)
    x = torch.randn(2, 3, 32, 32)
    for mode in ("dense", "shift"):
        assert check_onnx(export_onnx(model, tmp_path / f"{mode}.onnx", (3, 32, 32), stripe_mode=mode, opset=13),
                          model, x) <= 1e-4


@pytest.mark.parametrize("in_size, out_size", [((1, 1), (7, 7)), ((2, 2), (7, 7)), ((5, 3), (7, 7)), ((9, 13), (4, 5))])
def test_fixed_adaptive_avg_pool_equals_pytorchs(in_size, out_size):
    x = torch.randn(3, 4, *in_size, dtype=torch.float64)
    torch.testing.assert_close(FixedAdaptiveAvgPool2d(in_size, out_size)(x),
                               nn.functional.adaptive_avg_pool2d(x, out_size), rtol=1e-12, atol=1e-12)


def test_onnx_of_torchvision_vgg_below_224(tmp_path):
    """torchvision's VGG pools its 2x2 map at 64x64 inputs to 7x7, which PyTorch's exporter refuses as an adaptive
    pool; the export writes it as a fixed MatMul, exact at that size."""
    import onnx

    torch.manual_seed(0)  # (the heads' init and the check's inputs: not left to the tests run before)
    model = _skeleton_model("vgg11_bn", keep=0.5, num_classes=10)
    for i, (n_in, n_out) in zip((0, 3), ((512 * 7 * 7, 64), (64, 64))):  # a 64-wide head: a small file
        model.classifier[i] = nn.Linear(n_in, n_out)
    model.classifier[6] = nn.Linear(64, 10)
    model = compact(model)
    path = export_onnx(model, tmp_path / "vgg.onnx", (3, 64, 64))
    assert "MatMul" in {node.op_type for node in onnx.load(str(path)).graph.node}
    assert check_onnx(path, model, torch.randn(3, 3, 64, 64)) <= 1e-4
    assert isinstance(model.avgpool, nn.AdaptiveAvgPool2d)  # the model itself is left as it was


def test_onnx_of_timm_vgg_below_224(tmp_path):
    """timm's VGG head (ConvMlp) calls F.adaptive_avg_pool2d up to its 7x7 kernel on smaller maps (2x2 at 64x64),
    which PyTorch's exporter refuses; the export puts the fixed MatMul pool before the head, exact at that size."""
    import onnx

    model = _skeleton_model("timm:vgg11", keep=0.5, num_classes=10, mlp_ratio=1 / 16)  # a 256-wide head: a small file
    model = compact(model.eval(), fold_bn=True, fuse_relu=True)
    path = export_onnx(model, tmp_path / "vgg.onnx", (3, 64, 64))
    assert "MatMul" in {node.op_type for node in onnx.load(str(path)).graph.node}
    assert check_onnx(path, model, torch.randn(3, 3, 64, 64)) <= 1e-4
    assert type(model.pre_logits).__name__ == "ConvMlp"  # the model itself is left as it was


def test_missing_checkpoint_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        export_checkpoint(tmp_path / "nope.pt", tmp_path)


def test_check_onnx_is_not_fooled_by_outputs_that_hardly_depend_on_the_input(tmp_path):
    """A model whose outputs vary across the batch by ~1e-9 of their size (as a randomly initialised one can):
    float32 rounding must not read as a relative error near 1, and a real difference must still show."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).eval()
    with torch.no_grad():
        model[0].weight.mul_(1e-9)
        model[2].bias.add_(1.0)
    path = export_onnx(model, tmp_path / "flat.onnx", (3, 8, 8))
    x = torch.randn(4, 3, 8, 8)
    assert check_onnx(path, model, x) <= 1e-3
    # a change of the input-dependent part by half: 5e-10 of the output, far below float32 rounding of it
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        rounded[0].weight.mul_(1.5)
    assert check_onnx(path, rounded, x) <= 1e-3
    wrong = copy.deepcopy(model)
    with torch.no_grad():
        wrong[2].bias.mul_(1.01)
    assert check_onnx(path, wrong, x) >= 5e-3


def test_a_run_trained_at_another_input_size_is_reported_at_it(training_checkpoint, tmp_path):
    """An init= run may fine-tune a compact model at another size than it was built for: the report counts at the
    run's data.input_size, as its training summary did (it took the architecture's)."""
    arch = {"name": "resnet20", "kwargs": {"num_classes": 10, "input_size": 32, "in_chans": 3}}
    report = _export_with_config(training_checkpoint[0], tmp_path, "data", "input_size", 16, arch=arch)
    assert report["compact"]["input_size"] == report["dense"]["input_size"] == [3, 16, 16]
    assert load(tmp_path / "out" / FILES[0]).compress_arch["kwargs"]["input_size"] == 32
    # its compact file, exported again, counts at that size too (its architecture still says 32)
    again = export_checkpoint(tmp_path / "out" / FILES[0], tmp_path / "again", latency=False, choose_stripe_modes=False)
    assert again["compact"]["input_size"] == [3, 16, 16] and again["compact"]["macs"] == report["compact"]["macs"]
    import onnx

    dims = onnx.load(str(tmp_path / "again" / FILES[1])).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims][1:] == [3, 16, 16]
    # a run fine-tuning that compact file at 24 pixels counts at 24, not at the file's 16
    (tmp_path / "tuned").mkdir()
    tuned = _export_with_config(training_checkpoint[0], tmp_path / "tuned", "data", "input_size", 24,
                                model=load(tmp_path / "out" / FILES[0]).state_dict(),
                                config={**torch.load(training_checkpoint[0], weights_only=True)["config"],
                                        "data": {"name": "digits", "input_size": 24, "batch_size": 64},
                                        "init": str(tmp_path / "out" / FILES[0])})
    assert tuned["compact"]["input_size"] == tuned["dense"]["input_size"] == [3, 24, 24]
    init_file = (tmp_path / "out" / FILES[0]).read_bytes()
    with pytest.raises(ValueError, match=r"would overwrite .*model.compact.safetensors, the compact model the run "
                                         r"fine-tuned \(init=\)"):
        export_checkpoint(tmp_path / "tuned" / "last.pt", tmp_path / "out", onnx=False, latency=False)
    assert (tmp_path / "out" / FILES[0]).read_bytes() == init_file


def test_a_budgeted_compact_model_fine_tuned_at_another_size_records_both_counts_at_that_size(training_checkpoint,
                                                                                             tmp_path):
    """A compact model exported with a MAC budget at 32 pixels, fine-tuned (init=) at 16 and exported again: its record
    counts the compact and the dense MACs at 16 (it kept the dense count of 32 beside a compact count of 16)."""
    path, _ = training_checkpoint
    export_checkpoint(path, tmp_path / "a", target_macs=0.5, onnx=False, latency=False, choose_stripe_modes=False)
    first = load(tmp_path / "a" / FILES[0]).compress_compaction
    (tmp_path / "tuned").mkdir()
    tuned = _export_with_config(path, tmp_path / "tuned", "data", "input_size", 16,
                                model=load(tmp_path / "a" / FILES[0]).state_dict(),
                                config={**torch.load(path, weights_only=True)["config"],
                                        "data": {"name": "digits", "input_size": 16, "batch_size": 64},
                                        "init": str(tmp_path / "a" / FILES[0])})
    record = load(tmp_path / "tuned" / "out" / FILES[0]).compress_compaction
    assert (first["input_size"], record["input_size"], record["target_macs"]) == (32, 16, 0.5)
    assert record["macs"] == tuned["compact"]["macs"] < record["dense_macs"] == tuned["dense"]["macs"]
    assert record["dense_macs"] < first["dense_macs"]


def test_an_output_folder_spelled_otherwise_still_never_overwrites_the_input(training_checkpoint, tmp_path):
    path, _ = training_checkpoint
    export_checkpoint(path, tmp_path / "a", onnx=False, latency=False, choose_stripe_modes=False)
    before = (tmp_path / "a" / FILES[0]).read_bytes()
    (tmp_path / "b").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "a")
    for out in (tmp_path / "b" / ".." / "a", tmp_path / "link"):
        with pytest.raises(ValueError, match="would overwrite the input"):
            export_checkpoint(tmp_path / "a" / FILES[0], out, onnx=False, latency=False)
        assert (tmp_path / "a" / FILES[0]).read_bytes() == before


def test_re_exporting_a_padded_compact_file_with_the_defaults_keeps_its_multiple_without_a_warning(
        training_checkpoint, tmp_path):
    path, _ = training_checkpoint
    export_checkpoint(path, tmp_path / "a", channel_multiple=8, onnx=False, latency=False, choose_stripe_modes=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_checkpoint(tmp_path / "a" / FILES[0], tmp_path / "b", onnx=False, latency=False,
                          choose_stripe_modes=False)
    assert not [w for w in caught if "channel_multiple" in str(w.message)]
    assert load(tmp_path / "b" / FILES[0]).compress_compaction["channel_multiple"] == 8
    with pytest.warns(UserWarning, match="channel_multiple=1 is ignored"):  # a value given is still named
        export_checkpoint(tmp_path / "a" / FILES[0], tmp_path / "c", channel_multiple=1, onnx=False, latency=False,
                          choose_stripe_modes=False)


def test_export_py_passes_every_setting(tmp_path, monkeypatch):
    """Each conf/export.yaml key, set on the command line, reaches export_checkpoint."""
    from cli import _script

    module, got = _script("export.py"), {}

    def record(ckpt, out, **kwargs):
        got.update(kwargs, ckpt=ckpt)
        raise RuntimeError("recorded")

    monkeypatch.setattr(module, "export_checkpoint", record)
    settings = {"threshold": 0.3, "target_macs": 0.5, "fold_bn": False, "channel_multiple": 8, "fuse_relu": False,
                "choose_stripe_modes": False, "modes_timing": "fast", "onnx": False, "stripe_mode": "shift",
                "opset": 15, "device": "cpu", "batch_size": 3, "latency": False, "repeats": 4, "dtype": "bfloat16",
                "channels_last": True, "cuda_graphs": True}
    keys = {"choose_stripe_modes": "choose_modes", "modes_timing": "choose_modes_timing", "onnx": "onnx.enabled",
            "stripe_mode": "onnx.stripe_mode", "opset": "onnx.opset", "device": "profile.device",
            "batch_size": "profile.batch_size", "latency": "profile.latency", "repeats": "profile.repeats",
            "dtype": "profile.dtype", "channels_last": "profile.channels_last", "cuda_graphs": "profile.cuda_graphs"}
    args = [f"{keys.get(k, k)}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items()]
    proc = run_script("export.py", f"ckpt={tmp_path / 'x.pt'}", f"out={tmp_path / 'out'}", *args, cwd=tmp_path)
    assert proc.returncode != 0 and "recorded" in proc.stderr
    assert got == {**settings, "ckpt": tmp_path / "x.pt"}


@pytest.mark.parametrize("dynamo", [False, True])
def test_plain_torch_onnx_export_of_a_compact_model_in_stripe_mode(tmp_path, dynamo):
    """torch.onnx.export (either exporter) of a compact model whose layers run stripe mode failed (ONNX has no
    compress::stripe_conv2d), so a user's export worked or not with the modes choose_modes picked: under ONNX
    export a stripe conv is the standard conv of its dense weight."""
    import onnxruntime as ort

    small = compact(_skeleton_model("resnet20", 0.4, input_size=16), fold_bn=True, fuse_relu=True)
    stripe = [m for m in small.modules() if isinstance(m, StripeConv2d) and m.num_stripes]
    for m in stripe:
        m.mode = "stripe"
    assert stripe
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    torch.onnx.export(small, (x,), str(tmp_path / "m.onnx"), dynamo=dynamo, input_names=["input"])
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        _assert_same_function(torch.from_numpy(got), small(x))


def test_a_float16_compact_file_exports_a_float32_onnx_model(training_checkpoint, tmp_path):
    """export.py on a float16 compact file crashed in its ONNX check (the float16 model was called on float32
    inputs): it exports a float32 copy, as for bfloat16 and float64 files, checked at float32's tolerance."""
    path, _ = training_checkpoint
    export_checkpoint(path, tmp_path / "a", onnx=False, latency=False, choose_stripe_modes=False)
    held = tmp_path / "half.safetensors"
    compress.save(load(tmp_path / "a" / FILES[0]).half(), held)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        report = export_checkpoint(held, tmp_path / "b", latency=False, choose_stripe_modes=False)
    assert report["onnx"]["dtype"] == "float32" and 0 < report["onnx"]["max_rel_error"] < 1e-4
    assert next(load(tmp_path / "b" / FILES[0]).parameters()).dtype == torch.float16


def test_export_py_names_only_the_files_it_wrote(training_checkpoint, tmp_path):
    """With onnx off, a model.onnx of the user's own in out stays (with a warning) and the closing line no longer
    lists it among the files written."""
    path, _ = training_checkpoint
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.onnx").write_text("mine")
    r = run_script("export.py", f"ckpt={path}", f"out={out}", "onnx.enabled=false", "profile.latency=false",
                   "choose_modes=false", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"wrote model.compact.safetensors, report.json, report.md, stripes.png to ", r.stdout), r.stdout
    assert (out / "model.onnx").read_text() == "mine"
