"""StripeConv2d against F.conv2d with the masked dense weight (the independent reference)."""

from __future__ import annotations

import io
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from compress.skeleton import SkeletonConv2d
from compress.stripe import StripeConv2d, _layout

GEOMETRIES = [  # (kernel, stride, padding, dilation)
    (3, 1, 1, 1),
    (3, 2, 1, 1),
    (3, 1, 2, 2),
    ((3, 5), (2, 1), (0, 2), (1, 2)),
]


def _random_mask(n: int, kh: int, kw: int, keep: float, gen: torch.Generator) -> torch.Tensor:
    mask = torch.rand(n, kh, kw, generator=gen) < keep
    mask[0] = False  # one dead filter
    return mask


def _masked_reference(conv: nn.Conv2d, mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    w = conv.weight * mask[:, None].to(conv.weight.dtype)
    return F.conv2d(x, w, conv.bias, conv.stride, conv.padding, conv.dilation)


@pytest.mark.parametrize("mode", ["stripe", "dense"])
@pytest.mark.parametrize("kernel,stride,padding,dilation", GEOMETRIES)
def test_from_dense_matches_masked_conv(mode, kernel, stride, padding, dilation):
    gen = torch.Generator().manual_seed(0)
    conv = nn.Conv2d(5, 7, kernel, stride=stride, padding=padding, dilation=dilation, bias=True)
    mask = _random_mask(7, *conv.kernel_size, keep=0.5, gen=gen)
    x = torch.randn(2, 5, 11, 13, generator=gen)
    stripe = StripeConv2d.from_dense(conv, mask, mode=mode)
    assert stripe.num_stripes == int(mask.sum())
    torch.testing.assert_close(stripe(x), _masked_reference(conv, mask, x), rtol=1e-5, atol=1e-5)
    dense = stripe.to_dense()
    torch.testing.assert_close(dense(x), _masked_reference(conv, mask, x), rtol=1e-5, atol=1e-5)
    assert torch.equal(StripeConv2d.from_dense(dense, mask).weight, stripe.weight)


def test_canonical_order_and_mask():
    gen = torch.Generator().manual_seed(1)
    conv = nn.Conv2d(3, 6, 3, padding=1, bias=False)
    mask = _random_mask(6, 3, 3, keep=0.4, gen=gen)
    s = StripeConv2d.from_dense(conv, mask)
    key = (s.offset[:, 0] * 3 + s.offset[:, 1]) * 6 + s.out_index
    assert bool((key[1:] > key[:-1]).all())
    assert torch.equal(s.stripe_mask(), mask)
    assert f"stripes={int(mask.sum())}/54" in repr(s)


def test_from_skeleton_uses_scaled_weight_and_threshold():
    gen = torch.Generator().manual_seed(2)
    conv = SkeletonConv2d(4, 6, 3, stride=2, padding=1, bias=False)
    with torch.no_grad():
        conv.skeleton.copy_(torch.rand(6, 3, 3, generator=gen) * 2 - 1)
    x = torch.randn(2, 4, 9, 9, generator=gen)
    threshold = 0.3
    mask = conv.skeleton.abs() > threshold
    s = StripeConv2d.from_skeleton(conv, threshold)
    ref = F.conv2d(x, conv.weight * (conv.skeleton * mask)[:, None], None, 2, 1)
    torch.testing.assert_close(s(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["stripe", "dense"])
def test_gradients_match_masked_conv(mode):
    gen = torch.Generator().manual_seed(3)
    conv = nn.Conv2d(4, 5, 3, stride=2, padding=1, bias=True)
    mask = _random_mask(5, 3, 3, keep=0.6, gen=gen)
    x = torch.randn(2, 4, 8, 8, generator=gen, requires_grad=True)
    s = StripeConv2d.from_dense(conv, mask, mode=mode)
    g = torch.randn(2, 5, 4, 4, generator=gen)
    (s(x) * g).sum().backward()
    w = (conv.weight * mask[:, None]).detach().requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    (F.conv2d(x2, w, conv.bias, 2, 1) * g).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    o, i, j = s.out_index, s.offset[:, 0], s.offset[:, 1]
    torch.testing.assert_close(s.weight.grad, w.grad[o, :, i, j], rtol=1e-5, atol=1e-5)


def test_no_stripe_outputs_bias_with_conv_shape():
    conv = nn.Conv2d(3, 4, 3, stride=2, padding=1, bias=True)
    s = StripeConv2d.from_dense(conv, torch.zeros(4, 3, 3, dtype=torch.bool))
    x = torch.randn(2, 3, 9, 7)
    torch.testing.assert_close(s(x), _masked_reference(conv, torch.zeros(4, 3, 3, dtype=torch.bool), x))


def test_no_stripe_layer_behaves_as_its_zero_conv_in_autograd_autocast_and_errors():
    """A layer with no stripe outputs its bias from x's shape in plain inference; where autograd records x it is a
    function of x with F.conv2d's zero gradient, under CPU autocast it returns the autocast dtype, and a wrong dtype
    or a too-small input are errors, as for its zero-weight conv."""
    gen = torch.Generator().manual_seed(6)
    conv = nn.Conv2d(3, 4, 3, padding=1, bias=True)
    none = torch.zeros(4, 3, 3, dtype=torch.bool)
    s = StripeConv2d.from_dense(conv, none)
    x = torch.randn(2, 3, 6, 5, generator=gen, requires_grad=True)
    y = s(x)
    assert y.requires_grad
    (y * torch.randn(y.shape, generator=gen)).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape and not x.grad.any()
    torch.testing.assert_close(y.detach(), _masked_reference(conv, none, x.detach()))
    with torch.autocast("cpu", torch.bfloat16):
        assert s(x.detach()).dtype == F.conv2d(x.detach(), conv.weight, conv.bias, padding=1).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="dtype torch.float32 but 'x' has dtype torch.float64"):
        s(x.detach().double())
    with pytest.raises(ValueError, match="too small for kernel"):
        StripeConv2d.from_dense(nn.Conv2d(3, 4, 3), none)(torch.randn(1, 3, 2, 8))


@pytest.mark.parametrize("frozen", [True, False])
@pytest.mark.parametrize("mode", ["dense", "gemm"])
def test_weight_cache_built_in_inference_mode_serves_input_gradients(mode, frozen):
    """A forward under torch.inference_mode builds the layer's dense or unrolled weight cache (without recording
    autograd, also for weights that require grad); a later forward whose input needs a gradient (saliency,
    adversarial inputs; with frozen weights it uses that cache) gets F.conv2d's input gradient (an inference tensor
    cannot be saved for backward)."""
    gen = torch.Generator().manual_seed(8)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    mask = _random_mask(4, 3, 3, keep=0.5, gen=gen)
    s = StripeConv2d.from_dense(conv, mask, mode=mode).eval().requires_grad_(not frozen)
    x = torch.randn(1, 3, 8, 8, generator=gen)
    with torch.inference_mode():
        s(x)
    xg = x.clone().requires_grad_(True)
    g = torch.randn(1, 4, 8, 8, generator=gen)
    (s(xg) * g).sum().backward()
    xr = x.clone().requires_grad_(True)
    (_masked_reference(conv, mask, xr) * g).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-5, atol=1e-5)


def test_state_dict_roundtrip_weights_only_and_dtype():
    gen = torch.Generator().manual_seed(4)
    conv = nn.Conv2d(6, 8, 3, stride=2, padding=1, bias=True)
    mask = _random_mask(8, 3, 3, keep=0.5, gen=gen)
    s = StripeConv2d.from_dense(conv, mask, mode="dense")
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert "plan" not in state
    fresh = StripeConv2d(**s.config())
    fresh.load_state_dict(state)
    x = torch.randn(2, 6, 10, 10, generator=gen)
    ref = _masked_reference(conv, mask, x)
    for mode in ("stripe", "dense"):
        fresh.mode = mode
        torch.testing.assert_close(fresh(x), ref, rtol=1e-5, atol=1e-5)
    fresh.to(torch.float64)
    assert fresh.out_index.dtype == torch.int64 and fresh.weight.dtype == torch.float64
    torch.testing.assert_close(fresh(x.double()), ref.double(), rtol=1e-5, atol=1e-5)


def test_corrupt_indices_are_rejected():
    conv = nn.Conv2d(3, 4, 3, padding=1)
    s = StripeConv2d.from_dense(conv, torch.ones(4, 3, 3, dtype=torch.bool))
    state = s.state_dict()
    state["out_index"] = state["out_index"].flip(0)
    state["weight"] = state["weight"] + 1  # loaded before the indices are found invalid
    with pytest.raises(ValueError, match="StripeConv2d: invalid stripe indices"):
        StripeConv2d(**s.config()).load_state_dict(state)
    x = torch.randn(1, 3, 5, 5)
    want, good = s(x), {k: v.clone() for k, v in s.state_dict().items()}
    with pytest.raises(ValueError, match="StripeConv2d: invalid stripe indices"):
        s.load_state_dict(state)  # a failed load leaves the module as it was: indices, plan and output
    assert all(torch.equal(v, good[k]) for k, v in s.state_dict().items())
    torch.testing.assert_close(s(x), want)
    with pytest.raises(ValueError, match="StripeConv2d: invalid stripe indices"):
        s.load_state_dict(state, assign=True)  # assign replaces the tensors themselves: the old ones come back
    assert all(torch.equal(v, good[k]) for k, v in s.state_dict().items())
    torch.testing.assert_close(s(x), want)
    fewer = StripeConv2d.from_dense(conv, torch.rand(4, 3, 3, generator=torch.Generator().manual_seed(1)) < 0.5)
    for assign in (False, True):  # another stripe count: PyTorch's size-mismatch error, the module unchanged
        with pytest.raises(RuntimeError, match=rf"size mismatch for weight: copying a param with shape "
                                               rf"torch.Size\(\[{fewer.num_stripes}, 3\]\)"):
            s.load_state_dict(fewer.state_dict(), assign=assign)
        assert all(torch.equal(v, good[k]) for k, v in s.state_dict().items())
        torch.testing.assert_close(s(x), want)



@pytest.mark.parametrize("index_dtype", [torch.int8, torch.int16, torch.int32])
def test_assign_load_of_narrow_indices_widens_them_and_float_indices_leave_the_module_as_it_was(index_dtype):
    """A compact file stores its indices as int8/int16; load_state_dict(assign=True) (the meta / to_empty flow) puts
    the state dict's own tensors in place: they become int64 as a copying load makes them. Indices of a float dtype
    are refused with the module restored, not left half loaded."""
    gen = torch.Generator().manual_seed(12)
    conv = nn.Conv2d(5, 7, 3, padding=1, bias=True)
    mask = _random_mask(7, 3, 3, keep=0.4, gen=gen)
    s = StripeConv2d.from_dense(conv, mask)
    x = torch.randn(2, 5, 6, 6, generator=gen)
    ref = _masked_reference(conv, mask, x)
    narrow = {k: v.to(index_dtype) if k in ("out_index", "offset") else v.clone() for k, v in s.state_dict().items()}
    with torch.device("meta"):
        fresh = StripeConv2d(**s.config())
    fresh.load_state_dict(narrow, assign=True)
    assert fresh.out_index.dtype == fresh.offset.dtype == torch.int64
    for mode in ("stripe", "dense", "gemm"):
        fresh.mode = mode
        torch.testing.assert_close(fresh(x), ref, rtol=1e-5, atol=1e-5)
    floats = {k: v.float() if k in ("out_index", "offset") else v + 1 for k, v in s.state_dict().items()}
    good = {k: v.clone() for k, v in s.state_dict().items()}
    with pytest.raises(TypeError, match="out_index"):
        s.load_state_dict(floats, assign=True)
    assert all(torch.equal(v, good[k]) and v.dtype == good[k].dtype for k, v in s.state_dict().items())
    torch.testing.assert_close(s(x), ref, rtol=1e-5, atol=1e-5)

@pytest.mark.parametrize("mode", ["dense", "gemm"])
def test_kept_weights_built_in_inference_mode_follow_a_load(mode):
    """Tensors made under inference_mode have no version counter: a load of other stripes must still drop the kept
    dense / unrolled weight."""
    gen = torch.Generator().manual_seed(50)
    conv = nn.Conv2d(4, 6, 3, padding=1)
    m1 = _random_mask(6, 3, 3, keep=0.5, gen=gen)
    m2 = m1.flatten().roll(1).view(6, 3, 3)
    x = torch.randn(2, 4, 3, 3, generator=gen)
    with torch.inference_mode():
        s = StripeConv2d.from_dense(conv, m1, mode=mode).eval()
        s(x)
        s.load_state_dict(StripeConv2d.from_dense(conv, m2).state_dict())
        torch.testing.assert_close(s(x), _masked_reference(conv, m2, x), rtol=1e-5, atol=1e-5)


def test_modes_and_frozen_weights_carry_over_and_gemm_mode_follows_the_dtype():
    """from_dense and to_dense keep the train/eval mode and frozen weights (compaction of a frozen model stays
    frozen); gemm mode called under bf16 autocast and then in float32 gives the float32 result; a conv that pads
    asymmetrically ('same' with an even kernel) is refused."""
    from compress.stripe import masked_conv

    gen = torch.Generator().manual_seed(51)
    conv = nn.Conv2d(4, 6, 3, padding=1).requires_grad_(False)
    mask = _random_mask(6, 3, 3, keep=0.5, gen=gen)
    for training in (True, False):
        s = StripeConv2d.from_dense(conv.train(training), mask)
        assert s.training == training and not s.weight.requires_grad and not s.bias.requires_grad
        s.pool = True
        dense = s.to_dense()
        assert all(m.training == training for m in dense.modules())
        assert not any(p.requires_grad for p in dense.parameters())
    skeleton = SkeletonConv2d.from_conv(conv)
    assert not any(p.requires_grad for p in masked_conv(skeleton, 0.0).parameters())
    s = StripeConv2d.from_dense(nn.Conv2d(4, 6, 3, padding=1), mask, mode="gemm").eval()
    x = torch.randn(2, 4, 4, 4, generator=gen)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert s(x).dtype == torch.bfloat16
        y = s(x)
        assert y.dtype == torch.float32
        torch.testing.assert_close(y, F.conv2d(x, s.dense_weight(), s.bias, 1, 1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="pads asymmetrically"):
        StripeConv2d.from_dense(nn.Conv2d(3, 4, 4, padding="same"), torch.ones(4, 4, 4, dtype=torch.bool))


def test_macs_counts_kept_stripes():
    conv = nn.Conv2d(5, 6, 3, stride=2, padding=1)
    mask = _random_mask(6, 3, 3, keep=0.5, gen=torch.Generator().manual_seed(5))
    s = StripeConv2d.from_dense(conv, mask)
    x = torch.randn(2, 5, 8, 8)
    assert s.macs(x, s(x)) == 2 * 4 * 4 * int(mask.sum()) * 5


def test_stripe_counts_of_square_and_non_square_kernels_by_hand():
    """summary.json's compact_stripes: a 1x3 conv of 4 filters has 4 * 1 * 3 = 12 stripes (its centre column kept:
    4), a 3x3 conv of 2 filters 18 (5 kept); the plain conv counts no layer."""
    from compress.stripe import stripe_counts

    wide = torch.zeros(4, 1, 3, dtype=torch.bool)
    wide[:, :, 1] = True
    square = torch.zeros(2, 3, 3, dtype=torch.bool)
    square.view(-1)[[0, 4, 8, 9, 13]] = True
    model = nn.Sequential(StripeConv2d.from_dense(nn.Conv2d(2, 4, (1, 3), padding=(0, 1)), wide),
                          StripeConv2d.from_dense(nn.Conv2d(4, 2, 3), square), nn.Conv2d(2, 2, 1))
    assert stripe_counts(model) == {"layers": 2, "stripes_kept": 4 + 5, "stripes_total": 12 + 18}


@pytest.mark.parametrize("mode", ["stripe", "dense"])
@pytest.mark.parametrize("hw, ceil", [(8, False), (9, True), (9, False)])
def test_pool_is_relu_then_max_pool_and_survives_config_and_to_dense(mode, hw, ceil):
    """StripeConv2d(relu=True, pool=True) on CPU equals max_pool2d(relu(masked conv)) with its ceil mode (odd
    sizes: 5 or 4 rows); the module rebuilt from config() + state dict, and to_dense(), give the same output; MACs
    count the conv's pixels, not the pooled ones, and the paper convention adds one per conv output for the bias, the
    ReLU and the pool (as for a biased Conv2d, a ReLU and a MaxPool2d); a layer with no stripe pools its constant
    output."""
    gen = torch.Generator().manual_seed(37)
    conv = nn.Conv2d(6, 10, 3, padding=1).double()
    mask = _random_mask(10, 3, 3, keep=0.4, gen=gen)
    s = StripeConv2d.from_dense(conv, mask, mode=mode).double()
    s.relu, s.pool, s.pool_ceil = True, True, ceil
    x = torch.randn(2, 6, hw, hw, generator=gen, dtype=torch.float64)
    want = F.max_pool2d(torch.relu(_masked_reference(conv, mask, x)), 2, ceil_mode=ceil)
    torch.testing.assert_close(s(x), want)
    rebuilt = StripeConv2d(**s.config()).double()
    rebuilt.load_state_dict(s.state_dict())
    torch.testing.assert_close(rebuilt(x), want)
    torch.testing.assert_close(s.to_dense()(x), want)
    assert s.macs(x, want) == 2 * hw * hw * s.num_stripes * 6
    from compress.profile import profile

    paper, layers = (profile(s.float(), (6, hw, hw), latency=False, convention=c).macs for c in ("paper", "layers"))
    assert paper - layers == 3 * 10 * hw * hw  # bias, ReLU and pool, one each per conv output (ceil or not)
    s.double()
    empty = StripeConv2d(6, 10, 3, padding=1, bias=True, relu=True, pool=True, pool_ceil=ceil).double()
    with torch.no_grad():
        empty.bias.copy_(torch.linspace(-1, 1, 10, dtype=torch.float64))
    side = (hw + 1) // 2 if ceil else hw // 2
    torch.testing.assert_close(empty(x), torch.relu(empty.bias)[None, :, None, None].expand(2, 10, side, side))


@pytest.mark.parametrize("kwargs, match", [
    ({"padding": "same"}, r"padding must be an int or a pair of ints, got 'same': string padding"),
    ({"kernel_size": 3.5}, r"kernel_size must be an int or a pair of ints, got 3.5"),
    ({"stride": (1, 2, 3)}, r"stride must be an int or a pair of ints, got \[1, 2, 3\]"),
    ({"dilation": "2"}, r"dilation must be an int or a pair of ints, got '2'"),
])
def test_bad_geometry_arguments_are_named(kwargs, match):
    """The constructor and the geometry setters name the argument (a string padding gave "invalid literal for int()
    with base 10: 's'", a float kernel a TypeError, a 1-tuple an IndexError, and three strides were cut to two)."""
    args = {"in_channels": 3, "out_channels": 4, "kernel_size": 3, **kwargs}
    with pytest.raises(ValueError, match=rf"^StripeConv2d: {match}"):
        StripeConv2d(**args)
    layer = StripeConv2d(3, 4, 3)
    name, value = next(iter(kwargs.items()))
    if name != "kernel_size":  # (the geometry a built layer may change)
        with pytest.raises(ValueError, match=rf"^StripeConv2d: {match}"):
            setattr(layer, name, value)
        assert getattr(layer, name) == ((0, 0) if name == "padding" else (1, 1))  # unchanged
    one = StripeConv2d(3, 4, (3,), stride=[2], padding=(1,))  # one-element sequences: both sides, as F.conv2d
    assert (one.kernel_size, one.stride, one.padding) == ((3, 3), (2, 2), (1, 1))


def test_bad_mode_and_grouped_conv_errors():
    with pytest.raises(ValueError, match="mode must be one of"):
        StripeConv2d(3, 4, 3, mode="fast")
    with pytest.raises(ValueError, match="groups=1"):
        StripeConv2d.from_dense(nn.Conv2d(4, 4, 3, groups=2), torch.ones(4, 3, 3, dtype=torch.bool))


@pytest.mark.parametrize("mode", ["stripe", "dense", "empty"])
@pytest.mark.parametrize("in_channels", [1, 5])
def test_channels_last_input_gives_channels_last_output(mode, in_channels):
    # a 1-channel channels_last tensor is ambiguous by shape; its channel stride 1 says channels_last
    gen = torch.Generator().manual_seed(11)
    conv = nn.Conv2d(in_channels, 6, 3, padding=1, bias=True)
    mask = _random_mask(6, 3, 3, keep=0.0 if mode == "empty" else 0.5, gen=gen)
    s = StripeConv2d.from_dense(conv, mask, mode="dense" if mode == "dense" else "stripe")
    x_nchw = torch.randn(2, in_channels, 7, 7, generator=gen)
    x = torch.empty_like(x_nchw, memory_format=torch.channels_last).copy_(x_nchw)  # as a channels_last conv makes it
    with torch.no_grad():
        y = s(x)
        assert y.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(y, _masked_reference(conv, mask, x_nchw), rtol=1e-5, atol=1e-5)
        y = s(x_nchw)
        assert y.is_contiguous()  # NCHW stays NCHW
        torch.testing.assert_close(y, _masked_reference(conv, mask, x_nchw), rtol=1e-5, atol=1e-5)
        if mode == "dense":  # the cached dense weight follows the input's layout
            assert s._dense_cache[1].is_contiguous()
            s(x)
            assert s._dense_cache[1].is_contiguous(memory_format=torch.channels_last)


def test_dense_mode_cache_follows_weight_edits_casts_and_loads():
    """The cached zero-filled weight of dense mode is rebuilt after an in-place weight edit, a dtype cast and a
    state dict with other stripes; every output is checked against the masked dense conv."""
    gen = torch.Generator().manual_seed(14)
    conv = nn.Conv2d(5, 6, 3, padding=1)
    mask = _random_mask(6, 3, 3, keep=0.5, gen=gen)
    s = StripeConv2d.from_dense(conv, mask, mode="dense").eval()
    x = torch.randn(2, 5, 7, 7, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(s(x), _masked_reference(conv, mask, x), rtol=1e-5, atol=1e-5)
        s.weight.mul_(-2.0)
        conv.weight.mul_(-2.0)
        torch.testing.assert_close(s(x), _masked_reference(conv, mask, x), rtol=1e-5, atol=1e-5)
        s.double()
        torch.testing.assert_close(s(x.double()), _masked_reference(conv.double(), mask, x.double()))
        conv2 = nn.Conv2d(5, 6, 3, padding=1).double()
        mask2 = mask.flip(0)  # as many stripes, other places: same tensor shapes, other indices
        s.load_state_dict(StripeConv2d.from_dense(conv2, mask2, mode="dense").state_dict())
        torch.testing.assert_close(s(x.double()), _masked_reference(conv2, mask2, x.double()))


def test_dense_mode_in_eager_inference_runs_its_kept_weight_directly(monkeypatch):
    """Grad off, dense mode: after its first call a layer runs a call bound to the kept (weight, padding) after
    checking only the weight's identity, storage and version and x's layout, so its host time per call is about an
    nn.Conv2d's (with the general path's checks a compact ResNet-20 whose layers all chose dense mode ran 0.84x its
    dense model at batch 1 on the CPU host, stripe_dense_mode_eager_cpu_session39.txt). A new weight (`.data =`),
    an edit, another layout, grad on, a mode change or setting an attribute the call binds (bias, relu) take the
    general path; an unbatched x runs directly, a wrong one gets the general path's error; every output is
    checked against the masked conv."""
    gen = torch.Generator().manual_seed(15)
    conv = nn.Conv2d(5, 6, 3, padding=1)
    mask = _random_mask(6, 3, 3, keep=0.5, gen=gen)
    s = StripeConv2d.from_dense(conv, mask, mode="dense").eval()
    x = torch.randn(2, 5, 7, 7, generator=gen)
    built = []
    general = s._dense_mode_weight
    monkeypatch.setattr(s, "_dense_mode_weight", lambda fmt: (built.append(fmt), general(fmt))[1])

    def check(x_in, builds):
        y = s(x_in)
        torch.testing.assert_close(y, _masked_reference(conv, mask, x_in), rtol=1e-5, atol=1e-5)
        assert y.is_contiguous(memory_format=_layout(x_in)) and len(built) == builds, built
        return y

    with torch.no_grad():
        check(x, 1)
        check(x, 1)  # the kept weight, directly
        s.weight.data = s.weight.data * 3  # a new tensor under the same Parameter
        conv.weight.data *= 3
        check(x, 2)
        s.weight.mul_(-1)  # an edit: its version moves
        conv.weight.mul_(-1)
        check(x, 3)
        check(x.contiguous(memory_format=torch.channels_last), 4)
        check(x.contiguous(memory_format=torch.channels_last), 4)
        check(x[:, :, :, ::2], 5)  # neither layout: the general path copies it
        s.mode = "dense"
        check(x, 6)
        check(x, 6)
        with pytest.raises(ValueError, match=r"expected input \(B, 5, H, W\)"):
            s(torch.randn(2, 4, 7, 7))
        check(x[0], 6)  # unbatched, directly
        s.bias = nn.Parameter(torch.randn(6, generator=gen))  # an attribute the call binds
        conv.bias.copy_(s.bias)
        check(x, 7)
        check(x, 7)
        s.relu = True
        torch.testing.assert_close(s(x), _masked_reference(conv, mask, x).relu(), rtol=1e-5, atol=1e-5)
        s.relu = False
        check(x, 9)
    with torch.enable_grad():
        check(x, 10)


@pytest.mark.parametrize("flag", ["bias", "relu", "pool", "pool_ceil"])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_on_off_settings_must_be_bools(flag, value):
    """relu="no" (an edited compact recipe, a typo) ran as relu=True: bool() took it; now a TypeError names it."""
    with pytest.raises(TypeError, match=rf"StripeConv2d: {flag}={value!r}: must be True or False"):
        StripeConv2d(4, 6, 3, padding=1, **{flag: value})


def test_dense_mode_direct_path_follows_a_bias_or_weight_swapped_outside_setattr():
    """The direct dense call binds the bias: one swapped by torch.func.functional_call (for that call only), by
    register_parameter or by a parametrization takes the general path, as does a weight torch.nn.utils.prune or a
    parametrization moved out of _parameters (it raised KeyError there); each output against the masked conv."""
    from torch.func import functional_call
    from torch.nn.utils import parametrize, prune

    gen = torch.Generator().manual_seed(16)
    conv = nn.Conv2d(4, 6, 3, padding=1)
    mask = _random_mask(6, 3, 3, keep=0.5, gen=gen)
    x = torch.randn(2, 4, 8, 8, generator=gen)

    def expect(s, weight, bias):
        torch.testing.assert_close(s(x), F.conv2d(x, weight * mask[:, None], bias, 1, 1), rtol=1e-5, atol=1e-5)

    s = StripeConv2d.from_dense(conv, mask, mode="dense").eval()
    other = torch.randn(6, generator=gen)
    with torch.no_grad():
        expect(s, conv.weight, conv.bias)
        torch.testing.assert_close(functional_call(s, {"bias": other}, (x,)),
                                   F.conv2d(x, conv.weight * mask[:, None], other, 1, 1), rtol=1e-5, atol=1e-5)
        expect(s, conv.weight, conv.bias)  # the module's own bias again
        s.register_parameter("bias", nn.Parameter(other.clone()))
        expect(s, conv.weight, other)
        parametrize.register_parametrization(s, "bias", _Doubled())
        expect(s, conv.weight, 2 * other)
        expect(s, conv.weight, 2 * other)

    s = StripeConv2d.from_dense(conv, mask, mode="dense").eval()
    with torch.no_grad():
        expect(s, conv.weight, conv.bias)
        prune.l1_unstructured(s, "weight", amount=0.3)  # zeroes 30% of the kept stripes' values
        pruned = s.dense_weight()
        torch.testing.assert_close(s(x), F.conv2d(x, pruned, conv.bias, 1, 1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s(x), F.conv2d(x, pruned, conv.bias, 1, 1), rtol=1e-5, atol=1e-5)


class _Doubled(nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return 2 * t


@pytest.mark.parametrize("mode", ["stripe", "dense", "gemm"])
def test_setting_stride_padding_or_dilation_rebuilds_what_depends_on_them(mode):
    """After calls with one geometry, a new stride, padding or dilation gives the conv of the new geometry in
    every mode (dense mode's trim and every kept weight rebuilt; they kept the old ones); a bad value is refused and
    leaves the layer as it was."""
    gen = torch.Generator().manual_seed(17)
    conv = nn.Conv2d(4, 6, 3, padding=1)
    centre = torch.zeros(6, 3, 3, dtype=torch.bool)
    centre[:, 1, 1] = True  # dense mode trims this layer to a 1x1 conv
    centre[2, 0, 1] = True  # and one stripe off centre in one filter
    x = torch.randn(1, 4, 9, 9, generator=gen)
    for mask in (centre, _random_mask(6, 3, 3, keep=0.5, gen=gen)):
        s = StripeConv2d.from_dense(conv, mask, mode=mode).eval()
        w = conv.weight * mask[:, None]
        with torch.no_grad():
            for geometry in ({"padding": 0}, {"stride": 2}, {"dilation": (2, 1), "padding": (2, 1)}, {"padding": 3}):
                s(x)
                for name, value in geometry.items():
                    setattr(s, name, value)
                ref = F.conv2d(x, w, conv.bias, s.stride, s.padding, s.dilation)
                torch.testing.assert_close(s(x), ref, rtol=1e-5, atol=1e-5)
            with pytest.raises(ValueError, match=r"padding=\(-1, -1\)"):
                s.padding = -1
            assert s.padding == (3, 3)
            torch.testing.assert_close(s(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("in_channels", [8, 32])
def test_stripe_mode_passes_its_cached_dense_weight_to_the_kernel_dense_route(dtype, layout, in_channels):
    """A narrow layer (8 or 32 input channels: the CUDA kernel's dense route, with 32 the non-skipping one) in eval
    reads the module's cached channels_last dense weight; outputs follow an in-place weight edit; an eager training
    step (cuDNN, see the next test) gets the same gradients. Checked against the masked dense conv in float64
    (relative error)."""
    gen = torch.Generator().manual_seed(21)
    conv = nn.Conv2d(in_channels, 24, 3, padding=1).double()
    mask = _random_mask(24, 3, 3, keep=0.3, gen=gen)
    s = StripeConv2d.from_dense(conv, mask, mode="stripe").cuda().to(dtype).eval()
    x = torch.randn(4, in_channels, 12, 12, generator=gen, dtype=torch.float64)
    xd = x.cuda().to(dtype).contiguous(memory_format=layout)
    assert kernels.stripe_reads_dense(xd, s.weight, 24, 3)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-3

    with torch.no_grad():
        assert _rel(s(xd), _masked_reference(conv, mask, x)) < tol
        assert s._dense_cache is not None and s._dense_cache[1].is_contiguous(memory_format=torch.channels_last)
        s.weight.mul_(-2.0)
        conv.weight.mul_(-2.0)
        assert _rel(s(xd), _masked_reference(conv, mask, x)) < tol
    s.train()
    xg = xd.detach().clone().requires_grad_()
    g = torch.randn(4, 24, 12, 12, generator=gen, dtype=torch.float64)
    s(xg).backward(g.cuda().to(dtype))
    xr = x.clone().requires_grad_()
    _masked_reference(conv, mask, xr).backward(g)
    assert _rel(xg.grad, xr.grad) < tol


@pytest.mark.cuda
def test_float32_with_tf32_turned_off_gets_full_float32_products(monkeypatch):
    """torch.backends.cudnn.allow_tf32 = False asks convs for full float32 products; the stripe kernel multiplies in
    TF32 regardless (3e-4 from float64 on every call, also in a step's first, kernel-run training forward). With the
    flag off, float32 layers take cuDNN's dense path and the op PyTorch's path (1e-6 here), a kept launcher
    included; with it on (PyTorch's default) the kernel runs as before."""
    gen = torch.Generator().manual_seed(23)
    conv = nn.Conv2d(16, 32, 3, padding=1).double()
    mask = _random_mask(32, 3, 3, keep=0.3, gen=gen)
    s = StripeConv2d.from_dense(conv, mask, mode="stripe").cuda().float().eval()
    x = torch.randn(8, 16, 20, 20, generator=gen, dtype=torch.float64)
    xf = x.cuda().float()
    ref = _masked_reference(conv, mask, x)
    args = (xf, s.weight, s.out_index, s.offset, s.bias, 32, 3, 1, 1)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    with torch.no_grad():
        assert 1e-5 < _rel(s(xf), ref) < 1e-3 and 1e-5 < _rel(kernels.stripe_conv2d(*args), ref) < 1e-3  # TF32
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
        assert _rel(s(xf), ref) < 1e-5 and _rel(kernels.stripe_conv2d(*args), ref) < 1e-5
    xg = xf.clone().requires_grad_()
    s.train()
    s(xg).sum().backward()  # (a training step's first call for an input runs the op: its PyTorch path here)
    xr = x.clone().requires_grad_()
    _masked_reference(conv, mask, xr).sum().backward()
    assert _rel(xg.grad, xr.grad) < 1e-5


@pytest.mark.parametrize("mode, hw", [("dense", 6), ("gemm", 3)])
def test_kept_weights_follow_a_replaced_weight(mode, hw):
    """A weight replaced by assignment (`.data =`, or a new Parameter), whose storage the allocator may place at
    the freed address of the old one with the same version, is never mistaken for the cached one."""
    gen = torch.Generator().manual_seed(31)
    conv = nn.Conv2d(8, 8, 3, padding=1)
    s = StripeConv2d.from_dense(conv, _random_mask(8, 3, 3, keep=0.5, gen=gen), mode=mode).eval()
    x = torch.randn(1, 8, hw, hw, generator=gen)
    with torch.no_grad():
        for trial in range(20):
            s(x)
            for _ in range(2):  # the second new weight may take the first one's freed address
                new = torch.randn(s.weight.shape, generator=gen)
                if trial % 2:
                    s.weight.data = new
                else:
                    s.weight = nn.Parameter(new)
                del new
            want = F.conv2d(x.double(), s.dense_weight().double(), s.bias.double(), 1, 1)
            torch.testing.assert_close(s(x).double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("in_channels", [8, 128])
def test_eager_inference_launch_matches_the_op_and_follows_changes(dtype, layout, in_channels):
    """In eval without autograd the module launches the kernel through its kept launcher (8 input channels: the
    dense route with the cached weight; 128: the gather route on the stripes): the output equals the op's bit for
    bit on the first (JIT) and later (compiled-kernel) calls, is rebuilt for a new batch size, a misaligned input
    and an in-place weight edit, is not used while autograd records, and is dropped by deepcopy. Checked against
    the masked dense conv in float64 (relative error)."""
    import copy

    gen = torch.Generator().manual_seed(23)
    conv = nn.Conv2d(in_channels, 24, 3, padding=1).double()
    mask = _random_mask(24, 3, 3, keep=0.3, gen=gen)
    s = StripeConv2d.from_dense(conv, mask, mode="stripe").cuda().to(dtype).eval()
    s.relu = True
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-3

    def op(x):
        return kernels.stripe_conv2d(x, s.weight, s.out_index, s.offset, s.bias, 24, 3, 1, 1, 1, relu=True,
                                     plan=s.plan, dense=s._kernel_dense_weight(x))

    x = torch.randn(5, in_channels, 9, 9, generator=gen, dtype=torch.float64)
    xd = x.cuda().to(dtype).contiguous(memory_format=layout)
    with torch.no_grad():
        ys = [s(xd) for _ in range(3)]
        launch = s._launch_cache[1]
        assert launch is not None and launch._compiled is not None  # later calls skip the JIT
        for y in ys:
            assert torch.equal(y, op(xd)) and y.is_contiguous(memory_format=layout)
        assert _rel(ys[0], torch.relu(_masked_reference(conv, mask, x))) < tol
        xm = torch.empty(xd.numel() + 1, dtype=dtype, device="cuda")[1:].as_strided(xd.shape, xd.stride())
        for xi in (xd[:2].clone(memory_format=layout), xm.copy_(xd)):  # a new batch size; a misaligned input
            yi = s(xi)
            assert s._launch_cache[1] is not launch and torch.equal(yi, op(xi))
        s.weight.mul_(-2.0)
        conv.weight.mul_(-2.0)
        assert _rel(s(xd), torch.relu(_masked_reference(conv, mask, x))) < tol
        for _ in range(5):  # a replaced weight (its storage may land at the old address) is not the kept one
            s.weight.data = -s.weight.data
            conv.weight.mul_(-1.0)
            assert _rel(s(xd), torch.relu(_masked_reference(conv, mask, x))) < tol
    s2 = copy.deepcopy(s)
    assert s2._launch_cache is None
    xg = xd.detach().clone().requires_grad_()
    with torch.no_grad():
        launch = s._launch_cache[1]
    y = s(xg)  # autograd records: the op, with its backward
    assert y.grad_fn is not None and s._launch_cache[1] is launch
    with torch.no_grad():
        assert torch.equal(y.detach(), s2(xd))


def _cuda_training_case(monkeypatch, seed: int):
    """A stripe-mode layer (16 -> 24 channels, 3x3, keep 0.3) on CUDA in train mode, with every call of
    kernels.stripe_conv2d counted in `calls`; an input x and output gradient g (float64, CPU); the masked dense
    conv's output and input gradient for them in float64. Returns (layer, calls, x, g, y_ref, x_grad_ref)."""
    gen = torch.Generator().manual_seed(seed)
    conv = nn.Conv2d(16, 24, 3, padding=1).double()
    mask = _random_mask(24, 3, 3, keep=0.3, gen=gen)
    s = StripeConv2d.from_dense(conv, mask, mode="stripe").cuda().float().train()
    calls = []
    op = kernels.stripe_conv2d
    monkeypatch.setattr(kernels, "stripe_conv2d", lambda *a, **k: calls.append(1) or op(*a, **k))
    x = torch.randn(4, 16, 9, 9, generator=gen, dtype=torch.float64)
    g = torch.randn(4, 24, 9, 9, generator=gen, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    yr = _masked_reference(conv, mask, xr)
    yr.backward(g)
    return s, calls, x, g, yr.detach(), xr.grad


@pytest.mark.cuda
def test_eager_cuda_training_runs_cudnn_and_graph_capture_runs_the_kernel(monkeypatch):
    """A stripe-mode layer's first eager CUDA training step for an input shape runs the op (compiling its
    kernels), later ones cuDNN with the zero-filled weight (the op is not called); captured with
    make_graphed_callables it runs the op. Output and input gradient of each against the masked dense conv in
    float64 (relative error)."""
    s, calls, x, g, yr, xr_grad = _cuda_training_case(monkeypatch, 33)

    for step in range(2):
        xg = x.cuda().float().requires_grad_()
        y = s(xg)
        y.backward(g.cuda().float())
        assert len(calls) == 1 and _rel(y, yr) < 1e-3 and _rel(xg.grad, xr_grad) < 1e-3, step
    s.weight.grad = s.bias.grad = None
    del y, xg  # (no autograd graph of an eager step may stay alive into the capture)
    graphed = torch.cuda.make_graphed_callables(s, (x.cuda().float().requires_grad_(),))
    assert calls  # the capture ran the op
    xg = x.cuda().float().requires_grad_()
    y = graphed(xg)
    y.backward(g.cuda().float())
    assert _rel(y, yr) < 1e-3 and _rel(xg.grad, xr_grad) < 1e-3


@pytest.mark.cuda
def test_compiled_cuda_training_runs_cudnn(monkeypatch):
    """A stripe-mode layer in a torch.compile'd training step runs dense mode (the op is never called, not even
    on the first step) in one graph (no graph break): output and input gradient against the masked dense conv in
    float64 (relative error)."""
    s, calls, x, g, yr, xr_grad = _cuda_training_case(monkeypatch, 34)
    compiled = torch.compile(s)
    for step in range(2):
        xg = x.cuda().float().requires_grad_()
        y = compiled(xg)
        y.backward(g.cuda().float())
        err_y, err_x = _rel(y, yr), _rel(xg.grad, xr_grad)
        assert not calls and err_y < 1e-3 and err_x < 1e-3, (step, err_y, err_x)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(s)(x.cuda().float().requires_grad_())
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


def test_copies_drop_the_kept_launcher_and_the_trained_inputs():
    """deepcopy and pickle give a module without the per-process state (a kept launcher, the inputs an eager
    training step compiled the kernels for) and with the same output."""
    import copy
    import pickle

    gen = torch.Generator().manual_seed(34)
    conv = nn.Conv2d(4, 6, 3, padding=1)
    s = StripeConv2d.from_dense(conv, _random_mask(6, 3, 3, keep=0.5, gen=gen), mode="stripe").eval()
    s._launch_cache, s._op_trained = (("key",), object()), {("x", None)}
    x = torch.randn(2, 4, 5, 5, generator=gen)
    for c in (copy.deepcopy(s), pickle.loads(pickle.dumps(s))):
        assert c._launch_cache is None and c._op_trained == set()
        with torch.no_grad():
            torch.testing.assert_close(c(x), s(x), rtol=0, atol=0)
    assert s._op_trained == {("x", None)}  # the original keeps its own


@pytest.mark.parametrize("batch,out_channels", [(1, 4), (3, 1)])
def test_stripe_output_trains_through_inplace_relu(batch, out_channels):
    # one image or one output channel: the op's output must not be a view (autograd forbids relu_ on it)
    gen = torch.Generator().manual_seed(12)
    conv = nn.Conv2d(3, out_channels, 3, padding=1)
    mask = torch.ones(out_channels, 3, 3, dtype=torch.bool)
    mask[:, 0] = False
    s = StripeConv2d.from_dense(conv, mask, mode="stripe")
    x = torch.randn(batch, 3, 5, 5, generator=gen, requires_grad=True)
    torch.relu_(s(x)).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    torch.relu(_masked_reference(conv, mask, x2)).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)


def _pool_layer(in_channels: int, dtype: torch.dtype, gen: torch.Generator):
    """A StripeConv2d(relu=True, pool=True, pool_ceil=True) on CUDA in eval, its float64 nn.Conv2d and mask."""
    conv = nn.Conv2d(in_channels, 24, 3, padding=1).double()
    mask = _random_mask(24, 3, 3, keep=0.3, gen=gen)
    s = StripeConv2d.from_dense(conv, mask, mode="stripe").cuda().to(dtype).eval()
    s.relu, s.pool, s.pool_ceil = True, True, True
    return s, conv, mask


def _pool_reference(conv: nn.Conv2d, mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.max_pool2d(torch.relu(_masked_reference(conv, mask, x)), 2, ceil_mode=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of a (any device and dtype) against the float64 CPU reference b."""
    return ((a.double().cpu() - b).norm() / b.norm()).item()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("in_channels", [8, 40, 128])
def test_pool_epilogue_matches_conv_relu_then_max_pool(dtype, layout, in_channels):
    """StripeConv2d(relu=True, pool=True) in eager CUDA inference: 16x16 and 12x12 outputs are pooled in the
    kernel's epilogue (8 channels: the dense route; 40: im2col; 128: gather), an odd 9x9 one (ceil mode) by the
    launcher after the kernel; all equal max_pool2d(relu(masked dense conv)) in float64 (relative error)."""
    gen = torch.Generator().manual_seed(29)
    s, conv, mask = _pool_layer(in_channels, dtype, gen)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-3
    for hw, fused in ((16, True), (12, True), (9, False)):
        x = torch.randn(3, in_channels, hw, hw, generator=gen, dtype=torch.float64)
        xd = x.cuda().to(dtype).contiguous(memory_format=layout)
        with torch.no_grad():
            y = s(xd)
            assert s._launch_cache[1].pool_fused == fused, hw
        assert y.shape == (3, 24, (hw + 1) // 2, (hw + 1) // 2) and y.is_contiguous(memory_format=layout)
        assert _rel(y, _pool_reference(conv, mask, x)) < tol, hw


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("in_channels, out_channels, group", [(16, 48, 16), (64, 96, 32), (128, 136, 64)])
def test_grouped_masks_take_the_listed_route_on_cuda(dtype, layout, in_channels, out_channels, group):
    """A mask shared by groups of filters (prune.stripe_group): eager CUDA inference runs the LISTED route with
    tiles as wide as the groups (the last one partial for 136 channels), equal to the masked dense conv in float64;
    with a random mask of the same keep it does not take that route."""
    gen = torch.Generator().manual_seed(41)
    conv = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=True).double()
    groups = torch.rand(-(-out_channels // group), 3, 3, generator=gen) < 0.3
    groups[:, 1, 1] = True
    mask = groups.repeat_interleave(group, 0)[:out_channels]
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-3
    x = torch.randn(4, in_channels, 12, 10, generator=gen, dtype=torch.float64)
    xd = x.cuda().to(dtype).contiguous(memory_format=layout)
    s = StripeConv2d.from_dense(conv, mask, mode="stripe").cuda().to(dtype).eval()
    with torch.no_grad():
        y = s(xd)
    cfg = s._launch_cache[1].config
    assert cfg["LISTED"] and cfg["BLOCK_N"] == group, cfg
    assert y.is_contiguous(memory_format=layout)
    assert _rel(y, _masked_reference(conv, mask, x)) < tol
    rand = StripeConv2d.from_dense(conv, _random_mask(out_channels, 3, 3, 0.3, gen), mode="stripe").cuda().to(dtype)
    with torch.no_grad():
        rand.eval()(xd)
    assert not rand._launch_cache[1].config["LISTED"]


@pytest.mark.cuda
@pytest.mark.parametrize("in_channels", [8, 128])
def test_pool_layer_training_steps_match_the_reference_gradient(in_channels):
    """Eager CUDA training steps of a pooling StripeConv2d (the first runs the op, the next cuDNN; both pool
    after) give the float64 reference's input gradient, in float32. Inputs, weights and bias are multiples of 1/4
    and 1/2 with small numerators, so every conv output is exact in float32 and TF32 (the kernel's tensor cores)
    and the pool picks the same window maxima as float64; with random reals, TF32's rounding let near-ties pick
    other maxima now and then (2.2e-3 and 4.3e-3 against 1e-3 at 128 channels: pytest_cuda_gemm_h200_first.txt,
    pytest_cuda_session11_c8.txt). cuDNN's TF32 is off for the backward's accuracy."""
    gen = torch.Generator().manual_seed(31)
    conv = nn.Conv2d(in_channels, 24, 3, padding=1).double()
    with torch.no_grad():
        conv.weight.copy_(torch.randint(-3, 4, conv.weight.shape, generator=gen) / 4)
        conv.bias.copy_(torch.randint(-3, 4, (24,), generator=gen) / 2)
    mask = _random_mask(24, 3, 3, keep=0.3, gen=gen)
    s = StripeConv2d.from_dense(conv, mask, mode="stripe").cuda().float().train()
    s.relu, s.pool, s.pool_ceil = True, True, True
    x = torch.randint(-3, 4, (3, in_channels, 9, 9), generator=gen).double() / 2
    g = torch.randn(3, 24, 5, 5, generator=gen, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    _pool_reference(conv, mask, xr).backward(g)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        for _ in range(2):
            xg = x.cuda().float().requires_grad_()
            s(xg).backward(g.cuda().float())
            assert _rel(xg.grad, xr.grad) < 1e-3


@pytest.mark.cuda
def test_compact_vgg_with_fused_pools_on_cuda(tmp_path):
    """A compact VGG11 with ReLUs and pools fused (compact(fuse_relu=True)) on CUDA, modes chosen by
    choose_modes (which times each layer's ReLU and pool on both paths): same output as without the fusion,
    float32 and bfloat16 channels_last."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from test_compact import skeleton_model

    from compress import choose_modes, compact

    model = skeleton_model("vgg11", 32)
    plain = compact(model, fold_bn=True).cuda().eval()
    fused = compact(model, fold_bn=True, fuse_relu=True).cuda().eval()
    assert fused.compress_compaction["pool_fused"] == 5
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(3)).cuda()
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 2e-2)):
        p, f = plain.to(dtype), fused.to(dtype)
        xd = x.to(dtype).contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            choose_modes(f, xd, repeats=2)
            a, b = p(xd).double(), f(xd).double()
        assert ((a - b).norm() / a.norm()).item() < tol, dtype


def test_dense_trim():
    """Rings of offsets no stripe uses, limited by what the padding covers."""
    centre = torch.tensor([[1, 1], [1, 1]])
    assert kernels.dense_trim(centre, 3, 1, 1) == (1, 1)
    assert kernels.dense_trim(torch.tensor([[1, 1], [0, 2]]), 3, 1, 1) == (0, 0)
    assert kernels.dense_trim(torch.tensor([[1, 0], [1, 2]]), 3, 1, 1) == (1, 0)  # middle row only
    assert kernels.dense_trim(torch.tensor([[1, 2], [3, 3]]), 5, 2, 1) == (1, 1)  # the inner 3x3 of a 5x5
    assert kernels.dense_trim(centre, 3, 0, 1) == (0, 0)  # no padding to take back
    assert kernels.dense_trim(centre, 3, 2, 2) == (1, 1) and kernels.dense_trim(centre, 3, 1, 2) == (0, 0)
    assert kernels.dense_trim(torch.zeros(0, 2, dtype=torch.long), 3, 1, 1) == (0, 0)
    # stripes in the lower rows or right columns only: the bottom row / right column stays
    assert kernels.dense_trim(torch.tensor([[1, 1], [2, 1]]), 3, 1, 1) == (0, 1)
    assert kernels.dense_trim(torch.tensor([[1, 1], [1, 2]]), 3, 1, 1) == (1, 0)


@pytest.mark.parametrize("case", [(3, 1, 1, 1), (3, 2, 1, 1), (5, 1, 2, 1), (3, 1, 2, 2), (3, 1, 0, 1)])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_dense_mode_runs_the_trimmed_kernel(case, layout):
    """A layer whose stripes all sit in the kernel's centre (the deep layers of SWP models) runs dense mode as the
    smaller conv: same output and gradients as the full zero-filled conv (float64), in x's layout."""
    k, s, p, d = case
    gen = torch.Generator().manual_seed(hash((case, layout)) % 2**31)
    conv = nn.Conv2d(5, 6, k, stride=s, padding=p, dilation=d, bias=True).double()
    mask = torch.zeros(6, k, k, dtype=torch.bool)
    mask[:, k // 2, k // 2] = torch.rand(6, generator=gen) < 0.7
    mask[0, k // 2, k // 2] = True
    if k == 5:
        mask[1, 1, 3] = True  # inside the inner 3x3 window
    m = StripeConv2d.from_dense(conv, mask, mode="dense").train()
    x = torch.randn(2, 5, 9, 8, generator=gen, dtype=torch.float64)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    want_trim = (0, 0) if p < d else (1, 1)
    assert m._trim == want_trim
    xr, wr = x.clone().requires_grad_(), m.weight.detach().clone().requires_grad_()
    ref = F.conv2d(xr, kernels.stripe_to_dense(wr, m.out_index, m.offset, 6, k), m.bias.detach(), s, p, d)
    xm = x.clone().requires_grad_()
    y = m(xm)
    torch.testing.assert_close(y, ref)
    g = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    gx, gw = torch.autograd.grad((ref * g).sum(), (xr, wr))
    (y * g).sum().backward()
    torch.testing.assert_close(xm.grad, gx)
    torch.testing.assert_close(m.weight.grad, gw)
    m.eval()
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref.detach())
        assert y.is_contiguous(memory_format=torch.channels_last if layout == "channels_last" else
                               torch.contiguous_format)
    if any(want_trim):
        assert m._trim_cache[1][0].shape[2:] == (k - 2, k - 2)
    with torch.no_grad():  # an in-place edit of the kept weights shows in the trimmed conv too
        m.weight.mul_(-2.0)
        torch.testing.assert_close(m(x), F.conv2d(x, m.dense_weight(), m.bias, s, p, d))


def _layer(mode: str, seed: int, in_channels: int = 6, out_channels: int = 8):
    gen = torch.Generator().manual_seed(seed)
    conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)
    mask = _random_mask(out_channels, 3, 3, keep=0.5, gen=gen)
    return conv, mask, StripeConv2d.from_dense(conv, mask, mode=mode).eval(), gen


@pytest.mark.parametrize("mode, hw", [("stripe", 6), ("dense", 6), ("gemm", 3)])
def test_any_input_strides_and_unbatched_inputs(mode, hw):
    """A channel slice of a larger tensor (Res2Net's split branches) and an unbatched (C, H, W) input give the
    masked dense conv's output in every mode, as nn.Conv2d takes them."""
    conv, mask, s, gen = _layer(mode, 40)
    wide = torch.randn(3, 10, hw, hw, generator=gen)
    for x in (wide[:, 2:8], wide[:, 2:8].contiguous(memory_format=torch.channels_last)[:, :, :, :],
              wide.contiguous(memory_format=torch.channels_last)[:, 2:8]):
        with torch.no_grad():
            torch.testing.assert_close(s(x), _masked_reference(conv, mask, x), rtol=1e-5, atol=1e-5)
        y = s.train()(x)  # autograd records: the op (stripe mode) or the rebuilt weight
        torch.testing.assert_close(y, _masked_reference(conv, mask, x), rtol=1e-5, atol=1e-5)
        s.eval()
    one = wide[0, 2:8]
    with torch.no_grad():
        assert s(one).shape == (8, hw, hw)
        torch.testing.assert_close(s(one), _masked_reference(conv, mask, one[None])[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=rf"expected input \(B, 6, H, W\) or \(6, H, W\), got \(7, {hw}, {hw}\)"):
        s(wide[0, :7])  # the shape given, not one with a batch dimension added
    x = wide[:, 2:8]
    y = kernels.stripe_conv2d(x, s.weight, s.out_index, s.offset, s.bias, 8, 3, 1, 1)
    torch.testing.assert_close(y, _masked_reference(conv, mask, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode, hw", [("stripe", 6), ("dense", 6), ("gemm", 3)])
def test_empty_batch(mode, hw):
    conv, mask, s, gen = _layer(mode, 41)
    with torch.no_grad():
        y = s(torch.randn(0, 6, hw, hw, generator=gen))
    assert y.shape == (0, 8, hw, hw)


@pytest.mark.parametrize("mode, hw", [("dense", 6), ("gemm", 3)])
def test_writes_that_bypass_the_version_counter_show_after_train_eval(mode, hw):
    """`.data` writes and fused optimizers leave a tensor's version as it was, so the kept weights cannot see them by
    their key; the train()/eval() switch of every training loop drops them."""
    conv, mask, s, gen = _layer(mode, 42)
    x = torch.randn(2, 6, hw, hw, generator=gen)
    with torch.no_grad():
        s(x)  # builds the kept weight
    opt = torch.optim.SGD(s.parameters(), lr=0.5, fused=True)
    s.train()
    s(x).square().sum().backward()
    opt.step()
    s.eval()
    with torch.no_grad():
        want = F.conv2d(x, s.dense_weight(), s.bias, 1, 1)
        torch.testing.assert_close(s(x), want, rtol=1e-5, atol=1e-5)
        s.weight.data.mul_(-3.0)
        s.bias.data.add_(1.0)
        s.eval()
        torch.testing.assert_close(s(x), F.conv2d(x, s.dense_weight(), s.bias, 1, 1), rtol=1e-5, atol=1e-5)


def test_gemm_mode_follows_bias_edits_and_input_sizes():
    """gemm mode's kept unrolled weight follows an in-place bias edit, and a new input size gets its own GEMM."""
    conv, mask, s, gen = _layer("gemm", 44)
    x = torch.randn(2, 6, 3, 3, generator=gen)
    with torch.no_grad():
        s(x)
        s.bias.add_(1.0)
        torch.testing.assert_close(s(x), F.conv2d(x, s.dense_weight(), s.bias, 1, 1), rtol=1e-5, atol=1e-5)
        for hw in (2, 3, 4, 3):
            x = torch.randn(2, 6, hw, hw, generator=gen)
            torch.testing.assert_close(s(x), _masked_reference(conv, mask, x) + 1.0, rtol=1e-5, atol=1e-5)


def test_stripe_layer_under_cpu_autocast_sums_in_float32():
    """64 input channels x 25 offsets: a bf16 sum would be off by far more than one bf16 rounding of the result."""
    gen = torch.Generator().manual_seed(45)
    conv = nn.Conv2d(64, 8, 5, padding=2)
    mask = torch.rand(8, 5, 5, generator=gen) < 0.9
    s = StripeConv2d.from_dense(conv, mask).eval()
    x = torch.randn(2, 64, 8, 8, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        y = s(x)
    xb, wb, bb = (t.detach().bfloat16().double() for t in (x, conv.weight, conv.bias))
    ref = F.conv2d(xb, wb * mask[:, None].double(), bb, 1, 2)
    assert ((y.double() - ref).abs() / ref.abs().clamp_min(1e-2)).max() <= 2**-7


def test_stripe_layer_under_cpu_autocast():
    """Under CPU autocast (bf16) the op runs on bf16-cast inputs and accumulates in float32, forward and backward."""
    conv, mask, s, gen = _layer("stripe", 43)
    x = torch.randn(2, 6, 7, 7, generator=gen, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = s.train()(x)
    assert y.dtype == torch.bfloat16
    xb, wb = x.detach().bfloat16().double().requires_grad_(), conv.weight.detach().bfloat16().double()
    wb.requires_grad_()
    ref = F.conv2d(xb, wb * mask[:, None], conv.bias.detach().bfloat16().double(), 1, 1)
    torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-2)
    g = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    y.backward(g.bfloat16())
    ref.backward(g.bfloat16().double())
    torch.testing.assert_close(x.grad.double(), xb.grad, rtol=2e-2, atol=2e-2)


def _autocast_cases(device: str, seed: int):
    """(name, module, reference conv, mask, x): each StripeConv2d mode with its ReLU fused, and a Conv2dReLU, all
    float32 on `device`, with an x for which gemm mode runs its GEMM (3x3 maps)."""
    from compress.stripe import Conv2dReLU
    cases = []
    for mode in ("stripe", "dense", "gemm"):
        conv, mask, s, gen = _layer(mode, seed, 16, 24)
        s.relu = True
        cases.append((mode, s, conv, mask))
    conv = nn.Conv2d(16, 24, 3, padding=1)
    cases.append(("Conv2dReLU", Conv2dReLU.from_conv(conv).eval(), conv, torch.ones(24, 3, 3, dtype=torch.bool)))
    x = torch.randn(4, 16, 3, 3, generator=torch.Generator().manual_seed(seed)).to(device)
    return [(name, m.to(device), conv.to(device), mask.to(device), x) for name, m, conv, mask in cases]


def _check_autocast_relu_convs(device: str, seed: int):
    """Under bf16 autocast every fused conv + ReLU returns bf16, like F.conv2d under autocast, and the conv of the
    bf16-rounded inputs (float64 reference)."""
    for name, m, conv, mask, x in _autocast_cases(device, seed):
        with torch.autocast(device, dtype=torch.bfloat16), torch.no_grad():
            y = m(x)
        assert y.dtype == torch.bfloat16, (name, y.dtype)
        xb, wb, bb = (t.detach().bfloat16().double() for t in (x, conv.weight, conv.bias))
        ref = F.relu(F.conv2d(xb, wb * mask[:, None].double(), bb, 1, 1))
        torch.testing.assert_close(y.double(), ref, rtol=2e-2, atol=2e-2, msg=name)
        if name == "gemm":
            assert m._gemm_cache is not None and m._gemm_cache[1][0].dtype == torch.bfloat16  # the GEMM ran in bf16


def test_fused_relu_convs_under_cpu_autocast():
    _check_autocast_relu_convs("cpu", 47)


@pytest.mark.cuda
def test_fused_relu_convs_under_cuda_autocast():
    """On CUDA the fused call is torch.cudnn_convolution_relu, which autocast does not cast: the inputs are cast
    first (it returned float32 under bf16 autocast before)."""
    _check_autocast_relu_convs("cuda", 48)


@pytest.mark.parametrize("mode", ["stripe", "dense", "gemm"])
def test_float64_stays_float64_under_cpu_autocast(mode):
    """Autocast leaves float64 convs alone (not eligible); every mode does the same."""
    conv, mask, s, gen = _layer(mode, 45)
    x = torch.randn(2, 6, 7, 7, generator=gen, dtype=torch.float64)
    s, conv = s.double().eval(), conv.double()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        y = s(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, _masked_reference(conv, mask, x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", ["stripe", "dense", "gemm"])
def test_wrong_input_channels_and_an_unfilled_layer_are_clear_errors(mode):
    conv, mask, s, gen = _layer(mode, 46)
    with pytest.raises(ValueError, match=r"StripeConv2d: expected input \(B, 6, H, W\) or \(6, H, W\), got \(2, 5, 7, 7\)"):
        s(torch.randn(2, 5, 7, 7, generator=gen))
    x = torch.randn(2, 6, 7, 7, generator=gen)
    unfilled = StripeConv2d(6, 8, 3, padding=1, num_stripes=s.num_stripes, bias=True, mode=mode).eval()
    with pytest.raises(RuntimeError, match=f"its {s.num_stripes} stripes were never set .* load_state_dict"):
        unfilled(x)
    unfilled.load_state_dict(s.state_dict())
    torch.testing.assert_close(unfilled(x), _masked_reference(conv, mask, x).detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode, hw", [("stripe", 7), ("dense", 7), ("gemm", 3)])
def test_compile_export_trace_and_save_in_inference(mode, hw):
    """In inference the kept weights stay out of traced graphs: torch.compile gives one graph (fullgraph), and
    torch.export, torch.jit.trace and torch.save of the whole module work after an eager call; outputs equal
    eager. torch.jit.trace gives no TracerWarning (dense and gemm mode gave one per layer and call: size checks
    on traced sizes, which tell a deployer the trace may be wrong)."""
    conv, mask, s, gen = _layer(mode, 44)
    x = torch.randn(2, 6, hw, hw, generator=gen)
    want = _masked_reference(conv, mask, x).detach()
    with torch.no_grad():
        s(x)  # the kept weights exist
        torch.testing.assert_close(torch.compile(s, backend="eager", fullgraph=True)(x), want, rtol=1e-5, atol=1e-5)
        exported = torch.export.export(s, (x,))
        torch.testing.assert_close(exported.module()(x), want, rtol=1e-5, atol=1e-5)
        fresh = StripeConv2d.from_dense(conv, mask, mode=mode).eval()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            traced = torch.jit.trace(fresh, (x,))
        assert not [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
        torch.testing.assert_close(traced(x), want, rtol=1e-5, atol=1e-5)
        buf = io.BytesIO()
        torch.save(s, buf)
        buf.seek(0)
        torch.testing.assert_close(torch.load(buf, weights_only=False)(x), want, rtol=1e-5, atol=1e-5)


def test_jit_trace_of_a_layer_with_no_stripe_left_does_not_depend_on_the_grad_mode():
    """A compact layer that kept no stripe outputs its bias from x's shape; torch.jit.trace, whose check re-runs
    the module, gets the same graph with the grad mode on (x recorded) as off, and the traced outputs equal eager."""
    torch.manual_seed(0)
    empty = StripeConv2d.from_dense(nn.Conv2d(8, 16, 3), torch.zeros(16, 3, 3, dtype=torch.bool))
    model = nn.Sequential(nn.Conv2d(3, 8, 1), empty).eval()
    x = torch.randn(2, 3, 7, 6)
    want = F.conv2d(model[0](x), torch.zeros(16, 8, 3, 3), empty.bias).detach()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(model, (x,))  # raised TracingCheckError: "Graphs differed across invocations"
        with torch.no_grad():
            traced_no_grad = torch.jit.trace(model, (x,))
    assert not [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]  # the stripe count: structure
    for t in (traced, traced_no_grad):
        torch.testing.assert_close(t(x).detach(), want, rtol=1e-6, atol=1e-6)


def test_string_padding_is_a_clear_error():
    x, w = torch.randn(1, 4, 5, 5), torch.randn(2, 4)
    with pytest.raises(ValueError, match="padding must be an int or a pair of ints, got 'same'.*in pixels"):
        kernels.stripe_conv2d(x, w, torch.tensor([0, 1]), torch.tensor([[1, 1], [1, 1]]), None, 2, 3, 1, "same")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channel_slice_input_on_cuda(dtype):
    """A channel slice (neither contiguous layout) through the kept launcher (eval) and the op (training)."""
    conv, mask, s, gen = _layer("stripe", 45, in_channels=16, out_channels=24)
    conv, s = conv.double(), s.cuda().to(dtype)
    wide = torch.randn(3, 20, 9, 9, generator=gen, dtype=torch.float64)
    x = wide[:, 2:18]
    want = _masked_reference(conv, mask, x)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-3
    for layout in (torch.contiguous_format, torch.channels_last):
        xd = wide.cuda().to(dtype).contiguous(memory_format=layout)[:, 2:18]
        with torch.no_grad():
            assert _rel(s(xd), want) < tol
        assert _rel(s.train()(xd).detach(), want) < tol
        s.eval()


@pytest.mark.parametrize("mode", ["gemm", "dense"])
def test_caches_are_read_once_so_threads_serving_one_layer_get_their_own_entry(mode):
    """Threads serving one model: between a cache's key check and its use another thread may replace the cache with
    its input's entry (gemm mode: another input size; dense mode: another layout). The entry checked is the one used:
    here the key comparison itself stands for that other thread's write (QA found gemm mode returning the other
    size's output, or failing, in ~1% of calls with 4 threads)."""
    gen = torch.Generator().manual_seed(3)
    conv = nn.Conv2d(8, 8, 3, padding=1)
    mask = torch.rand(8, 3, 3, generator=gen) > 0.5
    layer = StripeConv2d.from_dense(conv, mask, mode=mode).eval()
    xa = torch.randn(1, 8, 2, 4, generator=gen)
    xb = torch.randn(1, 8, 4, 2, generator=gen) if mode == "gemm" else xa.to(memory_format=torch.channels_last)
    slot = "_gemm_cache" if mode == "gemm" else "_dense_cache"
    with torch.no_grad():
        want = F.conv2d(xa.double(), layer.dense_weight().double(), layer.bias.double(), padding=1)
        layer(xb)
        other_entry = getattr(layer, slot)
        layer(xa)

        class KeyWhileAnotherThreadWrites(tuple):
            def __ne__(self, other):
                setattr(layer, slot, other_entry)  # the other thread's write, between check and use
                return tuple.__ne__(self, other)

        key, *rest = getattr(layer, slot)
        setattr(layer, slot, (KeyWhileAnotherThreadWrites(key), *rest))
        if mode == "dense":  # dense mode's eager binding would skip the cache: drop it, as a new weight would
            layer._eager_dense = None
        got = layer(xa)
    assert got.shape == want.shape and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    if mode == "dense":
        assert got.is_contiguous()  # the NCHW entry's weight, not the channels_last one


@pytest.mark.parametrize("kwargs", [{"padding": 1, "padding_mode": "reflect"}, {"padding": "same"}])
def test_conv2d_relu_with_a_padding_mode_or_string_padding_still_applies_its_relu(kwargs):
    """Conv2dReLU hands a conv with padding_mode other than "zeros", or string padding, to nn.Conv2d's forward (which
    conv2d_relu cannot run): its ReLU must still follow, else the fused module outputs negative values."""
    from compress.stripe import Conv2dReLU

    gen = torch.Generator().manual_seed(61)
    conv = nn.Conv2d(3, 4, 3, **kwargs)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen))
        conv.bias.copy_(torch.randn(4, generator=gen))
    fused = Conv2dReLU.from_conv(conv)
    x = torch.randn(2, 3, 6, 7, generator=gen)
    want = conv(x)
    assert (want < 0).any()  # the ReLU has something to do
    torch.testing.assert_close(fused(x), want.relu())


def test_same_padding_of_a_non_square_kernel_pads_each_side_by_its_own_half():
    """padding="same" with a (3, 5) kernel is (1, 2): a padding of (1, 1) (the height's half for both sides) would
    give a narrower output with the wrong columns."""
    from compress.stripe import conv_padding

    gen = torch.Generator().manual_seed(62)
    conv = nn.Conv2d(2, 3, (3, 5), padding="same")
    assert conv_padding(conv) == (1, 2)
    mask = _random_mask(3, 3, 5, keep=0.5, gen=gen)
    x = torch.randn(2, 2, 7, 9, generator=gen)
    s = StripeConv2d.from_dense(conv, mask)
    assert s.padding == (1, 2)
    want = F.conv2d(x, conv.weight * mask[:, None], conv.bias, padding=(1, 2))
    torch.testing.assert_close(s(x), want, rtol=1e-5, atol=1e-5)


def test_same_padding_asymmetric_in_one_dimension_only_is_refused():
    """A (2, 3) kernel with padding="same" pads the height asymmetrically (1 row in total) while the width is
    symmetric: one odd total is enough to refuse it (requiring both odd would take it as padding (0, 1))."""
    from compress.stripe import stripe_padding_ok

    conv = nn.Conv2d(2, 3, (2, 3), padding="same")
    with pytest.raises(ValueError, match="asymmetrically"):
        StripeConv2d.from_dense(conv, torch.ones(3, 2, 3, dtype=torch.bool))
    assert not stripe_padding_ok(conv)


def test_masked_conv_and_from_skeleton_keep_the_skeleton_conv_bias():
    """masked_conv builds an uninitialised conv and copies weight and bias in: without the bias copy the compact
    layer's bias is whatever the memory held. Checked on a random, large bias, against the masked reference."""
    from compress.stripe import masked_conv

    gen = torch.Generator().manual_seed(63)
    conv = nn.Conv2d(4, 6, 3, padding=1, bias=True)
    with torch.no_grad():
        conv.bias.copy_(torch.randn(6, generator=gen) * 100)
    sk = SkeletonConv2d.from_conv(conv)
    with torch.no_grad():
        sk.skeleton.copy_(torch.rand(sk.skeleton.shape, generator=gen) * 2 - 1)
    dense = masked_conv(sk, 0.0)
    stripe = StripeConv2d.from_skeleton(sk, 0.0)
    assert torch.equal(dense.bias, sk.bias) and torch.equal(stripe.bias, sk.bias)
    x = torch.randn(2, 4, 7, 7, generator=gen)
    want = F.conv2d(x, sk.weight * sk.skeleton[:, None], sk.bias, padding=1).detach()
    torch.testing.assert_close(dense(x).detach(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(stripe(x).detach(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mode", ["dense", "stripe", "gemm"])
@pytest.mark.parametrize("pool", [False, True])
def test_repeated_eval_calls_with_relu_and_ceil_pool_match_the_reference(mode, pool):
    """Dense mode binds a direct call on its first call under torch.no_grad and runs it from the second on: that call
    must apply the ReLU (off CUDA: F.conv2d(...).relu_()) and pool with the layer's ceil mode (a 7x7 output pools to
    4x4 with ceil_mode=True, 3x3 without). Each of three calls against conv + ReLU (+ max_pool2d with ceil_mode)."""
    gen = torch.Generator().manual_seed(64)
    conv = nn.Conv2d(5, 6, 3, padding=1)
    mask = _random_mask(6, 3, 3, keep=0.5, gen=gen)
    s = StripeConv2d.from_dense(conv, mask, mode=mode).eval()
    s.relu, s.pool, s.pool_ceil = True, pool, True
    x = torch.randn(2, 5, 7, 7, generator=gen)
    want = _masked_reference(conv, mask, x).detach().relu()
    if pool:
        want = F.max_pool2d(want, 2, ceil_mode=True)
    assert want.shape[-1] == (4 if pool else 7)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(s(x), want, rtol=1e-5, atol=1e-5)
    if mode == "dense":
        assert s._eager_dense is not None  # the later calls took the direct path


def test_a_size_mismatched_load_leaves_every_entry_as_it_was_including_the_fitting_bias():
    """A state dict of another stripe count fails with PyTorch's size mismatch; its bias has the layer's shape and is
    loaded before the error is known, so the module restores it (copying load and assign=True alike). The other
    layer's bias differs, so that a bias left loaded shows."""
    gen = torch.Generator().manual_seed(65)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    s = StripeConv2d.from_dense(conv, _random_mask(4, 3, 3, keep=0.7, gen=gen))
    other = nn.Conv2d(3, 4, 3, padding=1)
    with torch.no_grad():
        other.bias.copy_(torch.randn(4, generator=gen) * 10)
    fewer = StripeConv2d.from_dense(other, torch.eye(4, 9, dtype=torch.bool).view(4, 3, 3))
    assert fewer.num_stripes != s.num_stripes and not torch.equal(fewer.bias, s.bias)
    x = torch.randn(2, 3, 6, 6, generator=gen)
    want, good = s(x).detach(), {k: v.clone() for k, v in s.state_dict().items()}
    for assign in (False, True):
        with pytest.raises(RuntimeError, match="size mismatch"):
            s.load_state_dict(fewer.state_dict(), assign=assign)
        now = s.state_dict()
        assert now.keys() == good.keys()
        for k, v in now.items():
            assert torch.equal(v, good[k]), k
        torch.testing.assert_close(s(x).detach(), want)
