"""compress.compact: the compact model's eval output equals the skeleton model's (the reference)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from randomize import random_bn_

import compress
from compress import compact, load, save
from compress.models import create_model
from compress.profile import profile
from compress.skeleton import SkeletonConv2d, attach_skeletons, swp_update
from compress.stripe import StripeConv2d

RTOL = 1e-5


def skeleton_model(name: str, size: int, seed: int = 0, dead: float = 0.2, zero_bn: bool = True) -> nn.Module:
    """`name` with skeletons keeping 30-70% of stripes at random, a fraction `dead` (at least one) of the
    filters with no stripe,
    BN statistics random; with `zero_bn` the dead filters' BN is zeroed as swp_update does."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = create_model(name, num_classes=10, input_size=size)
    attach_skeletons(model)
    random_bn_(model, gen)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SkeletonConv2d):
                keep = 0.3 + 0.4 * float(torch.rand(1, generator=gen))
                fs = torch.rand(m.skeleton.shape, generator=gen) + 0.5
                fs = fs * torch.sign(torch.rand(m.skeleton.shape, generator=gen) - 0.2)
                fs[torch.rand(m.skeleton.shape, generator=gen) > keep] = 0
                fs[torch.randperm(m.out_channels, generator=gen)[: max(1, round(dead * m.out_channels))]] = 0
                m.skeleton.copy_(fs)
    if zero_bn:
        swp_update(model, alpha=0.0, threshold=0.0)
    return model.eval()


def alive(conv: SkeletonConv2d) -> int:
    return int(conv.stripe_mask(0.0).flatten(1).any(1).sum())


def assert_same_output(ref_model: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        ref, out = ref_model(x), model(x)
    err = float((out - ref).abs().max() / ref.abs().max())
    assert err <= RTOL, f"relative error {err:.2e}"


# (model, input size, [(producer, consumer)] pairs whose dead filters must be removed,
#  [convs feeding a residual add, whose output channels must stay])
CASES = {
    "resnet56": (32, [(f"layer{s}.{b}.conv1", f"layer{s}.{b}.conv2") for s in (1, 2, 3) for b in (0, 8)],
                 ["layer1.0.conv2", "layer3.8.conv2", "conv1"]),
    "vgg16": (32, [("features.0", "features.3"), ("features.34", "features.37"), ("features.40", "classifier")],
              []),
    "resnet18": (64, [("layer1.0.conv1", "layer1.0.conv2"), ("layer4.1.conv1", "layer4.1.conv2")],
                 ["layer2.0.conv2", "layer4.1.conv2"]),
    "resnet50": (64, [("layer1.0.conv2", "layer1.0.conv3"), ("layer4.2.conv2", "layer4.2.conv3")], []),
}  # fmt: skip
FOLD_BN_CASES = ("resnet56", "resnet18")


@pytest.mark.parametrize("name", list(CASES))
def test_compact_equals_skeleton_model(name, tmp_path):
    size, chains, residual = CASES[name]
    model = skeleton_model(name, size)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    for fold in (False, True) if name in FOLD_BN_CASES else (False,):
        out = compact(model, fold_bn=fold)
        assert_same_output(model, out, x)
        save(out, tmp_path / f"{name}-{fold}.safetensors")  # and after a save/load round trip
        loaded = load(tmp_path / f"{name}-{fold}.safetensors")
        assert_same_output(model, loaded, x)
        assert loaded.compress_compaction == out.compress_compaction
        assert out.compress_arch == model.compress_arch and out.compress_compaction["threshold"] == 0.0
        assert any(isinstance(m, StripeConv2d) for m in out.modules())
        assert not any(isinstance(m, SkeletonConv2d) for m in out.modules())
        for producer, consumer in chains:
            kept = alive(model.get_submodule(producer))
            assert kept < model.get_submodule(producer).out_channels, "the random masks must kill filters"
            assert out.get_submodule(producer).out_channels == kept
            c = out.get_submodule(consumer)
            assert (c.in_features if isinstance(c, nn.Linear) else c.in_channels) == kept
        for conv in residual:
            assert out.get_submodule(conv).out_channels == model.get_submodule(conv).out_channels
        n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in out.modules())
        assert (n_bn == 0) if fold else (n_bn > 0)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "compact changed the caller's model"


@pytest.mark.parametrize("name, size, fused, pools", [("vgg11", 32, 8, 5), ("resnet20", 32, 10, 0),
                                                     ("resnet18", 32, 1, 0)])
def test_fuse_relu_takes_each_conv_relu_into_the_conv(name, size, fused, pools, tmp_path):
    """compact(fold_bn=True, fuse_relu=True): a conv whose only consumer is a ReLU (through folded BNs) runs it
    in its epilogue; shared ReLU modules (torchvision's blocks: only the stem qualifies) stay; a stripe conv also
    takes the 2x2 max-pool after its ReLU (VGG11: all five, each after a pruned conv). Same output, also after
    save/load and as ONNX (dense and shift stripe modes), and the same MACs in both conventions."""
    from compress.onnx_export import check_onnx, export_onnx
    from compress.pooling import MaxPool2d
    from compress.stripe import Conv2dReLU

    model = skeleton_model(name, size)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(2))
    plain = compact(model, fold_bn=True)
    out = compact(model, fold_bn=True, fuse_relu=True)
    assert out.compress_compaction["relu_fused"] == fused
    assert out.compress_compaction["pool_fused"] == pools
    assert sum(isinstance(m, nn.MaxPool2d) for m in out.modules()) == sum(
        isinstance(m, nn.MaxPool2d) for m in plain.modules()) - pools
    # the pools left are compaction's fast CPU max-pool (plain compaction keeps nn.MaxPool2d)
    assert all(type(m) is MaxPool2d for m in out.modules() if isinstance(m, nn.MaxPool2d))
    assert not any(type(m) is MaxPool2d for m in plain.modules())
    convs = [m for m in out.modules() if isinstance(m, Conv2dReLU) or getattr(m, "relu", False) is True]
    assert len(convs) == fused
    n_relu = sum(type(m) is nn.ReLU for m in out.modules())
    assert n_relu == sum(type(m) is nn.ReLU for m in plain.modules()) - (fused if name != "resnet18" else 1)
    assert_same_output(plain, out, x)
    assert_same_output(plain, load(save(out, tmp_path / "fused.safetensors")), x)
    # onnxruntime's error on the fused export is the unfused export's (shift mode on VGG11 only: the ResNets' shift-mode
    # exports take seconds and add no fused module type VGG11 lacks)
    for mode in ("dense", "shift") if name == "vgg11" else ("dense",):
        base = check_onnx(export_onnx(plain, tmp_path / f"plain-{mode}.onnx", (3, size, size), stripe_mode=mode),
                          plain, x)
        path = export_onnx(out, tmp_path / f"fused-{mode}.onnx", (3, size, size), stripe_mode=mode)
        assert check_onnx(path, plain, x) <= max(1e-4, 1.01 * base)
    for convention in ("layers", "paper"):
        macs = [profile(m, (3, size, size), latency=False, convention=convention).macs for m in (plain, out)]
        assert macs[0] == macs[1], convention
    with pytest.raises(ValueError, match="fuse_relu=True needs fold_bn=True"):
        compact(model, fuse_relu=True)


@pytest.mark.parametrize("ceil_mode", [False, True])
def test_fuse_relu_takes_a_pool_with_its_ceil_mode(ceil_mode):
    """The 2x2 max-pool a stripe conv takes keeps its ceil mode: on 9x9 maps (odd) floor pools 4x4, ceil 5x5."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.MaxPool2d(2, ceil_mode=ceil_mode), nn.Flatten(), nn.LazyLinear(5))
    x = torch.randn(2, 3, 9, 9, generator=torch.Generator().manual_seed(1))
    model(x)
    attach_skeletons(model)
    random_bn_(model, torch.Generator().manual_seed(2))
    with torch.no_grad():
        fs = torch.rand(model[0].skeleton.shape, generator=torch.Generator().manual_seed(3)) + 0.5
        model[0].skeleton.copy_(torch.where(fs < 0.9, 0.0, fs))  # about 40% of the stripes pruned
    out = compact(model.eval(), fold_bn=True, fuse_relu=True)
    assert out.compress_compaction["pool_fused"] == 1 and out[0].pool_ceil is ceil_mode
    assert_same_output(model, out, x)


class _DeadFilterNet(nn.Module):
    """conv1 (filters 1 and 4 dead) -> bn1 (biases 0.5-1.5: the dead filters output constants) -> act -> conv2, in
    float64 eval; `variant` changes one piece that dead-filter removal must handle or leave alone."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.conv1 = nn.Conv2d(4, 8, 3, padding=1, bias=False, groups=2 if variant == "grouped producer" else 1)
        self.bn1 = nn.BatchNorm2d(8)
        self.act = nn.ReLU()
        padding = "same" if variant == "same-padded consumer" else 0
        self.conv2 = nn.Conv2d(8, 8, 3 if padding else 1, padding=padding, bias=False)
        self.bn2 = self.bn1 if variant == "shared bn" else nn.BatchNorm2d(8)
        gen = torch.Generator().manual_seed(5)
        random_bn_(self, gen)
        with torch.no_grad():
            self.bn1.bias.copy_(torch.rand(8, generator=gen) + 0.5)
            if variant == "leaky_relu(0.2)":
                self.bn1.bias.sub_(3.0)  # negative constants: the slope matters
            self.conv1.weight[[1, 4]] = 0
        if variant == "hooked activation":  # a per-channel scale in a hook: the ReLU's channels must stay
            scale = torch.rand(8, 1, 1, generator=gen, dtype=torch.float64) + 0.5
            self.act.register_forward_hook(lambda module, inputs, out: out * scale)
        self.double().eval()

    def forward(self, x):
        y = self.bn1(self.conv1(x))
        y = F.leaky_relu(y, 0.2) if self.variant == "leaky_relu(0.2)" else self.act(y)
        return self.bn2(self.conv2(y))


@pytest.mark.parametrize("variant", ["hooked activation", "same-padded consumer", "leaky_relu(0.2)", "shared bn",
                                     "grouped producer"])
@pytest.mark.parametrize("fold", [False, True])
def test_dead_filter_removal_keeps_the_function_of_odd_chains(variant, fold):
    """Dead filters whose constant output a hook, a 'same'-padded consumer, a functional activation with arguments,
    a BN shared by two convs or a grouped producer could get wrong: the compact model equals the model (float64);
    a hooked activation or a padded consumer keeps the filters."""
    model = _DeadFilterNet(variant)
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    out = compact(model, fold_bn=fold)
    assert_same_output(model, out, x)
    if variant in ("hooked activation", "same-padded consumer"):
        assert out.conv1.out_channels == 8
    elif variant == "leaky_relu(0.2)":
        assert out.conv1.out_channels == 6  # removed, their constants folded into conv2


def test_a_hooked_layer_before_a_dead_conv_keeps_what_it_sees():
    """conv a -> BN -> hooked ReLU -> conv b with no stripe left (+ a parallel conv): b reads only its input's shape,
    but the hook records the ReLU's values, so a keeps its work (it became a StripeConv2d with no stripe, and the
    hook saw other features); the model's output is the masked model's either way."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.bna, self.relu = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
            self.b, self.p = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(3, 8, 1)

        def forward(self, x):
            return self.b(self.relu(self.bna(self.a(x)))) + self.p(x)

    torch.manual_seed(0)
    model = Net()
    attach_skeletons(model)
    random_bn_(model, torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.b.skeleton.zero_()
    model.double().eval()
    seen = []
    model.relu.register_forward_hook(lambda module, inputs, out: seen.append(out.clone()))
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    small = compact(model, fold_bn=True)
    assert_same_output(model, small, x)
    seen.clear()
    with torch.no_grad():
        model(x), small(x)
    torch.testing.assert_close(seen[1], seen[0], rtol=1e-12, atol=1e-12)
    assert not isinstance(small.a, StripeConv2d) or small.a.num_stripes > 0


@pytest.mark.parametrize("name,excluded", [("resnet18", "layer1.0.conv2"), ("vgg11_bn", "features.4")])
def test_a_channels_last_model_keeps_channels_last_weights_through_attach_and_compaction(name, excluded):
    """The convs attach_skeletons and compaction rebuild or shrink (skeleton convs; a plain conv whose input loses
    the dead filters before it, BN folded, fused ReLU) kept device and dtype but came back NCHW in a channels_last
    model."""

    def nchw(model):
        return [n for n, p in model.named_parameters() if p.dim() == 4 and p.shape[2] * p.shape[3] > 1
                and not p.is_contiguous(memory_format=torch.channels_last)]

    gen = torch.Generator().manual_seed(3)
    model = create_model(name, num_classes=10).to(memory_format=torch.channels_last)
    attach_skeletons(model, exclude=[excluded])
    assert nchw(model) == []
    random_bn_(model, gen)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SkeletonConv2d):
                m.skeleton.mul_(torch.rand(m.skeleton.shape, generator=gen) > 0.4)
                m.skeleton[: m.out_channels // 4] = 0  # dead filters
    swp_update(model, alpha=0.0, threshold=0.0)
    model.eval()
    x = torch.randn(2, 3, 32, 32, generator=gen).to(memory_format=torch.channels_last)
    for kwargs in ({}, {"fold_bn": True, "fuse_relu": True}):
        out = compact(model, **kwargs)
        shrunk = out.get_submodule(excluded)
        assert shrunk.in_channels < model.get_submodule(excluded).in_channels  # the plain conv was cut
        assert nchw(out) == []
        assert_same_output(model, out, x)


def test_compaction_keeps_frozen_parameters_frozen():
    """A frozen model compacts frozen: the biases BN folding and dead-filter removal add do not train."""
    model = _DeadFilterNet("leaky_relu(0.2)").requires_grad_(False)
    out = compact(model, fold_bn=True)
    assert out.conv1.bias is not None and not any(p.requires_grad for p in out.parameters())


def test_fuse_relu_leaves_a_padded_pool():
    """A 2x2 max-pool with padding is not the stripe kernel's epilogue pool: it stays a module, same output."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.MaxPool2d(2, 2, padding=1), nn.Conv2d(8, 4, 3))
    attach_skeletons(model)
    random_bn_(model, torch.Generator().manual_seed(2))
    with torch.no_grad():
        fs = torch.rand(model[0].skeleton.shape, generator=torch.Generator().manual_seed(3)) + 0.5
        model[0].skeleton.copy_(torch.where(fs < 0.9, 0.0, fs))
    out = compact(model.eval(), fold_bn=True, fuse_relu=True)
    assert out.compress_compaction["pool_fused"] == 0
    assert_same_output(model, out, torch.randn(2, 3, 9, 9, generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("name, act", [("timm:regnetx_002", nn.ReLU), ("timm:efficientnet_b0", nn.SiLU)])
def test_timm_batchnorm_act_folds_into_its_activation(name, act, tmp_path):
    """timm's BatchNormAct2d (BN -> act in one module) folds like a BatchNorm2d and leaves its activation in its
    place, which fuse_relu then takes into the conv where it is a ReLU; same output (float64), also after save/load."""
    from timm.layers import BatchNormAct2d

    model = skeleton_model(name, 32).double()
    assert sum(type(m) is BatchNormAct2d for m in model.modules()) > 10
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out = compact(model, fold_bn=True, fuse_relu=True)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in out.modules())
    assert (out.compress_compaction["relu_fused"] > 10) == (act is nn.ReLU)
    assert any(type(m) is act for m in out.modules())
    assert_same_output(model, out, x)
    assert_same_output(model, load(save(out.float(), tmp_path / "m.safetensors")).double(), x)


def test_compacting_a_compact_model_folds_its_bn_and_removes_new_dead_filters():
    """A compact model with its BN (fold_bn=False, what init= fine-tunes) compacted again with fold_bn and
    fuse_relu (export): every BN folds, ReLUs fuse into its stripe convs, a filter that lost all its stripes
    since (here: zeroed) is removed, and the output is unchanged."""
    model = skeleton_model("resnet20", 32)
    first = compact(model)
    gen = torch.Generator().manual_seed(3)
    random_bn_(first, gen)  # "fine-tuned": BN statistics moved
    conv = first.layer1[0].conv1
    assert isinstance(conv, StripeConv2d) and conv.out_channels > 1
    with torch.no_grad():
        conv.weight[conv.out_index == conv.out_index[0]] = 0  # one filter lost its last stripes
    x = torch.randn(2, 3, 32, 32, generator=gen)
    again = compact(first, fold_bn=True, fuse_relu=True)
    assert_same_output(first, again, x)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in again.modules())
    assert again.compress_compaction["relu_fused"] > 0
    assert again.layer1[0].conv1.out_channels == conv.out_channels - 1
    stripes = {n: m.num_stripes for n, m in first.named_modules() if isinstance(m, StripeConv2d)}
    assert {n: m.num_stripes for n, m in again.named_modules() if isinstance(m, StripeConv2d)} == stripes | {
        "layer1.0.conv1": stripes["layer1.0.conv1"] - int((conv.out_index == conv.out_index[0]).sum())}
    # a folded compact model (stripe convs with biases) compacted again keeps its output
    folded = compact(model, fold_bn=True)
    assert any(isinstance(m, StripeConv2d) and m.bias is not None for m in folded.modules())
    assert_same_output(folded, compact(folded), x)


def test_a_compact_model_compacted_again_keeps_the_record_of_what_chose_its_stripes():
    """compact() of a compact model keeps its stripes (a threshold given then warns that it has no effect), and its
    record keeps the first threshold and dense MACs, with the new layout's fold_bn; a model that never had
    skeletons records no threshold."""
    model = skeleton_model("resnet20", 32)
    first = compact(model, threshold=0.05)
    stripes = {n: m.num_stripes for n, m in first.named_modules() if isinstance(m, StripeConv2d)}
    with pytest.warns(UserWarning, match=r"threshold=0.5 has no effect: the model has no skeletons"):
        again = compact(first, threshold=0.5, fold_bn=True)
    assert {n: m.num_stripes for n, m in again.named_modules() if isinstance(m, StripeConv2d)} == stripes
    assert again.compress_compaction["threshold"] == 0.05 and again.compress_compaction["fold_bn"] is True
    # folded and fused by the first pass: the record says so after a second pass that has nothing left to fold
    fused = compact(model, fold_bn=True, fuse_relu=True)
    twice = compact(fused, fold_bn=True, fuse_relu=True)
    assert compact(fused).compress_compaction["fold_bn"] is True
    assert twice.compress_compaction["relu_fused"] == fused.compress_compaction["relu_fused"] > 0
    plain = compact(create_model("resnet20", num_classes=10))
    assert plain.compress_compaction["threshold"] is None


@pytest.mark.parametrize("name", ["resnet56", "vgg16"])
def test_channel_multiple_keeps_harmless_channels_exactly(name):
    size, chains, _ = CASES[name]
    model = skeleton_model(name, size, dead=0.4)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    out = compact(model, fold_bn=True, channel_multiple=8)
    assert_same_output(model, out, x)
    assert out.compress_compaction["channel_multiple"] == 8
    for producer, _consumer in chains:
        full, kept = model.get_submodule(producer).out_channels, alive(model.get_submodule(producer))
        assert out.get_submodule(producer).out_channels == min(full, -(-kept // 8) * 8)
    with pytest.raises(ValueError, match="channel_multiple must be an int >= 1"):
        compact(model, channel_multiple=0)


def test_a_pruned_conv_stripe_convs_cannot_express_is_an_error_naming_it():
    """A skeleton conv built by hand on a reflect-padded conv (attach_skeletons leaves those dense) with a pruned
    stripe: compaction refuses it, naming the layer."""
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(),
                        SkeletonConv2d.from_conv(nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect")))
    with torch.no_grad():
        net[2].skeleton[0, 0, 0] = 0
    with pytest.raises(ValueError, match=r"compact: 2: padding_mode='reflect' is not supported by stripe compaction"):
        compact(net.eval())


def test_stripe_conv_from_skeleton_keeps_stride_and_mask():
    model = skeleton_model("resnet20", 32, seed=3)
    out = compact(model)
    src, dst = model.layer2[0].conv1, out.layer2[0].conv1  # the stride-2 conv of stage 2
    assert isinstance(dst, StripeConv2d) and dst.stride == (2, 2)
    assert dst.num_stripes == int(src.stripe_mask(0.0).sum())


def test_nonzero_bn_bias_of_dead_filters_is_folded_or_kept_exactly():
    # BN not zeroed: a dead filter outputs relu(bn(0)) != 0. Unpadded consumers (1x1 conv3 of a
    # bottleneck, the final Linear of VGG) absorb it in their bias; padded 3x3 consumers keep the filter.
    for name, producer, consumer, padded in [
        ("resnet29_bottleneck", "layer2.1.conv2", "layer2.1.conv3", False),
        ("vgg11", "features.25", "classifier", False),
        ("vgg11", "features.0", "features.4", True),
    ]:
        model = skeleton_model(name, 32, seed=4, dead=0.3, zero_bn=False)
        with torch.no_grad():  # BN output > 0 for a zero input: every dead filter's constant is nonzero
            for m in model.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.bias.add_(1.5)
        x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
        out = compact(model)
        assert_same_output(model, out, x)
        src = model.get_submodule(producer)
        expected = src.out_channels if padded else alive(src)
        assert out.get_submodule(producer).out_channels == expected
        if not padded:
            assert out.get_submodule(consumer).bias is not None


def test_empty_residual_branch_is_removed_exactly():
    model = skeleton_model("resnet20", 32, seed=6)
    block = model.layer2[1]
    with torch.no_grad():
        block.conv2.skeleton.zero_()
    swp_update(model, alpha=0.0, threshold=0.0)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    for fold in (False, True):
        out = compact(model, fold_bn=fold)
        assert_same_output(model, out, x)
        b = out.layer2[1]
        assert isinstance(b.conv2, StripeConv2d) and b.conv2.num_stripes == 0
        assert isinstance(b.conv1, StripeConv2d) and b.conv1.num_stripes == 0 and b.conv1.out_channels == 1
    out64 = compact(model).to(torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(out64(x.double()).float(), model(x), rtol=1e-5, atol=1e-5)


def test_target_macs_far_undershot_by_tied_skeletons_warns():
    """Skeletons on two levels (as after a short run): no threshold lands near the budget; the one that meets it
    keeps far fewer MACs, and compact says so (with what the next lower threshold keeps)."""
    model = skeleton_model("resnet20", 32, seed=8, dead=0.0)
    gen = torch.Generator().manual_seed(10)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SkeletonConv2d):
                m.skeleton.copy_(torch.where(torch.rand(m.skeleton.shape, generator=gen) < 0.5, 0.5, 1.0))
    size = (3, 32, 32)
    dense = profile(model, size, latency=False).macs
    with pytest.warns(UserWarning, match=r"target_macs=0.4: threshold 1 meets the budget of 40% of the dense MACs "
                                         r"with only [\d.e-]+%, and the next lower one \(0.5\) keeps [4-6]\d\.?\d*%"):
        out = compact(model, target_macs=0.4, input_size=size)
    assert out.compress_compaction["macs"] < 0.1 * dense
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a budget the lower level meets closely: no warning
        compact(model, target_macs=0.6, input_size=size)


def test_target_macs_meets_budget_with_smallest_threshold():
    model = skeleton_model("resnet20", 32, seed=8, dead=0.0)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():  # |FS| on 12 levels, so that each threshold step drops some stripes
        for m in model.modules():
            if isinstance(m, SkeletonConv2d):
                levels = torch.randint(1, 13, m.skeleton.shape, generator=gen) / 8
                m.skeleton.copy_(torch.sign(m.skeleton) * levels)
    size = (3, 32, 32)
    dense = profile(model, size, latency=False).macs
    out = compact(model, target_macs=0.4, input_size=size)
    info = out.compress_compaction
    macs = profile(out, size, latency=False).macs
    assert info["dense_macs"] == dense and info["macs"] == macs <= 0.4 * dense
    t = info["threshold"]
    assert t > 0 and t in {k / 8 for k in range(1, 13)}
    below = compact(model, threshold=t - 1 / 8)  # the next smaller candidate misses the budget
    assert profile(below, size, latency=False).macs > 0.4 * dense
    assert_same_output(compact(model, threshold=t), out, torch.randn(2, *size, generator=gen))
    with pytest.raises(ValueError, match="target_macs=0.4 needs a model with skeletons"):
        compact(out, target_macs=0.4, input_size=size)  # a compact model has no stripes left to choose
    again = compact(out.eval(), fold_bn=True, fuse_relu=True, channel_multiple=8, input_size=size)  # re-export
    assert {k: again.compress_compaction[k] for k in ("threshold", "target_macs", "dense_macs")} == {
        "threshold": t, "target_macs": 0.4, "dense_macs": dense}
    assert again.compress_compaction["macs"] == profile(again, size, latency=False).macs  # its own, counted again
    assert compact(model, target_macs=macs, input_size=size).compress_compaction["threshold"] == t
    assert compact(model, target_macs=1.0, input_size=size).compress_compaction["threshold"] == 0.0
    with pytest.raises(ValueError, match=r"below what dropping every stripe reaches \(\d+ MACs, 0.\d+ of the dense "
                                         r"\d+\).*absolute MAC count"):
        compact(model, target_macs=100, input_size=size)  # the Linear alone has 640 MACs
    for bad in (float("nan"), float("inf"), "0.3", True, 0, -0.1):
        with pytest.raises(ValueError, match="target_macs must be a fraction in"):
            compact(model, target_macs=bad, input_size=size)
    for bad in (float("nan"), -0.1, "abc"):
        with pytest.raises(ValueError, match="threshold must be a number >= 0"):
            compact(model, threshold=bad)
    with pytest.raises(ValueError, match=r"input_size is \(C, H, W\), three positive ints, got 32"):
        compact(model, target_macs=0.4, input_size=32)
    with pytest.raises(ValueError, match=r"input_size is \(C, H, W\), three positive ints, got 32"):
        profile(model, 32, latency=False)
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        compress.choose_modes(out, torch.randn(1, *size), repeats=0)
    # a compiled model: its graph runs without the hooks that record each layer's input (it chose nothing, silently)
    with pytest.raises(ValueError, match=r"choose_modes: OptimizedModule is a wrapper; choose the modes of the model "
                                         r"inside it: model._orig_mod"):
        compress.choose_modes(torch.compile(out, backend="eager"), torch.randn(1, *size))


class _Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1, bias=False)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return self.conv2(y) if y.sum() > 0 else -self.conv2(y)  # data-dependent: fx cannot trace


def test_untraceable_model_warns_and_stays_exact():
    model = _Untraceable()
    attach_skeletons(model)
    gen = torch.Generator().manual_seed(10)
    random_bn_(model, gen)
    with torch.no_grad():
        model.conv1.skeleton.copy_((torch.rand(8, 3, 3, generator=gen) < 0.5).float())
        model.conv1.skeleton[:3] = 0
    swp_update(model, 0.0, 0.0)
    model.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compact(model)
    assert any("cannot trace" in str(w.message) for w in caught)
    assert out.conv1.out_channels == 8 and isinstance(out.conv1, StripeConv2d)
    assert_same_output(model, out, torch.randn(2, 3, 8, 8, generator=gen))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kept = compact(model, fold_bn=True)  # asked to fold, but nothing could be: the record says so
    assert isinstance(kept.bn1, nn.BatchNorm2d) and kept.compress_compaction["fold_bn"] is False
    assert compact(skeleton_model("resnet20", 8, seed=3).eval(), fold_bn=True).compress_compaction["fold_bn"] is True


def test_choose_modes_leaves_a_train_mode_model_as_it_was_and_compact_warns_on_one():
    """choose_modes runs its forward in eval mode (BN running statistics untouched) and restores the mode; compact
    with fold_bn of a train-mode model warns that the result computes the eval-mode function."""
    model = skeleton_model("resnet20", 8, seed=4)
    small = compact(model.eval()).train()
    stats = {k: v.clone() for k, v in small.state_dict().items() if "running" in k or "num_batches" in k}
    compress.choose_modes(small, 3 + 5 * torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(4)),
                          repeats=1)
    assert small.training and all(torch.equal(small.state_dict()[k], v) for k, v in stats.items())
    with pytest.warns(UserWarning, match="compact: the model is in train mode; fold_bn=True folds"):
        compact(model.train(), fold_bn=True)


def test_compact_warns_of_train_mode_where_a_dead_filter_s_constant_passes_a_batch_norm():
    """A dead filter's constant output goes into the next layer through its BN's running statistics (eval mode);
    a train-mode BN gives its bias instead, so on a train-mode model the compact model's train-mode outputs differ.
    That went without a word unless fold_bn=True. No warning in eval mode, or without dead filters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1),
                          nn.Flatten(), nn.Linear(2 * 8 * 8, 2)).double()
    compress.attach_skeletons(model)
    with torch.no_grad():
        model[1].bias.fill_(0.5)
        model[1].running_mean.fill_(0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compact(model)  # train mode, no dead filter
        with torch.no_grad():
            model[0].skeleton[1] = 0
        small = compact(model.eval())
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(small(x), model(x), rtol=1e-12, atol=1e-12)
        model.train()
        small.train()
        assert (small(x) - model(x)).abs().max() > 1e-3  # what the warning is about
    with pytest.warns(UserWarning, match="compact: the model is in train mode; a dead filter's constant output is "
                                         "folded .* running statistics"):
        compact(model)
    model[1].eval()  # a frozen BN (eval mode) in a train-mode model: the constant is its eval-mode one, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compact(model)
    model[1].train()
    with torch.no_grad():
        model[0].skeleton.copy_(torch.rand(4, 3, 3) + 0.1)
        model[0].skeleton[2] = 0.01  # dead only at the threshold a MAC budget picks
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compact(model)
    with pytest.warns(UserWarning, match="compact: the model is in train mode; a dead filter's constant output"):
        small = compact(model, target_macs=0.6, input_size=(3, 8, 8))
    assert small.compress_compaction["threshold"] >= 0.01


def _choose_modes_bf16_channels_last(device: str, timing: str = "auto") -> None:
    from compress import choose_modes

    model = skeleton_model("resnet20", 32, seed=5)
    small = compact(model, fold_bn=True)
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(x)
    small.to(device=device, dtype=torch.bfloat16, memory_format=torch.channels_last)
    xb = x.to(device=device, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    layouts = []
    for m in small.modules():
        if isinstance(m, StripeConv2d):
            m.register_forward_hook(lambda mod, i, o: layouts.append(o.is_contiguous(memory_format=torch.channels_last)))
    with torch.inference_mode():
        report = {}
        modes = choose_modes(small, xb, repeats=1, timing=timing, report=report)
        out = small(xb)
    stripes = {n for n, m in small.named_modules() if isinstance(m, StripeConv2d) and m.num_stripes}
    assert set(modes) == stripes and set(modes.values()) <= {"stripe", "dense"}
    assert all(small.get_submodule(n).mode == mode for n, mode in modes.items())
    assert set(report) == stripes and all(
        (modes[n] == "stripe") == (r["stripe_ms"] < r["dense_ms"]) and r["dense_ms"] > 0 for n, r in report.items())
    assert out.dtype == torch.bfloat16 and all(layouts)
    err = float((out.float().cpu() - ref).abs().max() / ref.abs().max())
    assert err < 3e-2, f"bf16 relative error {err:.2e}"


def test_choose_modes_bf16_channels_last_cpu():
    _choose_modes_bf16_channels_last("cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("timing", ["auto", "eager"])  # auto = CUDA-graph GPU time on CUDA
def test_choose_modes_bf16_channels_last_cuda(timing):
    _choose_modes_bf16_channels_last("cuda", timing)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-3), (torch.bfloat16, 3e-2)])
def test_fuse_relu_cuda_runs_one_cudnn_call_per_conv(dtype, tol, monkeypatch):
    """On CUDA in inference the fused convs call torch.cudnn_convolution_relu (dense mode) or the stripe kernel
    with its ReLU (stripe mode), and match the unfused compact model."""
    model = skeleton_model("vgg16", 32)
    plain = compact(model, fold_bn=True).cuda().to(dtype).to(memory_format=torch.channels_last)
    out = compact(model, fold_bn=True, fuse_relu=True).cuda().to(dtype).to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(3)).cuda().to(dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    calls = []
    fused_call = torch.cudnn_convolution_relu
    monkeypatch.setattr(torch, "cudnn_convolution_relu", lambda *a: calls.append(1) or fused_call(*a))
    for mode in ("dense", "stripe"):
        for m in (plain, out):
            for s in m.modules():
                if isinstance(s, StripeConv2d):
                    s.mode = mode
        calls.clear()
        with torch.inference_mode():
            ref, got = plain(x).float(), out(x).float()
        assert len(calls) == (13 if mode == "dense" else 0)
        assert float((got - ref).norm() / ref.norm()) < tol


def _conv_bn_net(first: nn.Module, bn: nn.BatchNorm2d) -> nn.Sequential:
    """first (3 -> 8 channels) -> bn -> ReLU -> 3x3 conv 8 -> 4, eval mode, float64, non-trivial BN."""
    net = nn.Sequential(first, bn, nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))
    with torch.no_grad():
        if bn.running_mean is not None:
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2)
        bn.weight.normal_()
        bn.bias.normal_()
    return net.eval().double()


def _std_conv(cls_name: str) -> nn.Module:
    import timm.layers

    return getattr(timm.layers, cls_name)(3, 8, 3, padding=1)


@pytest.mark.parametrize("make", [
    lambda: _conv_bn_net(_std_conv("StdConv2d"), nn.BatchNorm2d(8)),  # standardises its weight in forward
    lambda: _conv_bn_net(_std_conv("ScaledStdConv2d"), nn.BatchNorm2d(8)),
    lambda: _conv_bn_net(nn.utils.parametrizations.weight_norm(nn.Conv2d(3, 8, 3, padding=1)), nn.BatchNorm2d(8)),
    lambda: _conv_bn_net(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, track_running_stats=False)),
])
def test_bns_that_cannot_fold_stay_and_the_model_stays_exact(make):
    """A BN after a weight-standardising or parametrised conv, or one without running statistics, is not folded (it
    was: wrong outputs by up to 6.3, or a crash), nor taken as a fixed per-channel step of a dead-filter chain."""
    torch.manual_seed(0)
    model = make()
    attach_skeletons(model)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SkeletonConv2d):
                m.skeleton[0] = 0  # a dead filter (in the plain-conv net)
    x = torch.randn(2, 3, 12, 12, dtype=torch.float64)
    for fold in (False, True):
        out = compact(model, fold_bn=fold)
        assert isinstance(out[1], nn.BatchNorm2d)
        torch.testing.assert_close(out(x), model(x), rtol=1e-12, atol=1e-12)


def test_convs_with_padding_stripes_cannot_express_get_no_skeleton():
    """reflect padding: no skeleton, with a warning (compact used to refuse the whole trained model); an unpruned
    all-zero conv with it stays a conv."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect"), nn.Conv2d(8, 8, 3, padding=1),
                          nn.Conv2d(8, 4, 3, padding=1, padding_mode="circular"))
    with pytest.warns(UserWarning, match=r"attach_skeletons: 0, 2: a padding that stripe convs cannot express"):
        assert attach_skeletons(model) == ["1"]
    with torch.no_grad():
        model[1].skeleton[0] = 0
        model[2].weight.zero_()
    x = torch.randn(2, 3, 10, 10)
    out = compact(model.eval())
    assert isinstance(out[1], StripeConv2d) and type(out[2]) is nn.Conv2d
    torch.testing.assert_close(out(x), model(x), rtol=1e-6, atol=1e-6)


def test_pruned_grouped_skeleton_conv_stays_dense_with_a_warning():
    """A hand-built SkeletonConv2d with groups=2 (attach_skeletons never makes one): compact zeroes its pruned
    stripes in a dense conv, exact, and says that this saves no work."""
    torch.manual_seed(0)
    conv = SkeletonConv2d(4, 6, 3, padding=1, groups=2, dtype=torch.float64)
    with torch.no_grad():
        conv.skeleton.mul_((torch.rand_like(conv.skeleton) < 0.5).double())
    model = nn.Sequential(conv, nn.ReLU()).eval()
    with pytest.warns(UserWarning, match=r"compact: 0 has groups=2; its pruned stripes are zeroed in a dense"):
        out = compact(model)
    assert type(out[0]) is nn.Conv2d
    x = torch.randn(2, 4, 9, 10, dtype=torch.float64)
    torch.testing.assert_close(out(x), model(x), rtol=1e-12, atol=1e-12)


class _ReadsWeights(nn.Module):
    """Convs whose tensors the forward also reads itself: conv2's weight (a 3x3 conv that could get a skeleton),
    proj's weight with its BN after it (a 1x1 conv BN would fold into), and b's weight (the consumer of a's
    channels, which dead filters of a would slice)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.proj = nn.Conv2d(8, 8, 1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.a = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.relu(torch.nn.functional.conv2d(x, self.conv2.weight, self.conv2.bias, padding=1)) + self.conv2(x)
        x = torch.relu(self.bn(self.proj(x))) + torch.nn.functional.conv2d(x, self.proj.weight)
        x = self.b(torch.relu(self.a(x))) + torch.nn.functional.conv2d(x, self.b.weight, padding=1)
        return self.fc(x.mean((2, 3)))


def test_convs_whose_weights_the_forward_reads_directly_are_left_alone():
    """A conv whose weight the forward also reads (F.conv2d(x, conv.weight)) gets no skeleton (it had no effect on
    that read: compaction then changed the function, or crashed with the stripe weight's shape), no BN folded into
    it, and no channels removed as the consumer of dead filters (crashed); the compact model stays exact."""
    torch.manual_seed(0)
    model = _ReadsWeights().double()
    random_bn_(model, torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match=r"attach_skeletons: b, conv2: the forward also reads the weight"):
        assert attach_skeletons(model) == ["conv1", "a"]
    with torch.no_grad():
        model.conv1.skeleton[:, 0] = 0  # stripes pruned
        model.a.skeleton[:3] = 0  # dead filters, whose channels b (read directly) must keep
    model.eval()
    x = torch.randn(2, 3, 10, 10, dtype=torch.float64)
    for fold in (False, True):
        out = compact(model, fold_bn=fold)
        assert type(out.conv2) is nn.Conv2d and type(out.proj) is nn.Conv2d and isinstance(out.bn, nn.BatchNorm2d)
        assert out.b.in_channels == 8 and isinstance(out.conv1, StripeConv2d)
        torch.testing.assert_close(out(x), model(x), rtol=1e-12, atol=1e-12)


class _ReadsWeightsUntraceably(_ReadsWeights):
    """_ReadsWeights with a data-dependent branch before its head: fx cannot trace it."""

    def forward(self, x):
        y = super().forward(x)
        return y if y.sum() > 0 else -y


def test_direct_reads_in_a_forward_fx_cannot_trace_are_found_in_one_forward_of_the_example_input():
    model = _ReadsWeightsUntraceably()
    with pytest.warns(UserWarning, match=r"attach_skeletons: b, conv2: the forward also reads the weight"):
        assert attach_skeletons(copy.deepcopy(model), example_input=torch.randn(1, 3, 6, 6)) == ["conv1", "a"]
    assert model.training  # the probe's eval forward restored the mode
    # without an input the reads go unseen (README, "Not done yet"), which a warning says (it was silent), naming
    # the argument; a forward that fails says the check was skipped
    with pytest.warns(UserWarning, match=r"fx cannot trace _ReadsWeightsUntraceably .*convs whose weight the forward "
                                         r"reads itself .* cannot be found without example_input="):
        assert attach_skeletons(copy.deepcopy(model)) == ["conv1", "conv2", "a", "b"]
    with pytest.warns(UserWarning, match=r"one forward of a \(1, 4, 6, 6\) input failed .* were not looked for"):
        assert attach_skeletons(copy.deepcopy(model), example_input=torch.randn(1, 4, 6, 6)) == ["conv1", "conv2",
                                                                                                 "a", "b"]


def test_a_forward_with_bool_flags_is_traced_at_every_value_and_compacts_fully():
    """forward(x, return_features=False, scale=None) branching on the flag: fx could not trace it ("symbolically
    traced variables cannot be used as inputs to control flow"), so compaction kept dead filters and left BN
    unfolded. Traced at the default alone, BN was folded into conv1 although the features path returns conv1's own
    output (off by 5 there); traced at each value (`flag_settings`), surgery holds for both: conv2's dead filters
    go, bn2 folds, bn1 stays, and the compact model equals the skeleton model with the flag either way."""

    class Flagged(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
            self.fc = nn.Linear(8, 5)

        def forward(self, x, return_features=False, scale=None):
            f = self.conv1(x)
            y = self.conv3(self.bn2(self.conv2(self.bn1(f).relu())).relu()).mean((2, 3))
            out = self.fc(y) if scale is None else self.fc(y) * scale
            return (out, f) if return_features else out

    model = Flagged().double()
    random_bn_(model, torch.Generator().manual_seed(0))
    attach_skeletons(model)
    with torch.no_grad():
        model.conv2.skeleton[:3] = 0  # dead filters whose constant ReLU zeroes: conv3 loses those input channels
        model.bn2.bias[:3] = -10.0
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no "torch.fx cannot trace" warning)
        out = compact(model, fold_bn=True)
    assert isinstance(out.bn1, nn.BatchNorm2d) and isinstance(out.bn2, nn.Identity)
    assert out.conv2.out_channels == 5 and out.conv3.in_channels == 5
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(out(x), model(x), rtol=1e-10, atol=1e-10)
    for got, want in zip(out(x, return_features=True, scale=2.0), model(x, return_features=True, scale=2.0)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


class _TrainOnlyHead(nn.Module):
    """An auxiliary head that reads the stem's output in training mode only (as Inception-style aux logits)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.c2 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.aux = nn.Conv2d(8, 10, 3, padding=1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        f = self.stem(x)
        out = self.fc(self.c2(f).mean((2, 3)))
        return (out, self.aux(f).mean((2, 3))) if self.training else out


def test_surgery_holds_for_a_layer_read_in_training_mode_only():
    """Compaction traced the eval forward only: a dead stem filter was removed, shrinking the stem under the aux
    head, and the compact model's training forward failed ("expected input[2, 7, 16, 16] to have 8 channels"; a
    fully pruned c2 cut the stem to one channel). Surgery now holds in the training graph too (`mode_graphs`):
    the compact model trains as the skeleton model does, in eval and training mode, BN kept or folded."""
    torch.manual_seed(0)
    model = _TrainOnlyHead().double()
    random_bn_(model, torch.Generator().manual_seed(1))
    attach_skeletons(model)
    with torch.no_grad():
        model.stem[0].skeleton[0] = 0  # a dead filter: the aux head still reads its channel in training
        model.stem[1].bias[0] = -10.0  # (its constant, after BN and ReLU, 0: removable for the eval path alone)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    for fold in (False, True):
        out = compact(model.eval(), fold_bn=fold)
        assert out.stem[0].out_channels == 8
        torch.testing.assert_close(out.eval()(x), model.eval()(x), rtol=1e-10, atol=1e-10)
        logits, aux = out.train()(x)
        assert aux.shape == (2, 10)
        if not fold:  # (a folded BN normalises by its running statistics in training too)
            for got, want in zip((logits, aux), model.train()(x)):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert compact(_TrainOnlyHead().eval(), fold_bn=True, fuse_relu=True)(x.float()).shape == (2, 10)

    class Guarded(_TrainOnlyHead):  # a training forward fx cannot trace: said, not silently left to break
        def forward(self, x):
            out = super().forward(x)
            if self.training and float(out[1].abs().max()) > 1e6:
                raise FloatingPointError("aux logits overflow")
            return out

    with pytest.warns(UserWarning, match=r"torch.fx cannot trace Guarded's forward in training mode \(TypeError: .*\): "
                                         r"what compress changes by the graph holds in the forward it traced"):
        compact(Guarded().eval())


def test_a_model_of_several_inputs_is_named_where_one_batch_is_run():
    """profile, choose_modes, compact(target_macs=) and attach_skeletons' example_input run the model on one batch:
    a forward(x, y) failed with a raw TypeError (or an AttributeError for an example_input tuple); each names the
    inputs and the fix. Optional arguments (defaults) are fine."""
    from compress.compaction import choose_modes

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.fc = nn.Linear(8, 10)

        def forward(self, x, y, scale=1.0):
            return self.fc((self.conv(x) + self.conv(y)).mean((2, 3))) * scale

    fix = r"forward takes 2 inputs \(x, y\) and {} runs it on one \(B, C, H, W\) batch; wrap the model"
    x = torch.randn(1, 3, 8, 8)
    with pytest.raises(TypeError, match=r"example_input must be one tensor, a \(B, C, H, W\) batch .*got tuple"):
        attach_skeletons(TwoInputs(), example_input=(x, x))
    with pytest.raises(ValueError, match="attach_skeletons: example_input: the model's " + fix.format("attach_skeletons")):
        attach_skeletons(TwoInputs(), example_input=x)
    with pytest.raises(ValueError, match="profile: the model's " + fix.format("profile")):
        profile(TwoInputs(), (3, 8, 8))
    model = TwoInputs()
    assert attach_skeletons(model) == ["conv"]
    with pytest.raises(ValueError, match="compact: target_macs: the model's " + fix.format("compact")):
        compact(model, target_macs=0.5, input_size=(3, 8, 8))
    with pytest.raises(ValueError, match="choose_modes: the model's " + fix.format("choose_modes")):
        choose_modes(compact(model), x)
    assert profile(nn.Sequential(nn.Conv2d(3, 4, 3)), (3, 8, 8)).macs == 4 * 3 * 9 * 36  # one input: as before


def test_the_forward_probe_sees_views_and_leaves_hooks_of_the_conv_inside_its_call():
    """A slice of a weight read outside the conv's call counts; old-style weight_norm computes the weight from
    weight_g and weight_v in the conv's own pre-hook, which is inside the call."""
    from compress.surgery import read_outside_their_call

    class Sliced(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.normed = torch.nn.utils.weight_norm(nn.Conv2d(4, 4, 3))

        def forward(self, x):
            y = self.normed(self.conv(x))
            return y + F.conv2d(x, self.conv.weight[:, :, :1, :1]).mean()

    model = Sliced()
    x = torch.randn(1, 3, 8, 8)
    assert read_outside_their_call(model, x, ["conv", "normed"]) == {"conv"}


class _TiedAndShapes(nn.Module):
    """b and c share one weight (each reads it in its own call), d's weight only lends its shape (zeros_like,
    new_zeros); the forward works on its input in place."""

    def __init__(self):
        super().__init__()
        self.b, self.c, self.d = nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 3, 1)
        self.c.weight = self.b.weight
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x):
        x.mul_(2)
        y = self.bn(self.c(self.b(x))) + torch.zeros_like(self.d.weight).sum() + self.d.weight.new_zeros(1)
        return self.d(y)


def test_the_forward_probe_reads_tied_weights_inside_either_call_ignores_shape_only_ops_and_keeps_modes_and_input():
    from compress.surgery import read_outside_their_call

    model = _TiedAndShapes().train()
    model.bn.eval()  # a frozen BN
    x = torch.randn(1, 3, 6, 6)
    before = x.clone()
    assert read_outside_their_call(model, x, ["b", "c", "d"]) == set()
    assert torch.equal(x, before) and model.training and not model.bn.training


def test_convs_with_hooks_of_their_own_get_no_skeleton():
    """Old-style weight_norm recomputes the weight in a forward pre-hook of the conv, which a SkeletonConv2d in its
    place would drop."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), torch.nn.utils.weight_norm(nn.Conv2d(4, 4, 3)))
    with pytest.warns(UserWarning, match=r"attach_skeletons: 1: convs with forward hooks of their own get no skeleton"):
        assert attach_skeletons(model) == ["0"]


def test_hooks_added_to_a_skeleton_conv_after_attach_are_kept_and_it_stays_dense():
    """Hooks a user registers on a SkeletonConv2d (after attach_skeletons) move to its compact layer, which surgery
    then leaves alone (a dense zero-filled conv: no BN folded into it), with a warning; they were dropped, silently
    changing the compact model's output."""
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
    attach_skeletons(model)
    random_bn_(model, gen)
    with torch.no_grad():
        model[0].skeleton[:, 1, 1] = 0
        model[2].skeleton[:, 0, 0] = 0
    calls = []
    model[2].register_forward_pre_hook(lambda mod, inp: calls.append("pre"))
    model[2].register_forward_hook(lambda mod, inp, out: out * 2)
    model.eval()
    x = torch.randn(2, 3, 8, 8, generator=gen)
    with pytest.warns(UserWarning, match=r"compact: 2: layers with hooks of their own keep them and stay nn.Conv2d"):
        small = compact(model, fold_bn=True)
    assert type(small[0]) is StripeConv2d and type(small[2]) is nn.Conv2d and isinstance(small[3], nn.BatchNorm2d)
    torch.testing.assert_close(small(x), model(x), rtol=1e-5, atol=1e-5)
    assert calls == ["pre", "pre"]


def test_torchs_weight_recomputing_hooks_compact_exactly_after_training_steps():
    """torch.nn.utils.prune, and the old weight_norm/spectral_norm, keep `weight` as a tensor their pre-hook
    recomputes in every forward. After a forward with grad it is a non-leaf tensor, and compact's deepcopy failed
    ("Only Tensors created explicitly by the user ... support the deepcopy protocol"), as did export; on a skeleton
    conv the hook moved to the masked conv, which lacks weight_orig/weight_mask (AttributeError in the compact
    model's forward). Now the copy detaches those tensors, and a skeleton conv's compact layer holds the weight the
    hook computes from the current tensors (an optimizer step after the last forward leaves `weight` stale)."""
    from torch.nn.utils import prune, spectral_norm, weight_norm

    from compress.onnx_export import onnx_ready

    gen = torch.Generator().manual_seed(0)
    model = create_model("resnet20").double().eval()
    attach_skeletons(model, exclude=["layer1.0.conv1"])
    random_bn_(model, gen)
    prune.l1_unstructured(model.layer1[0].conv1, "weight", amount=0.5)  # a plain conv: left as it is
    prune.random_unstructured(model.layer1[1].conv1, "weight", amount=0.3)  # skeleton convs
    weight_norm(model.layer2[0].conv1)
    spectral_norm(model.layer3[0].conv2)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SkeletonConv2d):
                m.skeleton[torch.rand(m.skeleton.shape, generator=gen, dtype=m.skeleton.dtype) < 0.4] = 0
    x = torch.randn(2, 3, 32, 32, generator=gen, dtype=torch.double)
    model(x).sum().backward()  # every recomputed `weight` is now a non-leaf tensor
    with torch.no_grad():
        model.layer1[1].conv1.weight_orig.mul_(1.5)  # a step: `weight` stale until the next forward
        model.layer2[0].conv1.weight_v.mul_(-1.0)
    smalls = [compact(model, fold_bn=fold) for fold in (False, True)]
    ready = onnx_ready(model)
    with torch.no_grad():
        expected = model(x)  # (the forward brings `weight` up to date)
        for small in smalls:
            torch.testing.assert_close(small(x), expected, rtol=1e-10, atol=1e-10)
            assert "weight_orig" in dict(small.layer1[0].conv1.named_parameters())  # untouched, hook and all
            assert not any(hasattr(small.get_submodule(n), "weight_orig") or small.get_submodule(n)._forward_pre_hooks
                           for n in ("layer1.1.conv1", "layer2.0.conv1", "layer3.0.conv2"))
        torch.testing.assert_close(ready(x), expected, rtol=1e-10, atol=1e-10)


def test_compact_and_profile_run_under_another_default_device_and_to_dense_draws_nothing():
    """Code inside ``with torch.device("meta"):`` (or set_default_device("cuda")): StripeConv2d.from_dense built its
    module on the default device and copied into it ("Cannot copy out of meta tensor"), and profile drew its input
    with a CPU generator on the default device. StripeConv2d.to_dense drew a conv's initial weights from the global
    random stream (compact with fold_bn moved it where a layer's output went unread)."""
    gen = torch.Generator().manual_seed(0)
    model = create_model("resnet20").eval()
    attach_skeletons(model)
    random_bn_(model, gen)
    with torch.no_grad():
        model.conv1.skeleton[:, 0, 0] = 0
    x = torch.randn(2, 3, 32, 32, generator=gen)
    with torch.device("meta"):
        small = compact(model)
        rep = profile(model, (3, 32, 32), latency=True, repeats=1)
    torch.testing.assert_close(small(x), model(x), rtol=1e-5, atol=1e-5)
    assert rep.macs == profile(model, (3, 32, 32), latency=False).macs > 0
    stripe = small.conv1
    torch.manual_seed(7)
    untouched = torch.rand(4)
    torch.manual_seed(7)
    dense = stripe.to_dense()
    assert torch.equal(torch.rand(4), untouched)
    torch.testing.assert_close(dense(x), stripe(x), rtol=1e-5, atol=1e-5)


def test_onnx_ready_takes_the_current_weight_of_a_pruned_stripe_conv():
    """A StripeConv2d pruned with torch.nn.utils.prune after compaction, then stepped: its `weight` attribute is
    stale until the next forward, and onnx_ready's copy wrote that stale weight into the dense conv it exports."""
    from torch.nn.utils import prune

    from compress.onnx_export import onnx_ready

    gen = torch.Generator().manual_seed(3)
    model = create_model("resnet20").double().eval()
    attach_skeletons(model)
    random_bn_(model, gen)
    with torch.no_grad():
        model.layer1[0].conv1.skeleton[:, 0, 0] = 0
    small = compact(model)
    layer = small.layer1[0].conv1
    assert isinstance(layer, StripeConv2d)
    prune.l1_unstructured(layer, "weight", amount=0.5)
    x = torch.randn(2, 3, 32, 32, generator=gen, dtype=torch.double)
    small(x).sum().backward()
    with torch.no_grad():
        layer.weight_orig.mul_(-3.0)  # a step: `weight` stale until the next forward
    for mode in ("dense", "shift"):
        ready = onnx_ready(small, stripe_mode=mode)
        with torch.no_grad():
            torch.testing.assert_close(ready(x), small(x), rtol=1e-10, atol=1e-10)


def test_a_parametrized_batchnorm_after_dead_filters_is_left_alone():
    """A BN whose weight a parametrization without right_inverse computes sat in a chain from a conv with dead
    filters: compact sliced it by setting its weight and failed deep in torch ("does not implement right_inverse").
    Parametrized modules are left alone, like hooked ones: the dead filters stay, the output is exact."""
    class Abs(nn.Module):
        def forward(self, w):
            return w.abs()

    gen = torch.Generator().manual_seed(1)
    model = create_model("resnet20").double().eval()
    attach_skeletons(model)
    random_bn_(model, gen)
    torch.nn.utils.parametrize.register_parametrization(model.layer1[0].bn1, "weight", Abs())
    with torch.no_grad():
        model.layer1[0].conv1.skeleton[:4] = 0
        model.layer2[0].conv1.skeleton[:4] = 0  # (a chain without the parametrized BN: filters go where they can)
    x = torch.randn(2, 3, 32, 32, generator=gen, dtype=torch.double)
    small = compact(model)
    with torch.no_grad():
        torch.testing.assert_close(small(x), model(x), rtol=1e-10, atol=1e-10)
    assert small.layer1[0].conv1.out_channels == 16 and small.layer2[0].conv1.out_channels < 32


class _HasConfig(nn.Module):
    """A user's block with a method that happens to be called config, reading its conv's weight functionally too."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def config(self) -> dict:
        return {"channels": 8}

    def forward(self, x):
        return x + F.conv2d(x, self.conv.weight, padding=1) + self.bn(self.conv(x))


def test_a_users_module_with_a_config_method_is_traced_through():
    """Only registered extension types with config() are tracing leaves; a user's block with a config method hid its
    functional weight read, so its conv got a skeleton and the compact model failed on its first forward."""
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), _HasConfig(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 4))
    random_bn_(model, gen)
    with pytest.warns(UserWarning, match=r"1.conv: the forward also reads the weight of these convs directly"):
        assert attach_skeletons(model) == ["0"]
    with torch.no_grad():
        model[0].skeleton[:, 0, 0] = 0
    x = torch.randn(2, 3, 8, 8, generator=gen)
    small = compact(model.eval(), fold_bn=True)
    assert type(small[0]) is StripeConv2d and type(small[1].conv) is nn.Conv2d
    torch.testing.assert_close(small(x), model(x), rtol=1e-5, atol=1e-5)


def test_compact_of_a_wrapped_model_names_the_model_inside():
    """torch.compile and DataParallel wrappers: compact said fx cannot trace OptimizedModule and skipped BN folding
    and dead filters, or warned of train mode for an eval model inside a DataParallel."""
    model = create_model("resnet20", num_classes=4)
    attach_skeletons(model)
    model.eval()
    with pytest.raises(ValueError, match=r"compact: OptimizedModule is a wrapper; compact the model inside it: "
                                         r"model._orig_mod"):
        compact(torch.compile(model), fold_bn=True)
    with pytest.raises(ValueError, match=r"compact: DataParallel is a wrapper; compact the model inside it: "
                                         r"model.module"):
        compact(nn.DataParallel(model), fold_bn=True)
    with pytest.raises(ValueError, match=r"compact: CUDAGraphModel is a wrapper; compact the model inside it: "
                                         r"model.model"):
        compact(compress.CUDAGraphModel(model), fold_bn=True)


@compress.register_model
def _test_weight_norm_net(num_classes=10, in_chans=3):
    return nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Conv2d(in_chans, 8, 3, padding=1)), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))


def test_a_weight_norm_conv_saves_and_loads(tmp_path):
    """torch makes a new class for each parametrised module, so a weight_norm conv never equalled the rebuilt
    architecture's and save refused every model holding one."""
    model = create_model("_test_weight_norm_net", num_classes=4)
    with torch.no_grad():
        model[0].parametrizations.weight.original0.uniform_(0.5, 2)  # g, unlike its initial value
    x = torch.randn(2, 3, 8, 8)
    path = save(model.eval(), tmp_path / "wn.safetensors")
    again = load(path)
    assert torch.nn.utils.parametrize.is_parametrized(again[0])
    assert torch.equal(again(x), model(x))


class _Aliases(nn.Module):
    """conv -> BN -> ReLU -> 2x2 max-pool -> conv, the BN and the pool each registered under a second name that the
    forward calls (torch.fx names a module by its first name), and a 1x1 conv with an old-style weight_norm (its
    forward pre-hook recomputes the weight from weight_g and weight_v) reading the pruned conv's channels."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.norm = self.bn
        self.act = nn.ReLU()
        self.p = nn.MaxPool2d(2)
        self.pool = self.p
        self.mix = torch.nn.utils.weight_norm(nn.Conv2d(8, 4, 1))

    def forward(self, x):
        return self.mix(self.pool(self.act(self.norm(self.conv(x)))))


def test_aliased_modules_fold_and_fuse_under_every_name_and_hooked_convs_are_left_alone():
    """A folded BN or a fused pool left under its second name ran twice (wrong outputs, no warning); the weight_norm
    conv, sliced as the consumer of dead filters, failed at the next forward (its hook assigns the weight)."""
    torch.manual_seed(0)
    model = _Aliases().double()
    random_bn_(model, torch.Generator().manual_seed(1))
    assert attach_skeletons(model) == ["conv"]
    with torch.no_grad():
        model.conv.skeleton[:3] = 0  # dead filters: mix would lose those input channels
        model.conv.skeleton[3:, 0] = 0
    model.eval()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        want = model(x)
    for fold, fuse in ((False, False), (True, False), (True, True)):
        out = compact(model, fold_bn=fold, fuse_relu=fuse)
        assert out.norm is out.bn and out.pool is out.p and out.mix.in_channels == 8
        assert isinstance(out.bn, nn.Identity) == fold and isinstance(out.p, nn.Identity) == fuse
        with torch.no_grad():
            torch.testing.assert_close(out(x), want, rtol=1e-12, atol=1e-12)


class _FlattenHead(nn.Module):
    """conv (3 -> 6) -> BN -> ReLU, then flattened to a Linear in one of the ways user code writes it."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.conv, self.bn, self.act = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU()
        self.flat, self.drop = nn.Flatten(), nn.Dropout(0.5)
        self.fc = nn.Linear(6 * 4 * 4, 5)

    def forward(self, x):
        y = self.act(self.bn(self.conv(x)))
        if self.how == "module":
            return self.fc(self.flat(y))
        if self.how == "view":
            return self.fc(y.view(y.size(0), -1))
        return self.fc(self.drop(torch.flatten(y, 1)))  # "dropout"


@pytest.mark.parametrize("how", ["module", "view", "dropout"])
def test_dead_filters_before_a_flattened_linear_head_are_removed(how):
    torch.manual_seed(0)
    model = _FlattenHead(how).double()
    random_bn_(model, torch.Generator().manual_seed(1))
    attach_skeletons(model)
    with torch.no_grad():
        model.conv.skeleton[[1, 4]] = 0  # two dead filters: the Linear loses their 2 * 16 columns
        model.conv.skeleton[0, 0] = 0  # and 3 stripes of filter 0
    model.eval()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    out = compact(model, fold_bn=True)
    assert out.conv.out_channels == 4 and out.fc.in_features == 4 * 16
    torch.testing.assert_close(out(x), model(x), rtol=1e-12, atol=1e-12)


class _AliasNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv, self.bn, self.act, self.p = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), \
            nn.MaxPool2d(2)
        self.norm, self.pool = self.bn, self.p  # second names, which the forward calls
        self.head = nn.Linear(8 * 4 * 4, num_classes)

    def forward(self, x):
        return self.head(torch.flatten(self.pool(self.act(self.norm(self.conv(x)))), 1))


@compress.register_model
def _test_alias_net(num_classes=10, in_chans=3):
    return _AliasNet(num_classes)


def test_a_compact_model_with_aliased_modules_saves_and_loads(tmp_path):
    """save's recipe names a replaced module by its first name; rebuilding replaces it under its other names too
    (the recipe did not rebuild the model, and save refused it)."""
    model = create_model("_test_alias_net").double()
    random_bn_(model, torch.Generator().manual_seed(1))
    attach_skeletons(model)
    with torch.no_grad():
        model.conv.skeleton[:2] = 0
        model.conv.skeleton[2:, 0] = 0
    model.eval()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    for fold in (False, True):
        again = load(save(compact(model, fold_bn=fold, fuse_relu=fold), tmp_path / f"m{fold}.safetensors"))
        assert again.norm is again.bn and again.pool is again.p and again.head.in_features == 6 * 16
        torch.testing.assert_close(again(x), model(x), rtol=1e-12, atol=1e-12)


@compress.register_model
def _test_frozen_bn_resnet18(num_classes=10, in_chans=3):
    import torchvision
    from torchvision.ops import FrozenBatchNorm2d

    return torchvision.models.resnet18(num_classes=num_classes, norm_layer=FrozenBatchNorm2d)


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("bn_type", ["frozen", "sync"])
def test_frozen_and_sync_batchnorm_fold_and_slice_with_dead_filters(bn_type, fold, tmp_path):
    """torchvision's FrozenBatchNorm2d (detection backbones: fixed statistics held as buffers) and SyncBatchNorm (a
    DDP model's) are BatchNorms to compaction: dead filters are removed through them (sliced with them), fold_bn
    folds them into their conv, swp_update zeroes the dead filters' channels, and the compact model equals the
    skeleton model and saves and loads."""
    from torchvision.ops import FrozenBatchNorm2d

    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    model = create_model("_test_frozen_bn_resnet18" if bn_type == "frozen" else "resnet18", num_classes=10)
    if bn_type == "sync":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    kind = FrozenBatchNorm2d if bn_type == "frozen" else nn.SyncBatchNorm
    random_bn_(model, gen, kinds=(kind,))
    attach_skeletons(model)
    conv = model.layer1[0].conv1
    with torch.no_grad():
        conv.skeleton[:20] = 0  # 20 dead filters
    swp_update(model, alpha=0.0, threshold=0.0)
    assert torch.equal(model.layer1[0].bn1.weight[:20], torch.zeros(20))
    model.eval()
    x = torch.randn(2, 3, 64, 64, generator=gen)
    out = compact(model, fold_bn=fold)
    assert_same_output(model, out, x)
    assert out.layer1[0].conv1.out_channels == 44 and out.layer1[0].conv2.in_channels == 44
    bns = [m for m in out.modules() if isinstance(m, kind)]
    assert (not bns) if fold else (len(bns) == 20 and out.layer1[0].bn1.running_mean.numel() == 44)
    assert out.compress_compaction["fold_bn"] == fold
    save(out, tmp_path / "frozen.safetensors")
    assert_same_output(model, load(tmp_path / "frozen.safetensors"), x)
    # export of the compact file sees BNs it folded before (asked not to fold, it says so) and compares it with a
    # folded dense baseline
    from compress.export import export_checkpoint

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = export_checkpoint(tmp_path / "frozen.safetensors", tmp_path / "out", onnx=False, latency=False,
                                   choose_stripe_modes=False, fold_bn=False)
    assert report["fold_bn"] == fold
    assert any("fold_bn=false is ignored" in str(w.message) for w in caught) == fold


def test_tracing_leaves_no_proxies_in_the_callers_model():
    """attach_skeletons and compact trace the model with torch.fx; a forward that keeps values on its modules
    (timm's feature hooks, an activation cached for later) kept fx proxies in the caller's model, so that deepcopy
    (timm's ModelEma), torch.save and compact then failed with a raw torch error; also where an earlier forward
    with grad left a non-leaf tensor on the model (deepcopy refuses those). A model whose copy does not trace (a
    weak reference back to the original) is traced itself."""
    import weakref

    import timm

    from compress import surgery

    class Caching(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 2)

        def forward(self, x):
            self.last = self.conv(x)
            return self.head(self.last.mean((2, 3)))

    torch.manual_seed(0)
    hooks = timm.create_model("resnet18", features_only=True, feature_cls="hook", pretrained=False).eval()
    cached = Caching()
    cached(torch.randn(2, 3, 8, 8))  # with grad: `last` is a non-leaf tensor
    for model in (cached.eval(), hooks):
        compress.attach_skeletons(model)
        kept = [v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.fx.Proxy)]
        assert not kept and not isinstance(getattr(model, "last", None), torch.fx.Proxy)
        if model is hooks:  # (the other holds a non-leaf tensor, which deepcopy refuses whatever compress does)
            copy.deepcopy(model)
        x = torch.randn(2, 3, 32, 32)
        with torch.no_grad():
            want, got = model(x), compact(model)(x)
        for a, b in zip(want if isinstance(want, list) else [want], got if isinstance(got, list) else [got]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not any(isinstance(v, torch.fx.Proxy) for d in hooks.hooks._feature_outputs.values() for v in d.values())

    class Head(nn.Module):
        def __init__(self, owner):
            super().__init__()
            self.owner = weakref.ref(owner)

        def forward(self, x):
            return self.owner().fc(x.mean((2, 3)))

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8, 2)
            self.head = Head(self)

        def forward(self, x):
            return self.head(self.bn(self.conv(x)).relu())

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert surgery.conv_bn_pairs(Owner()) == {"conv": "bn"}


def test_compact_of_a_feature_extractor_keeps_its_eval_mode():
    """torchvision's feature extractors (GraphModules) deep-copy into train mode: compact returned the copy so, and
    its BNs normalised by batch statistics (outputs off by ~18 here); every module keeps the input's mode."""
    from torchvision.models.feature_extraction import create_feature_extractor

    torch.manual_seed(0)
    model = compress.create_model("resnet20").eval()
    with torch.no_grad():
        for bn in model.modules():
            if isinstance(bn, nn.BatchNorm2d):
                bn.running_mean.normal_()
                bn.running_var.uniform_(0.5, 2)
    features = create_feature_extractor(model, ["layer2"]).eval()
    small = compact(features)
    assert not any(m.training for m in small.modules())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(small(x)["layer2"], features(x)["layer2"], rtol=1e-5, atol=1e-5)


def test_library_calls_from_several_threads_take_turns():
    """torch.fx patches nn.Module.__call__ for the whole process while it traces, so compact in one thread broke
    the module calls of a compact (or attach_skeletons) in another ("module is not installed as a submodule": 4-6 of
    8 failed in every trial); profile's hooks counted another thread's forward of the same model (wrong MACs), its
    mode restore left the model in eval mode, and its save/restore of the attention fast path left it off. They now
    take turns (compress._modes.LIBRARY_LOCK): the results equal the single-threaded ones."""
    from concurrent.futures import ThreadPoolExecutor

    models = [skeleton_model("resnet20", 8, seed=20 + i).eval() for i in range(6)]
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            want = [compact(m, fold_bn=True)(x) for m in models]
        with ThreadPoolExecutor(3) as pool:
            small = list(pool.map(lambda m: compact(m, fold_bn=True), models))
            fresh = list(pool.map(lambda i: compress.attach_skeletons(compress.create_model("resnet20")), range(3)))
    with torch.no_grad():
        for s, w in zip(small, want):
            assert torch.equal(s(x), w)
    assert all(len(f) == 19 for f in fresh)
    model = compress.create_model("resnet20")  # train mode
    macs = compress.profile(model, latency=False).macs
    fastpath = torch.backends.mha.get_fastpath_enabled()
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda _: compress.profile(model, latency=False).macs, range(6)))
    assert got == [macs] * 6 and model.training and torch.backends.mha.get_fastpath_enabled() == fastpath


def test_target_macs_warns_when_the_only_lower_threshold_is_the_base():
    """Every skeleton at 0.5: the candidate thresholds are [0, 0.5]; 0 keeps everything, 0.5 drops every stripe and
    meets a 40% budget with far less, so compact warns though the threshold met is only the second candidate."""
    model = skeleton_model("resnet20", 8, seed=3, dead=0.0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SkeletonConv2d):
                m.skeleton.fill_(0.5)
    with pytest.warns(UserWarning, match=r"threshold 0.5 meets the budget.*next lower one \(0\).*"
                                         r"no threshold lands nearer"):
        out = compact(model, target_macs=0.4, input_size=(3, 8, 8))
    assert out.compress_compaction["threshold"] == 0.5


def test_compact_sets_each_stripe_convs_mode_by_the_cost_model():
    """Without choose_modes, each StripeConv2d compaction makes runs in the mode kernels.stripe_cost predicts
    faster: "stripe" below a ratio of 1, else "dense" (VGG16's random skeletons give layers of both)."""
    import kernels

    out = compact(skeleton_model("vgg16", 32, seed=1))
    modes = {}
    for name, m in out.named_modules():
        if isinstance(m, StripeConv2d):
            ratio = kernels.stripe_cost(m.in_channels, m.out_channels, m.num_stripes, m.kernel_size,
                                        m.weight.device.type, m.tile_keep)
            modes[name] = m.mode
            assert m.mode == ("stripe" if ratio < 1 else "dense"), name
    assert set(modes.values()) == {"stripe", "dense"}


def test_choose_modes_times_only_stripe_convs_with_stripes():
    """A conv with no stripe left (an emptied residual branch's conv2) has nothing to time: choose_modes returns
    the StripeConv2d layers with stripes and no other."""
    model = skeleton_model("resnet20", 8, seed=6)
    with torch.no_grad():
        model.layer2[1].conv2.skeleton.zero_()
    swp_update(model, alpha=0.0, threshold=0.0)
    small = compact(model)
    assert small.layer2[1].conv2.num_stripes == 0
    modes = compress.choose_modes(small, torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(6)),
                                  repeats=1)
    with_stripes = {n for n, m in small.named_modules() if isinstance(m, StripeConv2d) and m.num_stripes > 0}
    assert set(modes) == with_stripes and "layer2.1.conv2" not in modes


class _SharedProducer(nn.Module):
    """3x3 convs (padding 1) a (3 -> 4), z (4 -> 4) and head (4 -> 4); a is called twice: z(relu(a(x))) +
    head(a(x)). With z pruned to nothing, a's first call feeds only a conv that reads its shape, its second the
    head, which reads its values."""

    def __init__(self):
        super().__init__()
        self.a, self.z, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1), \
            nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.z(F.relu(self.a(x))) + self.head(self.a(x))


def test_a_layer_called_twice_keeps_its_work_when_one_call_is_read():
    """A layer's work is dropped only when every call's output goes unread: here one call of `a` feeds a conv with
    no stripe left, the other a live head, so `a` must keep its weights."""
    torch.manual_seed(11)
    model = _SharedProducer()
    attach_skeletons(model)
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for name in ("a", "head"):
            m = model.get_submodule(name)
            assert isinstance(m, SkeletonConv2d)
            m.skeleton.copy_(torch.rand(m.skeleton.shape, generator=gen) + 0.5)
        model.z.skeleton.zero_()
    model.eval()
    out = compact(model)
    assert out.z.num_stripes == 0
    assert_same_output(model, out, torch.randn(2, 3, 8, 8, generator=gen))


def test_a_fractional_target_macs_above_one_is_an_error():
    """target_macs=1.5 is neither a share (at most 1) nor a whole MAC count: compact refuses it rather than read it
    as a count of 1 or 2 MACs."""
    model = skeleton_model("resnet20", 8, seed=2)
    with pytest.raises(ValueError, match=r"target_macs=1.5 is neither a fraction in \(0, 1\] of the dense model's "
                                         r"MACs nor a whole count of MACs"):
        compact(model, target_macs=1.5, input_size=(3, 8, 8))
