"""Model surgery: find, replace and pair modules by name; find conv -> (BN, act) -> conv chains with
torch.fx, remove output channels along them, fold constant inputs and BatchNorm into convs."""

from __future__ import annotations

import copy
import inspect
import itertools
import sys
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from compress._checks import unwrapped
from compress._modes import LIBRARY_LOCK, evaluating, in_mode
from kernels._utils import is_channels_last

__all__ = [
    "conv_config",
    "get_module",
    "replace_module",
    "conv_bn_pairs",
    "Step",
    "Chain",
    "trace",
    "find_chains",
    "mode_graphs",
    "common_chains",
    "common_pairs",
    "conv_bn_pairs_traced",
    "read_directly",
    "read_outside_their_call",
    "hooked",
    "copy_model",
    "uninitialised",
    "WEIGHT_HOOKS",
    "reparametrizations",
    "refresh_weight",
    "left_alone",
    "called_once",
    "bn_remainder",
    "chain_constants",
    "consumer_columns",
    "consumers_unpadded",
    "fold_constant_inputs",
    "remove_channels",
    "fold_bn",
]


def conv_config(conv: nn.Conv2d) -> dict:
    """The JSON-serialisable constructor kwargs of `conv`: `nn.Conv2d(**conv_config(conv))` (or a subclass)
    builds an empty conv of the same shape and arguments."""
    return {
        "in_channels": conv.in_channels,
        "out_channels": conv.out_channels,
        "kernel_size": list(conv.kernel_size),
        "stride": list(conv.stride),
        "padding": conv.padding if isinstance(conv.padding, str) else list(conv.padding),
        "dilation": list(conv.dilation),
        "groups": conv.groups,
        "bias": conv.bias is not None,
        "padding_mode": conv.padding_mode,
    }


# torch's forward pre-hooks that set a module's `weight` from tensors of its own in every forward (weight_orig and
# weight_mask; weight_g and weight_v; weight_orig, u and v)
WEIGHT_HOOKS = (BasePruningMethod, WeightNorm, SpectralNorm)


@torch.no_grad()
def refresh_weight(m: nn.Module) -> None:
    """Run `m`'s `WEIGHT_HOOKS` (they set `m.weight` only in a forward: an optimizer step since left it stale)."""
    for hook in list(m._forward_pre_hooks.values()):
        if isinstance(hook, WEIGHT_HOOKS):
            hook(m, ())


def reparametrizations(m: nn.Module) -> list[str]:
    """The calls that make `m`'s computed weights plain tensors again: one per torch.nn.utils.prune,
    weight_norm/spectral_norm (old style) hook and torch.nn.utils.parametrize parametrization it has."""
    removals = {BasePruningMethod: "torch.nn.utils.prune.remove(module, {!r})",
                WeightNorm: "torch.nn.utils.remove_weight_norm(module, {!r})",
                SpectralNorm: "torch.nn.utils.remove_spectral_norm(module, {!r})"}
    calls = [call.format(getattr(hook, "_tensor_name", getattr(hook, "name", "weight")))
             for hook in m._forward_pre_hooks.values() for kind, call in removals.items() if isinstance(hook, kind)]
    if parametrize.is_parametrized(m):
        calls += [f"torch.nn.utils.parametrize.remove_parametrizations(module, {name!r})" for name in m.parametrizations]
    return calls


def copy_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, with the tensors that modules keep as plain attributes and that autograd computed
    detached (deepcopy refuses such non-leaf tensors: torch.nn.utils.prune's, weight_norm's and spectral_norm's
    `weight`, which their pre-hooks recompute in every forward, is one after a forward with grad enabled)."""
    computed = {id(t): t.detach().clone() for m in model.modules() for t in vars(m).values()
                if isinstance(t, torch.Tensor) and not t.is_leaf}
    return copy.deepcopy(model, computed)


def blank_conv(cls: type[nn.Conv2d], conv: nn.Conv2d, **kwargs) -> nn.Conv2d:
    """A `cls` conv with `conv`'s arguments (`conv_config`, plus `kwargs`), device, dtype and weight memory format
    (channels_last stays so), whose parameters and buffers the caller overwrites: they are left uninitialised (built
    on the meta device, then given memory, as `torch.nn.utils.skip_init` does), so compaction and skeleton attachment
    draw no numbers from the global random stream, nor save and restore it (which would undo another thread's
    draws), and spend no time initialising."""
    new = uninitialised(cls, **conv_config(conv), **kwargs, device=conv.weight.device, dtype=conv.weight.dtype)
    return new.to(memory_format=torch.channels_last) if is_channels_last(conv.weight) else new


def uninitialised(cls: type[nn.Module], *args, device: torch.device | str, **kwargs) -> nn.Module:
    """``cls(*args, **kwargs)`` on `device` with its tensors left uninitialised: built on the meta device (no numbers
    drawn from the random stream), then given memory, as `torch.nn.utils.skip_init` does."""
    return cls(*args, **kwargs, device="meta").to_empty(device=device)


def conv_like(new: nn.Module, old: nn.Module) -> nn.Module:
    """`new` (a conv built from conv `old`) in `old`'s train/eval mode, its weight and bias frozen where `old`'s are."""
    for name in ("weight", "bias"):
        if getattr(new, name, None) is not None and getattr(old, name, None) is not None:
            getattr(new, name).requires_grad_(getattr(old, name).requires_grad)
    return new.train(old.training)


def get_module(model: nn.Module, name: str) -> nn.Module:
    """Return the submodule at dotted path `name` ('' is the model itself)."""
    return model.get_submodule(name) if name else model


def replace_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put `new` at dotted path `name`, and at every other name the same module is registered under (an alias, as
    `self.norm = self.bn`: torch.fx calls it by its first name only), and return the module it replaced."""
    if not name:
        raise ValueError("replace_module: cannot replace the root module; build a new model instead")
    old = get_module(model, name)
    aliases = [n for n, m in model.named_modules(remove_duplicate=False) if m is old and n]
    for path in aliases or [name]:
        parent_name, _, child = path.rpartition(".")
        setattr(get_module(model, parent_name), child, new)
    return old


def conv_bn_pairs(model: nn.Module) -> dict[str, str]:
    """Map each Conv2d to the BatchNorm2d (a subclass, e.g. timm's BatchNormAct2d, or SyncBatchNorm) that normalises
    its output, by data flow: the conv's only user in the model's torch.fx graph is that BN, each called once
    (`conv_bn_pairs_traced(..., foldable=False)`). Registration order is not enough: Res2Net keeps its convs and BNs
    in two ModuleLists, and a pre-activation ResNet's next BN reads the residual sum. {} (with a warning) for a
    model torch.fx cannot trace. A torch.compile, DataParallel or DDP wrapper is looked through (names as in the
    model inside, as `swp_update` uses them)."""
    model = unwrapped(model)
    graphs = mode_graphs(model, "no BatchNorm channel is zeroed with its dead filter")
    return common_pairs(model, graphs, foldable=False) if graphs else {}


# ---- graph analysis ------------------------------------------------------------------------------
# per-channel affine maps in eval mode that surgery folds into the conv before them and slices with its filters:
# BatchNorm2d (and subclasses), SyncBatchNorm (a DDP model's, a BatchNorm in eval mode) and torchvision's
# FrozenBatchNorm2d (detection backbones; fixed statistics, buffers only), which torch.fx would otherwise trace
# into its arithmetic
def batch_norm_types() -> tuple[type, ...]:
    return (nn.BatchNorm2d, nn.SyncBatchNorm, *imported_classes("torchvision.ops", "FrozenBatchNorm2d"))


def is_batch_norm(m: nn.Module) -> bool:
    """Any BatchNorm (PyTorch's of any dimension and subclasses) or torchvision's FrozenBatchNorm2d: what "the model
    has BatchNorms" counts (compaction's record, export's fold check)."""
    return isinstance(m, (nn.modules.batchnorm._BatchNorm, *imported_classes("torchvision.ops", "FrozenBatchNorm2d")))


def imported_classes(module: str, *names: str) -> tuple[type, ...]:
    """The classes `names` of module `module` (e.g. "timm.layers", "BatchNormAct2d") where that module is imported,
    else (): isinstance/type checks against torchvision's and timm's classes without importing either (seconds
    each on a CPU: torchvision's ops import torch._dynamo). No instance of a class exists before its module is
    imported, so the checks lose nothing."""
    mod = sys.modules.get(module)
    return () if mod is None else tuple(getattr(mod, name) for name in names)
_ELEMENTWISE_MODULES = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SiLU, nn.GELU, nn.Hardswish, nn.Hardsigmoid,
    nn.Sigmoid, nn.Tanh, nn.Mish, nn.Identity, nn.Dropout, nn.Dropout2d,
)  # fmt: skip
_ELEMENTWISE_FUNCTIONS = {
    F.relu, F.relu_, torch.relu, torch.relu_, F.relu6, F.silu, F.gelu, F.hardswish, F.leaky_relu,
    torch.sigmoid, torch.tanh, F.dropout,
}  # fmt: skip
_ELEMENTWISE_METHODS = {"relu", "relu_", "sigmoid", "tanh"}
# pools map a spatially constant channel to the same constant
_POOL_MODULES = (nn.MaxPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
_POOL_FUNCTIONS = {F.max_pool2d, F.adaptive_avg_pool2d}


@dataclass
class Step:
    """One channel-wise op between a producer conv and its consumers.

    kind: "module" (`target` is a module name), "function" or "method" (applied with `args`/`kwargs`
    after the tensor), or "pool" (maps a constant channel to itself; nothing to apply).
    """

    kind: str
    target: Any = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass
class Chain:
    """A conv whose output channels reach only channel-wise steps and then the input channels of
    `consumers` (convs with groups 1, or one Linear after a flatten), so that any output channel can be
    removed together with its BN channel and the consumers' matching inputs."""

    producer: str
    steps: list[Step]
    consumers: list[str]


class _Tracer(fx.Tracer):
    """Keeps convs and the extension modules (docs/INTERFACES.md: a `config()` method and a type registered for
    compact files, as StripeConv2d and PiXBlock) as leaves. A user's module that merely has a method named config is
    traced through: as a leaf it hid the convs and weight reads inside it."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        from compress.checkpoint import _type_key  # (here: compress.checkpoint imports this module)

        return (
            isinstance(m, (nn.Conv2d, *batch_norm_types()))  # BN subclasses too (timm's BatchNormAct2d)
            or (callable(getattr(m, "config", None)) and _type_key(m) is not None)
            or super().is_leaf_module(m, qualname)
        )


def trace(model: nn.Module, consequence: str | None = "dead filters are kept and BatchNorm is not folded",
          training: bool = False, flags: dict[str, bool] | None = None) -> fx.Graph | None:
    """The torch.fx graph of `model` traced in eval mode (`training`: in training mode), or None (with a warning
    saying the `consequence`; none when it is None) if tracing fails. `flags`: the forward's bool arguments fixed
    to these values (fx ``concrete_args``; default: the first of `flag_settings`, their defaults).

    Traced on a copy of the modules that shares their tensors (parameters, buffers, tensor attributes: none is
    copied): tracing runs the forward on proxies, and a forward that keeps values on its modules (timm's feature
    hooks, a cached activation) left proxies in the caller's model, which then failed to copy, save or compact. A
    model that cannot be copied, or whose copy does not trace (a weak reference back to the original), is traced
    itself."""
    graph, failure = _trace(model, training, flag_settings(model)[0] if flags is None else flags)
    if graph is None and consequence is not None:
        warnings.warn(
            f"torch.fx cannot trace {type(model).__name__} ({type(failure).__name__}: {failure}); {consequence}. "
            "Make the forward traceable to enable that.",
            stacklevel=3,
        )
    return graph


def _trace(model: nn.Module, training: bool, flags: dict[str, bool]) -> tuple[fx.Graph | None, Exception | None]:
    """(`trace`'s graph, None), or (None, the error of the last attempt)."""
    shared = {id(t): t for m in model.modules() for t in (*m._parameters.values(), *m._buffers.values(),
                                                          *vars(m).values()) if isinstance(t, torch.Tensor)}
    try:
        copied = copy.deepcopy(model, shared)
    except Exception:  # noqa: BLE001 - a model that cannot be copied is traced itself
        copied = None
    failure = None
    for target in (t for t in (copied, model) if t is not None):
        try:
            with LIBRARY_LOCK, in_mode(target, training):  # (fx patches nn.Module.__call__ process-wide meanwhile)
                return _Tracer().trace(target, concrete_args=flags or None), None
        except Exception as err:  # noqa: BLE001 - any tracing failure means: no graph-based surgery
            failure = err
    return None, failure


MAX_FLAGS = 3  # bool forward arguments traced at every combination of values (2 ** 3 settings per mode at most)


def flag_settings(model: nn.Module) -> list[dict[str, bool]]:
    """Every combination of values of the forward's bool arguments (after the first; those with a bool default),
    the defaults first: fx traces a branch on one (``forward(x, return_features=False)`` with ``if
    return_features:``) only as a constant, and surgery must hold for each value, since the compact model keeps the
    argument. [{}] for none, or for more than MAX_FLAGS (left to fx as before: such a branch does not trace)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return [{}]
    defaults = {p.name: p.default for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                and isinstance(p.default, bool)}
    if not defaults or len(defaults) > MAX_FLAGS:
        return [{}]
    names = list(defaults)
    combos = [dict(zip(names, values)) for values in itertools.product((False, True), repeat=len(names))]
    return sorted(combos, key=lambda c: c != defaults)  # (stable: the defaults first, then the rest in order)


def mode_graphs(model: nn.Module, consequence: str | None = "dead filters are kept and BatchNorm is not folded",
                quiet: bool = False) -> list[fx.Graph]:
    """The forward's graphs that surgery must hold in: the eval-mode graph at the bool arguments' defaults
    (`trace`) first, then each other one that differs from those before it: training mode (a forward that
    branches on ``self.training``: an auxiliary head that reads a layer in training only; a change made by the
    eval graph alone broke such a model's training forward) and the other values of its bool arguments
    (`flag_settings`). [] where the first does not trace; another that does not trace is left out with a warning
    naming it unless `quiet` (surgery then holds in the forwards that traced)."""
    settings = flag_settings(model)
    graph = trace(model, consequence, flags=settings[0])
    if graph is None:
        return []
    graphs, untraced = [graph], []
    for training, flags in itertools.product((False, True), settings):
        if not training and flags is settings[0]:
            continue
        other, failure = _trace(model, training, flags)
        if other is None:
            untraced.append((" in training mode" if training else "")
                            + "".join(f" with {k}={v}" for k, v in flags.items() if v != settings[0][k])
                            + f" ({type(failure).__name__}: {str(failure).splitlines()[0] if str(failure) else ''})")
        elif all(str(other) != str(g) for g in graphs):
            graphs.append(other)
    if untraced and not quiet:
        warnings.warn(f"torch.fx cannot trace {type(model).__name__}'s forward{'; nor'.join(untraced)}: what compress "
                      "changes by the graph holds in the forward it traced (eval mode, the defaults) but may break "
                      "that one; make it traceable", stacklevel=3)
    return graphs


def common_pairs(model: nn.Module, graphs: list[fx.Graph], foldable: bool = True) -> dict[str, str]:
    """`conv_bn_pairs_traced` of the first graph, less the pairs that another of `graphs` (`mode_graphs`) lacks."""
    pairs = conv_bn_pairs_traced(model, graphs[0], foldable)
    for graph in graphs[1:]:
        other = conv_bn_pairs_traced(model, graph, foldable)
        pairs = {conv: bn for conv, bn in pairs.items() if other.get(conv) == bn}
    return pairs


def common_chains(model: nn.Module, graphs: list[fx.Graph]) -> list[Chain]:
    """`find_chains` of the first graph that every other of `graphs` (`mode_graphs`) has too, step for step."""
    others = [find_chains(model, graph) for graph in graphs[1:]]
    return [chain for chain in find_chains(model, graphs[0]) if all(chain in chains for chains in others)]


def _only_input(node: fx.Node, src: fx.Node) -> bool:
    """`node` reads `src` as its first argument and no other graph value."""
    others: list[fx.Node] = []
    fx.node.map_arg((node.args[1:], node.kwargs), others.append)
    return bool(node.args) and node.args[0] is src and not others


def read_directly(graph: fx.Graph) -> set[str]:
    """Names of the modules whose parameters or buffers the forward reads itself (fx `get_attr` nodes, as in
    `F.conv2d(x, self.conv.weight)`), not only by calling the module. Surgery leaves them alone: a skeleton, a folded
    BN or removed channels would change, or break, what those reads see."""
    return {n.target.rpartition(".")[0] for n in graph.nodes if n.op == "get_attr"}


_aten = torch.ops.aten
# ops that read only a tensor's shape, dtype and device, not its values
_SHAPE_ONLY = frozenset({
    _aten.empty_like, _aten.zeros_like, _aten.ones_like, _aten.full_like, _aten.rand_like, _aten.randn_like,
    _aten.randint_like, _aten.new_empty, _aten.new_empty_strided, _aten.new_zeros, _aten.new_ones, _aten.new_full,
})


def read_outside_their_call(model: nn.Module, x: torch.Tensor, names) -> set[str]:
    """Which of the modules `names` of `model` have a parameter or buffer that an op reads while the module's own
    forward is not running, in one eval forward of `x` (no grad): `read_directly` for a forward fx cannot trace,
    watched at the dispatcher. Views count (a slice of the weight reads it); ops that take only a tensor's shape
    (`zeros_like`, `new_zeros`, ...) do not. Tensors several of `names` share (tied weights) are read inside any of
    their calls. Each module's mode and `x` are left as they were."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    owners = defaultdict(set)  # storage address of each module's tensors -> the modules holding it
    for name in names:
        for t in [*get_module(model, name).parameters(recurse=False), *get_module(model, name).buffers(recurse=False)]:
            if t.numel():
                owners[t.untyped_storage().data_ptr()].add(name)
    running = Counter()  # the modules of `names` whose forward (hooks included) is running
    found = set()

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket not in _SHAPE_ONLY:
                for t in tree_leaves((args, kwargs)):
                    if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                        held = owners.get(t.untyped_storage().data_ptr(), ())
                        if held and not any(running[n] for n in held):
                            found.update(held)
            return func(*args, **(kwargs or {}))

    def enter(name):
        return lambda mod, inputs: running.update([name])

    def leave(name):
        def fn(mod, inputs, out):
            if running[name]:  # (its pre-hook ran: none before it raised)
                running[name] -= 1

        return fn

    handles = []
    for name in names:
        m = get_module(model, name)  # first in, last out: its own hooks (weight_norm's) run inside
        handles += [m.register_forward_pre_hook(enter(name), prepend=True),
                    m.register_forward_hook(leave(name), always_call=True)]
    try:
        with evaluating(model), torch.no_grad(), Watch():
            model(x.clone())  # a forward may work on its input in place
    finally:
        for h in handles:
            h.remove()
    return found


def hooked(model: nn.Module) -> set[str]:
    """Names of the modules with forward hooks or pre-hooks of their own, which surgery leaves alone: a hook may read
    or set their tensors (the old-style torch.nn.utils.weight_norm and spectral_norm recompute the weight in one)."""
    return {name for name, m in model.named_modules() if _has_hooks(m)}


def _has_hooks(m: nn.Module) -> bool:
    return bool(m._forward_pre_hooks or m._forward_hooks)


def left_alone(graph: fx.Graph, model: nn.Module) -> set[str]:
    """Names of the modules of `model` that surgery leaves as they are however often they are called: those whose
    tensors the forward also reads directly (`read_directly`) and those with hooks of their own (`hooked`)."""
    return read_directly(graph) | hooked(model)


def called_once(graph: fx.Graph, model: nn.Module) -> set[str]:
    """Names of the modules of `model` its graph calls exactly once, minus those `left_alone`: the modules surgery
    may change (one shared by several call sites is left alone too)."""
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    return {name for name, count in calls.items() if count == 1} - left_alone(graph, model)


def _channelwise_step(model: nn.Module, node: fx.Node, src: fx.Node, channels: int, once: set[str]):
    if not _only_input(node, src):
        return None
    args, kwargs = tuple(node.args[1:]), dict(node.kwargs)
    if node.op == "call_module":
        m = model.get_submodule(node.target)
        if _has_hooks(m) or parametrize.is_parametrized(m):
            return None  # left alone: a hook may read its channels (feature capture, a per-channel scale), and a
            # parametrized weight cannot be sliced by setting it (that needs an inverse the parametrization may lack)
        if isinstance(m, batch_norm_types()):  # in eval mode a fixed per-channel map, unless it keeps no statistics
            ok = m.running_mean is not None and m.running_mean.numel() == channels and node.target in once
            return Step("module", node.target) if ok else None
        if isinstance(m, _ELEMENTWISE_MODULES):
            return Step("module", node.target)
        return Step("pool") if isinstance(m, _POOL_MODULES) else None
    if node.op == "call_function" and node.target in _ELEMENTWISE_FUNCTIONS:
        return Step("function", node.target, args, kwargs)
    if node.op == "call_function" and node.target in _POOL_FUNCTIONS:
        return Step("pool")
    if node.op == "call_method" and node.target in _ELEMENTWISE_METHODS:
        return Step("method", node.target, args, kwargs)
    return None


def is_elementwise(model: nn.Module, node: fx.Node) -> bool:
    """Whether `node` applies an elementwise activation, Identity or dropout (`_ELEMENTWISE_*`) or a BatchNorm to
    its first argument alone: its output has that argument's shape and depends on nothing else."""
    if not node.args or not isinstance(node.args[0], fx.Node) or not _only_input(node, node.args[0]):
        return False
    if node.op == "call_module":
        return isinstance(model.get_submodule(node.target), (*_ELEMENTWISE_MODULES, *batch_norm_types()))
    if node.op == "call_function":
        return node.target in _ELEMENTWISE_FUNCTIONS
    return node.op == "call_method" and node.target in _ELEMENTWISE_METHODS


def _is_flatten(node: fx.Node) -> bool:
    is_fn = node.op == "call_function" and node.target is torch.flatten
    is_method = node.op == "call_method" and node.target == "flatten"
    if not (is_fn or is_method):
        return False
    start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
    end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
    return start == 1 and end == -1


def _flattened(model: nn.Module, cur: fx.Node, once: set[str]) -> fx.Node | None:
    """The node that flattens `cur` (B, C, H, W) to (B, C*H*W) when that is all `cur` feeds (torch.flatten(x, 1),
    x.flatten(1), a once-called nn.Flatten(), x.view(x.size(0), -1) or its reshape), after it any once-called
    nn.Dropout / nn.Identity modules (eval: no change); else None."""
    users = list(cur.users)
    flat = None
    if len(users) == 1 and _is_flatten(users[0]) and _only_input(users[0], cur):
        flat = users[0]
    elif len(users) == 1 and users[0].op == "call_module" and users[0].target in once and users[0].args == (cur,):
        m = get_module(model, users[0].target)
        flat = users[0] if type(m) is nn.Flatten and (m.start_dim, m.end_dim) == (1, -1) else None
    elif len(users) == 2:  # x.view(x.size(0), -1): the size call and the view
        size = next((u for u in users if u.op == "call_method" and u.target == "size" and u.args == (cur, 0)), None)
        view = next((u for u in users if u is not size), None)
        if (size is not None and list(size.users) == [view] and view.op == "call_method"
                and view.target in ("view", "reshape") and view.args == (cur, size, -1) and not view.kwargs):
            flat = view
    while flat is not None and len(flat.users) == 1:
        (nxt,) = flat.users
        if not (nxt.op == "call_module" and nxt.target in once and nxt.args == (flat,) and not nxt.kwargs
                and type(get_module(model, nxt.target)) in (nn.Dropout, nn.Identity)):
            break
        flat = nxt
    return flat


def _consumer(model: nn.Module, node: fx.Node, src: fx.Node, channels: int, once: set[str],
              cls) -> bool:
    if node.op != "call_module" or node.args != (src,) or node.kwargs or node.target not in once:
        return False
    m = model.get_submodule(node.target)
    if cls is nn.Linear:
        return type(m) is nn.Linear and m.in_features % channels == 0
    return type(m) is nn.Conv2d and m.groups == 1 and m.in_channels == channels


def _chain_from(model: nn.Module, node: fx.Node, once: set[str]) -> Chain | None:
    channels = model.get_submodule(node.target).out_channels
    steps, cur = [], node
    while True:
        users = list(cur.users)
        if users and all(_consumer(model, u, cur, channels, once, nn.Conv2d) for u in users):
            return Chain(node.target, steps, [u.target for u in users])
        flat = _flattened(model, cur, once)
        if flat is not None:
            linear = list(flat.users)
            if len(linear) == 1 and _consumer(model, linear[0], flat, channels, once, nn.Linear):
                return Chain(node.target, steps, [linear[0].target])
            return None
        if len(users) != 1:
            return None
        (user,) = users
        step = _channelwise_step(model, user, cur, channels, once)
        if step is None:
            return None
        steps.append(step)
        cur = user


def find_chains(model: nn.Module, graph: fx.Graph) -> list[Chain]:
    """Chains of every Conv2d (groups 1, called once) whose output channels can be removed, in graph order.

    Never returns a conv feeding a residual add, a concatenation or anything but channel-wise ops
    (BN, activations, dropout, max/adaptive pools) followed by convs or a flatten (`_flattened`) -> Linear, nor a
    chain through a module that `called_once` leaves alone.
    """
    once = called_once(graph, model)
    chains = []
    for node in graph.nodes:
        if node.op != "call_module" or node.target not in once:
            continue
        m = model.get_submodule(node.target)
        if type(m) is nn.Conv2d and m.groups == 1:
            chain = _chain_from(model, node, once)
            if chain is not None:
                chains.append(chain)
    return chains


def bn_remainder(bn: nn.Module) -> nn.Module | None:
    """What stands in the place of BatchNorm module `bn` once it is folded into the conv before it: nn.Identity for
    a BatchNorm2d, SyncBatchNorm or torchvision's FrozenBatchNorm2d, the activation of timm's BatchNormAct2d (BN -> drop -> act; only
    with drop an Identity); None for other BN subclasses, which are not folded (their forward may do more than
    normalise)."""
    if getattr(bn, "running_mean", None) is None:  # normalises by each batch's statistics, even in eval mode
        return None
    if type(bn) in batch_norm_types():
        return nn.Identity()
    if type(bn) in imported_classes("timm.layers", "BatchNormAct2d") and isinstance(bn.drop, nn.Identity):
        return bn.act
    return None


def foldable_conv(conv: nn.Module) -> bool:
    """Whether a BN after `conv` folds into its weight and bias: nn.Conv2d itself and timm's Conv2dSame (it only pads
    dynamically) use them as stored. Not weight-standardising subclasses (timm's StdConv2d, ScaledStdConv2d: their
    forward would undo a folded scale) or parametrised weights (weight_norm)."""
    return (type(conv) is nn.Conv2d or type(conv) in imported_classes("timm.layers", "Conv2dSame")) and not parametrize.is_parametrized(conv)


def conv_bn_pairs_traced(model: nn.Module, graph: fx.Graph, foldable: bool = True) -> dict[str, str]:
    """Map each Conv2d (called once) whose only user is a BatchNorm2d (called once) to that BN's name; with
    `foldable`, only pairs that fold: a `foldable_conv` and a BN that `bn_remainder` can fold. Neither may have
    tensors the forward also reads directly (`read_directly`)."""
    once = called_once(graph, model)
    pairs = {}
    for node in graph.nodes:
        if node.op != "call_module" or node.target not in once:
            continue
        conv = model.get_submodule(node.target)
        if not isinstance(conv, nn.Conv2d) or (foldable and not foldable_conv(conv)) or len(node.users) != 1:
            continue
        (user,) = node.users
        if user.op == "call_module" and user.args == (node,) and user.target in once:
            bn = model.get_submodule(user.target)
            if isinstance(bn, batch_norm_types()) and (not foldable or bn_remainder(bn) is not None):
                pairs[node.target] = user.target
    return pairs


# ---- channel surgery -----------------------------------------------------------------------------
@torch.no_grad()
def chain_constants(model: nn.Module, chain: Chain) -> torch.Tensor:
    """(C,) the value each producer channel reaches the consumers with when its filter is all zero
    (the producer's bias, or 0, through the chain's steps with BN in eval mode)."""
    producer = get_module(model, chain.producer)
    w = producer.weight
    x = producer.bias.detach().clone() if producer.bias is not None else w.new_zeros(w.shape[0])
    x = x.view(1, -1, 1, 1)
    for step in chain.steps:
        if step.kind == "module":
            m = get_module(model, step.target)
            with evaluating(m):
                x = m(x.clone())
        elif step.kind == "function":
            x = step.target(x.clone(), *step.args, **step.kwargs)
        elif step.kind == "method":
            x = getattr(x.clone(), step.target)(*step.args, **step.kwargs)
    return x.flatten()


def _set_param(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace (or add) Parameter `name` of `module` by `value`, keeping requires_grad (a new bias takes the
    weight's: a frozen conv stays frozen). `value` is a tensor of the caller's own (a slice by a mask, a product, a
    sum; not a view of a tensor a model keeps): it is not copied again (a copy held a large layer three times over,
    the old weight, the slice and its copy, at compaction's peak)."""
    old = getattr(module, name)
    requires_grad = (old if old is not None else module.weight).requires_grad
    if old is not None and is_channels_last(old) and value.dim() == 4:  # (a channels_last model stays so)
        value = value.contiguous(memory_format=torch.channels_last)
    setattr(module, name, nn.Parameter(value.detach(), requires_grad=requires_grad))


def consumer_columns(model: nn.Module, chain: Chain, name: str) -> torch.Tensor:
    """The consumer's weight viewed as (out, C, k) with C the producer's channels (k = kernel or hw)."""
    m = get_module(model, name)
    channels = get_module(model, chain.producer).out_channels
    return m.weight.detach().reshape(m.weight.shape[0], channels, -1)


@torch.no_grad()
def fold_constant_inputs(model: nn.Module, chain: Chain, values: torch.Tensor, channels: torch.Tensor) -> None:
    """Producer channels where `channels` (bool, (C,)) is True carry the constant `values` (C,): add their
    contribution to each consumer's bias and zero their weights (in place). Exact for consumers that
    do not pad their input (checked) and for zero values."""
    values = torch.where(channels, values, torch.zeros_like(values))
    for name in chain.consumers:
        m = get_module(model, name)
        if bool(values.any()) and isinstance(m, nn.Conv2d) and any(p != 0 for p in _padding(m)):
            raise ValueError(f"fold_constant_inputs: consumer {name!r} pads its input; folding is not exact")
        cols = consumer_columns(model, chain, name)
        if bool(values.any()):
            shift = (cols * values.to(cols.dtype)[None, :, None]).sum((1, 2))
            _set_param(m, "bias", shift if m.bias is None else m.bias + shift)
        cols = cols * (~channels).to(cols.dtype)[None, :, None]
        _set_param(m, "weight", cols.reshape(m.weight.shape))


def _padding(conv: nn.Conv2d) -> tuple[int, ...]:
    if isinstance(conv.padding, str):
        return (0,) if conv.padding == "valid" else (1,)
    return conv.padding


def consumers_unpadded(model: nn.Module, chain: Chain) -> bool:
    """True when no consumer pads its input (so a constant input channel adds a constant to its output)."""
    mods = [get_module(model, n) for n in chain.consumers]
    return all(not isinstance(m, nn.Conv2d) or all(p == 0 for p in _padding(m)) for m in mods)


@torch.no_grad()
def remove_channels(model: nn.Module, chain: Chain, keep: torch.Tensor) -> None:
    """Keep only the producer output channels where `keep` (bool, (C,)) is True: slice the producer's
    weight and bias, every BN of the chain, and the consumers' input channels (in place)."""
    producer = get_module(model, chain.producer)
    _set_param(producer, "weight", producer.weight[keep])
    if producer.bias is not None:
        _set_param(producer, "bias", producer.bias[keep])
    producer.out_channels = int(keep.sum())
    for step in chain.steps:
        m = get_module(model, step.target) if step.kind == "module" else None
        if isinstance(m, batch_norm_types()):
            for attr in ("weight", "bias", "running_mean", "running_var"):
                t = getattr(m, attr)
                if isinstance(t, nn.Parameter):
                    _set_param(m, attr, t[keep])
                elif t is not None:  # a buffer (running statistics; FrozenBatchNorm2d's weight and bias)
                    setattr(m, attr, t[keep])
            if hasattr(m, "num_features"):
                m.num_features = int(keep.sum())
    for name in chain.consumers:
        m = get_module(model, name)
        w = m.weight.reshape(m.weight.shape[0], keep.numel(), -1)[:, keep]
        if isinstance(m, nn.Linear):
            _set_param(m, "weight", w.reshape(w.shape[0], -1))
            m.in_features = w.shape[1] * w.shape[2]
        else:
            _set_param(m, "weight", w.reshape(w.shape[0], w.shape[1], *m.kernel_size))
            m.in_channels = w.shape[1]


@torch.no_grad()
def fold_bn(conv: nn.Conv2d, bn: nn.Module) -> None:
    """Fold eval-mode `bn` (one of `batch_norm_types()`) into the preceding `conv` (in place): conv(x) then bn == the new
    conv(x)."""
    if bn.running_mean is None:
        raise ValueError("fold_bn: BatchNorm without running statistics cannot be folded")
    scale = torch.rsqrt(bn.running_var + bn.eps)
    if bn.weight is not None:
        scale = scale * bn.weight
    bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
    bias = (bias - bn.running_mean) * scale
    if bn.bias is not None:
        bias = bias + bn.bias
    _set_param(conv, "weight", conv.weight * scale.view(-1, *([1] * (conv.weight.dim() - 1))))
    _set_param(conv, "bias", bias)
