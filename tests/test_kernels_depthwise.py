"""compress::depthwise_conv2d against F.conv2d(groups=C) in float64."""

import pytest
import torch
import torch.nn.functional as F
from grads import penalty_grads
from torch._subclasses.fake_tensor import FakeTensorMode

import kernels
from kernels import _ext
from kernels.depthwise import _dw_backward_op, _dw_op

TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2, torch.float16: 2e-3}
CONFIGS = [  # (C, H, W, k, stride, padding, dilation)
    (3, 7, 6, (3, 3), 1, 1, 1),
    (4, 9, 8, (5, 5), 1, 2, 1),
    (2, 9, 7, (3, 3), 2, 1, 1),
    (3, 10, 9, (3, 2), (2, 1), (0, 2), (2, 1)),
    (2, 6, 6, (1, 1), 1, 0, 1),
]


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(C, H, W, k, device="cpu", dtype=torch.float32, layout="contiguous", B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    w = torch.randn(C, 1, *k, generator=g, dtype=torch.float64)
    b = torch.randn(C, generator=g, dtype=torch.float64)
    x, w, b = (t.to(device, dtype) for t in (x, w, b))
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "noncontiguous":
        x = x.transpose(2, 3).contiguous().transpose(2, 3)
        assert not x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last)
    return x, w, b


def check(device, dtype, layout, cfg, B=2):
    C, H, W, k, s, p, d = cfg
    x, w, b = make(C, H, W, k, device, dtype, layout, B)
    x.requires_grad_(True)
    w.requires_grad_(True)
    b.requires_grad_(True)
    y = kernels.depthwise_conv2d(x, w, b, s, p, d)
    x64, w64, b64 = (t.detach().cpu().double().requires_grad_(True) for t in (x, w, b))
    yr = F.conv2d(x64, w64, b64, s, p, d, groups=C)
    assert y.shape == yr.shape and y.dtype == dtype
    if layout == "channels_last":
        assert y.is_contiguous(memory_format=torch.channels_last)
    assert rel_err(y.cpu(), yr) < TOL[dtype]
    if B == 0:  # no image: gradients of x's shape, and zero for the weight and bias
        gx, gw, gb = torch.autograd.grad(y, (x, w, b), torch.zeros_like(y))
        assert gx.shape == x.shape and not gw.any() and not gb.any()
        return
    dy = torch.randn(y.shape, dtype=torch.float64).to(dtype)  # the reference sees the same rounded dy
    grads = torch.autograd.grad(y, (x, w, b), dy.to(device))
    grads_r = torch.autograd.grad(yr, (x64, w64, b64), dy.double())
    for g, gr in zip(grads, grads_r):
        assert rel_err(g.cpu(), gr) < TOL[dtype]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "noncontiguous"])
def test_matches_reference_cpu(cfg, layout):
    check("cpu", torch.float32, layout, cfg)


def test_bf16_cpu_and_empty_batch():
    check("cpu", torch.bfloat16, "contiguous", CONFIGS[0])
    check("cpu", torch.float32, "contiguous", CONFIGS[0], B=0)


def test_gradcheck():
    x, w, b = make(2, 5, 4, (3, 3), dtype=torch.float64)
    for t in (x, w, b):
        t.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, c, e: kernels.depthwise_conv2d(a, c, e, 2, 1, 1), (x, w, b))


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_double_backward(layout):
    """Gradient penalties and Hessian-vector products work as with F.conv2d: gradgradcheck in float64, and a
    penalty's gradients equal F.conv2d's (the bias gets none: the penalty does not depend on it)."""
    x, w, b = make(3, 7, 6, (3, 3), dtype=torch.float64, layout=layout)
    for t in (x, w, b):
        t.requires_grad_(True)
    assert torch.autograd.gradgradcheck(lambda a, c, e: kernels.depthwise_conv2d(a, c, e, 2, 1, 1), (x, w, b))
    got = penalty_grads(lambda a, c, e: kernels.depthwise_conv2d(a, c, e, 1, 2, 2), x, w, b)
    want = penalty_grads(lambda a, c, e: F.conv2d(a, c, e, 1, 2, 2, groups=3), x, w, b)
    assert got[2] is None and want[2] is None
    for g, gr in zip(got[:2], want[:2]):
        assert rel_err(g, gr) < 1e-12


def test_errors():
    x, w, b = make(3, 6, 6, (3, 3))
    with pytest.raises(ValueError, match=r"compress::depthwise_conv2d: tensor 'weight' must have shape \(3, 1, kh, kw\)"):
        kernels.depthwise_conv2d(x, w[:2], b)
    with pytest.raises(ValueError, match=r"tensor 'weight' must have shape \(3, 1, kh, kw\) .*got \(3, 2, 3, 3\)"):
        kernels.depthwise_conv2d(x, torch.cat([w, w], 1), b)  # (PyTorch's error blamed the input's channels)
    with pytest.raises(ValueError, match=r"compress::depthwise_conv2d: tensor 'bias' must have shape \(3,\)"):
        kernels.depthwise_conv2d(x, w, b[:2])
    with pytest.raises(TypeError, match=r"compress::depthwise_conv2d: tensor 'weight' has dtype torch.float64"):
        kernels.depthwise_conv2d(x, w.double())
    with pytest.raises(ValueError, match=r"compress::depthwise_conv2d: tensor 'x' of spatial size \(6, 6\) is too small"):
        kernels.depthwise_conv2d(x, w, dilation=4)
    with pytest.raises(ValueError, match=r"compress::depthwise_conv2d: stride must be two ints >= 1"):
        kernels.depthwise_conv2d(x, w, stride=0)
    with pytest.raises(ValueError, match=r"compress::depthwise_conv2d: tensor 'x' has no channels"):
        kernels.depthwise_conv2d(x[:, :0], w[:0])
    with pytest.raises(ValueError, match=r"compress::depthwise_conv2d_backward: tensor 'grad' must have shape"):
        torch.ops.compress.depthwise_conv2d_backward(torch.randn(2, 3, 2, 2), x, w, [1, 1], [1, 1], [1, 1])
    # an empty kernel (oneDNN's error before; fake tensors gave a shape)
    with pytest.raises(ValueError, match=r"compress::depthwise_conv2d: the kernel \(0, 3\) is empty"):
        kernels.depthwise_conv2d(x, w[:, :, :0])
    empty = w[:, :, :, :0]
    with FakeTensorMode() as mode, pytest.raises(ValueError, match=r"the kernel \(3, 0\) is empty"):
        kernels.depthwise_conv2d(mode.from_tensor(x), mode.from_tensor(empty))
    reflect = torch.nn.Conv2d(3, 3, 3, padding=1, groups=3, padding_mode="reflect")
    with pytest.raises(ValueError, match=r"from_conv needs .* numeric zero padding, .*padding_mode='reflect'"):
        kernels.DepthwiseConv2d.from_conv(reflect)  # (it ran zero padding)


def test_opcheck_cpu():
    x, w, b = make(3, 6, 5, (3, 3))
    for xx in (x, x.contiguous(memory_format=torch.channels_last)):
        args = (xx.requires_grad_(True), w.clone().requires_grad_(True), b.clone().requires_grad_(True), [2, 1], [1, 1], [1, 1])
        torch.library.opcheck(_dw_op, args)
        torch.library.opcheck(_dw_backward_op, (torch.randn(2, 3, 3, 5), xx.detach(), w, [2, 1], [1, 1], [1, 1]))


def test_module_autocast_compile():
    conv = torch.nn.Conv2d(4, 4, 3, padding=1, groups=4)
    m = kernels.DepthwiseConv2d.from_conv(conv)
    x = torch.randn(2, 4, 6, 6)
    torch.testing.assert_close(m(x), conv(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m(x).dtype == torch.bfloat16
    f = torch.compile(m, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(f(x), conv(x))


# ----------------------------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("cfg", CONFIGS + [(8, 20, 33, (3, 3), 1, 1, 1), (8, 17, 17, (5, 5), 1, 2, 1),
                                           (8, 15, 15, (7, 7), 1, 3, 1), (4, 9, 9, (3, 3), 1, 4, 1),
                                           (8, 16, 16, (5, 5), 2, 2, 1), (4, 12, 12, (3, 3), 1, 2, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "noncontiguous"])
def test_matches_reference_cuda(cfg, dtype, layout):
    assert _ext.load() is not None, "CUDA extension failed to build"
    check("cuda", dtype, layout, cfg)


@pytest.mark.cuda
@pytest.mark.parametrize("cfg", CONFIGS + [(8, 16, 16, (5, 5), 2, 2, 1), (8, 20, 33, (3, 3), 1, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channels_last_kernel_forced_cuda(cfg, dtype, monkeypatch):
    """channels_last runs cuDNN by default; COMPRESS_DW_CL_KERNEL=1 keeps our channels_last kernels correct."""
    monkeypatch.setenv("COMPRESS_DW_CL_KERNEL", "1")
    assert _ext.load() is not None, "CUDA extension failed to build"
    check("cuda", dtype, "channels_last", cfg)


@pytest.mark.cuda
@pytest.mark.parametrize("cfg", [(8, 16, 16, 3, 1), (8, 17, 15, 3, 1), (4, 28, 28, 5, 2), (4, 14, 13, 5, 2),
                                 (4, 13, 14, 7, 3), (4, 12, 12, 3, 0), (4, 11, 11, 5, 1), (2, 7, 7, 3, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ["2", "1"])
def test_stride2_fast_paths_cuda(cfg, dtype, rows, monkeypatch):
    """NCHW stride 2, square k 3/5/7: the vectorised forward (even/odd padding, W % 4 and W % 8; two output rows
    per thread and one, forced by COMPRESS_DW_ROWS) and the phase-decomposed input gradient, interior and
    border columns and rows."""
    monkeypatch.setenv("COMPRESS_DW_ROWS", rows)
    C, H, W, k, p = cfg
    check("cuda", dtype, "contiguous", (C, H, W, (k, k), 2, p, 1), B=3)


@pytest.mark.cuda
@pytest.mark.parametrize("cfg", [(8, 14, 3), (16, 14, 5), (40, 14, 7), (8, 7, 3), (40, 7, 5), (16, 7, 7), (8, 28, 3),
                                 (2, 28, 5), (4, 28, 7)])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("staged", ["1", "0"])
def test_staged_small_planes_cuda(cfg, stride, dtype, staged, monkeypatch):
    """NCHW, padding k // 2, 7x7, 14x14 and 28x28 planes (batch 3: whole chunks of 1-8 planes): the shared-memory
    staged forward and weight gradient run (their kernels are in the profile) and are correct, forward and
    backward (stride 1's input gradient is the forward with the flipped kernel); COMPRESS_DW_STAGED=0 gives the
    register kernels."""
    monkeypatch.setenv("COMPRESS_DW_STAGED", staged)
    C, side, k = cfg
    check("cuda", dtype, "contiguous", (C, side, side, (k, k), stride, k // 2, 1), B=3)
    x, w, b = make(C, side, side, (k, k), "cuda", dtype, B=3)
    w.requires_grad_(True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        kernels.depthwise_conv2d(x, w, b, stride, k // 2).sum().backward()
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events())
    for kernel in ("dw_fwd_nchw_staged", "dw_wgrad_nchw_staged"):
        assert (kernel in names) == (staged == "1"), (kernel, names)


@pytest.mark.cuda
@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[2], (4, 14, 14, (3, 3), 1, 1, 1), (4, 28, 28, (5, 5), 2, 2, 1)])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_double_backward_cuda(cfg, layout):
    """A gradient penalty through the CUDA kernels (register and staged planes) in float32 equals F.conv2d's in
    float64."""
    C, H, W, k, s, p, d = cfg
    x, w, b = make(C, H, W, k, "cuda", torch.float32, layout)
    got = penalty_grads(lambda a, c, e: kernels.depthwise_conv2d(a, c, e, s, p, d), x, w, b)
    want = penalty_grads(lambda a, c, e: F.conv2d(a, c, e, s, p, d, groups=C), *(t.cpu().double() for t in (x, w, b)))
    for g, gr in zip(got[:2], want[:2]):
        assert rel_err(g.cpu(), gr) < 1e-4


@pytest.mark.cuda
def test_cuda_empty_and_opcheck():
    check("cuda", torch.float32, "contiguous", CONFIGS[0], B=0)
    x, w, b = make(3, 6, 5, (3, 3), device="cuda")
    for xx in (x, x.contiguous(memory_format=torch.channels_last)):
        args = (xx.requires_grad_(True), w.clone().requires_grad_(True), b.clone().requires_grad_(True), [2, 1], [1, 1], [1, 1])
        torch.library.opcheck(_dw_op, args)
        dy = torch.randn(2, 3, 3, 5, device="cuda")
        torch.library.opcheck(_dw_backward_op, (dy, xx.detach(), w, [2, 1], [1, 1], [1, 1]))


@pytest.mark.cuda
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_backward_is_deterministic_when_asked_cuda(layout):
    """Under torch.use_deterministic_algorithms(True) the weight gradient (float atomics across blocks: it varied by
    up to 0.06 from run to run at 32x64x56x56) takes cuDNN's path: bitwise equal runs, equal to float64."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(32, 64, 56, 56, generator=gen).cuda().contiguous(memory_format=layout)
    w = torch.randn(64, 1, 3, 3, generator=gen).cuda()
    g = torch.randn(32, 64, 56, 56, generator=gen).cuda().contiguous(memory_format=layout)

    def grads():
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        kernels.depthwise_conv2d(xg, wg, None, 1, 1, 1).backward(g)
        return xg.grad, wg.grad

    torch.use_deterministic_algorithms(True)
    try:
        runs = [grads() for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(False)
    for dx, dw in runs[1:]:
        assert torch.equal(dx, runs[0][0]) and torch.equal(dw, runs[0][1])
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    F.conv2d(xd, wd, None, 1, 1, 1, 64).backward(g.double())
    torch.testing.assert_close(runs[0][1].double(), wd.grad, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(runs[0][0].double(), xd.grad, rtol=1e-4, atol=1e-4)
