"""compress.CUDAGraphModel: CPU pass-through and errors; on CUDA, replays equal eager calls of the model (a compact
model with stripe-mode layers), across signatures, evictions, autocast and model changes."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn
from test_compact import skeleton_model

from compress import CUDAGraphModel, compact
from compress.stripe import StripeConv2d


def compact_resnet20() -> nn.Module:
    return compact(skeleton_model("resnet20", 32, seed=7), fold_bn=True).eval()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


def test_cpu_input_runs_the_model_without_grad():
    model = compact_resnet20()
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    graphed = CUDAGraphModel(model)
    out = graphed(x)
    with torch.no_grad():
        ref = model(x)
    assert torch.equal(out, ref) and not out.requires_grad
    assert len(graphed._graphs) == 0


def test_bad_use_is_a_clear_error():
    model = compact_resnet20()
    x = torch.randn(2, 3, 32, 32)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match=f"max_graphs must be a positive int, got {bad!r}"):
            CUDAGraphModel(model, max_graphs=bad)
    graphed = CUDAGraphModel(model)
    with pytest.raises(TypeError, match="one tensor"):
        graphed(x, x)
    with pytest.raises(TypeError, match="expected a tensor"):
        graphed([x])
    graphed.train()
    with pytest.raises(RuntimeError, match=r"\.eval\(\)"):
        graphed(x)


def test_copies_and_pickles_keep_the_model_not_the_graphs():
    graphed = CUDAGraphModel(compact_resnet20())
    graphed._graphs["sentinel"] = None
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    for other in (copy.deepcopy(graphed), pickle.loads(pickle.dumps(graphed))):
        assert len(other._graphs) == 0 and other._pool is None
        assert torch.equal(other(x), graphed(x))
    assert "sentinel" in graphed._graphs


# ---------------------------------------------------------------------------------------------------- CUDA
def cuda_model(dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    model = compact_resnet20().cuda().to(dtype).to(memory_format=torch.channels_last)
    for m in model.modules():
        if isinstance(m, StripeConv2d) and m.num_stripes:
            m.mode = "stripe"  # the Triton kernel and its kept launcher run inside the graph
    return model


def cuda_input(batch: int, dtype: torch.dtype, seed: int, channels_last: bool = True) -> torch.Tensor:
    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed)).cuda().to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


@pytest.mark.cuda
def test_replays_equal_eager_calls_across_signatures_and_evictions():
    model = cuda_model()
    graphed = CUDAGraphModel(model, max_graphs=2)
    # three signatures (two batch sizes, two layouts) in turn, so the LRU drops and recaptures graphs, and the
    # NCHW capture replaces each StripeConv2d's kept dense weight and launcher under the channels_last graphs
    sigs = [(8, True), (4, True), (8, False), (8, True), (4, True)]
    for step, (batch, cl) in enumerate(sigs * 2):
        x = cuda_input(batch, torch.bfloat16, seed=step, channels_last=cl)
        out = graphed(x)
        with torch.no_grad():
            ref = model(x)
        assert out.shape == ref.shape and not out.requires_grad
        assert rel_err(out, ref) < 1e-2, (step, batch, cl)
        assert len(graphed._graphs) <= 2 and all(g is not None for g in graphed._graphs.values())


@pytest.mark.cuda
def test_a_submodule_left_in_train_mode_is_refused_before_capture():
    """A graph replays the modes it was captured in: a module switched back to train mode inside an eval model (a
    BatchNorm would update its statistics on every replay) is named before any capture."""
    model = cuda_model()
    model.fc = nn.Sequential(nn.Dropout(0.5), model.fc)  # (compaction folded the BNs)
    name = "fc.0"
    model.get_submodule(name).train()
    graphed = CUDAGraphModel(model)
    with pytest.raises(RuntimeError, match=rf"{name} is in train mode .*call \.eval\(\)"):
        graphed(cuda_input(4, torch.bfloat16, seed=0, channels_last=True))
    assert not graphed._graphs


@pytest.mark.cuda
def test_output_is_a_copy_unless_asked_otherwise():
    model = cuda_model()
    x1, x2 = cuda_input(4, torch.bfloat16, 1), cuda_input(4, torch.bfloat16, 2)
    graphed = CUDAGraphModel(model)
    y1 = graphed(x1)
    y1_saved = y1.clone()
    y2 = graphed(x2)
    assert torch.equal(y1, y1_saved) and not torch.equal(y1, y2)
    static = CUDAGraphModel(model, copy_output=False)
    s1 = static(x1)
    s2 = static(x2)
    assert s1 is s2 and torch.equal(s2, y2)


@pytest.mark.cuda
def test_autocast_capture_survives_the_autocast_region():
    """A graph captured under autocast must not read weight casts from autocast's cache, which the end of the
    caller's autocast region frees."""
    model = cuda_model(torch.float32)
    graphed = CUDAGraphModel(model)
    x = cuda_input(8, torch.float32, 3)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        graphed(x)
    junk = [torch.full((1 << 20,), float("nan"), device="cuda") for _ in range(16)]  # reuse freed memory
    x2 = cuda_input(8, torch.float32, 4)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = graphed(x2)
        with torch.no_grad():
            ref = model(x2)
    del junk
    assert len(graphed._graphs) == 1 and out.dtype == ref.dtype
    assert torch.isfinite(out).all() and rel_err(out, ref) < 2e-2


@pytest.mark.cuda
def test_changes_through_the_wrapper_reset_the_graphs():
    model = cuda_model(torch.float32)
    graphed = CUDAGraphModel(model)
    x = cuda_input(4, torch.float32, 5)
    graphed(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for v in state.values():
        if v.is_floating_point():
            v.mul_(0.5)
    graphed.load_state_dict({f"model.{k}": v for k, v in state.items()})
    assert len(graphed._graphs) == 0
    with torch.no_grad():
        ref = model(x)
    assert rel_err(graphed(x), ref) < 1e-3
    graphed.half()
    assert len(graphed._graphs) == 0
    xh = x.half()
    with torch.no_grad():
        ref = model(xh)
    assert rel_err(graphed(xh), ref) < 1e-2


class _Syncs(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.conv(x)
        return y * float(y.abs().max().item() > 0)  # a host synchronisation: cannot be captured


@pytest.mark.cuda
def test_failed_capture_warns_and_runs_eagerly():
    model = _Syncs().cuda().eval()
    graphed = CUDAGraphModel(model)
    x = torch.randn(2, 3, 8, 8, device="cuda")
    with pytest.warns(UserWarning, match="capturing _Syncs"):
        out = graphed(x)
    with torch.no_grad():
        ref = model(x)
    assert torch.allclose(out, ref) and graphed._graphs[next(iter(graphed._graphs))] is None
    assert torch.allclose(graphed(x), ref)  # no second warning needed: remembered as eager
    # the failed capture left the CUDA random generator usable (it raised on every random op before)
    a = torch.randn(1000, device="cuda")
    assert a.std().item() > 0.5 and not torch.equal(a, torch.randn(1000, device="cuda"))
