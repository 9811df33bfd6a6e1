"""Model registry: every registered model builds, runs forward+backward, and matches documented sizes."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from randomize import random_bn_

import compress
from compress.models import create_model, list_models, register_model

CIFAR_MODELS = list_models(module="cifar_resnet") + list_models(module="cifar_vgg")
EXTERNAL_SAMPLE = ["resnet18", "vgg11_bn", "mobilenet_v2", "timm:resnet18"]


def count_macs(model: nn.Module, input_size: int, in_chans: int = 3) -> int:
    """Multiply-adds of Conv2d and Linear layers for one image, by hand formula on hooked outputs:
    conv: out_elems * in_ch/groups * kh*kw; linear: out_elems * in_features."""
    total = 0

    def hook(module, inputs, output):
        nonlocal total
        per_image = output[0].numel()
        if isinstance(module, nn.Conv2d):
            kh, kw = module.kernel_size
            total += per_image * module.in_channels // module.groups * kh * kw
        else:
            total += per_image * module.in_features

    handles = [
        m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))
    ]
    model.eval()
    with torch.no_grad():
        model(torch.randn(1, in_chans, input_size, input_size))
    for h in handles:
        h.remove()
    return total


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_registry_lists_all_families():
    names = set(list_models())
    assert {
        "resnet20",
        "resnet32",
        "resnet56",
        "resnet110",
        "resnet29_bottleneck",
        "resnet164_bottleneck",
    } <= names
    assert {"vgg11", "vgg13", "vgg16", "vgg19"} <= names
    assert list_models(module="cifar_vgg") == ["vgg11", "vgg13", "vgg16", "vgg19"]
    assert list_models(module="compress.models.cifar_vgg") == list_models(module="cifar_vgg")  # the dotted name too
    with pytest.raises(ValueError, match=r"list_models: no registered model comes from module 'cifar_vg'; the "
                                         r"families are \['cifar_resnet', 'cifar_vgg', "):
        list_models(module="cifar_vg")  # (a typo listed nothing)
    assert {"resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "mobilenet_v2"} <= names
    assert {"vgg11_bn", "vgg13_bn", "vgg16_bn", "vgg19_bn"} <= names
    assert list_models("resnet1*", module="cifar_resnet") == ["resnet110", "resnet164_bottleneck"]


@pytest.mark.parametrize("name", CIFAR_MODELS + EXTERNAL_SAMPLE)
def test_forward_backward(name):
    """CIFAR nets at 8x8 RGB; external nets at 32x32 with one input channel (stem conv replaced)."""
    torch.manual_seed(0)
    size, in_chans = (32, 1) if name in EXTERNAL_SAMPLE else (8, 3)
    model = create_model(name, num_classes=7, input_size=size, in_chans=in_chans)
    stem = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert stem.in_channels == in_chans
    out = model(torch.randn(2, in_chans, size, size))
    assert out.shape == (2, 7)
    out.square().sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def _vgg_params(cfg: list, classes: int = 10) -> int:
    """3x3 conv weights (no bias), 2 per BN channel, Linear(last, classes), counted by hand."""
    total, channels = 0, 3
    for width in cfg:
        total += 9 * channels * width + 2 * width
        channels = width
    return total + channels * classes + classes


@pytest.mark.parametrize("name, cfg", [
    ("vgg11", [64, 128, 256, 256, 512, 512, 512, 512]),
    ("vgg13", [64, 64, 128, 128, 256, 256, 512, 512, 512, 512]),
    ("vgg16", [64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512]),
    ("vgg19", [64, 64, 128, 128, 256, 256, 256, 256, 512, 512, 512, 512, 512, 512, 512, 512]),
])
def test_cifar_vgg_params_by_hand(name, cfg):
    """Simonyan & Zisserman's configurations A/B/D/E with BN, one Linear head (vgg19: 20.04 M, as in Liu et al.'s
    network slimming)."""
    assert n_params(create_model(name)) == _vgg_params(cfg)


def test_one_input_channel_keeps_the_stem_configuration():
    """in_chans=1: the stem conv replaced with the same kernel, stride, padding, bias and a He (fan-out) init."""
    import torchvision

    for name, stem in (("resnet18", "conv1"), ("vgg11_bn", "features.0"), ("mobilenet_v2", "features.0.0")):
        torch.manual_seed(0)
        new, old = create_model(name, in_chans=1).get_submodule(stem), getattr(torchvision.models, name)().get_submodule(stem)
        assert new.in_channels == 1 and [getattr(new, k) for k in ("out_channels", "kernel_size", "stride", "padding",
                                                                    "dilation", "groups")] == [
            getattr(old, k) for k in ("out_channels", "kernel_size", "stride", "padding", "dilation", "groups")]
        assert (new.bias is None) == (old.bias is None)
        fan_out = new.out_channels * new.kernel_size[0] * new.kernel_size[1]
        assert new.weight.std().item() == pytest.approx((2 / fan_out) ** 0.5, rel=0.15), name
    assert create_model("resnet20", input_size=16).compress_arch["kwargs"]["input_size"] == 16


@pytest.mark.parametrize("key", ["pretrained", "weights", "checkpoint_path", "pretrained_cfg", "pretrained_cfg_overlay",
                                 "cache_dir", "weights_backbone"])
def test_create_model_refuses_arguments_that_read_weights(key, tmp_path):
    with pytest.raises(ValueError, match=rf"create_model: \['{key}'\] would make the constructor read weights"):
        create_model("timm:resnet18", **{key: str(tmp_path / "w.pth")})


# He et al. 2016, Table 6 (params rounded to two significant digits).
@pytest.mark.parametrize(
    "name, documented_m", [("resnet20", 0.27), ("resnet32", 0.46), ("resnet56", 0.85), ("resnet110", 1.7)]
)
def test_cifar_resnet_params(name, documented_m):
    params_m = n_params(create_model(name)) / 1e6
    assert float(f"{params_m:.2g}") == documented_m


def test_resnet164_bottleneck_params():
    # He et al. 2016b ("Identity Mappings"), ResNet-164: 1.7 M params.
    assert float(f"{n_params(create_model('resnet164_bottleneck')) / 1e6:.2g}") == 1.7


@pytest.mark.parametrize("name, documented_macs", [("resnet56", 125.49e6), ("vgg16", 313.73e6)])
def test_cifar_macs(name, documented_macs):
    macs = count_macs(create_model(name), 32)
    assert abs(macs - documented_macs) / documented_macs < 0.01


def test_resnet56_shortcut_is_parameter_free():
    model = create_model("resnet56")
    downsamples = [m.downsample for m in model.modules() if hasattr(m, "downsample")]
    assert sum(d is not None for d in downsamples) == 2  # stage 2 and stage 3 entries
    assert all(d is None or n_params(d) == 0 for d in downsamples)
    # Option A: subsampled input in the middle channels, zeros in the padded ones.
    block = model.layer2[0]
    x = torch.randn(2, 16, 8, 8)
    y = block.downsample(x)
    assert y.shape == (2, 32, 4, 4)
    assert torch.equal(y[:, 8:24], x[:, :, ::2, ::2])
    assert not y[:, :8].any() and not y[:, 24:].any()


def _random_bn_model(name: str) -> nn.Module:
    """Model `name` in float64, eval mode, with random BN statistics and affine terms."""
    return random_bn_(create_model(name).double(), torch.Generator().manual_seed(4)).eval()


def _bn(y: torch.Tensor, bn: nn.BatchNorm2d) -> torch.Tensor:
    return F.batch_norm(y, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)


def test_blocks_compute_what_the_papers_define():
    """A basic block (option-A shortcut, stride 2), a bottleneck (projection shortcut, stride 2 in the 3x3) and a
    VGG stage against float64 references written from their definitions, eval mode, random BN statistics."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, 8, 8, dtype=torch.float64)
    basic = _random_bn_model("resnet20").layer2[0]
    y = F.relu(_bn(F.conv2d(x, basic.conv1.weight, stride=2, padding=1), basic.bn1))
    y = _bn(F.conv2d(y, basic.conv2.weight, padding=1), basic.bn2)
    with torch.no_grad():
        torch.testing.assert_close(basic(x), F.relu(y + F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, 8, 8))))

    x = torch.randn(2, 64, 8, 8, dtype=torch.float64)
    block = _random_bn_model("resnet29_bottleneck").layer2[0]
    y = F.relu(_bn(F.conv2d(x, block.conv1.weight), block.bn1))
    y = F.relu(_bn(F.conv2d(y, block.conv2.weight, stride=2, padding=1), block.bn2))
    y = _bn(F.conv2d(y, block.conv3.weight), block.bn3)
    shortcut = _bn(F.conv2d(x, block.downsample[0].weight, stride=2), block.downsample[1])
    with torch.no_grad():
        torch.testing.assert_close(block(x), F.relu(y + shortcut))

    x = torch.randn(2, 3, 7, 7, dtype=torch.float64)  # odd: VGG's pools round up
    features = _random_bn_model("vgg11").features
    y = F.relu(_bn(F.conv2d(x, features[0].weight, padding=1), features[1]))
    with torch.no_grad():
        torch.testing.assert_close(features[:4](x), F.max_pool2d(y, 2, ceil_mode=True))


def test_bottleneck_structure():
    model = create_model("resnet29_bottleneck")
    outs = [
        model.layer1[0].conv3.out_channels,
        model.layer2[0].conv3.out_channels,
        model.layer3[0].conv3.out_channels,
    ]
    assert outs == [64, 128, 256]
    # PiX squeeze factors (conv1 in/out channels): 1 for the very first block, 2 at stage entries, 4 elsewhere.
    factors = [
        b.conv1.in_channels // b.conv1.out_channels
        for s in (model.layer1, model.layer2, model.layer3)
        for b in s
    ]
    assert factors == [1, 4, 4, 2, 4, 4, 2, 4, 4]
    for stage in (model.layer1, model.layer2, model.layer3):
        assert isinstance(stage[0].downsample[0], nn.Conv2d) and isinstance(
            stage[0].downsample[1], nn.BatchNorm2d
        )
        assert all(b.downsample is None for b in stage[1:])


def test_bottleneck_zero_init_last():
    """CIFAR bottlenecks start each residual branch at zero (bn3 weight 0); basic blocks keep 1; opt-out works."""
    model = create_model("resnet29_bottleneck")
    blocks = [b for s in (model.layer1, model.layer2, model.layer3) for b in s]
    assert all(
        not b.bn3.weight.any() and torch.equal(b.bn2.weight, torch.ones_like(b.bn2.weight)) for b in blocks
    )
    assert all(
        torch.equal(b.downsample[1].weight, torch.ones_like(b.downsample[1].weight)) for b in blocks[::3]
    )
    off = create_model("resnet29_bottleneck", zero_init_last=False)
    assert all(b.bn3.weight.eq(1).all() for s in (off.layer1, off.layer2, off.layer3) for b in s)
    assert create_model("resnet20").layer1[0].bn2.weight.eq(1).all()
    assert not create_model("resnet20", zero_init_last=True).layer1[0].bn2.weight.any()


def test_block_layer_types_are_used():
    class MyConv(nn.Conv2d):
        pass

    class MyAct(nn.ReLU):
        pass

    model = create_model("resnet20", conv_layer=MyConv, norm_layer=nn.Identity)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 19 and all(type(m) is MyConv for m in convs)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    # bottlenecks: their projection shortcuts too (SWP prunes them), and every activation
    model = create_model("resnet29_bottleneck", conv_layer=MyConv, act_layer=MyAct)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 31 and all(type(m) is MyConv for m in convs)
    assert sum(type(m) is MyAct for m in model.modules()) == 28 and not any(type(m) is nn.ReLU for m in model.modules())


def test_weight_init():
    torch.manual_seed(0)
    model = create_model("vgg16")
    conv = model.features[14]  # a 128 -> 256 conv: fan_out = 256 * 9
    assert conv.weight.std().item() == pytest.approx((2 / (256 * 9)) ** 0.5, rel=0.02)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    with torch.no_grad():  # BN's own init is already 1 and 0: moved first, so init_weights must set them
        for b in bns:
            b.weight.fill_(0.5), b.bias.fill_(0.5)
    from compress.models._weight_init import init_weights

    init_weights(model)
    assert all(torch.equal(b.weight, torch.ones_like(b.weight)) and not b.bias.any() for b in bns)


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("resnet56", {}),
        ("resnet29_bottleneck", {"widths": [8, 16, 32]}),
        ("vgg11", {"in_chans": 1}),
        ("mobilenet_v2", {"width_mult": 0.5}),
        ("timm:resnet18", {"num_classes": 4}),
    ],
)
def test_compress_arch_rebuilds(name, kwargs):
    model = create_model(name, **kwargs)
    arch = model.compress_arch
    assert arch["name"] == name
    assert {"num_classes", "input_size", "in_chans"} <= set(arch["kwargs"])
    arch = json.loads(json.dumps(arch))  # the checkpoint stores it as JSON
    rebuilt = create_model(arch["name"], **arch["kwargs"])
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    assert shapes == {k: v.shape for k, v in rebuilt.state_dict().items()}
    assert rebuilt.compress_arch == arch


def test_unknown_model_error():
    with pytest.raises(ValueError, match=r"unknown model 'resnet57'.*resnet56.*timm:<name>"):
        create_model("resnet57")
    with pytest.raises(ValueError, match="timm has no model 'not_a_model'"):
        create_model("timm:not_a_model")


@pytest.mark.parametrize("name", ["resnet20", "timm:resnet18"])
def test_create_model_sizes_must_be_positive_ints(name):
    """num_classes, input_size and in_chans are refused by name before the builder runs (timm would take num_classes
    <= 0 as "no classifier", and a bad input_size reached compress_arch and later MAC budgets)."""
    for key, value in [("num_classes", 0), ("num_classes", -3), ("num_classes", True), ("in_chans", 1.5),
                       ("input_size", 2.5), ("input_size", "32"), ("input_size", (32, 32))]:
        with pytest.raises(ValueError, match=rf"create_model: {key} must be a positive int, got {re.escape(repr(value))}"):
            create_model(name, **{key: value})


def test_bad_depth_and_duplicate_registration():
    from compress.models.cifar_resnet import _create_cifar_resnet

    with pytest.raises(ValueError, match="6n\\+2"):
        _create_cifar_resnet(21, bottleneck=False)
    with pytest.raises(ValueError, match="3 stage depths for 2 stage widths"):
        create_model("resnet20", widths=[8, 16])
    with pytest.raises(ValueError, match="shortcut must be 'pad' or 'conv', got 'Conv'"):
        create_model("resnet20", shortcut="Conv")
    with pytest.raises(ValueError, match="already registered"):

        @register_model
        def resnet56():
            pass


def broken_state(model: nn.Module) -> dict:
    """`model`'s state dict with one NaN in conv1.weight."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["conv1.weight"][0, 0, 0, 0] = float("nan")
    return state


class _Payload:
    """Unpickling it would run a shell command that creates `marker` (it never is: weights_only)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_load_weights_takes_a_state_dict_file_and_keeps_a_classifier_of_other_classes_fresh(tmp_path):
    """A pretrained file (here a random torchvision ResNet-18 of 1000 classes, saved as torchvision does, wrapped as
    training scripts do, and as timm's safetensors) loads into create_model's model; a classifier of another size
    stays as initialised; another architecture, input channels or a pickled whole model are clear errors."""
    import torchvision
    from safetensors.torch import save_file

    from compress.models import load_weights

    torch.manual_seed(0)
    source = torchvision.models.resnet18(num_classes=1000)
    with torch.no_grad():
        source.layer4[1].bn2.running_var.uniform_(0.5, 2)  # buffers travel too
    torch.save(source.state_dict(), tmp_path / "r18.pth")
    model = create_model("resnet18", num_classes=10)
    fc_before = model.fc.weight.clone()
    assert load_weights(model, tmp_path / "r18.pth") == ["fc.bias", "fc.weight"]
    for key, value in source.state_dict().items():
        if not key.startswith("fc."):
            assert torch.equal(model.state_dict()[key], value), key
    assert torch.equal(model.fc.weight, fc_before)
    # a file without num_batches_tracked (saved by an older torch, or trimmed) loads with nothing missing
    torch.save({k: v for k, v in source.state_dict().items() if not k.endswith("num_batches_tracked")},
               tmp_path / "untracked.pth")
    assert load_weights(create_model("resnet18", num_classes=1000), tmp_path / "untracked.pth") == []
    # a VGG's head is its last Linear (classifier.6), not its first: kept fresh at another class count
    vgg = torchvision.models.vgg11_bn(num_classes=1000)
    torch.save(vgg.state_dict(), tmp_path / "vgg.pth")
    assert load_weights(create_model("vgg11_bn", num_classes=10), tmp_path / "vgg.pth") == ["classifier.6.bias",
                                                                                           "classifier.6.weight"]
    torch.save({"n_averaged": torch.tensor(3)}, tmp_path / "count_only.pth")  # once looped for ever
    with pytest.raises(ValueError, match="count_only.pth holds no state dict"):
        load_weights(create_model("resnet18"), tmp_path / "count_only.pth")

    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in source.state_dict().items()}}, tmp_path / "w.pth")
    same_classes = create_model("resnet18", num_classes=1000)
    assert load_weights(same_classes, tmp_path / "w.pth") == []
    assert torch.equal(same_classes.fc.weight, source.fc.weight)

    timm_source = create_model("timm:resnet26d", num_classes=1000)
    save_file(timm_source.state_dict(), str(tmp_path / "t.safetensors"))
    timm_model = create_model("timm:resnet26d", num_classes=5)
    assert load_weights(timm_model, tmp_path / "t.safetensors") == ["fc.bias", "fc.weight"]  # timm's get_classifier
    assert torch.equal(timm_model.conv1[0].weight, timm_source.conv1[0].weight)

    with pytest.raises(ValueError, match=r"does not fit ResNet: missing: layer1.2.conv1.weight.*same architecture"):
        load_weights(create_model("resnet34"), tmp_path / "r18.pth")
    with pytest.raises(ValueError, match=r"other shapes: conv1.weight \(64, 3, 7, 7\) \(model: \(64, 1, 7, 7\)\)"):
        load_weights(create_model("resnet18", in_chans=1), tmp_path / "r18.pth")
    torch.save(source, tmp_path / "whole.pth")
    with pytest.raises(ValueError, match="holds Python objects besides tensors .* never loaded"):
        load_weights(create_model("resnet18"), tmp_path / "whole.pth")
    torch.save({"w": _Payload(tmp_path / "ran")}, tmp_path / "payload.pth")  # torch words a blocked module's global differently
    with pytest.raises(ValueError, match=r"payload.pth holds Python objects besides tensors \(posix.system\)"):
        load_weights(create_model("resnet18"), tmp_path / "payload.pth")
    assert not (tmp_path / "ran").exists()
    torch.save(source.state_dict(), tmp_path / "torch_named.safetensors")  # a torch file named like safetensors
    assert load_weights(create_model("resnet18", num_classes=1000), tmp_path / "torch_named.safetensors") == []
    for text in ("not a checkpoint at all", '{"json": 1}'):
        (tmp_path / "text.pth").write_text(text)
        with pytest.raises(ValueError, match=r"text.pth is not a torch file[^;]*$") as info:
            load_weights(create_model("resnet18"), tmp_path / "text.pth")
        assert "weights_only" not in str(info.value)  # not torch's advice to unpickle it after all
    save_file({f"module.{k}": v for k, v in broken_state(source).items()}, str(tmp_path / "nan.safetensors"))
    with pytest.raises(ValueError, match=r"nan.safetensors holds NaN or inf values in conv1.weight"):  # prefix gone too
        load_weights(create_model("resnet18"), tmp_path / "nan.safetensors")
    import argparse  # training scripts' checkpoints: their args, tensor metadata beside the wrapped state dict

    torch.save({"model": source.state_dict(), "args": argparse.Namespace(lr=0.1), "epoch": 3,
                "best_acc1": torch.tensor(70.1)}, tmp_path / "script.pth")
    assert load_weights(create_model("resnet18", num_classes=1000), tmp_path / "script.pth") == []
    # another script's {"model", "optimizer", "config"} checkpoint is not train.py's: its model is unwrapped
    optimizer = torch.optim.SGD(source.parameters(), lr=0.1)
    torch.save({"model": source.state_dict(), "optimizer": optimizer.state_dict(), "config": {"lr": 0.1}},
               tmp_path / "generic.pth")
    assert load_weights(create_model("resnet18", num_classes=1000), tmp_path / "generic.pth") == []
    # AveragedModel's state dict (module. keys and n_averaged), compiled around DDP (_orig_mod.module.)
    averaged = {f"module.{k}": v for k, v in source.state_dict().items()} | {"n_averaged": torch.tensor(5)}
    torch.save(averaged, tmp_path / "swa.pth")
    torch.save({f"_orig_mod.module.{k}": v for k, v in source.state_dict().items()}, tmp_path / "compiled_ddp.pth")
    for name in ("swa.pth", "compiled_ddp.pth"):
        loaded = create_model("resnet18", num_classes=1000)
        assert load_weights(loaded, tmp_path / name) == [] and torch.equal(loaded.conv1.weight, source.conv1.weight)
    torch.save({"model": {"arch": "resnet18", "depth": 18}, "model_state_dict": source.state_dict()}, tmp_path / "m.pth")
    assert load_weights(create_model("resnet18", num_classes=1000), tmp_path / "m.pth") == []  # the tensors' wrapper
    torch.save(broken_state(source), tmp_path / "nan.pth")
    with pytest.raises(ValueError, match=r"nan.pth holds NaN or inf values in conv1.weight"):
        load_weights(create_model("resnet18"), tmp_path / "nan.pth")
    compress.save(create_model("resnet20"), tmp_path / "compact.safetensors")
    with pytest.raises(ValueError, match=r"is a compact model file .*init="):
        load_weights(create_model("resnet20"), tmp_path / "compact.safetensors")
    with pytest.raises(FileNotFoundError, match="no file at .*nothing is downloaded"):
        load_weights(create_model("resnet18"), tmp_path / "absent.pth")
    whole = (tmp_path / "t.safetensors").read_bytes()  # cut short (a broken copy): safetensors' own error type
    (tmp_path / "half.safetensors").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ValueError, match=r"half.safetensors is a damaged .safetensors file \(.*incomplete .*copy "):
        load_weights(create_model("resnet18"), tmp_path / "half.safetensors")


def test_load_weights_strips_a_module_prefix_only_when_every_key_has_it(tmp_path):
    """The "module." prefix (DataParallel/DDP) is cut only where every key carries it: a model whose own child is
    named `module` (beside a `head`) keeps its keys, and its file loads as saved; cutting 7 characters off every key
    as soon as one has the prefix mangled both children's names."""
    from collections import OrderedDict

    from compress.models import load_weights

    def build(seed):
        net = nn.Sequential(OrderedDict(module=nn.Conv2d(3, 4, 3), head=nn.Linear(4, 5)))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        return net

    source = build(0)
    torch.save(source.state_dict(), tmp_path / "own_module.pth")
    fresh = build(1)
    assert not torch.equal(fresh.module.weight, source.module.weight)
    assert load_weights(fresh, tmp_path / "own_module.pth") == []
    got, want = fresh.state_dict(), source.state_dict()
    assert got.keys() == want.keys() == {"module.weight", "module.bias", "head.weight", "head.bias"}
    assert all(torch.equal(got[k], want[k]) for k in want)
