"""Tests of ``kernels.stripe_conv2d`` against ``F.conv2d`` with the zero-filled dense weight (float64)."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import stripe_triton
from kernels.stripe import stripe_to_dense

CASES = [  # B, C, N, H, W, kernel, stride, padding, dilation
    (2, 3, 5, 7, 6, (3, 3), (1, 1), (1, 1), (1, 1)),
    (2, 4, 6, 9, 8, (3, 3), (2, 2), (1, 1), (1, 1)),
    (2, 4, 6, 9, 8, (3, 2), (2, 1), (1, 0), (1, 2)),
    (3, 5, 7, 11, 10, (3, 3), (2, 2), (2, 0), (2, 1)),
    (1, 2, 3, 6, 7, (5, 3), (1, 3), (0, 2), (1, 1)),
]


def random_layer(N, C, kernel_size, keep, gen, dtype=torch.float64, device="cpu"):
    """Random stripe layer in canonical order; never empty."""
    KH, KW = kernel_size
    m = torch.rand(N, KH, KW, generator=gen) < keep
    m[0, 0, 0] = True
    nz = m.permute(1, 2, 0).nonzero()  # rows (kh, kw, o): sorted by offset then output channel
    w = torch.randn(len(nz), C, generator=gen, dtype=dtype)
    return w.to(device), nz[:, 2].contiguous().to(device), nz[:, :2].contiguous().to(device)


def block_layer(N, C, kernel_size, group, keep, gen, dtype=torch.float64):
    """Random stripe layer whose mask is shared by groups of `group` consecutive filters (the last group may be
    shorter), in canonical order; never empty."""
    KH, KW = kernel_size
    g = torch.rand(-(-N // group), KH, KW, generator=gen) < keep
    g[0, 0, 0] = True
    nz = g.repeat_interleave(group, 0)[:N].permute(1, 2, 0).nonzero()
    return torch.randn(len(nz), C, generator=gen, dtype=dtype), nz[:, 2].contiguous(), nz[:, :2].contiguous()


def _ref(x, w, oi, off, b, N, ks, st, pd, dl, relu=False):
    y = F.conv2d(x, stripe_to_dense(w, oi, off, N, ks), b, st, pd, dl)
    return y.relu() if relu else y


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_forward_backward_matches_dense(case, with_bias, layout):
    B, C, N, H, W, ks, st, pd, dl = case
    gen = torch.Generator().manual_seed(hash((case, with_bias, layout)) % 2**31)
    w, oi, off = random_layer(N, C, ks, 0.5, gen)
    x = torch.randn(B, C, H, W, generator=gen, dtype=torch.float64)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    b = torch.randn(N, generator=gen, dtype=torch.float64) if with_bias else None
    plan = kernels.stripe_plan(oi, off, N, ks)
    ins = [t.clone().requires_grad_() for t in (x, w)] + ([b.clone().requires_grad_()] if with_bias else [])
    y = kernels.stripe_conv2d(ins[0], ins[1], oi, off, ins[2] if with_bias else None, N, ks, st, pd, dl, plan=plan)
    ref_ins = [t.clone().requires_grad_() for t in (x, w)] + ([b.clone().requires_grad_()] if with_bias else [])
    yr = _ref(ref_ins[0], ref_ins[1], oi, off, ref_ins[2] if with_bias else None, N, ks, st, pd, dl)
    assert y.shape == yr.shape
    torch.testing.assert_close(y, yr, rtol=1e-10, atol=1e-10)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    assert y.is_contiguous(memory_format=fmt)
    g = torch.randn(yr.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(y, ins, g)
    assert got[0].is_contiguous(memory_format=fmt)  # grad_x in x's layout
    want = torch.autograd.grad(yr, ref_ins, g)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


def test_no_plan_and_relu_match():
    gen = torch.Generator().manual_seed(1)
    w, oi, off = random_layer(6, 4, (3, 3), 0.4, gen)
    x = torch.randn(2, 4, 8, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    w.requires_grad_()
    y = kernels.stripe_conv2d(x, w, oi, off, b, 6, 3, 2, 1, 1, relu=True)
    yr = _ref(x, w, oi, off, b, 6, (3, 3), 2, 1, 1, relu=True)
    assert (yr == 0).any() and (yr > 0).any()
    torch.testing.assert_close(y, yr, rtol=1e-10, atol=1e-10)
    g = torch.randn(yr.shape, generator=gen, dtype=torch.float64)
    for got, want in zip(torch.autograd.grad(y, (x, w, b), g), torch.autograd.grad(yr, (x, w, b), g)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)  # the bias gradient too: behind the ReLU


def test_float32_and_empty_batch():
    gen = torch.Generator().manual_seed(2)
    w, oi, off = random_layer(8, 6, (3, 3), 0.3, gen, dtype=torch.float32)
    x = torch.randn(3, 6, 10, 10, generator=gen)
    y = kernels.stripe_conv2d(x, w, oi, off, None, 8, 3, 1, 1, 1)
    torch.testing.assert_close(y, _ref(x, w, oi, off, None, 8, (3, 3), 1, 1, 1), rtol=1e-5, atol=1e-5)
    x0 = torch.randn(0, 6, 10, 10, requires_grad=True)
    w.requires_grad_()
    y0 = kernels.stripe_conv2d(x0, w, oi, off, None, 8, 3, 2, 1, 1)
    assert y0.shape == (0, 8, 5, 5)
    y0.sum().backward()
    assert x0.grad.shape == x0.shape and torch.equal(w.grad, torch.zeros_like(w))
    # a layer with no stripe left (SWP can prune one whole): zeros out, zero gradient in
    x.requires_grad_()
    empty = torch.zeros(0, 6, requires_grad=True)
    y = kernels.stripe_conv2d(x, empty, oi[:0], off[:0], None, 8, 3, 1, 1, 1)
    assert y.shape == (3, 8, 10, 10) and not y.any()
    y.backward(torch.randn(y.shape, generator=gen))
    assert torch.equal(x.grad, torch.zeros_like(x)) and empty.grad.shape == (0, 6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_cpu_path_rounds_like_a_16_bit_conv(dtype):
    """On CPU a 16-bit stripe conv sums its offsets in float32 and rounds once: forward and gradients as close to the
    float64 reference as F.conv2d's in the same dtype (64 input channels, 9 offsets, all stripes kept)."""
    gen = torch.Generator().manual_seed(41)
    w, oi, off = random_layer(16, 64, (3, 3), 1.0, gen)
    x = torch.randn(2, 64, 10, 10, generator=gen, dtype=torch.float64)
    b = torch.randn(16, generator=gen, dtype=torch.float64)
    g = torch.randn(2, 16, 10, 10, generator=gen, dtype=torch.float64)
    dense = stripe_to_dense(w, oi, off, 16, (3, 3))

    def run(fn, weight):
        xh, wh = x.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
        y = fn(xh, wh)
        y.backward(g.to(dtype))
        return y.double(), xh.grad.double(), wh.grad.double()

    ours = run(lambda xh, wh: kernels.stripe_conv2d(xh, wh, oi, off, b.to(dtype), 16, (3, 3), (1, 1), (1, 1), (1, 1)), w)
    conv = run(lambda xh, wh: F.conv2d(xh, wh, b.to(dtype), 1, 1), dense)
    xr, wr = x.clone().requires_grad_(), dense.clone().requires_grad_()
    yr = F.conv2d(xr, wr, b, 1, 1)
    yr.backward(g)
    want = (yr.detach(), xr.grad, wr.grad[oi, :, off[:, 0], off[:, 1]])
    conv = (conv[0], conv[1], conv[2][oi, :, off[:, 0], off[:, 1]])
    for got, cudnn_like, ref in zip(ours, conv, want):
        assert (got - ref).abs().max() <= 1.5 * (cudnn_like - ref).abs().max() + 1e-6


def test_all_stripes_kept_equals_dense_conv():
    gen = torch.Generator().manual_seed(3)
    w, oi, off = random_layer(4, 3, (3, 3), 1.1, gen)
    assert len(oi) == 36
    x = torch.randn(2, 3, 5, 5, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(kernels.stripe_conv2d(x, w, oi, off, None, 4, 3, 1, 1, 1),
                               _ref(x, w, oi, off, None, 4, (3, 3), 1, 1, 1))


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
def test_stripe_to_dense_places_each_stripe_in_the_layout_asked(fmt):
    """W[o_s, :, kh_s, kw_s] = weight[s], zeros elsewhere, with the strides of `fmt` (also for one input channel,
    where both layouts count as contiguous); a format with nothing to preserve is refused."""
    gen = torch.Generator().manual_seed(6)
    for C in (3, 1):
        w, oi, off = random_layer(5, C, (3, 3), 0.4, gen)
        want = torch.zeros(5, C, 3, 3, dtype=torch.float64)
        for s in range(len(oi)):
            want[oi[s], :, off[s, 0], off[s, 1]] = w[s]
        dense = stripe_to_dense(w, oi, off, 5, (3, 3), memory_format=fmt)
        assert torch.equal(dense, want)
        assert dense.stride() == torch.empty_like(want, memory_format=fmt).stride()
    with pytest.raises(ValueError, match="memory_format=torch.preserve_format; give torch.contiguous_format or "
                                         "torch.channels_last"):
        stripe_to_dense(w, oi, off, 5, (3, 3), memory_format=torch.preserve_format)
    # bad indices or weights: errors naming them (PyTorch's index errors, or an unpacking error, before)
    top = int(oi.max())
    with pytest.raises(ValueError, match=rf"stripe_to_dense: 'out_index' values must lie in \[0, {top}\)"):
        stripe_to_dense(w, oi, off, top, (3, 3))  # one channel too few
    with pytest.raises(ValueError, match=r"stripe_to_dense: 'offset' values must lie in \[0, 2\) x \[0, 2\)"):
        stripe_to_dense(w, oi, off, 5, (2, 2))
    with pytest.raises(ValueError, match=r"stripe_to_dense: tensor 'offset' must have shape"):
        stripe_to_dense(w, oi, off[:, :1], 5, (3, 3))
    with pytest.raises(ValueError, match=r"stripe_to_dense: tensor 'weight' must have shape \(S, C\)"):
        stripe_to_dense(w[0], oi, off, 5, (3, 3))
    with pytest.raises(TypeError, match=r"stripe_to_dense: tensor 'out_index' must be int64, got torch.float32"):
        stripe_to_dense(w, oi.float(), off, 5, (3, 3))
    assert torch.equal(stripe_to_dense(w.flip(0), oi.flip(0), off.flip(0), 5, (3, 3)), want)  # any order


def test_gradcheck():
    gen = torch.Generator().manual_seed(4)
    w, oi, off = random_layer(3, 2, (3, 3), 0.5, gen)
    x = torch.randn(2, 2, 5, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, generator=gen, dtype=torch.float64, requires_grad=True)
    w.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x, w, b: kernels.stripe_conv2d(x, w, oi, off, b, 3, 3, (2, 1), (1, 0), (1, 2)), (x, w, b))


@pytest.mark.parametrize("case", CASES[:4])
@pytest.mark.parametrize("relu", [False, True])
def test_gradgradcheck(case, relu):
    """Double backward (the backward op's own autograd) against finite differences of the first derivatives (each
    case's geometry on a small layer: the check's cost grows with inputs x outputs)."""
    _, _, _, _, _, ks, st, pd, dl = case
    C, N = 2, 3
    gen = torch.Generator().manual_seed(14)
    w, oi, off = random_layer(N, C, ks, 0.5, gen)
    x = torch.randn(1, C, 5, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(N, generator=gen, dtype=torch.float64, requires_grad=True)
    w.requires_grad_()
    assert torch.autograd.gradgradcheck(
        lambda x, w, b: kernels.stripe_conv2d(x, w, oi, off, b, N, ks, st, pd, dl, relu=relu), (x, w, b))


def _input_gradient_penalty(conv, x, w, b):
    """d/d(w, b) of |d/dx sum(conv(x, w, b)^2)|^2: a gradient penalty, as WGAN-GP and input-gradient regularisers
    train with (create_graph=True)."""
    (gx,) = torch.autograd.grad(conv(x, w, b).square().sum(), x, create_graph=True)
    return torch.autograd.grad(gx.square().sum(), (w, b))


def _check_gradient_penalty(device: str, dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(15)
    w, oi, off = random_layer(8, 6, (3, 3), 0.4, gen)
    x = torch.randn(2, 6, 9, 9, generator=gen, dtype=torch.float64)
    b = torch.randn(8, generator=gen, dtype=torch.float64)
    want = _input_gradient_penalty(lambda x, w, b: _ref(x, w, oi, off, b, 8, (3, 3), 1, 1, 1, relu=True),
                                   x.requires_grad_(), w.requires_grad_(), b.requires_grad_())
    args = [t.detach().to(device, dtype).requires_grad_() for t in (x, w, b)]
    got = _input_gradient_penalty(
        lambda x, w, b: kernels.stripe_conv2d(x, w, oi.to(device), off.to(device), b, 8, 3, 1, 1, 1, relu=True),
        *args)
    for g, r in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double().cpu(), r, rtol=tol, atol=tol * r.abs().max().item())


def test_gradient_penalty_matches_dense():
    _check_gradient_penalty("cpu", torch.float64, 1e-9)


@pytest.mark.cuda
def test_gradient_penalty_matches_dense_cuda():
    """float32 products on tensor cores are TF32 (the forward and both backward levels): 1e-2 of the largest value."""
    _check_gradient_penalty("cuda", torch.float32, 1e-2)


def test_opcheck():
    gen = torch.Generator().manual_seed(5)
    w, oi, off = random_layer(5, 3, (3, 3), 0.5, gen)
    x = torch.randn(2, 3, 6, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)
    w.requires_grad_()
    plan = kernels.stripe_plan(oi, off, 5, 3)
    for xl in (x, x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()):
        torch.library.opcheck(torch.ops.compress.stripe_conv2d.default,
                              (xl, w, oi, off, b, plan, 5, [3, 3], [2, 2], [1, 1], [1, 1], False))
    dense = kernels.stripe_to_dense(w.detach(), oi, off, 5, 3, memory_format=torch.channels_last)
    torch.library.opcheck(torch.ops.compress.stripe_conv2d.default,
                          (x, w, oi, off, b, plan, 5, [3, 3], [2, 2], [1, 1], [1, 1], True, dense))
    g = torch.randn(2, 5, 3, 3, generator=gen, dtype=torch.float64)
    torch.library.opcheck(torch.ops.compress.stripe_conv2d_backward.default,
                          (g, x.detach(), w.detach(), oi, off, plan, 5, [3, 3], [2, 2], [1, 1], [1, 1], True, True))
    torch.library.opcheck(torch.ops.compress.stripe_conv2d_backward.default,  # with its own autograd
                          (g.requires_grad_(), x, w, oi, off, plan, 5, [3, 3], [2, 2], [1, 1], [1, 1], True, True))
    torch.library.opcheck(torch.ops.compress.stripe_conv2d_backward.default,
                          (g, x.detach(), w.detach(), oi, off, plan, 5, [3, 3], [2, 2], [1, 1], [1, 1], True, True,
                           dense))


def test_plan_contents():
    oi = torch.tensor([1, 3, 0, 2, 3])
    off = torch.tensor([[0, 0], [0, 0], [0, 2], [1, 1], [1, 1]])
    plan = kernels.stripe_plan(oi, off, 4, (2, 3))
    assert plan.dtype == torch.int32 and plan.shape == (6, 5)
    assert plan[0].tolist() == [0, 0, 1, 1, 2]  # offset (0,0): stripes 0 (ch 1) and 1 (ch 3)
    assert plan[2].tolist() == [2, 3, 3, 3, 3]  # offset (0,2): stripe 2 (ch 0)
    assert plan[4].tolist() == [3, 3, 3, 4, 5]  # offset (1,1): stripes 3 (ch 2) and 4 (ch 3)


@pytest.mark.parametrize("bad, msg", [
    ("order", "canonical order"),
    ("range", "out_index' values must lie"),
    ("offset", "offset' values must lie"),
    ("duplicate", "canonical order"),
    ("negative", "out_index' values must lie"),
    ("negative_offset", "offset' values must lie"),
])
def test_plan_validation(bad, msg):
    oi, off = torch.tensor([0, 1]), torch.tensor([[0, 0], [0, 1]])
    if bad == "order":
        off = torch.tensor([[0, 1], [0, 0]])
    elif bad == "range":
        oi = torch.tensor([0, 7])
    elif bad == "offset":
        off = torch.tensor([[0, 0], [3, 0]])
    elif bad == "duplicate":  # the same (offset, output channel) twice
        oi, off = torch.tensor([1, 1]), torch.tensor([[0, 0], [0, 0]])
    elif bad == "negative":
        oi, off = torch.tensor([-1, 1]), torch.tensor([[0, 0], [0, 0]])
    else:
        off = torch.tensor([[0, -1], [0, 0]])
    with pytest.raises(ValueError, match=msg):
        kernels.stripe_plan(oi, off, 2, 3)


def test_errors():
    gen = torch.Generator().manual_seed(6)
    w, oi, off = random_layer(4, 3, (3, 3), 0.5, gen, dtype=torch.float32)
    x = torch.randn(1, 3, 5, 5)
    with pytest.raises(ValueError, match=r"tensor 'weight' must have shape \(S, 3\)"):
        kernels.stripe_conv2d(x, w[:, :2], oi, off, None, 4, 3, 1, 1, 1)
    with pytest.raises(TypeError, match="tensor 'out_index' must be int64"):
        kernels.stripe_conv2d(x, w, oi.int(), off, None, 4, 3, 1, 1, 1)
    with pytest.raises(ValueError, match="tensor 'x' must be 4-D"):
        kernels.stripe_conv2d(x[0], w, oi, off, None, 4, 3, 1, 1, 1)
    with pytest.raises(TypeError, match="tensor 'weight' has dtype torch.float64"):
        kernels.stripe_conv2d(x, w.double(), oi, off, None, 4, 3, 1, 1, 1)
    with pytest.raises(ValueError, match=r"tensor 'bias' must have shape \(4,\)"):
        kernels.stripe_conv2d(x, w, oi, off, torch.zeros(3), 4, 3, 1, 1, 1)
    with pytest.raises(TypeError, match=r"stripe_conv2d: out_channels must be an int, got 4.0"):
        kernels.stripe_conv2d(x, w, oi, off, None, 4.0, 3, 1, 1, 1)
    with pytest.raises(ValueError, match=r"stride must be an int or a pair of ints, got \(1.5, 1\)"):
        kernels.stripe_conv2d(x, w, oi, off, None, 4, 3, (1.5, 1), 1, 1)
    assert kernels.stripe_conv2d(x, w, oi, off, None, np.int64(4), 3, np.int64(1), 1, 1).shape == (1, 4, 5, 5)
    for hw in ((2, 2), (5, 2), (5, 1)):  # too small in either direction
        with pytest.raises(ValueError, match="too small for kernel"):
            kernels.stripe_conv2d(torch.randn(1, 3, *hw), w, oi, off, None, 4, 3, 1, 0, 1)
    with pytest.raises(ValueError, match=r"stride must be two ints >= 1, got \[0, 1\]"):
        kernels.stripe_conv2d(x, w, oi, off, None, 4, 3, (0, 1), 1, 1)
    with pytest.raises(ValueError, match="tensor 'out_index' is on meta but 'x' is on cpu"):
        kernels.stripe_conv2d(x, w, oi.to("meta"), off, None, 4, 3, 1, 1, 1)
    with pytest.raises(ValueError, match=r"tensor 'out_index' must be 1-D \(S,\), got shape \(\d+, 1\)"):
        kernels.stripe_plan(oi[:, None], off, 4, 3)
    with pytest.raises(TypeError, match="'out_index' must be a Tensor, got list"):
        kernels.stripe_plan(oi.tolist(), off, 4, 3)
    with pytest.raises(ValueError, match=r"kernel_size must be two ints >= 1, got \[0, 0\]"):
        kernels.stripe_plan(oi, off, 4, 0)
    with pytest.raises(ValueError, match="tensor 'plan' must be int32"):
        kernels.stripe_conv2d(x, w, oi, off, None, 4, 3, 1, 1, 1, plan=torch.zeros(9, 5, dtype=torch.int64))
    other = kernels.stripe_plan(oi[:-1], off[:-1], 4, 3)  # the plan of other indices (one stripe fewer)
    with pytest.raises(ValueError, match=f"'plan' counts {len(oi) - 1} stripes but 'weight' has {len(oi)}"):
        kernels.stripe_conv2d(x, w, oi, off, None, 4, 3, 1, 1, 1, plan=other)
    with pytest.raises(ValueError, match="must be contiguous NCHW or channels_last"):  # the registered op itself;
        # kernels.stripe_conv2d copies such an x first (tests/test_stripe.py)
        torch.ops.compress.stripe_conv2d(x.transpose(2, 3), w, oi, off, None, None, 4, [3, 3], [1, 1], [1, 1], [1, 1],
                                         False)
    # without a plan the op checks the indices (with one, stripe_plan checked them when it was built)
    order = torch.argsort(oi * 9 + off[:, 0] * 3 + off[:, 1])  # by output channel first: not canonical
    out_of_range, off_kernel = oi.clone(), off.clone()
    out_of_range[-1], off_kernel[-1, 1] = 4, 3  # the last stripe: output channel 4 of 4; column 3 of a 3x3 kernel
    bad = [(oi[order], off[order], "stripes must be in canonical order"),
           (out_of_range, off, r"'out_index' values must lie in \[0, 4\)"),
           (oi, off_kernel, r"'offset' values must lie in \[0, 3\) x \[0, 3\)")]
    for o, f, message in bad:
        with pytest.raises(ValueError, match=f"compress::stripe_conv2d: {message}"):
            kernels.stripe_conv2d(x, w, o, f, None, 4, 3, 1, 1, 1)
        with pytest.raises(ValueError, match=f"compress::stripe_conv2d_backward: {message}"):
            torch.ops.compress.stripe_conv2d_backward(torch.randn(1, 4, 5, 5), x, w, o, f, None, 4, [3, 3], [1, 1],
                                                      [1, 1], [1, 1], True, True)


def test_dense_argument_is_checked_and_leaves_the_result_unchanged():
    """`dense` (the caller's cached zero-filled weight, channels_last) is validated; the CPU path gives the same
    result with it, and no gradient flows into it. The CUDA kernel's use of it: the interpreted test below."""
    gen = torch.Generator().manual_seed(12)
    w, oi, off = random_layer(6, 4, (3, 3), 0.5, gen, dtype=torch.float32)
    x = torch.randn(2, 4, 7, 7, generator=gen)
    dense = kernels.stripe_to_dense(w, oi, off, 6, 3, memory_format=torch.channels_last)
    want = F.conv2d(x, dense, None, 1, 1)
    g = torch.randn(want.shape, generator=gen)
    w_without = w.clone().requires_grad_()
    kernels.stripe_conv2d(x, w_without, oi, off, None, 6, 3, 1, 1, 1).backward(g)
    dense.requires_grad_()
    got = kernels.stripe_conv2d(x, w.requires_grad_(), oi, off, None, 6, 3, 1, 1, 1, dense=dense)
    torch.testing.assert_close(got, want)
    got.backward(g)
    assert w.grad.abs().sum() > 0 and torch.equal(w.grad, w_without.grad) and dense.grad is None
    dense = dense.detach()
    assert not kernels.stripe_reads_dense(x, w, 6, 3)  # CPU: never the kernel's dense route
    with pytest.raises(ValueError, match="tensor 'dense' must be the zero-filled dense weight"):
        kernels.stripe_conv2d(x, w, oi, off, None, 6, 3, 1, 1, 1, dense=dense.contiguous())  # NCHW strides
    with pytest.raises(ValueError, match="tensor 'dense' must be the zero-filled dense weight"):
        kernels.stripe_conv2d(x, w, oi, off, None, 6, 3, 1, 1, 1, dense=dense[:5])


def test_prepare_checks_like_the_op_and_defers_off_cuda():
    """The eager launcher checks its arguments as the op does, and on CPU (no Triton kernel) returns None, so
    that the caller runs the op."""
    gen = torch.Generator().manual_seed(5)
    w, oi, off = random_layer(6, 4, (3, 3), 0.5, gen, dtype=torch.float32)
    x = torch.randn(2, 4, 5, 5, generator=gen)
    assert kernels.prepare_stripe_conv2d(x, w, oi, off, None, 6, 3, 1, 1, 1) is None
    with pytest.raises(ValueError, match="tensor 'weight' must have shape"):
        kernels.prepare_stripe_conv2d(x[:, :3], w, oi, off, None, 6, 3, 1, 1, 1)
    with pytest.raises(TypeError, match="tensor 'bias' has dtype torch.float64"):
        kernels.prepare_stripe_conv2d(x, w, oi, off, torch.zeros(6, dtype=torch.float64), 6, 3, 1, 1, 1)


def test_route_helpers():
    gen = torch.Generator().manual_seed(7)
    w, oi, off = random_layer(8, 8, (3, 3), 0.3, gen, dtype=torch.float32)
    x = torch.randn(2, 8, 8, 8, generator=gen)
    r = kernels.stripe_route(x, w, oi, off, None, 8, 3, 1, 1, 1, repeats=1)  # 8x8: no gemm (64 > 2 * 9 pixels)
    assert set(r) == {"mode", "use_stripe", "stripe_ms", "dense_ms", "gemm_ms"} and r["gemm_ms"] is None
    assert r["stripe_ms"] > 0 and r["dense_ms"] > 0
    assert r["mode"] == ("stripe" if r["stripe_ms"] < r["dense_ms"] else "dense") and r["use_stripe"] == (
        r["mode"] == "stripe")
    r = kernels.stripe_route(x[:, :, :4, :4].contiguous(), w, oi, off, None, 8, 3, 1, 1, 1, repeats=1)  # 4x4: gemm
    times = {m: r[f"{m}_ms"] for m in ("stripe", "dense", "gemm")}
    assert all(t > 0 for t in times.values()) and r["mode"] == min(times, key=times.get)
    with pytest.raises(ValueError, match="timing='graph' times CUDA graphs and needs a CUDA input"):
        kernels.stripe_route(x, w, oi, off, None, 8, 3, 1, 1, 1, repeats=1, timing="graph")
    with pytest.raises(ValueError, match="timing must be 'auto', 'graph' or 'eager'"):
        kernels.stripe_route(x, w, oi, off, None, 8, 3, 1, 1, 1, repeats=1, timing="fast")
    for repeats in (0, -1, 2.0):  # (an IndexError from the median of no timing)
        with pytest.raises(ValueError, match=rf"stripe_route: repeats must be an int >= 1 .*got {repeats}"):
            kernels.stripe_route(x, w, oi, off, None, 8, 3, 1, 1, 1, repeats=repeats)
    lo = kernels.stripe_cost(256, 256, int(0.1 * 256 * 9), 3)
    hi = kernels.stripe_cost(256, 256, int(0.9 * 256 * 9), 3)
    assert lo < 1 < hi
    # any name of a CUDA device gets the CUDA estimate ("cuda:0" and torch.device("cuda") got the CPU's, 9.6 for 0.4)
    cuda = kernels.stripe_cost(16, 16, 100, 3, "cuda")
    assert cuda == 0.4 != kernels.stripe_cost(16, 16, 100, 3, "cpu")
    for name in ("cuda:0", torch.device("cuda"), torch.device("cuda", 1)):
        assert kernels.stripe_cost(16, 16, 100, 3, name) == cuda
    assert kernels.stripe_cost(16, 16, 100, 3, "meta") == kernels.stripe_cost(16, 16, 100, 3, "cpu")  # other kinds
    for bad in ("gpu", None):
        with pytest.raises(ValueError, match=r"stripe_cost: device must be a device or its name"):
            kernels.stripe_cost(16, 16, 100, 3, bad)
    with pytest.raises(ValueError, match=r"stripe_cost: num_stripes must be >= 0, got -1"):
        kernels.stripe_cost(16, 16, -1, 3)


def test_tile_keep_and_tile_offsets_follow_the_mask():
    """stripe_tile_keep: per tile width, the share of (offset, channel) pairs in (offset, tile) blocks keeping a
    stripe, counted by hand (equal to the stripes kept for tiles up to the group width);
    tile_offsets: each tile's kept offsets first, ascending, then the rest; default_config takes the LISTED route
    (tiles as wide as the mask's groups) for a grouped mask with the dense weight kept, never for a random one."""
    gen = torch.Generator().manual_seed(12)
    N, G = 72, 32
    w, oi, off = block_layer(N, 48, (3, 3), G, 0.3, gen)
    plan = kernels.stripe_plan(oi, off, N, 3)
    mask = torch.zeros(N, 9, dtype=torch.bool)
    mask[oi, off[:, 0] * 3 + off[:, 1]] = True
    keep = kernels.stripe_tile_keep(plan, N)
    assert set(keep) == set(stripe_triton.LISTED_TILES)
    for bn, share in keep.items():
        blocks = [mask[n0:n0 + bn].any(0) for n0 in range(0, N, bn)]
        work = sum(int(kept.sum()) * min(bn, N - t * bn) for t, kept in enumerate(blocks))
        assert share == pytest.approx(work / (9 * N), abs=1e-6), bn
        if bn <= G:
            assert share == pytest.approx(len(oi) / (9 * N), abs=1e-6)
        lists = stripe_triton.tile_offsets(plan, N, bn)
        for t, kept in enumerate(blocks):
            want = kept.nonzero().flatten().tolist()
            assert lists[t, 0] == len(want) and lists[t, 1:1 + len(want)].tolist() == want
            assert sorted(lists[t, 1:].tolist()) == list(range(9))
    cfg = stripe_triton.default_config(48, N, len(oi), 9, torch.bfloat16, dense_given=True, pixels=1 << 16,
                                       tile_keep=keep)
    assert cfg.get("LISTED") and cfg["BLOCK_N"] == G, cfg
    assert not stripe_triton.default_config(48, N, len(oi), 9, torch.bfloat16, pixels=1 << 16,
                                            tile_keep=keep).get("LISTED")  # the dense weight not kept
    w, oi, off = random_layer(N, 48, (3, 3), 0.3, gen)
    rand_keep = kernels.stripe_tile_keep(kernels.stripe_plan(oi, off, N, 3), N)
    assert min(rand_keep.values()) > 0.9
    assert not stripe_triton.default_config(48, N, len(oi), 9, torch.bfloat16, dense_given=True, pixels=1 << 16,
                                            tile_keep=rand_keep).get("LISTED")
    # the CUDA cost model: a wide layer stays dense unless its tiles skip most offsets
    assert kernels.stripe_cost(256, 256, 500, 3, "cuda") == kernels.stripe_cost(256, 256, 500, 3, "cuda", rand_keep) > 1
    assert kernels.stripe_cost(256, 256, 500, 3, "cuda", {16: 0.2, 32: 0.2, 64: 0.2, 128: 0.35}) < 1


_INTERPRET_PRELUDE = r"""
import sys, torch
sys.path.insert(0, "tests")
import kernels
from kernels import stripe_triton
from test_kernels_stripe import block_layer, random_layer, _ref
gen = torch.Generator().manual_seed(8)
cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, CHUNK=16, num_warps=4, num_stages=2)
gcfg = dict(cfg, CHUNK=8, GATHER=True)
"""

# every route's forward and both Triton gradients, per case
_INTERPRET_ROUTES = r"""
for dt, ks, st, pd, dl, C, N, c, fmt in [
        (torch.float32, (3, 3), (1, 1), (1, 1), (1, 1), 16, 20, None, torch.contiguous_format),
        (torch.float32, (3, 3), (1, 1), (1, 1), (1, 1), 3, 40, None, torch.channels_last),  # RGB: im2col route
        (torch.float32, (3, 3), (1, 1), (1, 1), (1, 1), 2, 12, None, torch.contiguous_format),  # im2col, 2 ch
        (torch.float16, (3, 3), (1, 1), (1, 1), (1, 1), 8, 20, None, torch.channels_last),  # kept: im2col, 8 ch
        (torch.float16, (7, 7), (2, 2), (3, 3), (1, 1), 3, 24, None, torch.contiguous_format),  # a stem, 3 chunks
        (torch.float32, (3, 3), (1, 1), (2, 2), (2, 2), 3, 20, dict(cfg, IM2COL=True), torch.channels_last),
        (torch.float32, (3, 3), (1, 1), (1, 1), (1, 1), 16, 4, None, torch.contiguous_format),  # grad_x: im2col
        (torch.float16, (3, 3), (2, 2), (1, 1), (1, 1), 40, 20, None, torch.contiguous_format),  # kept: im2col
        (torch.float32, (3, 3), (1, 1), (1, 1), (1, 1), 24, 20, None, torch.channels_last),  # kept: im2col (TF32)
        (torch.float32, (3, 3), (2, 2), (1, 1), (1, 1), 40, 20, cfg, torch.contiguous_format),
        # route (c) with the transposed product (SWAP), strided and plain
        (torch.float16, (3, 3), (2, 2), (1, 1), (1, 1), 40, 20, dict(cfg, IM2COL=True, SWAP=True), torch.channels_last),
        (torch.float32, (3, 3), (1, 1), (1, 1), (1, 1), 24, 36, dict(cfg, IM2COL=True, SWAP=True),
         torch.contiguous_format),
        (torch.float32, (3, 3), (2, 2), (1, 1), (1, 1), 40, 20, dict(cfg, DENSE=True, NOSKIP=True), torch.channels_last),
        (torch.float16, (3, 3), (2, 2), (1, 1), (1, 1), 40, 20, dict(cfg, DENSE=True), torch.channels_last),
        (torch.float16, (3, 2), (2, 1), (0, 1), (2, 1), 16, 36, cfg, torch.channels_last),
        (torch.float32, (3, 3), (1, 1), (1, 1), (1, 1), 40, 36, gcfg, torch.contiguous_format),
        (torch.float16, (3, 2), (2, 1), (0, 1), (2, 1), 24, 36, gcfg, torch.channels_last),
        (torch.float32, (3, 2), (1, 1), (1, 0), (2, 1), 24, 36, None, torch.channels_last),  # backward: dilated
        # the wide layers' route (c) tiles (16-bit: SWAP below 129 output channels, else 256-channel tiles; fp32:
        # 256-pixel tiles)
        (torch.float16, (3, 3), (1, 1), (1, 1), (1, 1), 72, 40, stripe_triton._wide_tiles(72, 40, torch.float16),
         torch.channels_last),
        (torch.float16, (3, 3), (2, 2), (1, 1), (1, 1), 72, 200, stripe_triton._wide_tiles(72, 200, torch.float16),
         torch.contiguous_format),
        (torch.float32, (3, 3), (1, 1), (1, 1), (1, 1), 72, 20, stripe_triton._wide_tiles(72, 20, torch.float32),
         torch.contiguous_format)]:
    w, oi, off = random_layer(N, C, ks, 0.4, gen, dtype=torch.float32)
    x = torch.randn(2, C, 6, 5, generator=gen).contiguous(memory_format=fmt)
    b = torch.randn(N, generator=gen)
    plan = kernels.stripe_plan(oi, off, N, ks)
    y = stripe_triton.forward(x.to(dt), w.to(dt), oi, off, b.to(dt), plan, N, list(ks), list(st), list(pd),
                              list(dl), True, c)
    yr = _ref(x.double(), w.double(), oi, off, b.double(), N, ks, st, pd, dl, relu=True)
    err = ((y.double() - yr).norm() / yr.norm()).item()
    assert y.shape == yr.shape and err < 1e-3, (dt, ks, st, err)
    assert y.is_contiguous(memory_format=fmt)
    if c is None or c.get("DENSE") or c.get("IM2COL"):  # with a kept dense weight (the default then may take another route)
        dense = kernels.stripe_to_dense(w.to(dt), oi, off, N, ks, memory_format=torch.channels_last)
        y2 = stripe_triton.forward(x.to(dt), w.to(dt), oi, off, b.to(dt), plan, N, list(ks), list(st), list(pd),
                                   list(dl), True, c, dense=dense)
        if c is not None:
            assert torch.equal(y2, y)
        assert ((y2.double() - yr).norm() / yr.norm()).item() < 1e-3, (dt, ks, st)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    yr = _ref(xr, wr, oi, off, None, N, ks, st, pd, dl)
    g = torch.randn(yr.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(yr, (xr, wr), g)
    ok = stripe_triton.backward_support(x, N, ks, st, pd, dl)
    assert ok == (st == (1, 1) and N <= 64, C <= 64 and N <= 64), (ks, st, ok)
    got = stripe_triton.backward(g.to(dt), x.to(dt), w.to(dt), oi, off, N, list(ks), list(st), list(pd), list(dl),
                                 *ok)
    for a, e, asked in zip(got, want, ok):
        assert (a is None) != asked
        if asked:
            assert a.shape == e.shape and ((a.double() - e).norm() / e.norm()).item() < 1e-3, (dt, ks, st)
# an empty batch through both Triton gradients: zeros of the right shapes
w, oi, off = random_layer(8, 16, (3, 3), 0.4, gen, dtype=torch.float32)
x0, g0 = torch.randn(0, 16, 6, 5), torch.randn(0, 8, 6, 5)
dx, dw = stripe_triton.backward(g0, x0, w, oi, off, 8, [3, 3], [1, 1], [1, 1], [1, 1], True, True)
assert dx.shape == x0.shape and dw.shape == w.shape and not dw.any(), (dx.shape, dw.shape)
print("OK")
"""

# prepared launches: the LISTED route, a kept Launch, the max-pool epilogue
_INTERPRET_LAUNCHES = r"""
import torch.nn.functional as F
# the LISTED route (a tile's kept offsets only) on masks shared by groups of 16 filters: tiles of 16 (the last
# one partial), C not a multiple of BLOCK_K, stride 2, both layouts, chosen by default_config from tile_keep
for dt, st, C, N, fmt in ((torch.float32, (1, 1), 24, 40, torch.channels_last),
                          (torch.float16, (2, 2), 16, 36, torch.contiguous_format)):
    w, oi, off = block_layer(N, C, (3, 3), 16, 0.3, gen, dtype=torch.float32)
    plan = kernels.stripe_plan(oi, off, N, (3, 3))
    x = torch.randn(2, C, 6, 5, generator=gen).contiguous(memory_format=fmt)
    b = torch.randn(N, generator=gen)
    dense = kernels.stripe_to_dense(w.to(dt), oi, off, N, (3, 3), memory_format=torch.channels_last)
    keep = kernels.stripe_tile_keep(plan, N)
    launch = stripe_triton.prepare(x.to(dt), w.to(dt), oi, off, b.to(dt), plan, N, [3, 3], list(st), [1, 1],
                                   [1, 1], True, None, dense=dense, tile_keep=keep)
    assert launch._args[-len(launch._args) + 4].shape == (-(-N // 16), 10)  # the tile offset lists
    yr = _ref(x.double(), w.double(), oi, off, b.double(), N, (3, 3), st, (1, 1), (1, 1), relu=True)
    y = launch(x.to(dt))
    assert y.is_contiguous(memory_format=fmt)
    assert ((y.double() - yr).norm() / yr.norm()).item() < 1e-3, (dt, st)
# a Launch kept and called again refills its input and output slots: a second input of the same signature
w, oi, off = random_layer(20, 16, (3, 3), 0.4, gen, dtype=torch.float32)
plan = kernels.stripe_plan(oi, off, 20, (3, 3))
x1, x2 = (torch.randn(2, 16, 6, 5, generator=gen) for _ in range(2))
launch = stripe_triton.prepare(x1, w, oi, off, None, plan, 20, [3, 3], [1, 1], [1, 1], [1, 1], False, cfg)
assert launch.signature == stripe_triton.input_signature(x2)
for xi, call in ((x1, launch), (x2, launch.run)):  # run: the same launch without the signature check
    yr = _ref(xi.double(), w.double(), oi, off, None, 20, (3, 3), (1, 1), (1, 1), (1, 1))
    y = call(xi)
    assert ((y.double() - yr).norm() / yr.norm()).item() < 1e-3
# the 2x2 max-pool epilogue (pool=True) on every route and layout, tiles of 4 windows (BLOCK_M 16) over 2x2 (a
# tile spans images: every route), 8x8 and 6x10 (a tile's windows span rows: the routes split between them, both
# layouts in each) outputs; a 5-high one takes the launcher's pool after the kernel (ceil mode: 3 rows). (Each
# interpreted launch over the larger maps takes seconds: the routes share the epilogue, so not every pair runs.)
routes = ((cfg, torch.contiguous_format, torch.float32), (gcfg, torch.channels_last, torch.float16),
          (dict(cfg, DENSE=True), torch.channels_last, torch.float32),
          (dict(cfg, DENSE=True, NOSKIP=True), torch.contiguous_format, torch.float16),
          (dict(cfg, DENSE=True, LISTED=True), torch.channels_last, torch.float16),
          (dict(cfg, IM2COL=True), torch.channels_last, torch.float32),
          (dict(cfg, IM2COL=True, SWAP=True), torch.channels_last, torch.float16))
for (H, W), fused, on in (((2, 2), True, routes), ((8, 8), True, routes[0::2]), ((6, 10), True, routes[1::2]),
                          ((5, 8), False, routes[:1])):
    for c, fmt, dt in on:
        w, oi, off = random_layer(20, 24, (3, 3), 0.4, gen, dtype=torch.float32)
        plan = kernels.stripe_plan(oi, off, 20, (3, 3))
        x = torch.randn(2, 24, H, W, generator=gen).contiguous(memory_format=fmt)
        b = torch.randn(20, generator=gen)
        dense = kernels.stripe_to_dense(w.to(dt), oi, off, 20, (3, 3), memory_format=torch.channels_last)
        launch = stripe_triton.prepare(x.to(dt), w.to(dt), oi, off, b.to(dt), plan, 20, [3, 3], [1, 1], [1, 1],
                                       [1, 1], True, c, dense=dense, pool=True, pool_ceil=True)
        assert launch.pool_fused == fused, (H, W)
        y = launch(x.to(dt))
        yr = F.max_pool2d(_ref(x.double(), w.double(), oi, off, b.double(), 20, (3, 3), (1, 1), (1, 1), (1, 1),
                               relu=True), 2, ceil_mode=True)
        assert y.shape == yr.shape and y.is_contiguous(memory_format=fmt), (H, W, c)
        assert ((y.double() - yr).norm() / yr.norm()).item() < 1e-3, (H, W, c)
print("OK")
"""


def test_triton_kernel_interpreted_on_cpu():
    """The Triton kernel's indexing, its one-hot and gather reductions, its im2col route and its max-pool epilogue,
    run by TRITON_INTERPRET=1 on tiny shapes (CHUNK 8 < the tile's stripes per offset, so a column's stripe may fall
    in a later chunk). The routes and the prepared launches run in two processes at once: the interpreter is
    single-threaded Python, so two processes use both cores of a 2-core CI machine."""
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = [subprocess.Popen([sys.executable, "-c", _INTERPRET_PRELUDE + part], cwd=root, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for part in (_INTERPRET_ROUTES, _INTERPRET_LAUNCHES)]
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0 and out.strip().endswith("OK"), out + err
    finally:
        for proc in procs:
            proc.kill()


def test_prepared_launcher_refuses_an_input_of_another_signature():
    """A launcher called on an input it was not prepared for (another batch, size, dtype or layout) is refused,
    naming both inputs: it returned an output of the prepared shape, and a smaller batch made the kernel read past
    the input's end (NaN on CPU under the interpreter, an illegal access on a GPU). Nothing launches here."""
    from kernels import stripe_triton

    gen = torch.Generator().manual_seed(3)
    w, oi, off = random_layer(8, 6, (3, 3), 0.5, gen, dtype=torch.float32)
    plan = kernels.stripe_plan(oi, off, 8, (3, 3))
    x = torch.randn(4, 6, 5, 5, generator=gen)
    launch = stripe_triton.prepare(x, w, oi, off, None, plan, 8, [3, 3], [1, 1], [1, 1], [1, 1], False)
    for other in (x[:1], torch.randn(4, 6, 7, 7), x.half(), x.contiguous(memory_format=torch.channels_last)):
        with pytest.raises(ValueError, match=r"prepared for inputs of shape \(4, 6, 5, 5\), torch.float32 on cpu, "
                                             r"strides \(150, 25, 5, 1\).* got shape " + re.escape(str(tuple(other.shape)))):
            launch(other)


# ----------------------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-3), (torch.float16, 1e-2), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_cuda_matches_dense(dtype, tol, layout, monkeypatch):
    gen = torch.Generator().manual_seed(9)
    for case in CASES + [(2, 3, 40, 12, 12, (3, 3), (1, 1), (1, 1), (1, 1)),
                         (4, 64, 64, 8, 8, (3, 3), (1, 1), (1, 1), (1, 1)),
                         (2, 128, 96, 9, 9, (3, 3), (2, 2), (1, 1), (1, 1)),
                         (2, 256, 160, 7, 7, (3, 3), (1, 1), (1, 1), (1, 1)),  # the default configs by width
                         (2, 3, 24, 20, 18, (7, 7), (2, 2), (3, 3), (1, 1)),  # a 7x7 stem: route (c)
                         (2, 40, 36, 9, 10, (3, 3), (2, 2), (1, 1), (1, 1))]:  # dense given: route (c)
        B, C, N, H, W, ks, st, pd, dl = case
        w, oi, off = random_layer(N, C, ks, 0.3, gen, device="cuda")
        x = torch.randn(B, C, H, W, generator=gen, dtype=torch.float64).cuda()
        b = torch.randn(N, generator=gen, dtype=torch.float64).cuda()
        yr = _ref(x, w, oi, off, b, N, ks, st, pd, dl, relu=True)
        fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
        xd = x.to(dtype).contiguous(memory_format=fmt).requires_grad_()
        wd, bd = w.to(dtype).requires_grad_(), b.to(dtype).requires_grad_()
        plan = kernels.stripe_plan(oi, off, N, ks)
        y = kernels.stripe_conv2d(xd, wd, oi, off, bd, N, ks, st, pd, dl, relu=True, plan=plan)
        assert ((y.double() - yr).norm() / yr.norm()).item() < tol, case
        g = torch.randn(yr.shape, generator=gen, dtype=torch.float64).cuda()
        # the ReLU mask is the kernel's own (a low-precision y can flip the sign of values near 0)
        g_eff = g * (y.detach() > 0).double()
        xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
        want = torch.autograd.grad(_ref(xr, wr, oi, off, br, N, ks, st, pd, dl), (xr, wr, br), g_eff)
        got = torch.autograd.grad(y, (xd, wd, bd), g.to(dtype))
        for a, e in zip(got, want):
            assert ((a.double() - e).norm() / e.norm()).item() < tol, case
        # given the forward's dense weight (as StripeConv2d passes it), the backward reads it: same gradients
        kept = kernels.stripe_to_dense(wd.detach(), oi, off, N, ks, memory_format=torch.channels_last)
        y_k = kernels.stripe_conv2d(xd, wd, oi, off, bd, N, ks, st, pd, dl, relu=True, plan=plan, dense=kept)
        got_k = torch.autograd.grad(y_k, (xd, wd, bd), g.to(dtype))
        # (its forward may take another route: in 16-bit types its own ReLU mask can differ near 0)
        xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
        want_k = torch.autograd.grad(_ref(xr, wr, oi, off, br, N, ks, st, pd, dl), (xr, wr, br),
                                     g * (y_k.detach() > 0).double())
        for a, e in zip(got_k, want_k):
            assert ((a.double() - e).norm() / e.norm()).item() < tol, ("dense given", case)
        # the Triton backward wherever it is supported, and cuDNN's, each forced (the default mixes them)
        from kernels import stripe_triton

        ok = stripe_triton.backward_support(xd, N, ks, st, pd, dl)
        got_t = stripe_triton.backward(g_eff.to(dtype), xd.detach(), wd.detach(), oi, off, N, list(ks), list(st),
                                       list(pd), list(dl), *ok)
        for a, e, asked in zip(got_t, want[:2], ok):
            if asked:
                assert ((a.double() - e).norm() / e.norm()).item() < tol, ("triton backward", case)
                assert a.dtype == dtype
        for choice in ("triton", "cudnn"):
            monkeypatch.setenv("COMPRESS_STRIPE_BWD", choice)
            got_c = torch.autograd.grad(kernels.stripe_conv2d(xd, wd, oi, off, bd, N, ks, st, pd, dl, relu=True,
                                                              plan=plan), (xd, wd), g.to(dtype))
            for a, e in zip(got_c, want[:2]):
                assert ((a.double() - e).norm() / e.norm()).item() < tol, (choice, case)
            assert got_c[0].is_contiguous(memory_format=fmt)
        monkeypatch.delenv("COMPRESS_STRIPE_BWD")


@pytest.mark.cuda
def test_pdl_launches_give_bitwise_the_outputs_of_plain_launches(monkeypatch):
    """On Hopper and later GPUs the forward launches with programmatic dependent launch (each program waits for
    the previous kernel before touching memory, ``stripe_triton.pdl_launch``): a chain of three layers, each reading
    the last one's output, called eagerly and replayed from a CUDA graph on fresh inputs, gives bitwise the outputs
    of plain launches and matches float64. Older GPUs launch plainly."""
    from kernels import stripe_triton

    gen = torch.Generator().manual_seed(11)
    shapes = [(24, 16), (40, 24), (64, 40)]  # (N, C): routes (c) and the one-hot route
    layers = []
    for N, C in shapes:
        w, oi, off = random_layer(N, C, (3, 3), 0.3, gen, dtype=torch.float32)
        b = torch.randn(N, generator=gen)
        layers.append((w, oi, off, b, N))
    x = torch.randn(64, 16, 32, 32, generator=gen)
    xs = [torch.randn_like(x) for _ in range(3)]
    hopper = torch.cuda.get_device_capability()[0] >= 9

    def chain(pdl: bool):
        monkeypatch.setattr(stripe_triton, "PDL", pdl)
        static = x.to("cuda", torch.bfloat16).contiguous(memory_format=torch.channels_last)
        launches, h = [], static
        for w, oi, off, b, N in layers:
            wc, oic, offc, bc = w.cuda().bfloat16(), oi.cuda(), off.cuda(), b.cuda().bfloat16()
            launch = kernels.prepare_stripe_conv2d(h, wc, oic, offc, bc, N, (3, 3), 1, 1, 1, relu=True,
                                                   plan=kernels.stripe_plan(oic, offc, N, (3, 3)))
            assert launch.pdl == (pdl and hopper)
            launches.append(launch)
            h = launch(h)  # (compiles; the graph below must find the kernels compiled)

        def run(inp):
            for launch in launches:
                inp = launch(inp)
            return inp

        eager = [run(xi.to("cuda", torch.bfloat16).contiguous(memory_format=torch.channels_last)) for xi in xs]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(static)
        replayed = []
        for xi in xs:
            static.copy_(xi.to("cuda", torch.bfloat16).contiguous(memory_format=torch.channels_last))
            graph.replay()
            replayed.append(out.clone())
        return eager, replayed

    plain, plain_graph = chain(False)
    pdl, pdl_graph = chain(True)
    for xi, a, b, c, d in zip(xs, plain, plain_graph, pdl, pdl_graph):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
        ref = xi.bfloat16().double().cuda()
        for w, oi, off, b_, N in layers:  # float64 reference on the bf16-rounded operands, bf16 between layers
            ref = _ref(ref, w.bfloat16().double().cuda(), oi.cuda(), off.cuda(), b_.bfloat16().double().cuda(), N,
                       (3, 3), (1, 1), (1, 1), (1, 1), relu=True).bfloat16().double()
        assert ((a.double() - ref).norm() / ref.norm()).item() < 2e-2


def test_tf32_is_read_from_either_of_pytorchs_settings(monkeypatch):
    """The stripe kernel multiplies float32 in TF32, so it runs only while convs may: cudnn.conv.fp32_precision
    ("ieee" or "tf32"; once set, reading the older allow_tf32 raises, which made every float32 forward fail) or,
    where that says "none", allow_tf32. (Settings modules stand in for PyTorch's: setting the real flags through
    both APIs leaves a mix that PyTorch's own reads refuse for the rest of the process.)"""
    import types

    from kernels import stripe_triton
    from kernels._utils import conv_tf32

    def settings(precision, allow):  # allow: what reading allow_tf32 gives (an exception: it raises)
        class Cudnn:
            conv = types.SimpleNamespace(fp32_precision=precision)

            @property
            def allow_tf32(self):
                if isinstance(allow, Exception):
                    raise allow
                return allow
        return Cudnn()

    mixed = RuntimeError("a mix of the legacy and new APIs")
    assert conv_tf32(settings("tf32", mixed)) and not conv_tf32(settings("ieee", mixed))
    assert conv_tf32(settings("none", True)) and not conv_tf32(settings("none", False))
    assert not conv_tf32(types.SimpleNamespace(allow_tf32=False))  # (a PyTorch without the newer API)
    x = types.SimpleNamespace(is_cuda=True, dtype=torch.float32)
    for allowed in (False, True):
        monkeypatch.setattr(stripe_triton, "conv_tf32", lambda allowed=allowed: allowed)
        assert stripe_triton.available(x) == (allowed and stripe_triton.triton is not None)
        assert stripe_triton.available(types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)) \
            == (stripe_triton.triton is not None)
