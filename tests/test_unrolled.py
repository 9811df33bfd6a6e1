"""The unrolled-GEMM form of a conv on tiny feature maps (kernels.unrolled) and StripeConv2d's "gemm" mode."""

import pytest
import torch
import torch.nn.functional as F

import compress
from compress.stripe import StripeConv2d
from kernels import unrolled

# (C, N, H, W, kernel, stride, padding, dilation)
SHAPES = [(5, 7, 2, 2, 3, 1, 1, 1), (4, 6, 4, 4, 3, 1, 1, 1), (3, 5, 5, 3, 3, 2, 1, 1), (6, 4, 4, 5, 3, 1, 2, 2),
          (3, 4, 3, 3, (3, 1), 1, (1, 0), 1), (4, 3, 4, 4, 3, 1, 0, 1)]  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_unrolled_conv_matches_conv2d(shape, relu, with_bias):
    C, N, H, W, k, s, p, d = shape
    k, s, p, d = (v if isinstance(v, tuple) else (v, v) for v in (k, s, p, d))
    gen = torch.Generator().manual_seed(hash((shape, relu, with_bias)) % 2**31)
    w = torch.randn(N, C, *k, generator=gen, dtype=torch.float64)
    b = torch.randn(N, generator=gen, dtype=torch.float64) if with_bias else None
    x = torch.randn(3, C, H, W, generator=gen, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    u, bias_rows, out_hw = unrolled.unrolled_operands(w, b, (H, W), s, p, d)
    assert u.shape == (out_hw[0] * out_hw[1] * N, H * W * C)
    got = unrolled.unrolled_conv2d(x, u, bias_rows, out_hw, relu)
    want = F.conv2d(x, w, b, s, p, d)
    want = want.relu() if relu else want
    assert got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert unrolled.unrolled_conv2d(x[:0], u, bias_rows, out_hw, relu).shape == (0, N, *out_hw)  # an empty batch


def test_fits_bounds():
    # 3x3 kernel: inputs of up to 18 pixels, a weight of at most MAX_BYTES, and an output of at least one pixel
    assert unrolled.fits(64, 64, (4, 4), (3, 3), (1, 1), (1, 1), (1, 1), 2)
    assert not unrolled.fits(64, 64, (8, 8), (3, 3), (1, 1), (1, 1), (1, 1), 2)
    assert not unrolled.fits(2048, 2048, (4, 4), (3, 3), (1, 1), (1, 1), (1, 1), 2)  # 2 GiB of weight
    assert not unrolled.fits(4, 4, (2, 2), (3, 3), (1, 1), (0, 0), (1, 1), 2)  # no output pixel
    assert unrolled.fits(8, 8, (3, 6), (3, 3), (1, 1), (1, 1), (1, 1), 4)  # 18 pixels: the bound itself
    assert not unrolled.fits(8, 8, (1, 19), (3, 3), (1, 1), (1, 1), (1, 1), 4)


def _masked_weight(m: StripeConv2d) -> torch.Tensor:
    """The layer's dense (N, C, KH, KW) weight, written stripe by stripe here (independent of dense_weight(), which
    dense and gemm mode both read): filter n's kernel offset (i, j) holds its stripe's C values, zeros elsewhere."""
    w = torch.zeros(m.out_channels, m.in_channels, *m.kernel_size, dtype=m.weight.dtype, device=m.weight.device)
    for s, (n, (i, j)) in enumerate(zip(m.out_index.tolist(), m.offset.tolist())):
        w[n, :, i, j] = m.weight[s].detach()
    return w


def _layer(C=6, N=5, keep=0.5, relu=True, pool=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    conv = torch.nn.Conv2d(C, N, 3, padding=1, bias=True).double()
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen, dtype=torch.float64))
        conv.bias.copy_(torch.randn(N, generator=gen, dtype=torch.float64))
    mask = torch.rand(N, 3, 3, generator=gen) < keep
    mask[0, 1, 1] = True
    m = StripeConv2d.from_dense(conv, mask)
    m.relu, m.pool = relu, pool
    return m.eval()


def test_a_non_finite_input_value_in_each_mode():
    """As README ("Compaction") and kernels.unrolled say: with every stripe kept, stripe and dense mode give inf/NaN
    exactly where F.conv2d does (the value's receptive field); gemm mode's unrolled zeros make the rest of that
    image's output NaN; the batch's other image stays exact in every mode."""
    m = _layer(keep=1.1, relu=False)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 6, 4, 4, generator=gen, dtype=torch.float64)
    x[0, 2, 1, 1] = float("inf")
    want = F.conv2d(x, _masked_weight(m), m.bias, 1, 1)
    assert 0 < (~want[0].isfinite()).sum() < want[0].numel()
    for mode in ("stripe", "dense", "gemm"):
        m.mode = mode
        with torch.no_grad():
            y = m(x)
        torch.testing.assert_close(y[1], want[1], rtol=1e-12, atol=1e-12)
        if mode == "gemm":  # non-finite everywhere: NaN wherever F.conv2d is finite
            assert not y[0].isfinite().any() and y[0][want[0].isfinite()].isnan().all()
        else:
            assert torch.equal(y[0].isfinite(), want[0].isfinite()), mode


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("pool", [False, True])
def test_gemm_mode_matches_dense_mode(layout, pool):
    m = _layer(pool=pool)
    x = torch.randn(4, 6, 4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)

    def expected():
        y = F.conv2d(x, _masked_weight(m), m.bias, 1, 1).relu()
        return F.max_pool2d(y, 2) if pool else y

    want = expected()
    m.mode = "gemm"
    with torch.no_grad():
        got = m(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert got.is_contiguous(memory_format=torch.channels_last if layout == "channels_last" else torch.contiguous_format)
    assert m._gemm_cache is not None  # the unrolled weight is kept ...
    with torch.no_grad():
        m.weight.mul_(2)  # ... until the weight changes
        torch.testing.assert_close(m(x), expected())


def test_gemm_mode_falls_back_to_dense_on_large_maps_and_in_training():
    m = _layer()
    m.mode = "gemm"
    x = torch.randn(2, 6, 9, 9, generator=torch.Generator().manual_seed(2), dtype=torch.float64)  # 81 > 18 pixels
    with torch.no_grad():
        torch.testing.assert_close(m(x), F.conv2d(x, _masked_weight(m), m.bias, 1, 1).relu())
    assert m._gemm_cache is None
    # autograd records: dense mode, gradients reach the stripes
    xs = torch.randn(2, 6, 4, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    m(xs).square().sum().backward()
    ref = _layer()
    ref.mode = "dense"
    ref(xs).square().sum().backward()
    assert m._gemm_cache is None
    torch.testing.assert_close(m.weight.grad, ref.weight.grad)


def test_choose_modes_picks_the_fastest_measured():
    model = torch.nn.Sequential(_layer().float())
    x = torch.randn(8, 6, 4, 4, generator=torch.Generator().manual_seed(5))
    report = {}
    with torch.no_grad():
        modes = compress.choose_modes(model, x, repeats=2, timing="eager", report=report)
    r = report["0"]
    times = {k: r[f"{k}_ms"] for k in ("stripe", "dense", "gemm")}
    assert modes == {"0": min(times, key=times.get)} and model[0].mode == modes["0"]
    with torch.no_grad():  # an empty batch times every mode too (gemm's output view failed on it)
        assert set(compress.choose_modes(model, x[:0], repeats=1, timing="eager", report=report).values()) <= set(times)
    assert report["0"]["gemm_ms"] > 0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_mode_cuda(dtype):
    m = _layer(C=40, N=48, keep=0.2, pool=True).to("cuda")
    x = torch.randn(16, 40, 4, 4, generator=torch.Generator().manual_seed(6), dtype=torch.float64).cuda()
    want = F.max_pool2d(F.conv2d(x, _masked_weight(m), m.bias, 1, 1).relu(), 2)
    m.to(dtype)
    m.mode = "gemm"
    with torch.no_grad():
        got = m(x.to(dtype).contiguous(memory_format=torch.channels_last)).double()
    err = ((got - want).norm() / want.norm()).item()
    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-3), err
