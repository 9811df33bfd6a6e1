"""compress::pix against a float64 reference written from the definition (DESIGN.md, seed 003)."""

import os
import shutil
import subprocess
import warnings
from decimal import Decimal

import numpy as np
import pytest
import torch

import compress
import kernels
from kernels import _ext
from kernels.pix import _pix_backward_op, _pix_op


def ref_pix(x, p, zeta, tau):
    """Loop over groups and channels; max with a strict '>' keeps the FIRST arg-max (as the official kernel), and a
    NaN is above every number (as torch.max: a group holding one has max NaN, its first NaN the arg-max)."""
    x, p = x.double(), p.double()
    B, C, H, W = x.shape
    ys, dmask = [], torch.zeros_like(x, dtype=torch.bool)
    for g in range(C // zeta):
        mx, idx = x[:, g * zeta].clone(), torch.full((B, H, W), g * zeta, dtype=torch.long)
        s = x[:, g * zeta].clone()
        for c in range(g * zeta + 1, (g + 1) * zeta):
            better = (x[:, c] > mx) | (x[:, c].isnan() & ~mx.isnan())
            mx = torch.where(better, x[:, c], mx)
            idx = torch.where(better, torch.full_like(idx, c), idx)
            s = s + x[:, c]
        pg = p[:, g, 0, 0].view(B, 1, 1)
        use_max = (p[:, g, 0, 0].float() < tau).view(B, 1, 1)
        ys.append(pg * torch.where(use_max, mx, s / zeta))
        for c in range(g * zeta, (g + 1) * zeta):
            dmask[:, c] = idx == c
    return torch.stack(ys, 1), dmask


def ref_pix_backward(dy, x, p, zeta, tau):
    x, p, dy = x.double(), p.double(), dy.double()
    B, C, H, W = x.shape
    _, first = ref_pix(x, p, zeta, tau)
    dx = torch.zeros_like(x)
    dp = torch.zeros_like(p)
    for g in range(C // zeta):
        pg = p[:, g, 0, 0].view(B, 1, 1)
        use_max = (p[:, g, 0, 0].float() < tau).view(B, 1, 1)
        grp = x[:, g * zeta:(g + 1) * zeta]
        for c in range(g * zeta, (g + 1) * zeta):
            dx[:, c] = torch.where(use_max & first[:, c], pg * dy[:, g], 0.0) + torch.where(use_max, 0.0, pg * dy[:, g] / zeta)
        sel = torch.where(use_max, grp.max(1).values, grp.mean(1))
        dp[:, g, 0, 0] = (sel * dy[:, g]).sum((1, 2))
    return dx, dp


def make(B=2, C=8, H=5, W=6, zeta=4, dtype=torch.float32, device="cpu", layout="contiguous", ties=False, seed=0,
         nans=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    if ties:  # many equal values inside a group: checks the first-arg-max rule
        x = (x * 1.5).round()
    if nans:  # NaN in about one group in five, at any channel of it: checks that NaN wins the max
        x[torch.rand(x.shape, generator=g) < 0.05] = float("nan")
    p = torch.rand(B, C // zeta, 1, 1, generator=g, dtype=torch.float64)
    p[0, 0] = 0.1  # make sure both branches appear
    p[-1, -1] = 0.9
    x, p = x.to(device, dtype), p.to(device, dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "noncontiguous":
        x = torch.cat([x, x], 3)[..., ::2]
        assert not x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last)
    return x, p


TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rel_err(a, b):
    """Relative error of `a` against the reference `b`, which must hold NaN at the same positions (compared there)."""
    a, b = a.double(), b.double()
    assert torch.equal(a.isnan(), b.isnan()), f"NaN at {a.isnan().sum()} positions, the reference's at {b.isnan().sum()}"
    a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_all(device, dtype, layout, ties, nans=False):
    x, p = make(dtype=dtype, device=device, layout=layout, ties=ties, nans=nans)
    x.requires_grad_(True)
    p.requires_grad_(True)
    y = kernels.pix(x, p, 4, 0.5)
    yr, _ = ref_pix(x.detach().cpu(), p.detach().cpu(), 4, 0.5)
    assert y.dtype == dtype and y.shape == yr.shape
    if layout == "channels_last":
        assert y.is_contiguous(memory_format=torch.channels_last)
    assert rel_err(y.cpu(), yr) < TOL[dtype]
    dy = torch.randn(y.shape, dtype=torch.float64)
    if nans:  # a NaN gradient reaches its group's arg-max channel only in the max branch
        dy[0, 0, 1, 2] = dy[-1, -1, 3, 4] = float("nan")
    dy = dy.to(device, dtype)
    dx, dp = torch.autograd.grad(y, (x, p), dy)
    dxr, dpr = ref_pix_backward(dy.cpu(), x.detach().cpu(), p.detach().cpu(), 4, 0.5)
    assert rel_err(dx.cpu(), dxr) < TOL[dtype]
    assert rel_err(dp.cpu(), dpr) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "noncontiguous"])
def test_matches_reference_cpu(dtype, layout):
    check_all("cpu", dtype, layout, ties=False)


def test_first_argmax_with_ties():
    check_all("cpu", torch.float32, "contiguous", ties=True)
    x, p = make(ties=True)
    p.fill_(0.1)
    x.requires_grad_(True)
    dx, = torch.autograd.grad(kernels.pix(x, p, 4).sum(), x)
    # exactly one channel per group and position receives the gradient in the max branch
    assert torch.equal((dx != 0).unflatten(1, (2, 4)).sum(2), torch.ones(2, 2, 5, 6, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_nan_wins_the_max_cpu(dtype, layout):
    """A NaN in a group: its max is NaN (the C++ max kept an earlier finite value: 0.3 for p = 0.1 and the group
    (1, NaN, 2, 3), where PyTorch's amax and the 16-bit path gave NaN); its first NaN takes the max branch's
    gradient, and a NaN upstream gradient stays on the arg-max channel (it was multiplied into every channel)."""
    check_all("cpu", dtype, layout, ties=False, nans=True)
    x = torch.tensor([1.0, float("nan"), 2.0, float("nan")], dtype=dtype).view(1, 4, 1, 1).requires_grad_(True)
    p = torch.full((1, 1, 1, 1), 0.1, dtype=dtype)
    y = kernels.pix(x, p, 4)
    assert y.isnan().all()
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert dx.flatten().tolist() == [0.0, p.item(), 0.0, 0.0]


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("library", [True, False])
def test_p_equal_tau_takes_mean(layout, library, monkeypatch):
    """p == tau takes the mean branch: in both layouts, with the C++ CPU kernels and with the PyTorch fallback."""
    if not library:
        _no_cpu_lib(monkeypatch)
    x, p = make(layout=layout)
    p.fill_(0.5)
    y = kernels.pix(x, p, 4, 0.5)
    torch.testing.assert_close(y, 0.5 * x.unflatten(1, (2, 4)).mean(2))
    y = kernels.pix(x, p.fill_(0.25), 4, 0.25)
    torch.testing.assert_close(y, 0.25 * x.unflatten(1, (2, 4)).mean(2))


@pytest.mark.parametrize("dtype,tau", [(torch.bfloat16, 0.7), (torch.float16, 0.1), (torch.float32, 0.3)])
def test_pix_reference_takes_the_ops_branch_where_p_rounds_onto_tau(dtype, tau):
    """pix_reference (PyTorch ops) computes the op's function: p = tau rounded to x's dtype compares against tau in
    float32, as the op and the reference above do (it compared in x's dtype, taking the mean where the op took the
    max); also off tau and in float32 the two agree to rounding."""
    x, _ = make()
    x = x.to(dtype)
    for p in (torch.full((2, 2, 1, 1), tau), torch.rand(2, 2, 1, 1, generator=torch.Generator().manual_seed(1))):
        p = p.to(dtype)
        want = ref_pix(x, p, 4, tau)[0]
        tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
        torch.testing.assert_close(kernels.pix_reference(x, p, 4, tau).double(), want, **tol)
        torch.testing.assert_close(kernels.pix(x, p, 4, tau).double(), want, **tol)
        # p of another float dtype is cast to x's by both ("the same function"; pix_reference refused it)
        assert torch.equal(kernels.pix_reference(x, p.double(), 4, tau), kernels.pix_reference(x, p, 4, tau))
        assert torch.equal(kernels.pix(x, p.double(), 4, tau), kernels.pix(x, p, 4, tau))


def test_gradcheck():
    x, p = make(B=2, C=6, H=3, W=4, zeta=3, dtype=torch.float64)
    x.requires_grad_(True)
    p.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: kernels.pix(a, b, 3, 0.5), (x, p))


def test_empty_batch():
    x, p = make(B=1)
    x, p = x[:0].requires_grad_(True), p[:0].requires_grad_(True)
    y = kernels.pix(x, p, 4)
    assert y.shape == (0, 2, 5, 6)
    y.sum().backward()
    assert x.grad.shape == x.shape and p.grad.shape == p.shape


def test_errors():
    x, p = make()
    with pytest.raises(ValueError, match=r"compress::pix: the channels of tensor 'x' \(8\) are not divisible by zeta=3"):
        kernels.pix(x, p, 3)
    with pytest.raises(ValueError, match=r"compress::pix: tensor 'p' must have shape \(2, 2, 1, 1\)"):
        kernels.pix(x, p[:, :1], 4)
    with pytest.raises(ValueError, match=r"compress::pix: tensor 'x' must be 4-D"):
        kernels.pix(x[0], p, 4)
    with pytest.raises(TypeError, match=r"compress::pix: tensor 'x' has dtype torch.int64"):
        kernels.pix(x.long(), p, 4)
    for zeta in (4.0, 3.7, True):  # int() would have run 3.7 as 3 and True as 1
        with pytest.raises(TypeError, match=rf"pix: zeta must be an int, got {zeta}"):
            kernels.pix(x, p, zeta)
    with pytest.raises(ValueError, match=r"compress::pix: tensor 'p' is on meta but 'x' is on cpu"):
        kernels.pix(x, p.to("meta"), 4)
    with pytest.raises(ValueError, match=r"compress::pix_backward: tensor 'grad' must have shape \(2, 2, 5, 6\)"):
        torch.ops.compress.pix_backward(torch.randn(2, 2, 1, 1), x, p, 4, 0.5)  # would broadcast
    with pytest.raises(ValueError, match=r"residual_relu: 'identity' must have the shape of 'out' \(2, 8, 5, 6\)"):
        kernels.residual_relu(x.clone(), x[:, :, :, :1])  # would broadcast
    for tau in (float("nan"), -0.1, 1.5, True, "0.5"):  # NaN took the mean everywhere without a word
        with pytest.raises(ValueError, match=rf"pix: tau={tau!r} must be a number in \[0, 1\]"):
            kernels.pix(x, p, 4, tau)
    for tau in (torch.tensor(0.3), np.float32(0.3), Decimal("0.3")):  # numbers of other kinds: as float(tau)
        assert torch.equal(kernels.pix(x, p, 4, tau), kernels.pix(x, p, 4, float(tau)))


def test_residual_relu_of_a_leaf_that_requires_grad():
    """A leaf cannot be overwritten while autograd records: residual_relu computes relu(out + identity) anew
    (PyTorch's in-place error before), with the same values and gradients as the float64 reference."""
    out, identity = torch.randn(2, 8, 5, 6, requires_grad=True), torch.randn(2, 8, 5, 6)
    y = kernels.residual_relu(out, identity)
    ref = torch.relu(out.detach().double() + identity.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6)
    y.sum().backward()
    torch.testing.assert_close(out.grad, (ref > 0).float())
    big = torch.randn(2, 16, 5, 6, requires_grad=True)  # a view of a leaf: likewise
    y = kernels.residual_relu(big[:, :8], identity)
    torch.testing.assert_close(y.double(), torch.relu(big[:, :8].detach().double() + identity.double()))
    y.sum().backward()
    assert big.grad[:, 8:].abs().sum() == 0 and big.grad[:, :8].sum() > 0


def test_opcheck_cpu():
    x, p = make(B=2, C=8, H=3, W=3)
    for xx in (x, x.contiguous(memory_format=torch.channels_last)):
        torch.library.opcheck(_pix_op, (xx.requires_grad_(True), p.clone().requires_grad_(True), 4, 0.5))
        dy = torch.randn(2, 2, 3, 3)
        torch.library.opcheck(_pix_backward_op, (dy, xx.detach(), p, 4, 0.5))


def test_autocast_bf16_and_compile():
    x, p = make()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = kernels.pix(x.bfloat16(), p, 4)  # fp32 p is cast to x's dtype
    assert y.dtype == torch.bfloat16
    assert rel_err(y, ref_pix(x.bfloat16().double(), p.bfloat16().double(), 4, 0.5)[0]) < 1e-2
    f = torch.compile(lambda a, b: kernels.pix(a, b, 4).square().sum(), backend="aot_eager", fullgraph=True)
    xa = x.clone().requires_grad_(True)
    f(xa, p).backward()
    xb = x.clone().requires_grad_(True)
    kernels.pix(xb, p, 4).square().sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad)


# ----------------------------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "noncontiguous"])
@pytest.mark.parametrize("ties,nans", [(False, False), (True, False), (False, True)])
def test_matches_reference_cuda(dtype, layout, ties, nans):
    assert _ext.load() is not None, "CUDA extension failed to build"
    check_all("cuda", dtype, layout, ties, nans)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(3, 16, 7, 7), (2, 32, 8, 8), (2, 8, 1, 37), (4, 12, 14, 14)])
@pytest.mark.parametrize("zeta", [2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_cuda_shapes(shape, zeta, layout):
    B, C, H, W = shape
    x, p = make(B, C, H, W, zeta, device="cuda", layout=layout, seed=1)
    x.requires_grad_(True)
    p.requires_grad_(True)
    y = kernels.pix(x, p, zeta)
    yr, _ = ref_pix(x.detach().cpu(), p.detach().cpu(), zeta, 0.5)
    assert rel_err(y.cpu(), yr) < 1e-5
    dy = torch.randn_like(y)
    dx, dp = torch.autograd.grad(y, (x, p), dy)
    dxr, dpr = ref_pix_backward(dy.cpu(), x.detach().cpu(), p.detach().cpu(), zeta, 0.5)
    assert rel_err(dx.cpu(), dxr) < 1e-5 and rel_err(dp.cpu(), dpr) < 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 64, 7, 7, 4), (3, 32, 5, 5, 2), (2, 36, 7, 7, 4), (1, 32, 3, 7, 1)])
@pytest.mark.parametrize("switch", ["1", "0"])
def test_cuda_staged_and_direct_paths(monkeypatch, dtype, shape, switch):
    """16-bit odd planes in whole 8-plane chunks take the warp-staged NCHW kernels; channels_last planes of at
    most 64 positions with a batch that fills the device write dp without a second launch. Both, and what they
    replace (switch "0"; and (2, 36, 7, 7, 4): 18 planes, not whole chunks), match the reference in pix (dx + dp)
    and in pix_squeeze (its dp-only and dx-with-pooling-gradient backward passes)."""
    assert _ext.load() is not None, "CUDA extension failed to build"
    monkeypatch.setenv("COMPRESS_PIX_STAGE", switch)
    monkeypatch.setenv("COMPRESS_PIX_CL_DIRECT", switch)
    B, C, H, W, zeta = shape
    big = 2 * torch.cuda.get_device_properties(0).multi_processor_count + 1
    for layout, b in (("contiguous", B), ("channels_last", big)):
        for ties, nans in ((False, False), (True, False), (False, True)):
            x, p = make(b, C, H, W, zeta, dtype, "cuda", layout, ties=ties, seed=2, nans=nans)
            x.requires_grad_(True)
            p.requires_grad_(True)
            y = kernels.pix(x, p, zeta)
            yr, _ = ref_pix(x.detach().cpu(), p.detach().cpu(), zeta, 0.5)
            assert rel_err(y.cpu(), yr) < TOL[dtype]
            dy = torch.randn(y.shape, dtype=torch.float64).to("cuda", dtype)
            dx, dp = torch.autograd.grad(y, (x, p), dy)
            dxr, dpr = ref_pix_backward(dy.cpu(), x.detach().cpu(), p.detach().cpu(), zeta, 0.5)
            assert rel_err(dx.cpu(), dxr) < TOL[dtype] and rel_err(dp.cpu(), dpr) < TOL[dtype]
        check_squeeze(b, C, H, W, zeta, dtype, "cuda", layout, TOL[dtype])


@pytest.mark.cuda
def test_opcheck_cuda():
    x, p = make(device="cuda")
    for xx in (x, x.contiguous(memory_format=torch.channels_last)):
        torch.library.opcheck(_pix_op, (xx.requires_grad_(True), p.clone().requires_grad_(True), 4, 0.5))
        torch.library.opcheck(_pix_backward_op, (torch.randn(2, 2, 5, 6, device="cuda"), xx.detach(), p, 4, 0.5))


# ------------------------------------------------------------------------------------------- pix_squeeze
def ref_squeeze(x, weight, zeta, tau, dtype):
    """The PiX block in float64 autograd ops, from the definition: p = sigmoid(mean_hw(x) @ W^T), then the fusion.
    p is rounded to `dtype` (as the op hands it to the fusion) with a straight-through gradient. Low-precision
    inputs tie often inside a group: the max branch's gradient goes to the first arg-max (amax would split it)."""
    p = torch.sigmoid(x.mean((2, 3)) @ weight.flatten(1).t())[:, :, None, None]
    p = p + (p.to(dtype).double() - p).detach()
    xg = x.unflatten(1, (x.shape[1] // zeta, zeta))
    first_max = xg.gather(2, xg.argmax(2, keepdim=True)).squeeze(2)  # ties: the FIRST arg-max gets the gradient
    return p * torch.where(p < tau, first_max, xg.mean(2))


def make_squeeze(B, C, H, W, zeta, dtype, device, layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C, H, W, generator=g, dtype=torch.float64) + 0.5  # mean far from 0: the predictor matters
    w = torch.randn(C // zeta, C, 1, 1, generator=g, dtype=torch.float64) * (2.0 / C**0.5)
    x = x.to(device, dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    return x.requires_grad_(True), w.to(device).float().requires_grad_(True)


def check_squeeze(B, C, H, W, zeta, dtype, device, layout, tol):
    x, w = make_squeeze(B, C, H, W, zeta, dtype, device, layout)
    y = kernels.pix_squeeze(x, w, zeta)
    assert y.dtype == dtype and y.shape == (B, C // zeta, H, W)
    assert y.is_contiguous(memory_format=torch.channels_last if layout == "channels_last" else torch.contiguous_format)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    dx, dw = torch.autograd.grad(y, (x, w), dy.to(device, dtype))
    xr = x.detach().cpu().double().requires_grad_(True)
    wr = w.detach().cpu().double().requires_grad_(True)
    yr = ref_squeeze(xr, wr, zeta, 0.5, dtype)
    dxr, dwr = torch.autograd.grad(yr, (xr, wr), dy)
    p = torch.sigmoid(xr.mean((2, 3)) @ wr.flatten(1).t())
    assert (p < 0.5).any() and (p >= 0.5).any(), "both branches must appear"
    assert rel_err(y.cpu(), yr) < tol
    assert rel_err(dx.cpu(), dxr) < tol
    assert rel_err(dw.cpu(), dwr) < tol
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    assert dx.is_contiguous(memory_format=fmt) and dw.dtype == w.dtype


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("zeta", [2, 4])
def test_pix_squeeze_matches_reference_cpu(layout, zeta):
    check_squeeze(3, 16, 5, 7, zeta, torch.float32, "cpu", layout, 1e-5)


def test_pix_squeeze_gradcheck_and_opcheck_cpu():
    x, w = make_squeeze(2, 8, 3, 4, 4, torch.float64, "cpu", "contiguous", seed=3)
    assert torch.autograd.gradcheck(lambda a, b: kernels.pix_squeeze(a, b, 4), (x, w.double()))
    from kernels.pix import _pix_squeeze_backward_op, _pix_squeeze_op

    x, w = make_squeeze(2, 8, 3, 4, 4, torch.float32, "cpu", "channels_last")
    torch.library.opcheck(_pix_squeeze_op, (x, w, 4, 0.5))
    pooled = x.detach().mean((2, 3))
    torch.library.opcheck(_pix_squeeze_backward_op, (torch.randn(2, 2, 3, 4), x.detach(), w.detach(), pooled, 4, 0.5))


def test_pix_squeeze_errors():
    x, w = make_squeeze(2, 8, 3, 4, 4, torch.float32, "cpu", "contiguous")
    with pytest.raises(ValueError, match=r"compress::pix_squeeze: tensor 'weight' must have shape \(2, 8, 1, 1\)"):
        kernels.pix_squeeze(x, w[:1], 4)
    with pytest.raises(ValueError, match=r"compress::pix_squeeze: the channels of tensor 'x' \(8\) are not divisible"):
        kernels.pix_squeeze(x, w, 3)
    with pytest.raises(TypeError, match=r"pix_squeeze: zeta must be an int, got 2.9"):
        kernels.pix_squeeze(x, w, 2.9)
    with pytest.raises(ValueError, match=r"pix_squeeze: tau=nan must be a number in \[0, 1\]"):
        kernels.pix_squeeze(x, w, 4, float("nan"))
    with pytest.raises(ValueError, match=r"compress::pix_squeeze: tensor 'weight' is on meta but 'x' is on cpu"):
        kernels.pix_squeeze(x, w.to("meta"), 4)
    with pytest.raises(TypeError, match=r"compress::pix_squeeze: 'weight' must be a Tensor, got NoneType"):
        kernels.pix_squeeze(x, None, 4)  # (an AttributeError from the eager shortcut before)
    backward, dy = torch.ops.compress.pix_squeeze_backward, torch.randn(2, 2, 3, 4)
    for pooled in (torch.randn(2, 50_000_000), torch.randn(3, 8), torch.randn(16), x.mean((2, 3)).double()):
        with pytest.raises(ValueError, match=r"pix_squeeze_backward: tensor 'pooled' must be the forward's pool of x, "
                                             r"shape \(2, 8\) torch.float32"):
            backward(dy, x, w, pooled, 4, 0.5)  # (the C++ predictor read past the weight: a segfault)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("shape", [(3, 16, 7, 7, 4), (2, 64, 8, 8, 4), (2, 64, 14, 14, 2), (2, 24, 1, 37, 3)])
def test_pix_squeeze_cuda(dtype, layout, shape):
    assert _ext.load() is not None, "CUDA extension failed to build"
    B, C, H, W, zeta = shape
    check_squeeze(B, C, H, W, zeta, dtype, "cuda", layout, TOL[dtype])


@pytest.mark.cuda
def test_pix_squeeze_opcheck_cuda():
    from kernels.pix import _pix_squeeze_backward_op, _pix_squeeze_op

    for layout in ("contiguous", "channels_last"):
        x, w = make_squeeze(2, 32, 5, 6, 4, torch.float32, "cuda", layout)
        torch.library.opcheck(_pix_squeeze_op, (x, w, 4, 0.5))
        pooled = x.detach().mean((2, 3))
        dy = torch.randn(2, 8, 5, 6, device="cuda")
        torch.library.opcheck(_pix_squeeze_backward_op, (dy, x.detach(), w.detach(), pooled, 4, 0.5))


# ------------------------------------------------------------------------------ C++ CPU kernels (kernels/_cpu.py)
def _no_cpu_lib(monkeypatch):
    """Make kernels._cpu.lib() return None (as without a compiler) for one test."""
    from kernels import _cpu

    monkeypatch.setattr(_cpu, "_state", {"lib": None})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("shape", [(3, 16, 5, 7, 4), (2, 24, 3, 11, 3), (1, 16, 6, 6, 1), (2, 32, 9, 9, 2),
                                   (2, 16, 28, 28, 4),  # a map of more than one vector block (ResNet-50's 56x56)
                                   (2, 64, 4, 5, 8), (2, 48, 1, 37, 16)])
def test_cpu_kernels_match_reference(dtype, layout, shape):
    """The C++ paths (pix_squeeze in one call, pix's fusion) against the float64 definitions, forward and backward
    (the CPU backward recomputes p with the forward's GEMV), all zeta specialisations and tails; and the eager
    inference fast path equals the op."""
    from kernels import _cpu
    from kernels.pix import _c_squeeze_ok

    if _cpu.lib() is None:
        pytest.skip("no C++ compiler")
    B, C, H, W, zeta = shape
    tol = 2e-6 if dtype == torch.float32 else 1e-12
    x, w = make_squeeze(B, C, H, W, zeta, dtype, "cpu", layout, seed=B * C + H + W + zeta)
    w = w.detach().to(dtype).requires_grad_(True)
    assert _c_squeeze_ok(x.detach())
    y = kernels.pix_squeeze(x, w, zeta)
    assert y.dtype == dtype and y.is_contiguous(
        memory_format=torch.channels_last if layout == "channels_last" else torch.contiguous_format)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    dx, dw = torch.autograd.grad(y, (x, w), dy.to(dtype))
    xr, wr = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    yr = ref_squeeze(xr, wr, zeta, 0.5, dtype)
    dxr, dwr = torch.autograd.grad(yr, (xr, wr), dy)
    p = torch.sigmoid(xr.mean((2, 3)) @ wr.flatten(1).t())
    assert (p < 0.5).any() and (p >= 0.5).any(), "both branches must appear"
    assert rel_err(y, yr) < tol and rel_err(dx, dxr) < tol and rel_err(dw, dwr) < tol
    with torch.inference_mode():
        assert torch.equal(kernels.pix_squeeze(x.detach(), w.detach(), zeta), y.detach())
        other = torch.float32 if dtype == torch.float64 else torch.float64  # a weight of another float dtype
        assert rel_err(kernels.pix_squeeze(x.detach(), w.detach().to(other), zeta), y.detach()) < tol

    xp, p = make(B=B, C=C, H=H, W=W, zeta=zeta, dtype=dtype, layout=layout, seed=zeta)
    yp = kernels.pix(xp, p, zeta, 0.5)
    assert rel_err(yp, ref_pix(xp, p, zeta, 0.5)[0]) < tol
    assert yp.is_contiguous(memory_format=torch.channels_last if layout == "channels_last" else torch.contiguous_format)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_cpu_kernels_fall_back_without_the_library(monkeypatch, layout):
    """Without the C++ library (no compiler, COMPRESS_KERNELS_NO_CPU=1) the PyTorch path matches the float64
    definitions (pix and pix_squeeze, forward and backward) and gives the C++ path's results."""
    x, w = make_squeeze(2, 16, 5, 6, 4, torch.float32, "cpu", layout)
    y = kernels.pix_squeeze(x, w, 4)
    dx, dw = torch.autograd.grad(y.square().sum(), (x, w))
    _no_cpu_lib(monkeypatch)
    y2 = kernels.pix_squeeze(x, w, 4)
    dx2, dw2 = torch.autograd.grad(y2.square().sum(), (x, w))
    torch.testing.assert_close(y2, y)
    torch.testing.assert_close(dx2, dx)
    torch.testing.assert_close(dw2, dw)
    xr, wr = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    yr = ref_squeeze(xr, wr, 4, 0.5, torch.float32)
    dxr, dwr = torch.autograd.grad(yr.square().sum(), (xr, wr))
    assert rel_err(y2, yr) < 1e-5 and rel_err(dx2, dxr) < 1e-5 and rel_err(dw2, dwr) < 1e-5
    x, p = make(layout=layout)
    x.requires_grad_(True)
    y = kernels.pix(x, p, 4, 0.5)
    assert y.is_contiguous(memory_format=torch.channels_last if layout == "channels_last" else torch.contiguous_format)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    yr, _ = ref_pix(x.detach().double(), p.double(), 4, 0.5)
    (dx,) = torch.autograd.grad(y, x, dy)
    dxr, _ = ref_pix_backward(dy.double(), x.detach().double(), p.double(), 4, 0.5)
    assert rel_err(y, yr) < 1e-5 and rel_err(dx, dxr) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("zeta", [2, 3, 4])
def test_cpu_kernels_threaded_match_reference(dtype, layout, B, zeta):
    """Shapes past the C++ kernels' threading threshold (32768 elements of x; G * C * B for the predictor) with 1
    and 2 torch threads (the kernels run on torch's OpenMP threads) against the float64 definitions. Odd H*W: the
    channels_last shares of positions split inside a sample and its 32-position pool chunks."""
    from kernels import _cpu

    if _cpu.lib() is None:
        pytest.skip("no C++ compiler")
    C, H, W = 128 * zeta, 11, 13
    tol = 2e-6 if dtype == torch.float32 else 1e-12
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x, w = make_squeeze(B, C, H, W, zeta, dtype, "cpu", layout, seed=B + zeta)
    x, w = x.detach(), w.detach().to(dtype)
    yr = ref_squeeze(x.double(), w.double(), zeta, 0.5, dtype)
    p = torch.sigmoid(x.double().mean((2, 3)) @ w.double().flatten(1).t())
    assert (p < 0.5).any() and (p >= 0.5).any(), "both branches must appear"
    xp, pp = make(B=B, C=C, H=H, W=W, zeta=zeta, dtype=dtype, layout=layout, seed=zeta)
    ypr = ref_pix(xp, pp, zeta, 0.5)[0]
    threads = torch.get_num_threads()
    got = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            with torch.no_grad():
                y = kernels.pix_squeeze(x, w, zeta)
            yp = kernels.pix(xp, pp, zeta, 0.5)
            assert y.dtype == yp.dtype == dtype
            assert y.is_contiguous(memory_format=fmt) and yp.is_contiguous(memory_format=fmt)
            assert rel_err(y, yr) < tol, n
            assert rel_err(yp, ypr) < tol, n
            got[n] = y, yp
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[1][1], got[2][1])  # the fusion: every output element is one thread's, same code
    if layout == "contiguous":  # NCHW: each row's pool too; channels_last adds per-thread pool sums (reordered)
        assert torch.equal(got[1][0], got[2][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_predictor_tiles_agree_with_the_batch(dtype):
    """The C++ predictor tiles samples by 4 and, for the rest, groups by 8 (then 1): p of a sample is the same bits
    whether it comes in a batch of 5 (one 4-sample tile, one 1 x 8 + 1 x 1 remainder) or alone, and matches the
    float64 sigmoid(pooled @ W^T). G = 13 and C = 77 leave tails in both the groups and the 32-lane dot."""
    from kernels import _cpu
    from kernels.pix import _predict_c

    if _cpu.lib() is None:
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(7)
    B, C, G = 5, 77, 13
    pooled = torch.rand(B, C, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(G, C, 1, 1, generator=g, dtype=torch.float64) / C**0.5).to(dtype)
    x = torch.empty(0, dtype=dtype)  # only its dtype matters to _predict_c
    p, _ = _predict_c(pooled, w, x)
    ref = torch.sigmoid(pooled.double() @ w.double().flatten(1).t())
    assert rel_err(p, ref) < (2e-6 if dtype == torch.float32 else 1e-12)
    for b in range(B):
        alone, _ = _predict_c(pooled[b : b + 1], w, x)
        assert torch.equal(alone, p[b : b + 1]), b


def test_cpu_kernels_use_torchs_threads():
    """The library links libgomp.so.1, which binds to the libgomp that torch loaded: one OpenMP runtime, whose
    thread count torch.set_num_threads sets."""
    from kernels import _cpu

    if (lib := _cpu.lib()) is None:
        pytest.skip("no C++ compiler")
    if lib.compress_omp_max_threads() == 0:
        pytest.skip("the C++ kernels were built without OpenMP")
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3, 1):
            torch.set_num_threads(n)
            assert lib.compress_omp_max_threads() == n
    finally:
        torch.set_num_threads(threads)
    if os.path.exists("/proc/self/maps"):  # one libgomp.so.1 (others, vendored under other sonames, are apart)
        with open("/proc/self/maps") as f:
            gomp = {ln.split()[-1] for ln in f if os.path.basename(ln.split()[-1]).startswith("libgomp.so")}
        assert len(gomp) <= 1, f"two libgomp.so.1 loaded: {sorted(gomp)}"


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_squeeze_of_lazily_negated_and_zero_tensors_computes_their_values(layout):
    """A lazily negated view (torch._neg_view, as a conjugate's imaginary part gives) keeps the un-negated numbers
    in memory, and a ZeroTensor has none: the eager path must not hand their memory to the C++ kernel (it read the
    un-negated x, and crashed on a ZeroTensor weight)."""
    x, w = make_squeeze(2, 8, 5, 5, 4, torch.float32, "cpu", layout)
    x, w = x.detach(), w.detach()
    with torch.no_grad():
        got = kernels.pix_squeeze(torch._neg_view(x), torch._neg_view(w), 4)
        zero_w = kernels.pix_squeeze(x, torch._efficientzerotensor(w.shape), 4)
    assert rel_err(got, ref_squeeze(-x.double(), -w.double(), 4, 0.5, torch.float32)) < 2e-6
    assert rel_err(zero_w, ref_squeeze(x.double(), torch.zeros_like(w, dtype=torch.float64), 4, 0.5,
                                       torch.float32)) < 2e-6


def _fast_cpu_builds(monkeypatch, tmp_path):
    """A fresh process's view of kernels._cpu with its cache in tmp_path, built at -O0 (2 s, not 15-50)."""
    from kernels import _cpu

    monkeypatch.setenv("COMPRESS_KERNELS_CACHE", str(tmp_path))
    monkeypatch.setattr(_cpu, "SERIAL_FLAGS", ["-O0", "-shared", "-fPIC"])
    monkeypatch.setattr(_cpu, "FLAGS", [*_cpu.SERIAL_FLAGS, "-fopenmp"])
    monkeypatch.setattr(_cpu, "_state", {})
    return _cpu


def test_cpu_library_falls_back_to_a_serial_build(monkeypatch, tmp_path, capfd):
    """Where the OpenMP build fails (here: an unknown flag), the library is built without it (one warning), and
    the failed build is remembered, not retried by the next process."""
    _cpu = _fast_cpu_builds(monkeypatch, tmp_path)
    if _cpu._compiler()[0] is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setattr(_cpu, "FLAGS", [*_cpu.FLAGS, "-fno-such-openmp-flag"])
    with pytest.warns(RuntimeWarning, match="built without OpenMP"):
        lib = _cpu.lib()
    assert lib is not None and lib.compress_omp_max_threads() == 0
    failed = list((tmp_path / "cpu").glob("*.so.failed"))
    assert len(failed) == 1 and "no-such-openmp-flag" in failed[0].read_text()
    x, w = make_squeeze(2, 64, 9, 9, 4, torch.float32, "cpu", "channels_last")
    x, w = x.detach(), w.detach()
    y = torch.empty(2, 16, 9, 9).contiguous(memory_format=torch.channels_last)
    pooled = torch.empty(2, 64)  # called directly: kernels.pix keeps the functions of the library it met first
    assert lib.pix_squeeze_cl_f32(x.data_ptr(), w.data_ptr(), pooled.data_ptr(), y.data_ptr(), 2, 64, 4, 81, 0.5) == 0
    assert rel_err(y, ref_squeeze(x.double(), w.double(), 4, 0.5, torch.float32)) < 2e-6
    capfd.readouterr()
    monkeypatch.setattr(_cpu, "_state", {})  # a new process: both builds are cached (the failed one as failed)
    with pytest.warns(RuntimeWarning, match="built without OpenMP"):
        assert _cpu.lib() is not None
    assert "compiling" not in capfd.readouterr().err
    monkeypatch.setattr(_cpu, "_compiler", lambda: (None, "no C++ compiler found"))  # and then no compiler: the
    monkeypatch.setattr(_cpu, "_state", {})  # serial library, the reason and the remembered failure named
    with pytest.warns(RuntimeWarning, match=r"without OpenMP \(the OpenMP build is not in the cache, and no C\+\+ "
                                            r"compiler found\); they run single-threaded \(delete .*\.failed to try"):
        assert _cpu.lib().compress_omp_max_threads() == 0


def test_cpu_library_rebuilds_a_damaged_cache_and_forgets_a_killed_compiler(monkeypatch, tmp_path, capfd):
    """A cached library damaged on disk (truncated: dlopen would crash the process with SIGBUS; its tail zeroed:
    SIGSEGV), empty, or without its recorded digest (built by an older version) is built again, with
    OpenMP, not loaded and not replaced by the serial build; a compiler killed by a signal (the OOM killer) falls
    back to the serial build for this process without remembering the OpenMP build as failed."""
    _cpu = _fast_cpu_builds(monkeypatch, tmp_path)
    if _cpu._compiler()[0] is None:
        pytest.skip("no C++ compiler")
    assert _cpu.lib().compress_omp_max_threads() > 0
    (so,) = (tmp_path / "cpu").glob("*.so")
    assert _cpu._intact(str(so))
    whole = so.read_bytes()
    half = len(whole) // 2
    for damaged in (whole[:half], whole[:half] + bytes(len(whole) - half), b"", None):
        if damaged is None:  # whole, but without its digest
            damaged = whole
            (tmp_path / "cpu" / f"{so.name}.sha256").unlink()
        (tmp_path / "damaged").write_bytes(damaged)
        os.replace(tmp_path / "damaged", so)  # (writing into `so` itself would break this process's mapping of it)
        assert not _cpu._intact(str(so))
        capfd.readouterr()
        monkeypatch.setattr(_cpu, "_state", {})  # a new process
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback warning: the OpenMP build is made again
            assert _cpu.lib().compress_omp_max_threads() > 0
        assert "compiling" in capfd.readouterr().err and _cpu._intact(str(so))
    so.unlink()
    real_run = subprocess.run

    def killed(cmd, **kwargs):  # the OpenMP compile dies of SIGKILL
        if "-fopenmp" in cmd:
            return subprocess.CompletedProcess(cmd, -9, "", "c++: fatal error: Killed signal terminated program cc1plus")
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(_cpu.subprocess, "run", killed)
    monkeypatch.setattr(_cpu, "_state", {})
    with pytest.warns(RuntimeWarning, match="built without OpenMP .*Killed signal"):
        assert _cpu.lib().compress_omp_max_threads() == 0
    assert not list((tmp_path / "cpu").glob("*.failed"))  # the next process tries OpenMP again


def test_cpu_library_warns_about_an_unusable_cxx(monkeypatch, tmp_path):
    """A CXX that is not an executable: one warning naming the compiler used instead; with none on PATH either
    (and no library built before), one warning (not a second one saying to set CXX)."""
    from kernels import _cpu

    monkeypatch.setenv("COMPRESS_KERNELS_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setattr(_cpu.shutil, "which", lambda c: "/usr/bin/g++" if c == "g++" else None)
    assert _cpu._compiler() == (
        ["/usr/bin/g++"], "compress kernels: CXX='/nonexistent/g++' is not an executable compiler; using /usr/bin/g++")
    monkeypatch.setattr(_cpu.shutil, "which", lambda c: None)
    monkeypatch.setattr(_cpu, "_state", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _cpu.lib() is None
    assert [str(w.message) for w in caught] == [
        "compress kernels: the C++ CPU kernels are unavailable (CXX='/nonexistent/g++' is not an executable compiler, "
        "and no c++, g++ or clang++ is on PATH); CPU tensors use the slower PyTorch path."]


def test_cpu_library_takes_a_cxx_of_several_words(monkeypatch, tmp_path):
    """CXX="ccache g++" (a launcher, then the compiler) is split as a shell would: it was taken as one missing
    executable's name, with a warning, and the build used another compiler."""
    from kernels import _cpu

    monkeypatch.setenv("CXX", "env 'g++'")
    monkeypatch.setenv("COMPRESS_KERNELS_CACHE", str(tmp_path))
    env = shutil.which("env")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cxx, _ = _cpu._compiler()
    assert cxx == [env, "g++"]
    calls = []
    monkeypatch.setattr(_cpu.subprocess, "run", lambda argv, **kw: calls.append(argv) or
                        subprocess.CompletedProcess(argv, 1, "", "g++: error: stopped here"))
    with pytest.raises(_cpu._CompileError, match=f"^{env} g\\+\\+ failed: g\\+\\+: error: stopped here"):
        _cpu._build(_cpu.SERIAL_FLAGS, lambda: cxx)
    assert calls[0][:3] == [env, "g++", _cpu.SERIAL_FLAGS[0]]
    monkeypatch.setenv("CXX", "g++ 'oops")  # an unclosed quote: a CXX that is no command (shlex's error before)
    cxx, note = _cpu._compiler()
    assert cxx is not None and note.startswith("compress kernels: CXX=\"g++ 'oops\" is not an executable compiler; using ")


def test_kernel_settings_read_on_off_values_and_expand_the_cache_path(monkeypatch):
    """COMPRESS_KERNELS_NO_CPU=false (or no, off, 0, empty) leaves the kernels on (any value but 0 turned them off);
    another word is refused naming the variable; a quoted ~ in COMPRESS_KERNELS_CACHE is the home folder (it made
    a folder named ~ in the working directory)."""
    from kernels import _cpu

    for value, on in (("1", True), ("YES", True), (" true ", True), ("on", True), ("false", False), ("no", False),
                      ("OFF", False), ("0", False), ("", False)):
        monkeypatch.setenv("COMPRESS_KERNELS_NO_CPU", value)
        assert _cpu.env_flag("COMPRESS_KERNELS_NO_CPU") is on, value
    monkeypatch.setenv("COMPRESS_KERNELS_NO_CPU", "maybe")
    with pytest.raises(ValueError, match=r"COMPRESS_KERNELS_NO_CPU='maybe': give 1 \(or true, yes, on\) to set it"):
        _cpu.env_flag("COMPRESS_KERNELS_NO_CPU")
    monkeypatch.setenv("COMPRESS_KERNELS_CACHE", "~/kernel-cache")
    assert _cpu.cache_root() == os.path.join(os.path.expanduser("~"), "kernel-cache")


def test_cpu_library_missing_compiler_warns_once(monkeypatch, tmp_path):
    from kernels import _cpu

    monkeypatch.setenv("COMPRESS_KERNELS_CACHE", str(tmp_path))  # (no library built before)
    monkeypatch.setattr(_cpu, "_state", {})
    monkeypatch.setattr(_cpu, "_compiler", lambda: (None, "no C++ compiler found"))
    with pytest.warns(RuntimeWarning, match="C\\+\\+ CPU kernels are unavailable"):
        assert _cpu.lib() is None
    assert _cpu.lib() is None  # cached, no second warning
    monkeypatch.setenv("COMPRESS_KERNELS_NO_CPU", "1")
    monkeypatch.setattr(_cpu, "_state", {})
    assert _cpu.lib() is None


def test_cpu_library_prebuilt_loads_without_a_compiler_or_with_another_one(monkeypatch, tmp_path, capfd):
    """`python -m kernels build` in a container image, then no compiler at run time (or another CXX): the cached
    library loads, no warning, nothing compiled. It was named by the compiler's command and looked up only
    through it, so the PyTorch path ran with a warning saying to set CXX."""
    _cpu = _fast_cpu_builds(monkeypatch, tmp_path)
    if _cpu._compiler()[0] is None:
        pytest.skip("no C++ compiler")
    assert _cpu.lib().compress_omp_max_threads() > 0  # the build step
    capfd.readouterr()
    for compiler in ((None, "no C++ compiler found (c++, g++ or clang++ on PATH); set CXX"), (["/bin/false"], "")):
        monkeypatch.setattr(_cpu, "_compiler", lambda compiler=compiler: compiler)
        monkeypatch.setattr(_cpu, "_state", {})  # a new process
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert _cpu.lib().compress_omp_max_threads() > 0
        assert "compiling" not in capfd.readouterr().err
    (so,) = (tmp_path / "cpu").glob("*.so")
    so.unlink()  # nothing to load and no compiler: the one warning
    monkeypatch.setattr(_cpu, "_compiler", lambda: (None, "no C++ compiler found (c++, g++ or clang++ on PATH); set CXX"))
    monkeypatch.setattr(_cpu, "_state", {})
    with pytest.warns(RuntimeWarning, match=r"unavailable \(no C\+\+ compiler found \(c\+\+, g\+\+ or clang\+\+ on PATH\); set CXX\)"):
        assert _cpu.lib() is None


def test_cpu_library_warning_raised_as_an_error_comes_once(monkeypatch, tmp_path, capfd):
    """Under `python -W error` the fallback's warning raises; the outcome is kept first, so later calls return it
    instead of building again and raising each time (every forward retried the whole build). A CXX that names no
    executable: the warning raises once, and the library built with the compiler found instead is kept."""
    _cpu = _fast_cpu_builds(monkeypatch, tmp_path)
    monkeypatch.setattr(_cpu, "_compiler", lambda: (None, "no C++ compiler found"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match="unavailable"):
            _cpu.lib()
        assert _cpu.lib() is None and _cpu.lib() is None
    monkeypatch.undo()
    _cpu = _fast_cpu_builds(monkeypatch, tmp_path)
    if _cpu._compiler()[0] is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match="CXX='/nonexistent/c\\+\\+' is not an executable compiler"):
            _cpu.lib()
        assert _cpu.lib().compress_omp_max_threads() > 0
    assert capfd.readouterr().err.count("compiling") == 1


def test_cpu_library_compiler_that_builds_nothing_is_remembered_per_command(monkeypatch, tmp_path, capfd):
    """A compiler that fails both the OpenMP and the serial build: one warning naming both remembered failures;
    the next process with that compiler does not compile again (each paid both failed builds, up to twice 15-50
    s, and said "first use only"); another compiler command tries again."""
    _cpu = _fast_cpu_builds(monkeypatch, tmp_path)
    calls = []
    monkeypatch.setattr(_cpu.subprocess, "run", lambda argv, **kw: calls.append(argv) or
                        subprocess.CompletedProcess(argv, 1, "", "c++: error: unrecognized option '-bogus'"))
    monkeypatch.setattr(_cpu, "_compiler", lambda: (["/usr/bin/c++", "-bogus"], ""))
    with pytest.warns(RuntimeWarning, match=r"unavailable \(_CompileError: /usr/bin/c\+\+ -bogus failed: .*-bogus'"
                                            r" \(delete .*\.so\.failed and .*\.so\.failed to try again\)"):
        assert _cpu.lib() is None
    assert len(calls) == 2 and len(list((tmp_path / "cpu").glob("*.so.failed"))) == 2
    monkeypatch.setattr(_cpu, "_state", {})  # a new process, the same compiler: nothing compiled
    with pytest.warns(RuntimeWarning, match=r"-bogus failed: .* \(delete .*\.failed and .*\.failed to try again\)"):
        assert _cpu.lib() is None
    assert len(calls) == 2
    monkeypatch.setattr(_cpu, "_compiler", lambda: (["/usr/bin/c++"], ""))  # another command: tried again
    monkeypatch.setattr(_cpu, "_state", {})
    with pytest.warns(RuntimeWarning, match="unavailable"):
        assert _cpu.lib() is None
    assert len(calls) == 4 and [c[:1] for c in calls[2:]] == [["/usr/bin/c++"]] * 2


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_pix_squeeze_eager_fast_path_equals_op_cuda(layout):
    """Plain eager CUDA calls skip the dispatcher (kernels.pix._PixSqueezeCUDA); they must equal the registered op."""
    from kernels.pix import _pix_squeeze_op

    x, w = make_squeeze(2, 64, 8, 8, 4, torch.bfloat16, "cuda", layout)
    y = kernels.pix_squeeze(x, w, 4)
    assert y.grad_fn is not None and "PixSqueezeCUDA" in type(y.grad_fn).__name__
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    y2 = _pix_squeeze_op(x, w, 4, 0.5)[0]
    dx2, dw2 = torch.autograd.grad(y2, (x, w), dy)
    assert torch.equal(y, y2)
    assert rel_err(dx, dx2) < 1e-3 and rel_err(dw, dw2) < 1e-5  # dp's shared-memory sums may reorder
    with torch.no_grad():
        assert torch.equal(kernels.pix_squeeze(x, w, 4), y2)


# ----------------------------------------------------------------- residual_relu (the next PiX block's pool)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "mixed"])
@pytest.mark.parametrize("inference", [True, False])
def test_residual_relu_cpu_is_add_relu_without_a_kept_mean(dtype, layout, inference):
    """CPU inference takes the fused aten::_add_relu_ (float32/64), the rest add_ + relu_: same values in place."""
    from kernels.pix import _attached_mean

    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randn(2, 8, 5, 6, generator=gen).to(dtype) for _ in range(2))
    if layout != "contiguous":
        a = a.contiguous(memory_format=torch.channels_last)
    if layout == "channels_last":
        b = b.contiguous(memory_format=torch.channels_last)
    want = torch.relu(a + b)
    out = a.clone()
    with torch.inference_mode(inference):
        y = kernels.residual_relu(out, b)
    assert torch.equal(y, want) and y.data_ptr() == out.data_ptr()
    assert _attached_mean(y) is None


def test_residual_relu_cpu_gradients_match_autograd_of_torch_ops():
    gen = torch.Generator().manual_seed(4)
    a0, b0 = torch.randn(2, 8, 5, 6, generator=gen), torch.randn(2, 8, 5, 6, generator=gen)
    g = torch.randn(2, 8, 5, 6, generator=gen)
    grads = []
    for fused in (True, False):
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        y = kernels.residual_relu(a * 1, b) if fused else torch.relu(a + b)
        y.backward(g)
        grads.append((y.detach(), a.grad, b.grad))
    for got, want in zip(*grads):
        assert torch.equal(got, want)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("shape", [(3, 16, 7, 7), (2, 64, 14, 14), (2, 24, 1, 37)])
@pytest.mark.parametrize("inference", [False, True])
def test_residual_relu_cuda_feeds_pix_squeeze(dtype, layout, shape, inference):
    """Also under torch.inference_mode (as compress.profile and export run models), where the result must stay a
    tensor with a version counter so that an in-place change still drops the kept mean."""
    from kernels.pix import _attached_mean

    assert _ext.load() is not None, "CUDA extension failed to build"
    gen = torch.Generator().manual_seed(4)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    a64 = torch.randn(shape, generator=gen, dtype=torch.float64)
    b64 = torch.randn(shape, generator=gen, dtype=torch.float64)
    w = (torch.randn(shape[1] // 4, shape[1], 1, 1, generator=gen) / shape[1] ** 0.5).cuda()
    a, b = (t.to(dtype).cuda().contiguous(memory_format=fmt) for t in (a64, b64))
    with torch.inference_mode(inference):
        y = kernels.residual_relu(a.clone(), b)
        # the sum is rounded once to dtype, as PyTorch's add does; the ReLU is exact
        assert torch.equal(y, torch.relu(a + b)) and y.is_contiguous(memory_format=fmt)
        pooled = _attached_mean(y)
        torch.testing.assert_close(pooled, y.double().mean((2, 3)).float(), rtol=1e-5, atol=1e-6)
        # pix_squeeze takes the kept mean: the same output as computing it itself
        fresh = y.clone()
        assert _attached_mean(fresh) is None
        torch.testing.assert_close(kernels.pix_squeeze(y, w, 4), kernels.pix_squeeze(fresh, w, 4), rtol=1e-3,
                                   atol=1e-3)
        y.mul_(-1)  # an in-place change makes the kept mean stale: it is not used
        assert _attached_mean(y) is None


@pytest.mark.cuda
def test_residual_relu_cuda_gradients_match_autograd_of_torch_ops():
    gen = torch.Generator().manual_seed(5)
    shape = (2, 32, 9, 9)
    w0 = torch.randn(8, 32, 1, 1, generator=gen, dtype=torch.float64) / 32**0.5
    a0, b0 = torch.randn(shape, generator=gen, dtype=torch.float64), torch.randn(shape, generator=gen, dtype=torch.float64)
    dy = torch.randn(2, 8, 9, 9, generator=gen, dtype=torch.float64)
    grads = []
    for fused in (True, False):
        a = a0.float().cuda().contiguous(memory_format=torch.channels_last).requires_grad_()
        b = b0.float().cuda().contiguous(memory_format=torch.channels_last).requires_grad_()
        w = w0.float().cuda().requires_grad_()
        x = kernels.residual_relu(a * 1, b) if fused else torch.relu(a + b)
        kernels.pix_squeeze(x, w, 4).backward(dy.float().cuda())
        grads.append((a.grad, b.grad, w.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_profiler_sees_the_pix_op_of_a_plain_eager_cpu_call():
    """Plain eager CPU calls skip the dispatcher; under torch.profiler they take the op, so its time is attributed."""
    block = compress.PiXBlock(16, 4).eval()
    x = torch.randn(2, 16, 6, 6, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = block(x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got = block(x)
    assert torch.equal(got, want)
    assert "compress::pix_squeeze" in {e.name for e in prof.events()}


def test_cpu_library_cache_path_is_fixed_at_start_and_an_unwritable_one_is_named_with_the_fix(monkeypatch, tmp_path):
    """A relative COMPRESS_KERNELS_CACHE is taken against the directory the process started in: it followed the
    working directory, so train.py with hydra.job.chdir=true built the library anew inside each run dir. A cache
    that cannot be written gives the one warning, now with the setting that moves it."""
    from kernels import _cpu

    monkeypatch.setenv("COMPRESS_KERNELS_CACHE", "kernel cache")
    monkeypatch.chdir(tmp_path)  # (as Hydra's chdir into a run dir)
    assert _cpu.cache_root() == os.path.join(_cpu._START_DIR, "kernel cache") != os.path.join(tmp_path, "kernel cache")
    (tmp_path / "a file").write_text("")
    monkeypatch.setenv("COMPRESS_KERNELS_CACHE", str(tmp_path / "a file" / "cache"))
    monkeypatch.setattr(_cpu, "_compiler", lambda: (["/bin/false"], ""))  # (any: the cache fails before a build)
    monkeypatch.setattr(_cpu, "_state", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _cpu.lib() is None
    assert len(caught) == 1 and "NotADirectoryError" in str(caught[0].message)
    assert "COMPRESS_KERNELS_CACHE=<a writable folder> moves the cache" in str(caught[0].message)

    def unloadable(notes):  # what ctypes raises for a library file it cannot load: no hint about the cache then
        raise OSError("compress_cpu.so: file too short")

    monkeypatch.setattr(_cpu, "_load_any", unloadable)
    monkeypatch.setattr(_cpu, "_state", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _cpu.lib() is None
    assert len(caught) == 1 and "file too short" in str(caught[0].message)
    assert "COMPRESS_KERNELS_CACHE" not in str(caught[0].message)


@pytest.mark.cuda
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_backwards_are_deterministic_when_asked_cuda(layout, monkeypatch):
    """Under torch.use_deterministic_algorithms(True), pix's and pix_squeeze's backward (dp summed with shared-memory
    float atomics: pix_squeeze's gradients varied by ~4e-5 from run to run) take PyTorch's path: bitwise equal
    runs, equal to float64."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (the predictor's product in cuBLAS, deterministic)
    gen = torch.Generator().manual_seed(9)
    x = torch.rand(16, 256, 28, 28, generator=gen).cuda().contiguous(memory_format=layout)
    w = (torch.randn(64, 256, generator=gen) * 0.1).cuda()
    p = torch.rand(16, 64, 1, 1, generator=gen).cuda()
    g = torch.randn(16, 64, 28, 28, generator=gen).cuda().contiguous(memory_format=layout)

    def grads():
        xs, ws, xp, pp = (t.clone().requires_grad_() for t in (x, w, x, p))
        kernels.pix_squeeze(xs, ws, 4, 0.5).backward(g)
        kernels.pix(xp, pp, 4, 0.5).backward(g)
        return xs.grad, ws.grad, xp.grad, pp.grad

    torch.use_deterministic_algorithms(True)
    try:
        runs = [grads() for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(False)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))
    xs, ws, xp, pp = (t.double().requires_grad_() for t in (x, w, x, p))
    kernels.pix_reference(xs, torch.sigmoid(xs.mean((2, 3)) @ ws.T)[:, :, None, None], 4, 0.5).backward(g.double())
    kernels.pix_reference(xp, pp, 4, 0.5).backward(g.double())
    for got, want in zip(runs[0], (xs.grad, ws.grad, xp.grad, pp.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-4)
