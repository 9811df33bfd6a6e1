"""kernels.max_pool2d (the C++ CPU NCHW max-pool) and compress.pooling.MaxPool2d, against F.max_pool2d."""

import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from compress.pooling import MaxPool2d, fast_max_pools
from kernels import _cpu
from kernels.pool import max_pool2d

pytestmark = pytest.mark.skipif(_cpu.lib() is None, reason="no C++ compiler: the C++ kernels cannot build")


@pytest.fixture
def no_aten_pool(monkeypatch):
    """F.max_pool2d raises: a call that passes ran the C++ kernel."""
    def refuse(*args, **kwargs):
        raise AssertionError("F.max_pool2d was called")

    monkeypatch.setattr(F, "max_pool2d", refuse)
    return refuse


def _input(shape, dtype, seed):
    x = torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))
    flat = x.view(-1)
    flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(seed + 1))[:3]] = float("nan")
    flat[seed % flat.numel()] = float("-inf")
    return x


def _same(a, b):
    """Equal values (NaN where the other has NaN), shapes and strides."""
    return (a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_aten_on_every_valid_window(dtype, threads, no_aten_pool):
    """Every kernel size, stride, padding, dilation and ceil mode F.max_pool2d accepts (square and not), on maps
    from 1 wide to 35, with NaN and -inf in the input: the same values as PyTorch's own pool (NaN wins a window)."""
    aten = torch.max_pool2d  # the ATen op itself (F.max_pool2d is patched to refuse)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    checked = 0
    try:
        with torch.inference_mode():
            for (h, w), k, s, p, d, ceil in itertools.product(
                    [(7, 9), (1, 4), (35, 16), (8, 8), (9, 9)], [1, 2, 3, (3, 2)], [1, 2, 3, (2, 3)], [0, 1], [1, 2],
                    [False, True]):  # (9, 9), k = s = 3: padded windows whose rows tile the map exactly
                x = _input((3, 5, h, w), dtype, seed=checked)
                try:
                    ref = aten(x, k, s, p, d, ceil)
                except RuntimeError:  # refused by PyTorch: handed to F.max_pool2d for its error, not computed
                    with pytest.raises(AssertionError, match="F.max_pool2d was called"):
                        max_pool2d(x, k, s, p, d, ceil)
                    continue
                assert _same(max_pool2d(x, k, s, p, d, ceil), ref), (h, w, k, s, p, d, ceil)
                checked += 1
            big = _input((2, 64, 112, 112), dtype, seed=5)  # ResNet's stem pool, threads sharing the planes
            assert _same(max_pool2d(big, 3, 2, 1), aten(big, 3, 2, 1))
            strided = _input((2, 3, 10, 12), dtype, seed=7)[:, :, :, ::2]  # a view: PyTorch's pool reads it
            with pytest.raises(AssertionError, match="F.max_pool2d was called"):
                max_pool2d(strided, 2)
            unbatched = _input((4, 11, 6), dtype, seed=6)
            assert _same(max_pool2d(unbatched, 2, ceil_mode=True), aten(unbatched, 2, 2, 0, 1, True))
            # padding past the map's edge on both sides (no window starts inside: SPPF's 5x5 / pad 2 on a 1-wide
            # map): each row's left-edge outputs once ran past the row, over the next thread's first plane
            for shape, k, p in (((64, 512, 2, 1), 5, 2), ((2, 8, 3, 1), (1, 5), (0, 2)), ((2, 3, 2, 1), (1, 7), (0, 3)),
                                ((1, 2, 5000, 1), (1, 5), (0, 2))):
                for seed in range(3):
                    x = _input(shape, dtype, seed=seed)
                    assert _same(max_pool2d(x, k, 1, p), aten(x, k, 1, p)), (shape, k, p)
    finally:
        torch.set_num_threads(old)
    assert checked > 400  # of 640 combinations; the rest are refused by PyTorch (padding over half the window)


def test_other_calls_run_aten():
    """channels_last, half precision, autograd and bad parameters go to F.max_pool2d: same layout, a gradient,
    PyTorch's own error."""
    x = torch.randn(2, 8, 10, 10)
    cl = x.contiguous(memory_format=torch.channels_last)
    y = max_pool2d(cl, 3, 2, 1)
    assert y.is_contiguous(memory_format=torch.channels_last) and torch.equal(y, F.max_pool2d(x, 3, 2, 1))
    assert torch.equal(max_pool2d(x.bfloat16(), 2), F.max_pool2d(x.bfloat16(), 2))
    xg = x.clone().requires_grad_()
    max_pool2d(xg, 2).sum().backward()
    ref = x.clone().requires_grad_()
    F.max_pool2d(ref, 2).sum().backward()
    assert torch.equal(xg.grad, ref.grad) and xg.grad.abs().sum() > 0
    with pytest.raises(RuntimeError, match="pad should be"):
        max_pool2d(x, 2, padding=2)


def test_inputs_and_arguments_only_aten_takes_right():
    """What the C++ path must not take, found by a QA pass: padding over half the undilated kernel (PyTorch
    refuses it even where the dilated window is wide), argument types F.max_pool2d rejects, tensors without plain
    data (efficient zeros, a lazily negated view, mkldnn), and dual tensors of forward-mode AD (tangent kept)."""
    import torch.autograd.forward_ad as fwad

    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        for kwargs in (dict(kernel_size=2, stride=1, padding=3, dilation=5), dict(kernel_size=True),
                       dict(kernel_size=2, ceil_mode=1), dict(kernel_size=2, stride=2**31)):
            with pytest.raises((RuntimeError, TypeError)) as ours:
                max_pool2d(x, **kwargs)
            with pytest.raises(ours.type):
                F.max_pool2d(x, **kwargs)
        assert torch.equal(max_pool2d(torch._efficientzerotensor((2, 3, 8, 8)), 2), torch.zeros(2, 3, 4, 4))
        negated = torch._neg_view(x)
        assert torch.equal(max_pool2d(negated, 2), torch.max_pool2d(-x, 2))
        assert torch.equal(max_pool2d(x.to_mkldnn(), 2).to_dense(), torch.max_pool2d(x, 2))
    with fwad.dual_level():
        dual = fwad.make_dual(x, torch.randn_like(x))
        tangent = fwad.unpack_dual(max_pool2d(dual, 2)).tangent
        assert tangent is not None and torch.equal(tangent, fwad.unpack_dual(F.max_pool2d(dual, 2)).tangent)


def test_module_and_swap(no_aten_pool):
    """fast_max_pools swaps exactly the nn.MaxPool2d modules without indices; MaxPool2d runs the kernel in eager
    inference and is a leaf of compaction's fx tracer."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.MaxPool2d(3, 2, 1, ceil_mode=True), nn.ReLU(),
                          nn.MaxPool2d(2, return_indices=True))
    assert fast_max_pools(model) == ["1"]
    assert type(model[1]) is MaxPool2d and type(model[3]) is nn.MaxPool2d
    assert model[1].config() == {"kernel_size": 3, "stride": 2, "padding": 1, "dilation": 1, "ceil_mode": True}
    x = torch.randn(2, 4, 15, 13)
    with torch.no_grad():
        y = model[1](x)
    assert _same(y, torch.max_pool2d(x, 3, 2, 1, 1, True))
    from compress.surgery import trace
    graph = trace(nn.Sequential(MaxPool2d(2)))
    assert [n.op for n in graph.nodes] == ["placeholder", "call_module", "output"]
    assert kernels.max_pool2d is max_pool2d
