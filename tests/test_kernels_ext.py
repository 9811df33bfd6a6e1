"""The lazy CUDA-extension loader: one warning and a None module where the extension cannot be built."""

import os
import stat
import warnings

import pytest
import torch

import kernels
from kernels import _ext


@pytest.fixture
def fresh_loader():
    _ext.reset_for_tests()
    yield
    _ext.reset_for_tests()


def test_fallback_warns_once(monkeypatch, fresh_loader):
    monkeypatch.setenv("COMPRESS_KERNELS_NO_CUDA", "1")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert _ext.load() is None
        assert _ext.load() is None
        x = torch.randn(2, 8, 3, 3)
        kernels.pix(x, torch.rand(2, 2, 1, 1), 4)  # the PyTorch path still runs
    msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1
    assert "CUDA extension 'compress_kernels_ext' is unavailable (COMPRESS_KERNELS_NO_CUDA is set)" in msgs[0]


def test_cuda_home_prefers_env(monkeypatch, tmp_path):
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert _ext.cuda_home() == str(tmp_path)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "missing"))
    assert _ext.cuda_home() != str(tmp_path / "missing")


def test_build_dir_is_versioned(monkeypatch, tmp_path):
    monkeypatch.setenv("COMPRESS_KERNELS_CACHE", str(tmp_path))
    d = _ext.build_dir("x")
    assert d.startswith(str(tmp_path)) and os.path.isdir(d) and torch.__version__.replace("+", "_") in d


def test_sources_exist():
    for s in _ext.SOURCES:
        assert os.path.exists(os.path.join(_ext.CSRC, s)), s


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dw = kernels.DepthwiseConv2d(8, 3, padding=1)
        self.conv = kernels.Im2colConv2d(8, 8, 3, padding=1, groups=2)

    def forward(self, x, p):
        return kernels.pix(self.conv(self.dw(x)), p, 4)


def test_torch_export_keeps_the_ops():
    m = _Net().eval()
    x, p = torch.randn(2, 8, 6, 6), torch.rand(2, 2, 1, 1)
    ep = torch.export.export(m, (x, p))
    names = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"compress.depthwise_conv2d.default", "compress.conv2d.default", "compress.pix.default"} <= names
    torch.testing.assert_close(ep.module()(x, p), m(x, p))


def test_cli_build_builds_the_cpu_kernels_without_a_gpu(monkeypatch, capsys):
    """`python -m kernels build` on a machine without a GPU builds the C++ CPU kernels (it built nothing and exited
    1, so an image could not prebuild them) and skips the CUDA extension, exit 0; a CPU library that cannot be
    built is a failure."""
    from kernels import __main__ as cli
    from kernels import _cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cli._ext, "load", lambda verbose=False: pytest.fail("no GPU: the CUDA build is skipped"))
    monkeypatch.setattr(_cpu, "lib", lambda: object())
    assert cli.main(["build"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "build: C++ CPU kernels ok", "build: CUDA extension skipped (no CUDA GPU or a CPU-only PyTorch build)"]
    monkeypatch.setattr(_cpu, "lib", lambda: None)
    assert cli.main(["build"]) == 1


def test_cli_build_takes_verbose_and_arch_list_is_checked(monkeypatch):
    """`python -m kernels build -v` parses (it was refused by argparse); TORCH_CUDA_ARCH_LIST must name compute
    capabilities (empty: the default 9.0)."""
    from kernels import __main__ as cli

    seen = {}
    monkeypatch.setattr(cli._ext, "load", lambda verbose=False: seen.setdefault("verbose", verbose))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert cli.main(["build", "-v"]) == 0 and seen == {"verbose": True}
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a;9.0+PTX")
    assert cli._arch_flags() == ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
                                 "-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_90,code=compute_90"]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "")
    assert cli._arch_flags() == ["-gencode=arch=compute_90,code=sm_90"]
    for bad in ("Hopper", "9"):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", bad)
        with pytest.raises(SystemExit, match=rf"TORCH_CUDA_ARCH_LIST entry '{bad}' is not a compute capability"):
            cli._arch_flags()


def test_huge_or_grid_overflowing_calls_take_the_pytorch_path(monkeypatch):
    """The compiled CUDA kernels index in 32 bits, with grid-stride loops that step up to a million past their end
    before the check, and put the batch or channels in grid y/z (at most 65535). Calls beyond that take the
    PyTorch path (routing checked on meta tensors, the extension and Triton stubbed): an output of 2^31 elements
    from a small input (depthwise with large padding: the kernel raised "output too large"), and a stripe conv whose
    output channel planes pass 2^31 (NCHW offsets wrapped, writing outside y) or whose pixel rows do."""
    from kernels import _utils, depthwise, stripe, stripe_triton

    meta = dict(device="meta", dtype=torch.bfloat16)
    limit = _utils.INDEX_LIMIT
    assert 2**31 - limit > 2**20 and _utils.use_kernel(torch.empty(4, 8, 16, 16, **meta))
    for shape in ((1, 1, limit), (65536, 8, 2, 2), (1, 65536, 4, 4), (1, 8, 16383, 16383)):
        assert not _utils.use_kernel(torch.empty(shape, **meta)), shape
    assert not _utils.use_kernel(torch.empty(4, 8, 16, 16, **meta), out_elements=limit)
    assert not _utils.use_kernel(torch.empty(4, 8, 16, 16, device="meta", dtype=torch.float64))

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(_ext, "load", lambda *a, **k: type("Ext", (), {"__getattr__": lambda s, n: no_kernel})())
    x = torch.empty(1, 2, 3, 3, **meta)  # output (1, 2, 33001, 33001): 2.18e9 elements
    y = depthwise._dw_cuda(x, torch.empty(2, 1, 3, 3, **meta), None, [1, 1], [16500, 16500], [1, 1])
    assert y.shape == (1, 2, 33001, 33001)

    calls = []
    monkeypatch.setattr(stripe_triton, "available", lambda x: True)
    monkeypatch.setattr(stripe_triton, "forward", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(stripe, "_forward_torch", lambda *a, **k: calls.append("torch"))
    oi, off = torch.tensor([0, 1]), torch.tensor([[0, 1], [1, 1]])
    for n, b, hw, want in ((513, 1, 2048, "torch"), (8, 1, 2048, "triton"), (8, 130, 4096, "torch"),
                           (513, 1, 512, "triton")):
        x = torch.empty(b, 1, hw, hw, **meta)
        stripe._stripe_cuda(x, torch.empty(2, 1, **meta), oi.to("meta"), off.to("meta"), None,
                            kernels.stripe_plan(oi, off, n, (3, 3)).to("meta"), n, [3, 3], [1, 1], [1, 1], [1, 1],
                            False)
        assert calls.pop() == want, (n, b, hw)
