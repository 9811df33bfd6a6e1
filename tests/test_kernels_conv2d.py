"""compress::conv2d (im2col/col2im) against F.conv2d in float64."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from grads import penalty_grads

import kernels
from kernels import _ext
from kernels.conv2d import _conv_backward_op, _conv_op

kc = importlib.import_module("kernels.conv2d")

TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2, torch.float16: 2e-3}
CONFIGS = [  # (C, Co, H, W, k, stride, padding, dilation, groups)
    (3, 5, 7, 6, (3, 3), 1, 1, 1, 1),
    (4, 6, 9, 8, (3, 2), (2, 1), (1, 0), (1, 2), 2),
    (6, 6, 8, 8, (5, 5), 1, 2, 1, 6),
    (4, 8, 6, 7, (1, 1), 2, 0, 1, 1),
]


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(cfg, device="cpu", dtype=torch.float32, layout="contiguous", B=3, seed=0):
    C, Co, H, W, k, s, p, d, g = cfg
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C, H, W, generator=gen, dtype=torch.float64)
    w = torch.randn(Co, C // g, *k, generator=gen, dtype=torch.float64)
    b = torch.randn(Co, generator=gen, dtype=torch.float64)
    x, w, b = (t.to(device, dtype) for t in (x, w, b))
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "noncontiguous":
        x = x.transpose(2, 3).contiguous().transpose(2, 3)
    return x, w, b


def check(device, dtype, layout, cfg, B=3):
    C, Co, H, W, k, s, p, d, g = cfg
    x, w, b = make(cfg, device, dtype, layout, B)
    for t in (x, w, b):
        t.requires_grad_(True)
    y = kernels.conv2d(x, w, b, s, p, d, g)
    x64, w64, b64 = (t.detach().cpu().double().requires_grad_(True) for t in (x, w, b))
    yr = F.conv2d(x64, w64, b64, s, p, d, g)
    assert y.shape == yr.shape and y.dtype == dtype
    if layout == "channels_last":
        assert y.is_contiguous(memory_format=torch.channels_last)
    assert rel_err(y.cpu(), yr) < TOL[dtype]
    dy = torch.randn(y.shape, dtype=torch.float64).to(dtype)  # the reference sees the same rounded dy
    grads = torch.autograd.grad(y, (x, w, b), dy.to(device))
    grads_r = torch.autograd.grad(yr, (x64, w64, b64), dy.double())
    for gg, gr in zip(grads, grads_r):
        if B == 0:
            assert gg.shape == gr.shape
        else:
            assert rel_err(gg.cpu(), gr) < TOL[dtype]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "noncontiguous"])
def test_matches_reference_cpu(cfg, layout):
    check("cpu", torch.float32, layout, cfg)


def test_bf16_empty_and_chunking(monkeypatch):
    check("cpu", torch.bfloat16, "contiguous", CONFIGS[0])
    check("cpu", torch.float32, "contiguous", CONFIGS[0], B=0)
    monkeypatch.setattr(kc, "COL_BYTES", 1)  # one sample per chunk
    check("cpu", torch.float32, "contiguous", CONFIGS[1], B=4)


def test_gradcheck():
    cfg = (4, 4, 5, 4, (3, 3), 2, 1, 1, 2)
    x, w, b = make(cfg, dtype=torch.float64, B=2)
    for t in (x, w, b):
        t.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, c, e: kernels.conv2d(a, c, e, 2, 1, 1, 2), (x, w, b))


def test_double_backward():
    """Gradient penalties and Hessian-vector products work as with F.conv2d (groups, stride, dilation): gradgradcheck
    in float64, and a penalty's gradients equal F.conv2d's, on NCHW and channels_last input."""
    cfg = (4, 4, 5, 4, (3, 3), 2, 1, 1, 2)
    x, w, b = make(cfg, dtype=torch.float64, B=2)
    for t in (x, w, b):
        t.requires_grad_(True)
    assert torch.autograd.gradgradcheck(lambda a, c, e: kernels.conv2d(a, c, e, 2, 1, 1, 2), (x, w, b))
    for xx in (x, x.detach().contiguous(memory_format=torch.channels_last)):
        got = penalty_grads(lambda a, c, e: kernels.conv2d(a, c, e, 1, 2, 2, 2), xx, w, b)
        want = penalty_grads(lambda a, c, e: F.conv2d(a, c, e, 1, 2, 2, 2), xx, w, b)
        for g, gr in zip(got[:2], want[:2]):
            assert ((g - gr).norm() / gr.norm()).item() < 1e-12


def test_errors():
    x, w, b = make(CONFIGS[0])
    with pytest.raises(ValueError, match=r"compress::conv2d: groups=2 must divide the channels of 'x' \(3\)"):
        kernels.conv2d(x, w, b, groups=2)
    with pytest.raises(ValueError, match=r"compress::conv2d: tensor 'weight' must have shape \(5, 3, kh, kw\)"):
        kernels.conv2d(x, w[:, :2], b)
    with pytest.raises(ValueError, match=r"compress::conv2d: tensor 'bias' must have shape \(5,\)"):
        kernels.conv2d(x, w, b[:1])
    with pytest.raises(TypeError, match=r"compress::conv2d: tensor 'x' has dtype torch.int32"):
        kernels.conv2d(x.int(), w, b)
    with pytest.raises(ValueError, match=r"compress::conv2d: tensor 'x' has no channels \(shape \(2, 0, 7, 7\)\)"):
        kernels.conv2d(torch.randn(2, 0, 7, 7), torch.randn(5, 0, 3, 3), b)
    with pytest.raises(TypeError, match=r"conv2d: groups must be an int, got 1.0"):
        kernels.conv2d(x, w, b, groups=1.0)
    with pytest.raises(ValueError, match=r"compress::conv2d: the kernel \(3, 0\) is empty"):
        kernels.conv2d(x, w[..., :0], b)
    x4 = torch.randn(1, 4, 5, 5)
    with pytest.raises(ValueError, match=r"groups=2 must divide the channels of 'x' \(4\) and of 'weight' \(5\)"):
        kernels.conv2d(x4, torch.randn(5, 2, 3, 3), groups=2)
    for kwargs, message in (({"padding": -1}, r"padding must be two ints >= 0, got \[-1, -1\]"),
                            ({"dilation": [1, 0]}, r"dilation must be two ints >= 1, got \[1, 0\]")):
        for op, args in ((kernels.conv2d, (x4, torch.randn(6, 4, 3, 3))),
                         (kernels.depthwise_conv2d, (x4, torch.randn(4, 1, 3, 3))),
                         (kernels.stripe_conv2d, (x4, torch.randn(1, 4), torch.tensor([0]), torch.tensor([[1, 1]]),
                                                  None, 2, 3))):
            with pytest.raises(ValueError, match=message):  # (F.conv2d refuses them too; a stripe conv returned a
                op(*args, **kwargs)  # smaller or larger output)


def test_one_element_lists_mean_both_sides_as_in_f_conv2d():
    x, w = torch.randn(1, 4, 9, 9, dtype=torch.float64), torch.randn(6, 2, 3, 3, dtype=torch.float64)
    want = F.conv2d(x, w, None, stride=[2], padding=[1], dilation=[1], groups=2)
    torch.testing.assert_close(kernels.conv2d(x, w, None, stride=[2], padding=[1], dilation=[1], groups=2), want)


def test_opcheck_cpu():
    cfg = CONFIGS[1]
    x, w, b = make(cfg)
    for xx in (x, x.contiguous(memory_format=torch.channels_last)):
        args = (xx.requires_grad_(True), w.clone().requires_grad_(True), b.clone().requires_grad_(True), [2, 1], [1, 0], [1, 2], 2)
        torch.library.opcheck(_conv_op, args)
        y = _conv_op(*args)
        torch.library.opcheck(_conv_backward_op, (torch.randn(y.shape), xx.detach(), w, [2, 1], [1, 0], [1, 2], 2))


def test_module():
    conv = torch.nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2)
    m = kernels.Im2colConv2d.from_conv(conv)
    x = torch.randn(2, 4, 7, 7)
    torch.testing.assert_close(m(x), conv(x))
    f = torch.compile(m, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(f(x), conv(x))


@pytest.mark.cuda
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "noncontiguous"])
def test_matches_reference_cuda(cfg, dtype, layout):
    assert _ext.load() is not None, "CUDA extension failed to build"
    check("cuda", dtype, layout, cfg)


@pytest.mark.cuda
def test_opcheck_cuda():
    x, w, b = make(CONFIGS[1], device="cuda")
    args = (x.requires_grad_(True), w.clone().requires_grad_(True), b.clone().requires_grad_(True), [2, 1], [1, 0], [1, 2], 2)
    torch.library.opcheck(_conv_op, args)
