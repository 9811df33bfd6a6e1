"""PiX block and insertion: the block against a float64 reference written from the definition (DESIGN.md
"PiX"), shapes kept by insertion, clear errors, the paper's MAC/param totals, save/load and ONNX export."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.nn as nn
import torchvision
from randomize import random_bn_

import compress
import kernels
from compress.models import create_model
from compress.pix import PiXBlock, apply_pix, downscale_pix, insert_pix
from compress.profile import profile


class RefFusion(torch.autograd.Function):
    """The PiX fusion from its definition, one group and one channel at a time (float64).
    Forward: y = p * max_group(x) if p < tau else p * mean_group(x). Backward: the max branch sends
    p * dy to the first arg-max channel only, the mean branch p * dy / zeta to every channel,
    dp = sum_hw (max or mean) * dy."""

    @staticmethod
    def forward(ctx, x, p, zeta, tau):
        ctx.save_for_backward(x, p)
        ctx.zeta, ctx.tau = zeta, tau
        y = []
        for g in range(x.shape[1] // zeta):
            chans = [x[:, g * zeta + k] for k in range(zeta)]
            mx, mean = chans[0], sum(chans) / zeta
            for c in chans[1:]:
                mx = torch.maximum(mx, c)
            pg = p[:, g, 0, 0].view(-1, 1, 1)
            y.append(pg * torch.where(pg < tau, mx, mean))
        return torch.stack(y, 1)

    @staticmethod
    def backward(ctx, dy):
        x, p = ctx.saved_tensors
        zeta, tau = ctx.zeta, ctx.tau
        dx, dp = torch.zeros_like(x), torch.zeros_like(p)
        for g in range(x.shape[1] // zeta):
            chans = x[:, g * zeta : (g + 1) * zeta]
            mx = chans.amax(1)
            taken = torch.zeros_like(mx, dtype=torch.bool)  # first arg-max already found
            for b in range(x.shape[0]):
                pg = p[b, g, 0, 0]
                if pg < tau:
                    for k in range(zeta):
                        first = (chans[b, k] == mx[b]) & ~taken[b]
                        dx[b, g * zeta + k] = torch.where(first, pg * dy[b, g], 0.0)
                        taken[b] |= first
                    dp[b, g] = (mx[b] * dy[b, g]).sum()
                else:
                    dx[b, g * zeta : (g + 1) * zeta] = pg * dy[b, g] / zeta
                    dp[b, g] = (chans[b].mean(0) * dy[b, g]).sum()
        return dx, dp, None, None


def _ref_block(block: PiXBlock, x: torch.Tensor) -> torch.Tensor:
    w = block.weight.detach().double().requires_grad_()
    p = torch.sigmoid(torch.einsum("oc,bc->bo", w[:, :, 0, 0], x.mean((2, 3))))[:, :, None, None]
    return RefFusion.apply(x, p, block.zeta, block.tau), w


def _inputs_with_ties(b: int, c: int, h: int, w: int, zeta: int) -> torch.Tensor:
    """Random non-zero values in (1, 2) (so the pooled input is positive), with exact ties in each group's max."""
    gen = torch.Generator().manual_seed(0)
    x = 1 + torch.rand(b, c, h, w, generator=gen, dtype=torch.float64)
    for g in range(c // zeta):  # channels 0 and zeta-1 of every group tie at the max at half the pixels
        x[:, g * zeta, ::2] = 3.0
        x[:, g * zeta + zeta - 1, ::2] = 3.0
    return x


def _three_branch_block(c: int, zeta: int, tau: float = 0.5) -> PiXBlock:
    """A float64 PiXBlock whose predictor rows cycle through p ~ 0.18, p == 0.5 exactly (a zero row:
    sigmoid(0)), p ~ 0.82 for inputs in (1, 2) (pooled input ~1.5)."""
    block = PiXBlock(c, zeta, tau).double()
    with torch.no_grad():
        base = torch.rand(c // zeta, c, dtype=torch.float64) / c + 0.5 / c
        sign = torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64).repeat(c)[: c // zeta]
        block.weight.copy_((base * sign[:, None])[:, :, None, None])
    return block


@pytest.mark.parametrize("zeta,tau", [(4, 0.5), (3, 0.3), (1, 0.5)])
def test_block_matches_float64_reference(zeta, tau):
    b, c, h, w = 2, 6 * zeta, 4, 5
    block = _three_branch_block(c, zeta, tau)
    x = _inputs_with_ties(b, c, h, w, zeta).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y = block(x)
    y_ref, w_ref = _ref_block(block, x_ref)
    p = torch.sigmoid(block.weight[:, :, 0, 0] @ x.detach().mean((2, 3)).T)
    assert (p < tau).any() and (p > tau).any() and (p == 0.5).any()  # every branch is exercised
    assert y.shape == (b, c // zeta, h, w)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    dy = 1 + torch.rand_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block.weight.grad, w_ref.grad, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # an unbatched (C, H, W) input gives the batched result of one image, (C / zeta, H, W)
        torch.testing.assert_close(block(x[1].detach()), y_ref[1].detach(), rtol=1e-12, atol=1e-12)
        # channels_last input: the same values
        torch.testing.assert_close(block(x.detach().contiguous(memory_format=torch.channels_last)), y_ref.detach(),
                                   rtol=1e-12, atol=1e-12)


def test_block_ties_send_gradient_to_first_argmax_and_p_equal_tau_takes_mean():
    block = PiXBlock(4, 4).double()
    nn.init.zeros_(block.weight)  # p = sigmoid(0) = 0.5 = tau exactly -> mean
    x = torch.tensor([1.0, 3.0, 3.0, 2.0], dtype=torch.float64).view(1, 4, 1, 1).requires_grad_()
    block(x).sum().backward()
    assert block(x).item() == 0.5 * 9.0 / 4
    assert x.grad.flatten().tolist() == [0.5 / 4] * 4
    block = PiXBlock(4, 4, tau=0.6).double()  # same p = 0.5 < 0.6 -> max; tie between channels 1 and 2
    nn.init.zeros_(block.weight)
    x.grad = None
    block(x).sum().backward()
    assert block(x).item() == 0.5 * 3.0
    assert x.grad.flatten()[:3].tolist() == [0.0, 0.5, 0.0]


def test_block_macs_count_pool_predictor_fusion():
    # Supplement sec. E example: X of 12x5x5, zeta 4 -> pool 300 adds, predictor 12*3 = 36 multiply-adds,
    # fusion 3 groups * 25 pixels * (3 compares + 1 multiply by p) = 300.
    block = PiXBlock(12, 4)
    x = torch.randn(2, 12, 5, 5)
    assert block.macs(x, block(x)) == 2 * (300 + 36 + 300)


def test_block_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"PiXBlock\(in_channels=10\).*not divisible by zeta=4"):
        PiXBlock(10, 4)
    with pytest.raises(ValueError, match=r"expected input \(B, 8, H, W\)"):
        PiXBlock(8, 2)(torch.randn(1, 6, 3, 3))
    with pytest.raises(ValueError, match=r"expected input \(B, 32, H, W\) or \(32, H, W\), got \(2, 32, 4\);"):
        PiXBlock(32, 4)(torch.randn(2, 32, 4))  # the shape given, not one with a batch added
    for bad in (16.0, 0, True):
        with pytest.raises(ValueError, match=rf"PiXBlock: in_channels must be a positive int, got {bad!r}"):
            PiXBlock(bad, 4)


def test_config_rebuilds_same_shapes():
    block = PiXBlock(8, 2, 0.4)
    rebuilt = type(block)(**block.config())
    assert rebuilt.config() == block.config() == {"in_channels": 8, "zeta": 2, "tau": 0.4}
    assert rebuilt.weight.shape == block.weight.shape == (4, 8, 1, 1)


def _block_outputs(model: nn.Module, names: list[str], x: torch.Tensor) -> dict[str, tuple]:
    shapes = {}
    handles = [
        model.get_submodule(n).register_forward_hook(lambda m, i, o, n=n: shapes.__setitem__(n, o.shape))
        for n in names
    ]
    shapes["output"] = model(x).shape
    for h in handles:
        h.remove()
    return shapes


def _train_step(model: nn.Module, x: torch.Tensor) -> None:
    """One forward/backward: finite loss, a finite non-zero gradient for every PiX predictor."""
    loss = nn.functional.cross_entropy(model(x), torch.arange(x.shape[0]) % 10)
    loss.backward()
    assert torch.isfinite(loss)
    pix = [m for m in model.modules() if isinstance(m, PiXBlock)]
    assert pix and all(torch.isfinite(m.weight.grad).all() and m.weight.grad.abs().sum() > 0 for m in pix)


@pytest.mark.parametrize("zeta", [4, 8])
def test_torchvision_resnet50_insertion(zeta):
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=10)
    blocks = [f"layer{s}.{i}" for s, n in enumerate((3, 4, 6, 3), 1) for i in range(n)]
    x = torch.randn(2, 3, 32, 32)
    before = _block_outputs(model, blocks, x)
    assert insert_pix(model, zeta) == blocks
    pix_out = []  # torchvision's shared ReLU stays after PiX: exact because PiX's output is >= 0 here
    for blk in blocks:
        model.get_submodule(blk).conv1.register_forward_hook(lambda m, i, o: pix_out.append(o.min().item()))
    assert _block_outputs(model, blocks, x) == before
    assert len(pix_out) == len(blocks) and min(pix_out) >= 0
    widths = {blk: model.get_submodule(blk).conv2.out_channels for blk in blocks}
    factors = [
        model.get_submodule(blk).conv1.zeta for blk in ("layer1.0", "layer1.1", "layer2.0", "layer3.1")
    ]
    if zeta == 4:  # standard widths; first blocks 64 -> 64 (a gate) and 256 -> 128 (pairs)
        assert factors == [1, 4, 2, 4] and widths["layer4.2"] == 512
    else:  # thin: width = out / 8
        assert factors == [2, 8, 4, 8] and widths["layer1.0"] == 32 and widths["layer4.2"] == 256
    _train_step(model, x)


def test_pix_bottleneck_forward_is_torchvision_forward(tmp_path):
    """PiXBottleneck (torchvision blocks after insert_pix) drops the no-op ReLU after PiX and ends with
    kernels.residual_relu: outputs and gradients equal torchvision's own forward on the same modules; it survives
    compress.save/load and torch.fx tracing."""
    from compress import surgery
    from compress.pix import PiXBottleneck

    torch.manual_seed(0)
    model = create_model("resnet50", num_classes=10)  # compress_arch: save/load below
    insert_pix(model, 4)
    blocks = [m for m in model.modules() if isinstance(m, torchvision.models.resnet.Bottleneck)]
    assert len(blocks) == 16 and all(type(m) is PiXBottleneck for m in blocks)
    x = torch.randn(2, 3, 64, 64)
    results = []
    for cls in (PiXBottleneck, torchvision.models.resnet.Bottleneck):
        for m in blocks:
            m.__class__ = cls
        model.zero_grad()
        y = model(x)
        y.square().sum().backward()
        results.append((y.detach(), [p.grad.clone() for p in model.parameters()]))
    for m in blocks:
        m.__class__ = PiXBottleneck
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    for g0, g1 in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(g0, g1, rtol=1e-6, atol=1e-7)
    loaded = compress.load(compress.save(model, tmp_path / "pix_resnet50.safetensors"))
    assert sum(type(m) is PiXBottleneck for m in loaded.modules()) == 16
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    graph = surgery.trace(model)  # compaction traces models: the residual tail is a leaf of the fx graph
    assert graph is not None
    assert sum(n.target is compress.pix.traced_residual_relu for n in graph.nodes) == 16
    # a feature extractor returns values the tail would overwrite: bn3's output is bn3's, not the block's (it was
    # relu(bn3 + identity): the graph ran the tail in place on it)
    from torchvision.models.feature_extraction import create_feature_extractor

    seen = {}
    hook = model.layer1[0].bn3.register_forward_hook(lambda m, i, o: seen.__setitem__("bn3", o.clone()))
    with torch.no_grad():
        model(x)
        hook.remove()
        got = create_feature_extractor(model, ["layer1.0.bn3", "layer1.0"])(x)
    torch.testing.assert_close(got["layer1.0.bn3"], seen["bn3"], rtol=0, atol=0)
    torch.testing.assert_close(got["layer1.0"], torch.relu(seen["bn3"] + model.layer1[0].downsample(model.maxpool(
        model.relu(model.bn1(model.conv1(x)))))), rtol=1e-6, atol=1e-6)


def test_cifar_bottleneck_and_timm_insertion_keep_shapes():
    for name in ("timm:resnet26", "resnet29_bottleneck"):
        torch.manual_seed(0)
        # zero_init_last=False: with bn3 zero-initialised (both families' default) no gradient reaches PiX
        model = create_model(name, num_classes=10, input_size=32, zero_init_last=False)
        blocks = [n for n, m in model.named_modules() if type(m).__name__ == "Bottleneck"]
        x = torch.randn(2, 3, 32, 32)
        before = _block_outputs(model, blocks, x)
        assert apply_pix(model, 4) == blocks
        assert all(isinstance(model.get_submodule(b).conv1, PiXBlock) for b in blocks)
        assert _block_outputs(model, blocks, x) == before
    _train_step(model, x)


@pytest.mark.parametrize("name,zeta", [("vgg11", 2), ("resnet20", 4), ("vgg11_bn", 2)])
def test_downscaling_keeps_shapes(name, zeta):
    torch.manual_seed(0)
    model = create_model(name, num_classes=10, input_size=32)
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)][1:]
    x = torch.randn(2, 3, 32, 32)
    before = _block_outputs(model, convs, x)
    assert apply_pix(model, zeta) == convs
    assert all(
        model.get_submodule(n)[1].in_channels == model.get_submodule(n)[0].in_channels // zeta for n in convs
    )
    assert _block_outputs(model, convs, x) == before
    if name == "vgg11":
        _train_step(model, x)


def test_errors_name_the_layer():
    with pytest.raises(
        ValueError, match=r"downscale_pix: layer 'features.4': 64 input channels are not divisible by zeta=3"
    ):
        downscale_pix(create_model("vgg11"), 3)
    with pytest.raises(
        ValueError,
        match=r"layer 'layer1.0' \(compress.*Bottleneck\): block output channels 64 are not divisible by zeta=3; "
              r"choose a zeta that divides 64",
    ):
        insert_pix(create_model("resnet29_bottleneck"), 3)
    with pytest.raises(
        ValueError, match=r"layer 'layer1.0'.*input channels 64 are not divisible by the new width 128"
    ):
        insert_pix(torchvision.models.resnet50(), 2)
    with pytest.raises(ValueError, match=r"unsupported model MobileNetV2; PiX supports bottleneck ResNets"):
        apply_pix(create_model("mobilenet_v2"), 4)
    # a timm ResNet whose blocks PiX does not rebuild: the message names them
    with pytest.raises(ValueError, match=r"unsupported model ResNet \(its blocks are SelectiveKernelBottleneck, which "
                                         r"PiX does not rebuild\)"):
        apply_pix(create_model("timm:skresnet50", num_classes=10, input_size=32), 4)
    with pytest.raises(ValueError, match=r"unsupported model ResNet \(its blocks are SelectiveKernelBasic, which "):
        apply_pix(create_model("timm:skresnet18", num_classes=10, input_size=32), 4)
    with pytest.raises(ValueError, match=r"insert_pix: ResNet has no bottleneck block PiX rebuilds \(its blocks are "
                                         r"SelectiveKernelBottleneck, which PiX does not rebuild\)"):
        insert_pix(create_model("timm:skresnet50", num_classes=10, input_size=32), 4)
    # a numpy tau is a number; a VGG inside a wrapper is a VGG
    import numpy as np

    assert apply_pix(torchvision.models.resnet50(), 4, np.float32(0.25))
    wrapped = nn.Sequential(nn.Identity(), create_model("vgg11"))
    assert apply_pix(wrapped, 2) and wrapped(torch.randn(1, 3, 32, 32)).shape == (1, 10)
    with pytest.raises(ValueError, match=r"zeta must be a positive int, got 0"):
        apply_pix(create_model("resnet20"), 0)


@pytest.mark.parametrize("arch, zeta", [("resnet29_bottleneck", 4), ("resnet20", 2)])
def test_a_numpy_zeta_gives_a_model_that_saves(arch, zeta, tmp_path):
    """A numpy int zeta is taken (channel squeezing and downscaling alike) as a Python int: the blocks' configs,
    which compress.save writes as JSON, hold ints, and the model saves and loads into the same function."""
    import numpy as np

    model = create_model(arch, num_classes=5, input_size=16)
    apply_pix(model, np.int64(zeta))
    blocks = [m for m in model.modules() if isinstance(m, PiXBlock)]
    assert blocks and all(type(v) is int for b in blocks for v in (b.zeta, b.in_channels, b.out_channels))
    model.eval()
    x = torch.randn(2, 3, 16, 16)
    loaded = compress.load(compress.save(model, tmp_path / "pix.safetensors")).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


# Paper Table 1 (PiX, CVPR 2024) and the supplement: GMACs at 224x224 and M params.
PAPER = {
    "resnet50": (4, 3.18, 25.5),
    "resnet101": (4, 6.05, 44.5),
    "resnet152": (4, 8.91, 60.1),
    "thin resnet50": (8, 1.39, 12.3),
}


@pytest.mark.parametrize("name", list(PAPER))
def test_paper_totals(name):
    zeta, gmacs, mparams = PAPER[name]
    with torch.device("meta"):
        model = getattr(torchvision.models, name.split()[-1])()
        insert_pix(model, zeta)
    report = profile(model, (3, 224, 224), latency=False)
    assert report.params / 1e6 == pytest.approx(mparams, rel=0.01)
    paper = profile(model, (3, 224, 224), latency=False, convention="paper")
    assert paper.convention == "paper" and report.convention == "layers"
    assert paper.macs / 1e9 == pytest.approx(gmacs, rel=0.01)
    # The default convention counts convs, Linear and PiX only (BN, ReLU, pooling are 0): within 0.6% for
    # zeta 4, 1.7% under for the thin net, whose BN/ReLU share of the total is larger.
    assert report.macs / 1e9 == pytest.approx(gmacs, rel=0.006 if zeta == 4 else 0.02)
    assert report.macs < paper.macs


def test_paper_convention_plain_resnet50():
    """ptflops-style count of torchvision ResNet-50: 4.12 GMACs (paper Table 1, E0); convs only 4.09."""
    with torch.device("meta"):
        model = torchvision.models.resnet50()
    assert profile(model, (3, 224, 224), latency=False, convention="paper").macs / 1e9 == pytest.approx(
        4.12, rel=0.01
    )
    assert profile(model, (3, 224, 224), latency=False).macs / 1e9 == pytest.approx(4.09, rel=0.002)


def test_swp_compaction_save_load_and_onnx_keep_pix(tmp_path):
    """SWP + PiX: skeletons on the remaining convs; compaction, compress.save/load and ONNX export keep PiX."""
    from compress.compaction import compact
    from compress.onnx_export import check_onnx, export_onnx

    torch.manual_seed(0)
    model = create_model("resnet29_bottleneck", num_classes=10, input_size=32)
    apply_pix(model, 8)  # thin: widths rebuilt, conv2 of layer2.0 reads 128 / 8 = 16 channels
    skeletons = compress.attach_skeletons(model)
    assert len(skeletons) == 10  # stem + the 9 bottlenecks' 3x3 convs
    # a trained model's BNs: at init each block's last BN scales by 0, so every branch would compact to nothing
    random_bn_(model, torch.Generator().manual_seed(0))
    with torch.no_grad():  # prune about half of the stripes
        for n in skeletons:
            sk = model.get_submodule(n).skeleton
            sk.mul_((torch.rand_like(sk) > 0.5).float())
    model.eval()
    x = torch.randn(2, 3, 32, 32)
    small = compact(model, fold_bn=True)
    assert sum(isinstance(m, PiXBlock) for m in small.modules()) == 9
    torch.testing.assert_close(small(x), model(x), rtol=1e-5, atol=1e-5)
    compress.save(small, tmp_path / "pix.safetensors")
    loaded = compress.load(tmp_path / "pix.safetensors").eval()
    assert isinstance(loaded.layer2[0].conv1, PiXBlock) and loaded.layer2[0].conv1.zeta == 4
    torch.testing.assert_close(loaded(x), small(x), rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_onnx(small, tmp_path / "pix.onnx", (3, 32, 32))
    assert check_onnx(tmp_path / "pix.onnx", small, x) < 1e-4  # float32 rounding (the other ONNX tests' bound)


def test_swp_pix_torchvision_resnet50_compacts_fused_and_reloads(tmp_path):
    """SWP + PiX on torchvision ResNet-50: compaction with BN folded and ReLUs fused keeps PiXBottleneck (whose
    conv2's ReLU now runs once, so it fuses too), stays exact, and survives save/load."""
    from compress.compaction import compact
    from compress.pix import PiXBottleneck

    torch.manual_seed(0)
    model = create_model("resnet50", num_classes=10)
    insert_pix(model, 4)
    skeletons = compress.attach_skeletons(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n in skeletons:
            sk = model.get_submodule(n).skeleton
            sk.mul_((torch.rand(sk.shape, generator=gen) > 0.5).float())
    random_bn_(model, gen).eval()
    x = torch.randn(2, 3, 64, 64, generator=gen)
    small = compact(model, fold_bn=True, fuse_relu=True)
    assert small.compress_compaction["relu_fused"] == 17  # the stem and every block's conv2
    assert sum(type(m) is PiXBottleneck for m in small.modules()) == 16
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(small(x), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        loaded = compress.load(compress.save(small, tmp_path / "pix50.safetensors"))
        assert sum(type(m) is PiXBottleneck for m in loaded.modules()) == 16
        torch.testing.assert_close(loaded(x), small(x), rtol=0, atol=0)


@pytest.mark.parametrize("arch, zeta, dead, replaced", [
    ("resnet20", 2, ("layer1.1.conv1.1", "layer1.1.conv2.1"), ["layer1.1.conv1.0", "layer1.1.conv2.0"]),  # downscaling
    # the branch's last conv alone: its first conv's output is read by nothing but the ZeroChannels, so it keeps no
    # stripe, and the PiX block before it goes too (channel removal cannot reach through PiX blocks)
    ("resnet20", 2, ("layer1.1.conv2.1",), ["layer1.1.conv1.0", "layer1.1.conv2.0"]),
    ("resnet29_bottleneck", 4, ("layer1.1.conv2",), ["layer1.1.conv1"]),  # channel squeezing
    ("resnet50", 4, ("layer1.2.conv2",), ["layer1.2.conv1"]),  # torchvision's Bottleneck (PiXBottleneck)
])
def test_compaction_drops_the_pix_work_of_a_branch_with_no_stripe_left(tmp_path, arch, zeta, dead, replaced):
    """A PiX block whose output reaches only convs with no stripe left becomes a ZeroChannels (no MACs), a conv
    whose output reaches only those a StripeConv2d with no stripe, and so on up the branch: the
    compact model stays exact (float64, NCHW and channels_last, whose layout it keeps), no layer of that block
    counts MACs, and it saves and loads into the same function. (BN biases and statistics are random, so the dead
    branch adds a constant of either sign and the block's last ReLU matters: a torchvision block loaded without
    PiXBottleneck's forward lost it.)"""
    from compress.compaction import ZeroChannels, compact

    torch.manual_seed(0)
    model = create_model(arch, num_classes=5, input_size=16)
    apply_pix(model, zeta)
    compress.attach_skeletons(model)
    random_bn_(model, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name in dead:
            model.get_submodule(name).skeleton.zero_()
    model = model.double().eval()
    small = compact(model, fold_bn=True, fuse_relu=True)
    assert sorted(n for n, m in small.named_modules() if isinstance(m, ZeroChannels)) == replaced
    assert sum(isinstance(m, PiXBlock) for m in small.modules()) == sum(
        isinstance(m, PiXBlock) for m in model.modules()) - len(replaced)
    x = torch.randn(3, 3, 16, 16, dtype=torch.float64)
    block = replaced[0].split(".conv")[0] + "."
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(small(x), ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(small(x.contiguous(memory_format=torch.channels_last)), ref, rtol=1e-12, atol=1e-12)
        stand_in = small.get_submodule(replaced[0])
        z = stand_in(torch.randn(3, 8, 5, 7, dtype=torch.float64).contiguous(memory_format=torch.channels_last))
        assert z.shape == (3, stand_in.channels, 5, 7) and z.dtype == torch.float64 and not z.any()
        assert z.is_contiguous(memory_format=torch.channels_last)
        assert stand_in(torch.randn(8, 5, 7, dtype=torch.float64)).shape == (stand_in.channels, 5, 7)  # unbatched
        assert not [r.name for r in profile(small, (3, 16, 16), latency=False).layers
                    if r.name.startswith(block) and r.macs]
        loaded = compress.load(compress.save(small, tmp_path / "dead.safetensors")).double()
        torch.testing.assert_close(loaded(x), small(x), rtol=0, atol=0)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_onnx_export_uses_standard_ops(dynamo):
    """Both exporters take PiXBlock's standard-ops branch (TorchScript tracing and torch.export both make the
    call not plain eager, the condition under which PiXBlock asks whether ONNX export is running)."""
    import onnx
    import onnxruntime as ort

    torch.manual_seed(0)
    block = PiXBlock(16, 4).eval()
    x = torch.randn(2, 16, 5, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            proto = torch.onnx.export(block, (x,), dynamo=True, verbose=False).model_proto.SerializeToString()
        else:
            f = io.BytesIO()
            torch.onnx.export(block, (x,), f, dynamo=False)
            proto = f.getvalue()
    graph = onnx.load_from_string(proto).graph
    assert {"ReduceMax", "ReduceMean", "Where", "Less"} <= {n.op_type for n in graph.node}
    assert all(n.domain in ("", "ai.onnx") for n in graph.node)
    session = ort.InferenceSession(proto)
    y = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    torch.testing.assert_close(torch.from_numpy(y), block(x).detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_cuda_matches_float64_reference(dtype):
    zeta, c = 4, 64
    block = _three_branch_block(c, zeta)
    block.weight.data = block.weight.to(dtype).double()  # the reference sees the same rounded values
    x = _inputs_with_ties(4, c, 7, 7, zeta).to(dtype).double()
    x_ref = x.clone().requires_grad_()
    y_ref, w_ref = _ref_block(block, x_ref)
    dy = 1 + torch.rand_like(y_ref)
    y_ref.backward(dy)
    gpu = PiXBlock(c, zeta).cuda().to(dtype)
    gpu.load_state_dict(block.state_dict())
    xg = x.cuda().to(dtype).contiguous(memory_format=torch.channels_last).requires_grad_()
    y = gpu(xg)
    y.backward(dy.cuda().to(dtype))
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(y.double().cpu(), y_ref.detach(), **tol)
    torch.testing.assert_close(xg.grad.double().cpu(), x_ref.grad, **tol)
    wtol = {"rtol": 5e-2, "atol": 5e-2} if dtype == torch.bfloat16 else tol
    torch.testing.assert_close(gpu.weight.grad.double().cpu(), w_ref.grad, **wtol)


@pytest.mark.cuda
def test_pix_resnet50_cuda_inference_mode_matches_the_float64_reference():
    """A PiX ResNet-50 on CUDA under torch.inference_mode, as compress.profile and export run models (its residual
    tails keep the next block's channel mean on their output, which needs a version counter): the output matches the
    float64 CPU model and the no_grad run, and compress.profile measures its latency on CUDA."""
    import copy

    torch.manual_seed(0)
    model = create_model("resnet50", num_classes=10)
    insert_pix(model, 4)
    model.eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(x.double())
    gpu = model.cuda()
    xg = x.cuda()
    with torch.no_grad():
        plain = gpu(xg)
    with torch.inference_mode():
        got = gpu(xg)
    rel = ((got.double().cpu() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2  # TF32 convs
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-6)
    report = profile(gpu, (3, 64, 64), batch_size=2, device="cuda", repeats=2)
    assert report.device.startswith("cuda") and report.latency_ms > 0


def test_torchvision_and_timm_pix_resnet50_count_alike_in_the_paper_convention():
    """The same architecture from two libraries gets one count: torchvision's PiX bottleneck runs its residual ReLU
    as the ResidualReLU module, counted like timm's act3 (and the dense Bottleneck's ReLU)."""
    counts = {}
    for name in ("resnet50", "timm:resnet50"):
        with torch.device("meta"):
            model = create_model(name, num_classes=1000, input_size=224)
            insert_pix(model, 4)
        counts[name] = profile(model, (3, 224, 224), latency=False, convention="paper").macs
    assert counts["resnet50"] == counts["timm:resnet50"]


def _last_bn1_grouped(model: nn.Module) -> nn.Module:
    model.layer4[2].bn1 = nn.GroupNorm(32, 512)  # not a BatchNorm2d: its block cannot take PiX
    return model


def _last_conv_grouped(model: nn.Module) -> nn.Module:
    name, conv = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)][-1]
    model.features[int(name.split(".")[1])] = nn.Conv2d(conv.in_channels, conv.out_channels, 3, padding=1, groups=2,
                                                        bias=False)
    return model


def downscaled(model: nn.Module) -> nn.Module:
    downscale_pix(model, 2)
    return model


@pytest.mark.parametrize("build, zeta, tau, message", [
    (lambda: torchvision.models.resnext50_32x4d(), 16, 0.5, "new width 16 is not divisible by conv2's groups=32"),
    (lambda: torchvision.models.resnet50(), 4, 1.5, r"tau=1.5 must be a number in \[0, 1\]"),
    (lambda: create_model("vgg11"), 3, 0.5, "not divisible by zeta=3"),
    (lambda: create_model("timm:wide_resnet50_2", num_classes=10, input_size=32), 2, 0.5,
     r"input channels 64 are not divisible by the new width 128 .* PiX can only squeeze"),
    (lambda: downscaled(create_model("vgg11")), 2, 0.5, "VGG has PiX blocks already; apply PiX once"),
    # found wrong only at the last block or conv: nothing before it may have been replaced either
    (lambda: _last_bn1_grouped(torchvision.models.resnet50()), 4, 0.5, "layer4.2"),
    (lambda: _last_conv_grouped(create_model("vgg11")), 2, 0.5, "groups=2"),
])
def test_a_failed_insertion_leaves_the_model_as_it_was(build, zeta, tau, message):
    model = build().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    structure = [(n, type(m)) for n, m in model.named_modules()]
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        want = model(x)
    with pytest.raises(ValueError, match=message):
        apply_pix(model, zeta, tau)
    assert [(n, type(m)) for n, m in model.named_modules()] == structure
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)


@pytest.mark.parametrize("insert, name, zeta", [(insert_pix, "resnet29_bottleneck", 4), (downscale_pix, "resnet20", 2)])
def test_insert_and_downscale_record_pix_in_the_architecture_and_give_every_block_tau(insert, name, zeta):
    """The recorded tau is every block's: tau 0 (every group takes the mean) and tau 1 (every group the max) give
    different outputs (bottleneck branches not zero-initialised, so the PiX branch shows)."""
    model = create_model(name)
    insert(model, zeta, 0.4)
    assert model.compress_arch["pix"] == {"zeta": zeta, "tau": 0.4}
    outputs = []
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    for tau in (0.0, 1.0):
        torch.manual_seed(0)
        model = create_model(name, **({"zero_init_last": False} if "bottleneck" in name else {}))
        insert(model, zeta, tau)
        assert {m.tau for m in model.modules() if isinstance(m, PiXBlock)} == {tau}
        with torch.no_grad():
            outputs.append(model.eval()(x))
    assert not torch.allclose(*outputs)


def test_squeezes_pix_cannot_take_are_refused_naming_the_layer_and_tau_bounds_are_inclusive():
    """A strided squeeze conv (Caffe-style bottleneck) and timm's anti-aliased blocks at another width are refused,
    the model left as it was; tau 0 and 1 are valid."""
    model = torchvision.models.resnet50()
    model.layer2[0].conv1.stride, model.layer2[0].conv2.stride = (2, 2), (1, 1)
    with pytest.raises(ValueError, match=r"layer 'layer2.0'.*conv1 must be the squeeze, a plain stride-1 1x1"):
        insert_pix(model, 4)
    assert not any(isinstance(m, PiXBlock) for m in model.modules())
    model = create_model("timm:resnetblur50", num_classes=10, input_size=32)
    with pytest.raises(ValueError, match=r"layer 'layer2.0' .*cannot change the width with anti-aliasing that holds "
                                         r"per-channel tensors \(BlurPool2d\); only zeta=4 keeps this block's width 128"):
        insert_pix(model, 8)
    assert not any(isinstance(m, PiXBlock) for m in model.modules())
    # AvgPool2d anti-aliasing (resnetaa50d) holds nothing per channel: any width (it was refused, advising the zeta
    # just refused)
    model = create_model("timm:resnetaa50d", num_classes=10, input_size=32).eval()
    insert_pix(model, 8)
    assert model.layer2[0].conv2.out_channels == 64 and type(model.layer2[0].aa) is nn.AvgPool2d
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert [PiXBlock(8, 2, tau).tau for tau in (0, 0.0, 1, 1.0)] == [0.0, 0.0, 1.0, 1.0]


def test_inductor_with_frozen_weights_hands_pix_its_channels_last_activations(monkeypatch):
    """torch.compile (Inductor on the CPU, weights frozen: the CPU deployment recipe) of a PiX bottleneck ResNet
    from an NCHW input: the output matches eager (float32 within 1e-4 relative), and every PiX block receives the
    channels_last activations Inductor keeps around its oneDNN convs (the ops are tagged flexible_layout;
    without the tag Inductor converts each one to NCHW and back, and the compiled PiX ResNet-50 lost its speed)."""
    import importlib

    import torch._inductor.config as inductor_config

    pix_ops = importlib.import_module("kernels.pix")  # the module (the package's `pix` is the function)
    torch.manual_seed(0)
    model = create_model("resnet29_bottleneck", num_classes=10)
    insert_pix(model, 4)
    model.eval()
    x = torch.randn(2, 3, 32, 32)
    layouts = []
    squeeze_cpu = pix_ops._squeeze_cpu

    def recording(x, *args, **kwargs):
        layouts.append(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())
        return squeeze_cpu(x, *args, **kwargs)

    monkeypatch.setattr(pix_ops, "_squeeze_cpu", recording)
    torch._dynamo.reset()
    # (the config's own patch: pytest 9.2's monkeypatch restores from the module's __dict__, where torch's config
    # keeps no value, and so deleted `freezing` from the config for every later test)
    try:
        with torch.inference_mode(), inductor_config.patch(freezing=True):
            want = model(x)
            layouts.clear()
            got = torch.compile(model, dynamic=False)(x)
    finally:
        torch._dynamo.reset()
    n_blocks = sum(isinstance(m, PiXBlock) for m in model.modules())
    assert len(layouts) == n_blocks and all(layouts), layouts
    assert ((got - want).norm() / want.norm()).item() < 1e-4


@pytest.mark.cuda
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_inductor_cuda_training_step_matches_the_float64_reference(channels_last, monkeypatch):
    """A torchvision PiX ResNet-50 (train mode, BN batch statistics) through torch.compile with Inductor on CUDA,
    from NCHW and channels_last inputs: the loss, the input gradient and a PiX predictor's gradient match the
    float64 CPU model (relative error, TF32 off), in two steps (the second reuses the compiled graph). The gradients
    of a random-init ResNet-50 are sensitive to rounding (ReLU kinks, max ties): on an H100 the float32 CPU model
    was 4e-4-3.6e-3 off the float64 one, CUDA eager 2e-3-3.6e-3, compiled 5e-3-7e-3; hence 2e-2 for them."""
    import copy

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=10)
    insert_pix(model, 4)
    x = torch.randn(4, 3, 64, 64)
    ref = copy.deepcopy(model).double()
    x_ref = x.double().requires_grad_()
    loss_ref = ref(x_ref).square().mean()
    loss_ref.backward()
    gpu = model.cuda()
    if channels_last:
        gpu = gpu.to(memory_format=torch.channels_last)
    compiled = torch.compile(gpu)
    torch._dynamo.reset()
    try:
        for step in range(2):
            gpu.zero_grad()
            xg = x.cuda().contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
            xg.requires_grad_()
            loss = compiled(xg).square().mean()
            loss.backward()
            errors = {
                "loss": abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()),
                "x.grad": ((xg.grad.double().cpu() - x_ref.grad).norm() / x_ref.grad.norm()).item(),
                "pix weight grad": ((gpu.layer2[1].conv1.weight.grad.double().cpu() - ref.layer2[1].conv1.weight.grad).norm()
                                    / ref.layer2[1].conv1.weight.grad.norm()).item(),
            }
            assert errors["loss"] < 1e-4 and errors["x.grad"] < 2e-2 and errors["pix weight grad"] < 2e-2, (step, errors)
    finally:
        torch._dynamo.reset()


def test_inserted_modules_fit_the_model_they_join():
    """The PiX blocks and the convs/BNs rebuilt at a new width take the model's dtype, train/eval mode, frozen
    parameters and BN settings: an eval float64 model stays an eval float64 model (its rebuilt BNs used to train on
    every forward, in float32)."""
    model = torchvision.models.resnet50(num_classes=10, norm_layer=lambda c: nn.BatchNorm2d(c, eps=1e-3, momentum=0.01))
    model.double().eval().requires_grad_(False)
    insert_pix(model, 8)  # zeta 8: conv2, bn2 and conv3 rebuilt at the thin width
    assert {p.dtype for p in model.parameters()} == {torch.float64} and not model.layer1[0].bn2.training
    assert not any(m.training for m in model.modules()) and not any(p.requires_grad for p in model.parameters())
    assert model.layer1[0].bn2.eps == 1e-3 and model.layer1[0].bn2.momentum == 0.01
    assert model.layer1[0].conv2.bias is None and model.layer1[0].conv2.in_channels == 32
    with_bias = create_model("resnet29_bottleneck", widths=[8, 16, 32]).to(memory_format=torch.channels_last)
    with_bias.layer1[1].conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=True).to(memory_format=torch.channels_last)
    insert_pix(with_bias, 8)  # rebuilt: a bias where the old conv had one, channels_last kept
    assert with_bias.layer1[1].conv2.bias is not None and with_bias.layer1[0].conv2.bias is None
    assert with_bias.layer1[0].conv2.weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model(x)[:1], model(x[:1]), rtol=1e-12, atol=1e-12)  # no batch statistics
    untracked = torchvision.models.resnet50(norm_layer=lambda c: nn.BatchNorm2d(c, track_running_stats=False))
    insert_pix(untracked, 8)
    assert not untracked.layer1[0].bn2.track_running_stats
    vgg = create_model("vgg11").double().eval()
    downscale_pix(vgg, 2)
    assert {p.dtype for p in vgg.parameters()} == {torch.float64} and not any(m.training for m in vgg.modules())
    assert vgg(torch.randn(1, 3, 32, 32, dtype=torch.float64)).dtype == torch.float64


def test_hooks_on_the_modules_pix_replaces_or_rebuilds_are_named_in_a_warning():
    """insert_pix and downscale_pix replace or rebuild convs and BNs; a feature-capture hook registered on one went
    with it and silently stopped firing. The warning names them; hooks on modules PiX keeps stay and say nothing."""
    model = create_model("resnet29_bottleneck")
    seen = []
    for name in ("layer1.0.conv1", "layer2.1.conv2", "layer3.0.bn3"):
        model.get_submodule(name).register_forward_hook(lambda m, i, o, name=name: seen.append(name))
    model.layer1[1].conv1.register_full_backward_hook(lambda m, gi, go: None)  # (backward hooks go too)
    with pytest.warns(UserWarning, match=r"insert_pix: layer1\.0\.conv1, layer1\.1\.conv1, layer2\.1\.conv2: PiX "
                                         r"replaced or rebuilt"):
        insert_pix(model, 8)  # (zeta 8: conv2, bn2 and conv3 rebuilt thinner)
    model(torch.randn(1, 3, 32, 32))
    assert seen == ["layer3.0.bn3"]
    kept = create_model("resnet29_bottleneck")
    kept.layer3[0].bn3.register_forward_hook(lambda m, i, o: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        insert_pix(kept, 4)
    vgg = create_model("vgg11")
    second = [name for name, m in vgg.named_modules() if isinstance(m, nn.Conv2d)][1]  # the first PiX replaces
    vgg.get_submodule(second).register_forward_pre_hook(lambda m, i: None)
    with pytest.warns(UserWarning, match=rf"downscale_pix: {second}: PiX replaced or rebuilt"):
        downscale_pix(vgg, 2)


def test_pix_twice_is_refused_and_numpy_ints_are_zetas():
    import numpy as np

    model = torchvision.models.resnet50(num_classes=10)
    insert_pix(model, np.int64(4))
    with pytest.raises(ValueError, match=r"insert_pix: layer 'layer1.0' .* has a PiX block already; apply PiX once"):
        insert_pix(model, 4)


@pytest.mark.parametrize("name, zeta", [("resnet20", 2), ("resnet29_bottleneck", 8)])
def test_pix_after_skeletons_is_refused_with_the_order_to_use(name, zeta):
    """PiX resizes plain convs: a model with skeletons attached first is refused, saying to apply PiX before."""
    model = create_model(name, num_classes=3)
    compress.attach_skeletons(model)
    with pytest.raises(ValueError, match=r"got SkeletonConv2d; apply PiX to the model before compress.attach_skeletons"):
        apply_pix(model, zeta)


def test_pix_into_a_compacted_model_is_refused_with_the_order_to_use():
    """After compaction the widths are the pruning's (here stage 1 lost stem channels): no zeta fits, and the error
    says to insert PiX first instead of suggesting another zeta; the model is unchanged."""
    from compress.compaction import compact

    for name, apply in (("resnet29_bottleneck", insert_pix), ("vgg11", downscale_pix)):
        model = create_model(name, num_classes=3).eval()
        first = compress.attach_skeletons(model)[0]
        with torch.no_grad():
            model.get_submodule(first).skeleton[:3] = 0  # 3 dead filters of the first conv
        small = compact(model)
        before = {k: v.clone() for k, v in small.state_dict().items()}
        with pytest.raises(ValueError, match=rf"{apply.__name__}: the model is compacted already .* insert PiX into the "
                                             r"dense model, then train with SWP and compact"):
            apply(small, 4)
        assert small.state_dict().keys() == before.keys()
        assert all(torch.equal(v, before[k]) for k, v in small.state_dict().items())


@pytest.mark.cuda
def test_pix_inserted_into_a_cuda_model_lands_on_its_device():
    """Inserted PiX blocks and rebuilt convs used to be made on the CPU in float32 whatever the model held."""
    model = torchvision.models.resnet50(num_classes=10).cuda().to(torch.bfloat16).eval()
    insert_pix(model, 8)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cuda", torch.bfloat16)}
    vgg = create_model("vgg11").cuda().eval()
    downscale_pix(vgg, 2)
    with torch.no_grad():
        assert model(torch.randn(2, 3, 64, 64, device="cuda", dtype=torch.bfloat16)).shape == (2, 10)
        assert vgg(torch.randn(2, 3, 32, 32, device="cuda")).isfinite().all()


def test_residual_tail_traces_without_tracer_warnings():
    """ONNX export traces PiXBottleneck's tail (TorchScript): its eager-only checks must not compare traced shapes,
    which warns that the trace might be incorrect; the traced tail still computes relu(out + identity)."""
    from compress.pix import ResidualReLU

    out, identity = torch.randn(2, 4, 3, 3), torch.randn(2, 4, 3, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)
        traced = torch.jit.trace(ResidualReLU(), (out.clone(), identity))
    torch.testing.assert_close(traced(out.clone(), identity), torch.relu(out + identity), rtol=0, atol=0)


def test_eager_cpu_inference_calls_the_bound_cpp_block_directly(monkeypatch):
    """Grad off, nothing tracing or observing: a PiX block calls the C++ block through a call bound to its weight's
    memory (one bind for repeated calls and for in-place edits, also .data ones), bit-identical to the op, near the
    float64 reference. A new weight and a new tau bind again; grad on, a dispatch mode, the profiler, bf16, a
    weight of another dtype than x or re-strided in place, batch 0, a sliced x and a tensor subclass take the op;
    a zeta or weight shape that no longer fit get the op's error (the bound call segfaulted); copies and pickles
    after a call work."""
    import copy
    import pickle

    from torch.utils._python_dispatch import TorchDispatchMode

    import compress.pix as pix_module
    from kernels._utils import memory_format

    binds = []
    real = pix_module.squeeze_cpu_call
    monkeypatch.setattr(pix_module, "squeeze_cpu_call", lambda *a: (binds.append(a[1]), real(*a))[1])
    gen = torch.Generator().manual_seed(3)
    block = PiXBlock(16, 4).eval()
    x = torch.randn(2, 16, 5, 6, generator=gen)

    def check(x_in, n_binds, **kw):
        with torch.no_grad():
            y = block(x_in)
        w = block.weight.detach().to(x_in.dtype) if x_in.dtype == torch.float64 else block.weight.detach()
        op = kernels.pix_squeeze(x_in, w, block.zeta, block.tau)  # not a module call: the op path
        assert torch.equal(y, op) and len(binds) == n_binds, binds
        ref = _ref_block(block, x_in.double())[0]
        torch.testing.assert_close(y.double(), ref, rtol=kw.get("rtol", 1e-5), atol=kw.get("atol", 1e-6))
        assert y.is_contiguous(memory_format=memory_format(x_in)) and type(y) is type(op)  # (a subclass stays one)
        return y

    check(x, 1)
    check(x, 1)
    check(x.contiguous(memory_format=torch.channels_last), 1)
    with torch.no_grad():
        block.weight.mul_(-1)  # in place: the call reads the weight's memory
    check(x, 1)
    block.weight.data.mul_(2)  # past the version counter: the same
    check(x, 1)
    block.weight.data = block.weight.data * 2  # a new tensor
    check(x, 2)
    check(x.double(), 3)  # float64 x, float32 weight: the op (converting the predictor)
    check(x, 3)
    block.tau = 0.9
    check(x, 4)
    check(x[:, :, :, ::2], 4)  # neither layout: the op
    check(x[:0], 4)
    check(x.bfloat16(), 4, rtol=2e-2, atol=2e-2)
    check(x.as_subclass(_Sub), 4)
    with pytest.raises(ValueError, match="tau=2.0 must be a number in"):
        block.tau = 2.0

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            names.append(str(func))
            return func(*args, **(kwargs or {}))

    names = []
    with torch.no_grad(), Seen():
        block(x)
    assert any("compress.pix_squeeze" in n for n in names), names
    with torch.no_grad(), torch.profiler.profile() as prof:
        block(x)
    assert any("pix_squeeze" in e.name for e in prof.events())
    x.requires_grad_()
    block(x).sum().backward()  # grad on: the op's autograd
    assert x.grad is not None and len(binds) == 4
    assert torch.equal(copy.deepcopy(block)(x.detach()), pickle.loads(pickle.dumps(block))(x.detach()))

    with torch.no_grad():
        block.zeta = 2  # the weight is still zeta 4's: the op's error, not the C++ block writing past y
        with pytest.raises(ValueError, match=r"weight' must have shape \(8, 16, 1, 1\)"):
            block(x)
        block.zeta = 4
        block(x)
        block.weight.data = block.weight.data[:2]  # same address, another shape
        with pytest.raises(ValueError, match=r"weight' must have shape \(4, 16, 1, 1\)"):
            block(x)

    square = PiXBlock(6, 1).eval()  # zeta 1: a square predictor, so its transpose keeps the address and the shape
    xs = torch.randn(2, 6, 3, 3, generator=gen)
    with torch.no_grad():
        square(xs)
        square.weight.data = square.weight.data.transpose(0, 1)  # another layout: the op (the call read it as before)
        torch.testing.assert_close(square(xs).double(), _ref_block(square, xs.double())[0], rtol=1e-5, atol=1e-6)


class _Sub(torch.Tensor):
    pass


def test_pix_into_a_wrapped_model_is_refused_naming_the_model_inside():
    """PiX went into a DataParallel's model but its record (compress_arch["pix"], which export reads for the dense
    baseline) onto the wrapper, which has none; wrappers are refused as compact and save refuse them."""
    for apply, name in ((apply_pix, "resnet29_bottleneck"), (insert_pix, "resnet29_bottleneck"),
                        (downscale_pix, "vgg11")):
        model = create_model(name, num_classes=3)
        for wrapped, inner in ((nn.DataParallel(model), r"model\.module"),
                               (torch.compile(model), r"model\._orig_mod")):
            with pytest.raises(ValueError, match=rf"{apply.__name__}: .* is a wrapper; insert PiX into the model "
                                                 rf"inside it: {inner}"):
                apply(wrapped, 4)
        assert "pix" not in model.compress_arch and not any(isinstance(m, compress.PiXBlock) for m in model.modules())
