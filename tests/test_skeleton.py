"""Filter Skeleton: conv semantics vs F.conv2d, the SWP update rule, BN zeroing, attach and stats."""

import math
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

from compress.models import create_model
from compress.skeleton import SkeletonConv2d, attach_skeletons, skeleton_stats, swp_update
from compress.surgery import conv_bn_pairs


@pytest.mark.parametrize(
    "stride,padding,dilation,bias",
    [(1, 1, 1, True), (2, 0, 1, False), (1, 2, 2, True), ((2, 1), (1, 0), (1, 2), False), (1, "same", 1, True)],
)
def test_skeleton_conv_matches_masked_f_conv2d(stride, padding, dilation, bias):
    g = torch.Generator().manual_seed(0)
    conv = nn.Conv2d(5, 7, 3, stride=stride, padding=padding, dilation=dilation, bias=bias).double()
    sk = SkeletonConv2d.from_conv(conv)
    with torch.no_grad():
        sk.skeleton.copy_(torch.randn(7, 3, 3, generator=g, dtype=torch.double))
    x = torch.randn(2, 5, 9, 8, generator=g, dtype=torch.double, requires_grad=True)
    y = sk(x)

    w = conv.weight.detach().clone().requires_grad_(True)
    s = sk.skeleton.detach().clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = F.conv2d(x_ref, w * s[:, None], conv.bias, stride, padding, dilation)
    torch.testing.assert_close(y, y_ref)

    dy = torch.randn(y.shape, generator=g, dtype=torch.double)
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(sk.weight.grad, w.grad)
    torch.testing.assert_close(sk.skeleton.grad, s.grad)
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_from_conv_keeps_arguments_dtype_and_padding_mode():
    conv = nn.Conv2d(3, 4, (3, 5), padding=(1, 2), padding_mode="circular", dtype=torch.float64)
    sk = SkeletonConv2d.from_conv(conv)
    assert sk.skeleton.shape == (4, 3, 5) and sk.skeleton.dtype == torch.float64
    assert torch.equal(sk.skeleton, torch.ones(4, 3, 5, dtype=torch.float64))
    x = torch.randn(2, 3, 6, 7, dtype=torch.float64)
    torch.testing.assert_close(sk(x), conv(x))  # skeleton = 1: identical to the source conv


def test_attach_selection_frozen_weights_modes_and_float64_under_autocast():
    """exclude= alone, min_kernel_size on non-square kernels (the larger side counts), an asymmetric 'same' conv left
    dense with a warning; from_conv keeps a frozen weight frozen and the train/eval mode; a float64 skeleton conv
    stays float64 under CPU autocast, as nn.Conv2d does."""
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Conv2d(4, 4, 3))
    assert attach_skeletons(net, exclude=["0", "3"]) == ["2"]
    net = nn.Sequential(nn.Conv2d(3, 4, (1, 3)), nn.Conv2d(4, 4, (3, 1)), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, (1, 5)))
    assert attach_skeletons(net, min_kernel_size=3) == ["0", "1", "3"]
    net = nn.Sequential(nn.Conv2d(3, 4, 4, padding="same"), nn.Conv2d(4, 4, 3, padding="same"))
    with pytest.warns(UserWarning, match="asymmetric 'same'"):
        assert attach_skeletons(net) == ["1"]
    conv = nn.Conv2d(3, 4, 3, padding=1).double().eval()
    conv.weight.requires_grad_(False)
    sk = SkeletonConv2d.from_conv(conv)
    assert not sk.weight.requires_grad and sk.bias.requires_grad and not sk.training
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = sk(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, conv(x))


def test_stripe_mask_threshold_is_strict():
    sk = SkeletonConv2d(1, 2, 2)
    with torch.no_grad():
        sk.skeleton.copy_(torch.tensor([[[0.5, -0.01], [0.02, 0.0]], [[-0.3, 0.01], [0.011, -0.2]]]))
    expected = torch.tensor([[[True, False], [True, False]], [[True, False], [True, True]]])
    assert torch.equal(sk.stripe_mask(0.01), expected)
    # a float32 value above the threshold that the threshold rounds to in float32: kept, as in float64
    t = 0.99826
    with torch.no_grad():
        sk.skeleton.fill_(t)
    assert sk.skeleton[0, 0, 0].item() > t and sk.stripe_mask(t).all()
    assert sk.double().stripe_mask(t).all()


def _net_with_bn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 2, 2, bias=False), nn.BatchNorm2d(2), nn.ReLU(), nn.Conv2d(2, 3, 1))


def test_swp_update_hand_computed():
    net = _net_with_bn()
    assert attach_skeletons(net) == ["0"]
    conv, bn = net[0], net[1]
    with torch.no_grad():
        conv.skeleton.copy_(torch.tensor([[[0.5, -0.2], [0.005, 1.0]], [[-0.008, 0.009], [0.003, -0.01]]]))
        bn.weight.copy_(torch.tensor([1.5, 2.0]))
        bn.bias.copy_(torch.tensor([0.1, -0.4]))
    conv.skeleton.grad = torch.tensor([[[0.1, 0.2], [0.3, -0.4]], [[0.5, 0.6], [0.7, 0.8]]])
    bn.weight.grad = torch.tensor([0.25, 0.5])
    bn.bias.grad = torch.tensor([-0.25, 0.75])

    swp_update(net, alpha=0.1, threshold=0.01)

    # grad + 0.1 * sign(FS): [[0.2, 0.1], [0.4, -0.3]]; entries with |FS| <= 0.01 zeroed (value and grad).
    torch.testing.assert_close(conv.skeleton.grad[0], torch.tensor([[0.2, 0.1], [0.0, -0.3]]))
    torch.testing.assert_close(conv.skeleton.data[0], torch.tensor([[0.5, -0.2], [0.0, 1.0]]))
    assert torch.equal(conv.skeleton.data[1], torch.zeros(2, 2))
    assert torch.equal(conv.skeleton.grad[1], torch.zeros(2, 2))
    # filter 1 is dead: its BN channel (weight, bias and their grads) zeroed, filter 0 untouched.
    torch.testing.assert_close(bn.weight.data, torch.tensor([1.5, 0.0]))
    torch.testing.assert_close(bn.bias.data, torch.tensor([0.1, 0.0]))
    torch.testing.assert_close(bn.weight.grad, torch.tensor([0.25, 0.0]))
    torch.testing.assert_close(bn.bias.grad, torch.tensor([-0.25, 0.0]))


def test_swp_update_after_real_backward_and_stats():
    net = _net_with_bn()
    attach_skeletons(net)
    with torch.no_grad():
        net[0].skeleton[1] = 0.004  # filter 1 entirely below threshold -> dead
    net(torch.randn(4, 2, 5, 5)).square().mean().backward()
    expected_grad = net[0].skeleton.grad[0] + 1e-3 * torch.sign(net[0].skeleton[0])
    swp_update(net, alpha=1e-3, threshold=0.005)
    torch.testing.assert_close(net[0].skeleton.grad[0], expected_grad.detach())
    assert float(net[1].weight[1].detach()) == 0.0 and float(net[1].bias[1].detach()) == 0.0
    stats = skeleton_stats(net, threshold=0.005)
    assert stats["layers"]["0"] == {"stripes_total": 8, "stripes_kept": 4, "filters_total": 2, "filters_dead": 1}
    assert (stats["stripes_total"], stats["stripes_kept"], stats["filters_dead"]) == (8, 4, 1)


def test_swp_update_through_a_wrapper_zeroes_the_bn_of_dead_filters():
    """swp_update(DataParallel(net)) (as a training loop holds it) traced the wrapper, which fx cannot: it warned
    and left the dead filters' BN channels alive; it works on the model inside now."""
    net = _net_with_bn()
    dp = nn.DataParallel(net)
    attach_skeletons(dp)
    with torch.no_grad():
        net[0].skeleton[1] = 0.004
    dp(torch.randn(4, 2, 5, 5)).square().mean().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pairs = conv_bn_pairs(dp)  # (once, as a training loop passes it to every step: it traced the wrapper too)
        swp_update(dp, alpha=1e-3, threshold=0.005, bn_pairs=pairs)
    assert pairs == {"0": "1"}
    assert float(net[1].weight[1]) == 0.0 and float(net[1].bias[1]) == 0.0 and float(net[1].weight[0]) != 0.0


def test_attach_skeletons_to_a_bare_conv_is_a_clear_error():
    with pytest.raises(ValueError, match=r"bare nn.Conv2d.*nn.Sequential\(conv\).*SkeletonConv2d.from_conv"):
        attach_skeletons(nn.Conv2d(3, 4, 3))


def test_swp_update_gives_a_frozen_skeleton_no_gradient():
    """A skeleton with requires_grad=False stays as it is under the optimizer (its pruned entries still zeroed); the
    trained one beside it gets the L1 term."""
    net = nn.Sequential(SkeletonConv2d(3, 4, 3), SkeletonConv2d(4, 4, 3))
    with torch.no_grad():
        for conv in net:
            conv.skeleton.uniform_(0.5, 1.5)
        net[0].skeleton[0, 0, 0] = 0.001  # below the threshold
    net[0].skeleton.requires_grad_(False)
    frozen = net[0].skeleton.detach().clone()
    optimizer = torch.optim.SGD(net.parameters(), lr=1.0)
    net(torch.randn(2, 3, 7, 7)).sum().backward()
    trained_grad = net[1].skeleton.grad.clone()
    swp_update(net, alpha=0.01, threshold=0.005)
    assert net[0].skeleton.grad is None
    torch.testing.assert_close(net[1].skeleton.grad, trained_grad + 0.01)  # sign(FS) = 1: all positive
    optimizer.step()
    frozen[0, 0, 0] = 0.0
    assert torch.equal(net[0].skeleton.detach(), frozen)


def test_swp_update_before_backward_warns():
    """Called before backward (or with none), swp_update set the gradients to alpha * sign(FS) and zeroed the pruned
    entries, which the backward then revived, without a word."""
    net = _net_with_bn()
    attach_skeletons(net)
    with pytest.warns(UserWarning, match=r"no skeleton has a gradient; call it after loss.backward\(\) .*"
                                         r"scaler.unscale_\(optimizer\).* before optimizer.step\(\)") as caught:
        swp_update(net, alpha=1e-3, threshold=0.005)
    assert caught[0].filename == __file__  # the caller's line, not torch.no_grad's wrapper
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        swp_update(net, alpha=0.0, threshold=0.005)  # alpha 0: masks only (benchmarks/_masks.py), no warning
    net(torch.randn(4, 2, 5, 5)).square().mean().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        swp_update(net, alpha=1e-3, threshold=0.005)  # after backward: no warning


@pytest.mark.parametrize("alpha,threshold,key", [(-1e-5, 0.01, "alpha"), (1e-5, -0.1, "threshold"),
                                                 (1e-5, float("nan"), "threshold"), ("x", 0.01, "alpha")])
def test_swp_update_rejects_negative_nan_and_non_numbers(alpha, threshold, key):
    """A NaN threshold would zero every skeleton (|FS| <= NaN is False, so nothing counts as kept)."""
    net = _net_with_bn()
    attach_skeletons(net)
    before = [p.clone() for p in net.parameters()]
    with pytest.raises(ValueError, match=f"{key} must be a finite number >= 0"):
        swp_update(net, alpha=alpha, threshold=threshold)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("threshold", [0.01, 0.1, 0.3])
def test_swp_update_keeps_what_stripe_mask_keeps_at_the_threshold_in_every_dtype(dtype, threshold):
    """The threshold rounded to the skeleton's dtype can lie above it (0.01 in bfloat16 is 0.010009765625, 0.1 in
    float32 0.10000000149): an entry equal to that is above the threshold, kept by stripe_mask, compact and
    skeleton_stats (float64), and swp_update zeroed it."""
    net = nn.Sequential(nn.Conv2d(3, 4, 3)).to(dtype)
    attach_skeletons(net)
    conv = net[0]
    rounded = torch.tensor(threshold, dtype=torch.float64).to(dtype)
    up, down = (torch.nextafter(rounded, torch.tensor(v, dtype=dtype)) for v in (1.0, -1.0))
    values = torch.stack([rounded, up, down, -rounded, -up, -down]).repeat(2)
    with torch.no_grad():
        fs = torch.rand(conv.skeleton.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        fs = (fs * 3 * threshold).to(dtype).flatten()
        fs[: values.numel()] = values
        conv.skeleton.copy_(fs.view_as(conv.skeleton))
    exact = conv.skeleton.detach().double().abs() > threshold  # an independent float64 comparison
    assert exact.any() and not exact.all()
    assert torch.equal(conv.stripe_mask(threshold), exact)
    swp_update(net, alpha=0.0, threshold=threshold)
    assert torch.equal(conv.skeleton.detach() != 0, exact)
    assert skeleton_stats(net, threshold)["stripes_kept"] == int(exact.sum())


def test_swp_update_refuses_a_parametrized_skeleton_naming_the_layer():
    """Each read of a parametrized skeleton is a new tensor: the masks zeroed a temporary (a raw KeyError before)."""

    class Double(nn.Module):
        def forward(self, t):
            return 2 * t

    net = _net_with_bn()
    names = attach_skeletons(net)
    torch.nn.utils.parametrize.register_parametrization(net.get_submodule(names[-1]), "skeleton", Double())
    before = [p.clone() for p in net.parameters()]
    with pytest.raises(ValueError, match=rf"swp_update: the skeleton of {re.escape(names[-1])} has a parametrization"
                                         r".*remove_parametrizations\(conv, 'skeleton'\)"):
        swp_update(net, alpha=1e-3, threshold=0.005)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_entry_points_that_read_values_refuse_a_meta_model_and_profile_counts_it(tmp_path):
    """A model built on the meta device has shapes but no values: compact, skeleton_stats, save, choose_modes and a
    timed profile name the problem and the fix (raw "Tensor.item() cannot be called on meta tensors", "Cannot copy
    out of meta tensor" or autocast errors before); profile's counts need shapes only and equal a real model's."""
    import compress

    with torch.device("meta"):
        meta = create_model("resnet20", num_classes=10)
    real = create_model("resnet20", num_classes=10)
    for m in (meta, real):
        attach_skeletons(m)
    fix = r"they hold shapes but no values; .*to_empty\(device='cpu'\) then model.load_state_dict"
    calls = {"compact": lambda: compress.compact(meta.eval(), threshold=0.01),
             "skeleton_stats": lambda: skeleton_stats(meta, 0.01),
             "compress.save": lambda: compress.save(meta, tmp_path / "m.safetensors"),
             "choose_modes": lambda: compress.choose_modes(meta, torch.randn(1, 3, 32, 32)),
             "profile: latency=True": lambda: compress.profile(meta, (3, 32, 32))}
    for where, call in calls.items():
        with pytest.raises(ValueError, match=rf"{re.escape(where)}: the model's tensors are on the meta device "
                                             rf"\(conv1.weight, ...\): {fix}"):
            call()
    with pytest.raises(ValueError, match="pass latency=False to count"):
        compress.profile(meta, (3, 32, 32))
    counted, want = (compress.profile(m, (3, 32, 32), latency=False) for m in (meta, real))
    assert (counted.macs, counted.params, counted.weight_bytes) == (want.macs, want.params, want.weight_bytes)
    assert counted.macs > 0 and [r.macs for r in counted.layers] == [r.macs for r in want.layers]


def test_attach_skeletons_torchvision_resnet18():
    model = torchvision.models.resnet18(num_classes=10)
    names = attach_skeletons(model)
    expected = [n for n, m in torchvision.models.resnet18().named_modules()
                if isinstance(m, nn.Conv2d) and m.kernel_size != (1, 1)]
    assert names == expected and len(names) == 17  # stem 7x7 + 16 block 3x3; the 3 downsample 1x1 excluded
    assert isinstance(model.layer1[0].conv1, SkeletonConv2d)
    assert type(model.layer2[0].downsample[0]) is nn.Conv2d
    assert attach_skeletons(model) == []  # idempotent


def test_attach_skeletons_mobilenet_skips_depthwise_and_filters():
    model = torchvision.models.mobilenet_v2(num_classes=10)
    names = attach_skeletons(model)
    assert names == ["features.0.0"]  # the only dense 3x3; depthwise (groups=C) and 1x1 convs stay
    model = torchvision.models.resnet18(num_classes=10)
    names = attach_skeletons(model, include=["layer1.*", "layer2.*"], exclude=["*.conv2"])
    assert names == ["layer1.0.conv1", "layer1.1.conv1", "layer2.0.conv1", "layer2.1.conv1"]
    names = attach_skeletons(torchvision.models.resnet18(), min_kernel_size=1, include=["layer4.0.*"])
    assert names == ["layer4.0.conv1", "layer4.0.conv2", "layer4.0.downsample.0"]


def test_attach_skeletons_checks_min_kernel_size_and_warns_of_patterns_that_match_no_conv():
    model = torchvision.models.resnet18(num_classes=10)
    for bad in (0, -1, 3.5, "3", True):
        with pytest.raises(ValueError, match=rf"min_kernel_size must be an int >= 1 .*got {re.escape(repr(bad))}"):
            attach_skeletons(model, min_kernel_size=bad)
    with pytest.warns(UserWarning) as seen:
        names = attach_skeletons(model, include=["layer1.*", "layr2.*"], exclude=["*.conv3", "layer1.1.conv2"])
    assert names == ["layer1.0.conv1", "layer1.0.conv2", "layer1.1.conv1"]
    messages = [str(w.message) for w in seen]
    assert any("include pattern(s) ['layr2.*'] match no conv of the model (conv names: conv1, layer1.0.conv1" in m
               for m in messages), messages
    assert any("exclude pattern(s) ['*.conv3'] match no conv" in m and "prune.exclude" in m for m in messages)
    assert not any("layer1.1.conv2" in m or "'layer1.*'" in m for m in messages)  # the patterns that match


def test_a_conv_shared_under_two_names_gets_no_skeleton_and_stays_tied():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Conv2d(4, 4, 3, padding=1)
            self.dec = self.enc
            self.head = nn.Conv2d(4, 2, 3, padding=1)

        def forward(self, x):
            return self.head(self.dec(torch.relu(self.enc(x))))

    model = Tied()
    with pytest.warns(UserWarning, match=r"enc = dec: one conv under several names \(tied weights\) gets no skeleton"):
        assert attach_skeletons(model) == ["head"]
    assert model.enc is model.dec and type(model.enc) is nn.Conv2d and isinstance(model.head, SkeletonConv2d)


def test_a_conv_whose_weight_another_module_holds_gets_no_skeleton_and_stays_tied():
    """One Parameter in two convs, and a conv's weight tied to a ConvTranspose2d decoder: skeleton convs would copy it
    into weights of their own, trained apart from then on."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ConvTranspose2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1))
    model[2].weight = model[1].weight
    model[3].weight = model[4].weight
    with pytest.warns(UserWarning, match=r"1.weight = 2.weight, 3.weight = 4.weight: a conv weight or bias that other "
                                         r"modules hold too \(tied\) gets no skeleton"):
        assert attach_skeletons(model) == ["0"]
    assert model[1].weight is model[2].weight and model[3].weight is model[4].weight
    assert [type(m) for m in model[1:]] == [nn.Conv2d, nn.Conv2d, nn.ConvTranspose2d, nn.Conv2d]
    # a shared bias alone: the skeleton convs' copies untied it silently (QA)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1))
    model[2].bias = model[1].bias
    with pytest.warns(UserWarning, match=r"1.bias = 2.bias: a conv weight or bias that other modules hold too"):
        assert attach_skeletons(model) == ["0"]
    assert model[1].bias is model[2].bias


def test_conv_subclasses_get_no_skeleton_with_a_warning():
    """timm's StdConv2d (weight standardisation in its forward) is not a plain conv: it stays, and the call says so,
    naming the class with its module (a QAT-prepared conv is torch.ao.nn.qat's "Conv2d")."""
    from timm.layers import StdConv2d

    model = nn.Sequential(StdConv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))
    with pytest.warns(UserWarning, match=r"\{'timm\.layers\.std_conv\.StdConv2d': 1\} convs get no skeleton: only plain "
                                         r"nn.Conv2d"):
        assert attach_skeletons(model) == ["2"]
    assert type(model[0]) is StdConv2d


def test_attach_skeletons_cifar_resnet():
    model = create_model("resnet20", num_classes=10)
    names = attach_skeletons(model)
    convs = [n for n, m in create_model("resnet20").named_modules() if isinstance(m, nn.Conv2d)]
    assert names == [n for n in convs if n == "conv1" or n.endswith((".conv1", ".conv2"))]
    assert len(names) == 19  # stem + 9 blocks x 2 (option-A shortcuts have no conv)
    stats = skeleton_stats(model, 0.01)
    assert stats["stripes_total"] == 9 * (16 + 6 * 16 + 6 * 32 + 6 * 64) and stats["filters_dead"] == 0


@pytest.mark.parametrize("name", ["resnet20", "timm:res2net50_14w_8s", "timm:resnetv2_18"])
def test_bn_pairs_follow_data_flow_and_swp_zeroes_the_bn_that_reads_the_dead_filter(name):
    """Each paired BN receives its conv's output tensor itself (forward hooks: the independent reference), also in
    Res2Net (convs and BNs in two ModuleLists) and a pre-activation ResNet (the next BN reads the residual sum and
    must not be paired); swp_update zeroes the BN channel of a dead filter there and leaves the others."""
    from compress.surgery import conv_bn_pairs

    model = create_model(name, num_classes=10, input_size=32).eval()
    attach_skeletons(model)
    pairs = conv_bn_pairs(model)
    outputs, inputs = {}, {}
    for n, m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            m.register_forward_hook(lambda mod, inp, out, n=n: outputs.setdefault(n, out))
        if isinstance(m, nn.BatchNorm2d):
            m.register_forward_pre_hook(lambda mod, inp, n=n: inputs.setdefault(n, inp[0]))
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    reads = {bn: conv for bn, x in inputs.items() for conv, y in outputs.items() if x is y}
    assert pairs and all(reads.get(bn) == conv for conv, bn in pairs.items())
    assert {conv for conv in pairs} == {conv for bn, conv in reads.items()}  # every conv -> BN edge is found
    conv = next(iter(pairs))
    bns = {n: (m.weight.detach().clone(), m.bias.detach().clone()) for n, m in model.named_modules()
           if isinstance(m, nn.BatchNorm2d)}
    with torch.no_grad():
        model.get_submodule(conv).skeleton[0] = 0.0
    swp_update(model, alpha=0.0, threshold=0.0, bn_pairs=pairs)
    for n, (w, b) in bns.items():
        bn = model.get_submodule(n)
        if n == pairs[conv]:
            assert bn.weight[0] == 0 and bn.bias[0] == 0 and torch.equal(bn.weight[1:], w[1:])
        else:
            assert torch.equal(bn.weight, w) and torch.equal(bn.bias, b), n


# ----------------------------------------------------------------------------------------------- grouped skeletons
def test_grouped_skeleton_conv_matches_f_conv2d_with_each_entry_repeated_over_its_filters():
    """stripe_group=3 on 7 filters: skeleton (3, 3, 3), filters 0-2, 3-5 and 6 share an entry per offset; the forward
    and every gradient equal F.conv2d with the skeleton repeated by hand (float64); masks repeat likewise."""
    g = torch.Generator().manual_seed(3)
    conv = nn.Conv2d(5, 7, 3, padding=1, bias=True).double()
    sk = SkeletonConv2d.from_conv(conv, stripe_group=3)
    assert sk.skeleton.shape == (3, 3, 3) and "stripe_group=3" in repr(sk)
    with torch.no_grad():
        sk.skeleton.copy_(torch.randn(3, 3, 3, generator=g, dtype=torch.double))
        sk.skeleton[2, 0, 1] = 0.005
    x = torch.randn(2, 5, 6, 7, generator=g, dtype=torch.double, requires_grad=True)
    s = sk.skeleton.detach().clone().requires_grad_(True)
    per_filter = torch.stack([s[0], s[0], s[0], s[1], s[1], s[1], s[2]])
    w = conv.weight.detach().clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = sk(x), F.conv2d(x_ref, w * per_filter[:, None], conv.bias, 1, 1)
    torch.testing.assert_close(y, y_ref)
    dy = torch.randn(y.shape, generator=g, dtype=torch.double)
    y.backward(dy)
    y_ref.backward(dy)
    for got, want in ((sk.skeleton.grad, s.grad), (sk.weight.grad, w.grad), (x.grad, x_ref.grad)):
        torch.testing.assert_close(got, want)
    assert torch.equal(sk.stripe_mask(0.01), per_filter.detach().abs() > 0.01)
    assert not sk.stripe_mask(0.01)[6, 0, 1] and sk.stripe_mask(0.01)[5, 0, 1] == (abs(s[1, 0, 1]) > 0.01)


def test_swp_update_of_a_grouped_skeleton_zeroes_whole_groups_and_the_bn_of_their_filters():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 5, 2, bias=False), nn.BatchNorm2d(5), nn.ReLU(), nn.Conv2d(5, 3, 1))
    assert attach_skeletons(net, stripe_group=2) == ["0"]
    conv, bn = net[0], net[1]
    assert conv.skeleton.shape == (3, 2, 2)
    with torch.no_grad():
        conv.skeleton.copy_(torch.tensor([[[0.5, 0.004], [0.2, -0.3]],   # filters 0, 1
                                          [[0.003, -0.002], [0.001, 0.0]],  # filters 2, 3: dead
                                          [[0.0, 0.0], [0.0, -0.7]]]))  # filter 4
    conv.skeleton.grad = torch.ones(3, 2, 2)
    bn.weight.grad, bn.bias.grad = torch.ones(5), torch.ones(5)
    swp_update(net, alpha=0.1, threshold=0.005)
    assert torch.equal(conv.skeleton.data[1], torch.zeros(2, 2)) and conv.skeleton.data[0, 0, 1] == 0
    torch.testing.assert_close(conv.skeleton.grad[0], torch.tensor([[1.1, 0.0], [1.1, 0.9]]))
    alive = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0])  # BN weight 1, bias 0, their gradients 1 before the update
    assert torch.equal(bn.weight.data, alive) and torch.equal(bn.weight.grad, alive) and torch.equal(bn.bias.grad, alive)
    stats = skeleton_stats(net, threshold=0.005)
    assert stats["layers"]["0"] == {"stripes_total": 20, "stripes_kept": 7, "filters_total": 5, "filters_dead": 2}


def test_stripe_group_must_be_a_positive_int():
    for bad in (0, -2, 1.5, True, "4"):
        with pytest.raises(ValueError, match="prune.stripe_group"):
            attach_skeletons(nn.Sequential(nn.Conv2d(2, 4, 3)), stripe_group=bad)


def test_attach_skeletons_keeps_existing_skeletons_of_another_group_with_a_warning():
    net = nn.Sequential(nn.Conv2d(2, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    attach_skeletons(net, include=["0"])
    with pytest.warns(UserWarning, match="0 already have skeletons of another stripe_group"):
        assert attach_skeletons(net, stripe_group=4) == ["2"]
    assert net[0].stripe_group == 1 and net[2].stripe_group == 4 and net[2].skeleton.shape == (2, 3, 3)


def test_a_diverged_skeleton_and_bad_thresholds_are_refused_not_compacted_silently():
    """A NaN skeleton entry compared as not above the threshold, so compaction dropped its stripe: the compact
    model's outputs looked normal where the skeleton model's were NaN. compact and StripeConv2d.from_skeleton now
    refuse it naming the layer; stripe_mask refuses a NaN or negative threshold (NaN dropped every stripe, -1 kept
    them all); swp_update on a model with no skeleton says so (it returned, pruning nothing)."""
    from compress.compaction import compact
    from compress.stripe import StripeConv2d

    model = create_model("resnet20")
    attach_skeletons(model)
    model.eval()
    conv = model.layer1[0].conv1
    assert conv.stripe_mask(0.0).all() and not conv.stripe_mask(math.inf).any()
    assert torch.equal(conv.stripe_mask(torch.tensor(0.5)), conv.stripe_mask(0.5))  # a one-element tensor, as before
    for bad in (float("nan"), -1.0, "0.1", True):
        with pytest.raises(ValueError, match=r"stripe_mask: threshold must be a number >= 0"):
            conv.stripe_mask(bad)
    with torch.no_grad():
        conv.skeleton[0, 1, 1] = float("nan")
    with pytest.raises(ValueError, match=r"compact: layer layer1\.0\.conv1: the skeleton holds 1 NaN or inf values"):
        compact(model)
    with pytest.raises(ValueError, match=r"skeleton_stats: layer layer1\.0\.conv1: the skeleton holds 1 NaN or inf"):
        skeleton_stats(model, 0.01)  # (it counted the NaN stripe as pruned)
    with pytest.raises(ValueError, match=r"StripeConv2d\.from_skeleton: the skeleton holds 1 NaN"):
        StripeConv2d.from_skeleton(conv, 0.0)
    with pytest.raises(ValueError, match=r"swp_update: the model has no skeleton convs; call "
                                         r"compress.attach_skeletons\(model\)"):
        swp_update(create_model("resnet20"), alpha=1e-5, threshold=0.01)


def test_skeleton_and_stripe_convs_from_other_layer_types_are_type_errors():
    """from_conv / from_dense / from_skeleton on a ConvTranspose2d, Conv1d, Conv3d or Linear failed with an
    IndexError, an unpacking ValueError or an AttributeError."""
    from compress.stripe import StripeConv2d

    for layer in (nn.ConvTranspose2d(4, 6, 3), nn.Conv1d(4, 6, 3), nn.Conv3d(4, 6, 3), nn.Linear(4, 6)):
        kind = type(layer).__name__
        with pytest.raises(TypeError, match=rf"SkeletonConv2d.from_conv: expected an nn.Conv2d, got {kind}"):
            SkeletonConv2d.from_conv(layer)
        with pytest.raises(TypeError, match=rf"StripeConv2d.from_dense: expected an nn.Conv2d, got {kind}"):
            StripeConv2d.from_dense(layer, torch.ones(6, 3, 3, dtype=torch.bool))


def test_swp_update_with_shared_skeletons_and_shared_bn_tensors():
    """A skeleton two convs share got the L1 term twice (2 alpha); a BN weight two convs' BNs share had the channel
    of one conv's dead filter zeroed although the other conv's filter lives (its output became a constant)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    model[7].weight, model[7].bias = model[4].weight, model[4].bias
    with torch.no_grad():
        for bn in (model[1], model[4]):
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(0.5, 1.5)
    attach_skeletons(model)
    with torch.no_grad():
        model[3].skeleton[0] = 0  # conv 3's filter 0 dies; conv 6's filter 0 lives
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    swp_update(model, alpha=0.0, threshold=0.0)
    assert model[4].weight[0] != 0 and model[4].bias[0] != 0  # the shared BN channel stays: conv 6 uses it
    assert model[1].weight.ne(0).all()
    # conv 6's filter 0 dies too: now the shared channel goes
    with torch.no_grad():
        model[6].skeleton[0] = 0
    swp_update(model, alpha=0.0, threshold=0.0)
    assert model[4].weight[0] == 0 and model[4].bias[0] == 0

    shared = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
    attach_skeletons(shared)
    shared[2].skeleton = shared[0].skeleton  # (shape (4, 3, 3) both)
    shared[0].skeleton.grad = torch.zeros_like(shared[0].skeleton)
    swp_update(shared, alpha=1.0, threshold=0.0)
    assert torch.equal(shared[0].skeleton.grad, torch.ones_like(shared[0].skeleton))  # alpha * sign, once
