"""CUDAGraphModel: inference replayed from CUDA graphs, one per input signature.

Why: an eager forward pays host time for every layer (Python, dispatch, kernel launch: 19-38 us per conv module
call on an H200 host, benchmarks/results/stripe_eager_gpu_h200.json), so a CIFAR model at batch 256 is
host-bound. On an H200 host, bf16 batch 256, a stripe-pruned
ResNet-56 (random masks, 55% of MACs cut) ran eagerly in 4.74 ms against 4.20 ms for the dense model (0.89x, both
host-bound), and replayed from CUDA graphs in 0.94 ms against 1.64 ms (1.75x; real masks 2.07x)
(benchmarks/results/stripe_models_gpu_h200_launch.json).

    fast = compress.CUDAGraphModel(model.cuda().eval())
    y = fast(x)              # x: a CUDA tensor; the first call per input signature warms up and captures

A signature is x's shape, strides, dtype and device and the CUDA autocast dtype (None without autocast). For a
new one the wrapper runs the model 3 times on a side stream (Triton kernels compile, cuDNN picks algorithms),
captures one call into a graph that reads a static copy of x, and checks one replay against the last warm-up
call. Later calls copy x in, replay, and return a clone of the static output (``copy_output=False`` returns the
static output itself, overwritten by the next call).
Graphs share one memory pool; at most ``max_graphs`` are kept, the least recently used dropped first.

A graph holds the addresses of the model's parameters and buffers and of whatever the model derived from them
before the capture (StripeConv2d's zero-filled dense weight and kernel launcher; each graph keeps those alive
through the modules' ``graph_keepalive()``, so that another signature's capture cannot free them). After any
change to the model (new weights, in place or not, another dtype or device, module surgery) call ``reset()``; the
wrapper's own ``load_state_dict``, ``to``, ``cuda``, ``half`` and the like reset it.

Outputs never require grad (graphs run under ``torch.no_grad``); for training steps use
``torch.cuda.make_graphed_callables``. Replays run on the current stream; do not call one wrapper from two
streams or threads at once. Runs eagerly (no graph) where a graph cannot help or cannot be made: an input that is
not a CUDA tensor, or a model whose capture fails (host synchronisation in its forward, for example; one warning
naming the error; the device's CUDA random generator is put back to its state before the capture).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from compress._checks import check_module
from kernels._utils import autocast_dtype

__all__ = ["CUDAGraphModel"]

WARMUP_CALLS = 3
# the layers whose train mode changes what a replay computes or updates
_MODE_DEPENDENT = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)
# a replay runs the kernels an eager call does (cuDNN keeps its algorithm per shape), so it agrees with the last
# warm-up call to rounding; the check only guards against a graph reading memory it does not own
REPLAY_TOLERANCE = 1e-2


def _signature(x: torch.Tensor) -> tuple:
    return tuple(x.shape), x.stride(), x.dtype, x.device, autocast_dtype("cuda")


def _max_rel_diff(out, ref) -> float:
    """max |out - ref| / max |ref| over the tensors of two outputs of the same structure (float('inf') if the
    structures differ)."""
    outs, refs = tree_flatten(out)[0], tree_flatten(ref)[0]
    if len(outs) != len(refs):
        return float("inf")
    worst = 0.0
    for o, r in zip(outs, refs):
        if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor) and o.is_floating_point():
            scale = r.detach().abs().max().item() if r.numel() else 0.0
            diff = (o.detach().double() - r.detach().double()).abs().max().item() if r.numel() else 0.0
            worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def _clone(out):
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)


class _Captured:
    """One captured forward: the static input, the graph, its static output and the objects it reads that the
    model may replace later (``graph_keepalive()`` of its modules)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, static_x: torch.Tensor, static_out, keepalive: list):
        self.graph, self.static_x, self.static_out, self.keepalive = graph, static_x, static_out, keepalive

    def replay(self):
        """Re-run the captured forward on whatever static_x holds now; returns the static output."""
        self.graph.replay()
        return self.static_out


class CUDAGraphModel(nn.Module):
    """Wraps `model` (eval mode, on CUDA) so that calls replay CUDA graphs; see the module docstring.

    model(x) must take one tensor and return a tensor or a (nested) tuple/list/dict of tensors.
    """

    def __init__(self, model: nn.Module, max_graphs: int = 8, copy_output: bool = True):
        super().__init__()
        check_module("CUDAGraphModel", model)
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"CUDAGraphModel: max_graphs must be a positive int, got {max_graphs!r}")
        self.model = model
        self.max_graphs = max_graphs
        self.copy_output = copy_output
        self._graphs: OrderedDict[tuple, _Captured | None] = OrderedDict()  # None: capture failed, run eagerly
        self._pool = None

    def reset(self) -> None:
        """Drop every captured graph (the next call per signature captures again)."""
        self._graphs.clear()
        self._pool = None

    def forward(self, x: torch.Tensor, *rest, **kwargs):
        if rest or kwargs:
            raise TypeError(
                "CUDAGraphModel: the model is called with one tensor, got "
                f"{1 + len(rest)} positional and {len(kwargs)} keyword arguments; wrap a model that takes one input"
            )
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"CUDAGraphModel: expected a tensor, got {type(x).__name__}")
        captured = self._graph_for(x)
        if captured is None:
            with torch.no_grad():
                return self.model(x)
        captured.static_x.copy_(x)
        out = captured.replay()
        return _clone(out) if self.copy_output else out

    def capture(self, x: torch.Tensor) -> _Captured:
        """Capture model(x) now (kept like a call's) and return it: ``.static_x`` to fill, ``.replay()`` to run."""
        captured = self._graph_for(x)
        if captured is None:
            raise RuntimeError(f"CUDAGraphModel: no graph of {type(self.model).__name__} for this input (not a "
                               "CUDA tensor, or the capture failed: see the warning)")
        return captured

    def _graph_for(self, x: torch.Tensor) -> _Captured | None:
        """The graph for x's signature, captured now if new (least recently used dropped beyond max_graphs); None
        where x runs eagerly (not CUDA, or its capture failed)."""
        if self.model.training:
            raise RuntimeError(
                "CUDAGraphModel runs inference only: call .eval() first (in train mode BatchNorm would update "
                "its running statistics on every replay)"
            )
        if not x.is_cuda:
            return None
        key = _signature(x)
        if key in self._graphs:
            self._graphs.move_to_end(key)
            return self._graphs[key]
        # a graph replays the modes it was captured in: no BatchNorm or dropout of the model may be training then
        # (other modules' flags change nothing in PyTorch's layers: compaction's Identity modules may keep theirs)
        training = [name for name, m in self.model.named_modules() if m.training and isinstance(m, _MODE_DEPENDENT)]
        if training:
            raise RuntimeError(
                f"CUDAGraphModel runs inference only: {', '.join(training[:3])} {'is' if len(training) == 1 else 'are'} "
                "in train mode (a BatchNorm would update its running statistics on every replay); call .eval() on it"
            )
        captured = self._graphs[key] = self._capture(x, autocast=key[-1])
        if len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return captured

    def _capture(self, x: torch.Tensor, autocast: torch.dtype | None) -> _Captured | None:
        # Autocast (the caller's dtype, None when off) runs with its weight-cast cache off: a cast cached while
        # warming up would be read by the graph at an address the cache frees when the caller's autocast region ends.
        static_x = x.detach().clone()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(device=x.device)
        rng = torch.cuda.default_generators[x.device.index if x.device.index is not None else
                                            torch.cuda.current_device()]
        rng_before = None
        try:
            with torch.no_grad(), torch.autocast(
                "cuda", dtype=autocast or torch.float16, enabled=autocast is not None, cache_enabled=False
            ):
                stream.wait_stream(torch.cuda.current_stream(x.device))
                with torch.cuda.stream(stream):
                    for _ in range(WARMUP_CALLS):
                        eager_out = self.model(static_x)
                torch.cuda.current_stream(x.device).wait_stream(stream)
                rng_before = rng.clone_state()
                with torch.cuda.graph(graph, pool=self._pool):
                    static_out = self.model(static_x)
                graph.replay()
                diff = _max_rel_diff(static_out, eager_out)
        except Exception as err:  # noqa: BLE001 - any capture failure falls back to eager, with its message
            if rng_before is not None:
                # a capture that failed inside leaves the device's CUDA generator in capture mode (every later
                # random op on the device would raise "Offset increment outside graph capture"): put it back
                rng.graphsafe_set_state(rng_before)
            warnings.warn(
                f"CUDAGraphModel: capturing {type(self.model).__name__} for input {tuple(x.shape)} "
                f"{x.dtype} failed ({type(err).__name__}: {err}); this signature runs eagerly",
                stacklevel=4,
            )
            return None
        if not diff <= REPLAY_TOLERANCE:
            warnings.warn(
                f"CUDAGraphModel: the graph of {type(self.model).__name__} for input {tuple(x.shape)} {x.dtype} "
                f"computes something else than the eager model (max relative difference {diff:.2e}); this signature "
                "runs eagerly",
                stacklevel=4,
            )
            return None
        keepalive = [m.graph_keepalive() for m in self.model.modules() if hasattr(m, "graph_keepalive")]
        return _Captured(graph, static_x, static_out, keepalive)

    # ---- anything that changes the model's tensors invalidates the graphs ----------------------------------
    def _apply(self, fn, *args, **kwargs):
        self.reset()
        return super()._apply(fn, *args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        self.reset()
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def __getstate__(self) -> dict:
        """Copies and pickles keep the model, not the graphs (they hold this process's device memory)."""
        state = dict(super().__getstate__())
        state["_graphs"] = OrderedDict()
        state["_pool"] = None
        return state
