"""torch.func transforms (grad, vmap, per-sample gradients) on stripe convs and PiX models: our torch.library ops
have no functorch rules, so under a transform the modules compute the same function with standard ops. The
reference is plain autograd on the same model, per sample for per-sample gradients."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from randomize import random_bn_

import compress
from compress.stripe import StripeConv2d


def _stripe_layer(mode: str, relu: bool, pool: bool, device: str) -> tuple[StripeConv2d, torch.Tensor]:
    """(the layer, its source conv's weight with the dropped stripes zeroed: a reference independent of the
    layer's own dense_weight())."""
    gen = torch.Generator().manual_seed(1)
    conv = nn.Conv2d(6, 8, 3, padding=1, bias=True)
    mask = torch.rand(8, 3, 3, generator=gen) < 0.4
    mask[0] = False  # a dead filter
    layer = StripeConv2d.from_dense(conv, mask, mode=mode)
    layer.relu, layer.pool = relu, pool
    return layer.to(device).eval(), (conv.weight * mask[:, None]).detach().to(device)


def _per_sample_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """d(sum of squares of model(x[i]))/d(params) for each sample i, with torch.func.vmap over torch.func.grad."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi):
        return torch.func.functional_call(model, p, (xi.unsqueeze(0),)).square().sum()

    return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)


def _autograd_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same per-sample gradients, one plain autograd backward per sample (the model's own ops)."""
    rows = []
    for xi in x:
        model.zero_grad(set_to_none=True)
        model(xi.unsqueeze(0)).square().sum().backward()
        rows.append({k: v.grad.clone() for k, v in model.named_parameters()})
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _assert_close(got: dict, want: dict, rtol: float) -> None:
    assert got.keys() == want.keys()
    for k in want:
        scale = want[k].abs().max().clamp_min(1e-30)
        assert (got[k] - want[k]).abs().max() <= rtol * scale, k


def _check_layer(device: str, mode: str, relu: bool, pool: bool, rtol: float) -> None:
    layer, masked = _stripe_layer(mode, relu, pool, device)
    x = torch.randn(3, 6, 8, 8, generator=torch.Generator().manual_seed(2)).to(device)
    dense = F.conv2d(x, masked, layer.bias.detach(), padding=1)
    dense = dense.relu() if relu else dense
    want = F.max_pool2d(dense, 2) if pool else dense
    assert torch.allclose(torch.func.vmap(layer)(x), want, atol=rtol, rtol=rtol)  # unbatched samples
    _assert_close(_per_sample_grads(layer, x), _autograd_grads(layer, x), rtol)
    grad_x = torch.func.grad(lambda t: layer(t).square().sum())(x)
    xr = x.clone().requires_grad_()
    layer(xr).square().sum().backward()
    assert torch.allclose(grad_x, xr.grad, atol=rtol, rtol=rtol)


@pytest.mark.parametrize("mode", ["stripe", "dense", "gemm"])
@pytest.mark.parametrize("relu,pool", [(False, False), (True, True)])
def test_stripe_conv_under_grad_and_vmap(mode, relu, pool):
    _check_layer("cpu", mode, relu, pool, 1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["stripe", "dense", "gemm"])
def test_stripe_conv_under_grad_and_vmap_cuda(mode):
    """The autograd reference runs the stripe kernel, whose float32 products are TF32: 1e-3."""
    _check_layer("cuda", mode, True, True, 1e-3)


def _compact_model(name: str, zeta: int | None, device: str) -> nn.Module:
    torch.manual_seed(0)
    model = compress.create_model(name, num_classes=5, input_size=8)
    if zeta is not None:
        compress.apply_pix(model, zeta)
    compress.attach_skeletons(model)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "skeleton"):
                module.skeleton.copy_(torch.rand_like(module.skeleton))
    random_bn_(model, torch.Generator().manual_seed(0))
    model = compress.compact(model.eval(), threshold=0.5)
    for layer in model.modules():  # every stripe conv on the op's path
        if isinstance(layer, StripeConv2d):
            layer.mode = "stripe"
    return model.to(device).eval()


@pytest.mark.parametrize("name,zeta", [("resnet20", None), ("vgg11", None), ("resnet29_bottleneck", 4)])
def test_per_sample_gradients_of_compact_and_pix_models(name, zeta):
    """Per-sample gradients (as DP-SGD computes them) through a compact model in stripe mode and a PiX model."""
    model = _compact_model(name, zeta, "cpu")
    assert any(isinstance(m, StripeConv2d) and m.num_stripes for m in model.modules())
    assert (zeta is not None) == any(isinstance(m, compress.PiXBlock) for m in model.modules())
    x = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    _assert_close(_per_sample_grads(model, x), _autograd_grads(model, x), 1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_pix_block_under_vmap_takes_other_input_dtypes_as_eager_does(dtype):
    """The predictor weight stays float32; the pool and predictor run in float32 (float64 for float64 x), the output
    in x's dtype, in eager and under a transform."""
    block = compress.PiXBlock(8, 2).eval()
    x = torch.randn(4, 8, 5, 5, generator=torch.Generator().manual_seed(4)).to(dtype)
    with torch.no_grad():
        want = block(x)
    got = torch.func.vmap(block)(x)
    assert got.dtype == want.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-12
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype, logit", [(torch.bfloat16, -0.002), (torch.float16, -0.0002)])
def test_pix_block_under_vmap_takes_the_ops_branch_for_a_p_that_rounds_onto_tau(dtype, logit):
    """The op rounds p to x's dtype before comparing it with tau; p just below 0.5 rounds to 0.5 in 16 bits, which
    takes the mean branch (p == tau). The standard-op path of torch.func must pick the same branch (it took the max)."""
    from compress.pix import PiXBlock

    block = PiXBlock(4, 2, tau=0.5)
    with torch.no_grad():
        block.weight.zero_()
        block.weight[:, 0] = logit  # p = sigmoid(logit) for a channel-0 pool of 1
    x = torch.rand(1, 4, 3, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[:, 0] = 1
    assert torch.sigmoid(torch.tensor(logit)) < 0.5 and torch.sigmoid(torch.tensor(logit)).to(dtype) == 0.5
    eager = block(x)
    mapped = torch.func.vmap(block)(x[None])[0]
    assert torch.equal(mapped, eager)
    groups = x.float().unflatten(1, (2, 2))
    torch.testing.assert_close(eager.float(), 0.5 * groups.mean(2), rtol=1e-2, atol=1e-2)  # the mean branch


def _forward_ad_case(name: str, zeta: int | None) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """(float64 CPU model, input, tangent) for the forward-mode tests: a compact model in stripe mode (for a VGG also
    compacted with fuse_relu, so its pools are fused or compaction's C++ CPU max-pool) or a PiX model."""
    model = _compact_model(name, zeta, "cpu").double()
    if zeta is None:
        model = compress.compact(model, fold_bn=True, fuse_relu=True)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64, generator=gen)
    t = torch.randn(3, 3, 8, 8, dtype=torch.float64, generator=gen)
    return model, x, t


@pytest.mark.parametrize("name,zeta", [("vgg11", None), ("resnet29_bottleneck", 4)])
def test_forward_mode_ad_through_compact_and_pix_models(name, zeta):
    """Dual tensors (torch.autograd.forward_ad) through a compact model in stripe mode (with fused pools on the
    C++ CPU max-pool's path) and a PiX model: the tangent equals a central finite difference in float64 (before,
    the kernels' eager shortcuts dropped it or the ops raised for want of a forward-mode rule)."""
    import torch.autograd.forward_ad as fwad

    model, x, t = _forward_ad_case(name, zeta)
    with fwad.dual_level():
        tangent = fwad.unpack_dual(model(fwad.make_dual(x, t))).tangent
    with torch.no_grad():
        fd = (model(x + 1e-6 * t) - model(x - 1e-6 * t)) / 2e-6
        scale = model(x).abs().max().item()  # the difference quotient's rounding: about 1e-10 of the outputs
    assert tangent is not None and tangent.abs().max() > 1e3 * 1e-9 * scale
    torch.testing.assert_close(tangent, fd, rtol=1e-5, atol=1e-9 * scale)


@pytest.mark.cuda
@pytest.mark.parametrize("name,zeta", [("vgg11", None), ("resnet29_bottleneck", 4)])
def test_forward_mode_ad_through_compact_and_pix_models_cuda(name, zeta):
    """The same on CUDA in float32 (fused conv + ReLU layers, the stripe and PiX kernels' eager paths; TF32 off): the
    tangent equals the float64 CPU model's (float32 on the CPU: within 1e-6 of it)."""
    import torch.autograd.forward_ad as fwad

    model, x, t = _forward_ad_case(name, zeta)
    tangents = []
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            for m, dev, dt in ((model, "cpu", torch.float64),
                               (copy.deepcopy(model).float().cuda(), "cuda", torch.float32)):
                with fwad.dual_level():
                    tangents.append(fwad.unpack_dual(m(fwad.make_dual(x.to(dev, dt), t.to(dev, dt)))).tangent)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
    assert tangents[1] is not None
    torch.testing.assert_close(tangents[1].double().cpu(), tangents[0], rtol=1e-4,
                               atol=1e-4 * tangents[0].abs().max().item())


def _function_case(name: str, gen: torch.Generator):
    """(our function f(x, w), an independent reference ref(x, w), x, w) in float64 for a public function of kernels."""
    import kernels

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=gen)

    if name == "conv2d":
        return (lambda x, w: kernels.conv2d(x, w, None, 2, 1, 1, 2), lambda x, w: F.conv2d(x, w, None, 2, 1, 1, 2),
                rand(2, 4, 7, 6), rand(6, 2, 3, 3))
    if name == "depthwise_conv2d":
        return (lambda x, w: kernels.depthwise_conv2d(x, w, None, 1, 2, 2),
                lambda x, w: F.conv2d(x, w, None, 1, 2, 2, groups=4), rand(2, 4, 7, 6), rand(4, 1, 3, 3))
    if name == "stripe_conv2d":  # 5 kept stripes of a 3 -> 4 3x3 conv, canonical order
        out_index, offset = torch.tensor([0, 3, 0, 2, 1]), torch.tensor([[0, 0], [0, 2], [1, 1], [1, 1], [2, 0]])
        place = torch.zeros(4 * 3 * 3, 5, dtype=torch.float64)  # (N*KH*KW, S): where each stripe lands
        place[(out_index * 9 + offset[:, 0] * 3 + offset[:, 1]), torch.arange(5)] = 1

        def ref(x, w):
            return F.conv2d(x, (place @ w).view(4, 3, 3, 3).permute(0, 3, 1, 2), None, 1, 1).relu()

        return (lambda x, w: kernels.stripe_conv2d(x, w, out_index, offset, None, 4, 3, 1, 1, relu=True), ref,
                rand(2, 3, 6, 5), rand(5, 3))
    p = torch.rand(2, 3, 1, 1, dtype=torch.float64, generator=gen) * 0.8 + 0.1  # (none within 1e-6 of tau)

    def fuse(x, p):  # the definition: p * (max of each group of 2 channels if p < 0.5 else their mean)
        g = x.unflatten(1, (3, 2))
        return p * torch.where(p < 0.5, g.amax(2), g.mean(2))

    if name == "pix":
        return lambda x, w: kernels.pix(x, w, 2), fuse, rand(2, 6, 4, 5), p
    return (lambda x, w: kernels.pix_squeeze(x, w, 2), lambda x, w: fuse(x, torch.sigmoid(x.mean((2, 3)) @ w.t())[
        :, :, None, None]), rand(2, 6, 4, 5), rand(3, 6))


@pytest.mark.parametrize("name", ["conv2d", "depthwise_conv2d", "stripe_conv2d", "pix", "pix_squeeze"])
def test_kernels_functions_under_forward_ad_and_torch_func(name):
    """Our public functions under torch.func.jvp, dual tensors, torch.func.grad and vmap equal an independent reference
    in float64 (F.conv2d; the PiX definition). Before, jvp and dual tensors gave a zero tangent silently (custom ops
    have no forward-mode rules) and torch.func.grad raised."""
    import torch.autograd.forward_ad as fwad

    f, ref, x, w = _function_case(name, torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(6)
    tx, tw = torch.randn(x.shape, dtype=x.dtype, generator=gen), torch.randn(w.shape, dtype=w.dtype, generator=gen)
    y, tangent = torch.func.jvp(f, (x, w), (tx, tw))
    y_ref, tangent_ref = torch.func.jvp(ref, (x, w), (tx, tw))
    assert tangent_ref.abs().max() > 0.1
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(tangent, tangent_ref, rtol=1e-10, atol=1e-12)
    with fwad.dual_level():
        dual = fwad.unpack_dual(f(fwad.make_dual(x, tx), fwad.make_dual(w, tw))).tangent
    torch.testing.assert_close(dual, tangent_ref, rtol=1e-10, atol=1e-12)
    grads = torch.func.grad(lambda x, w: (f(x, w) ** 2).sum(), argnums=(0, 1))(x, w)
    grads_ref = torch.func.grad(lambda x, w: (ref(x, w) ** 2).sum(), argnums=(0, 1))(x, w)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12)
    xs = torch.stack([x, x.flip(0)])
    torch.testing.assert_close(torch.func.vmap(f, (0, None))(xs, w), torch.stack([ref(x, w), ref(x.flip(0), w)]),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name,zeta", [("resnet20", None), ("vgg11", None), ("resnet29_bottleneck", 4)])
def test_torch_fx_traces_skeleton_compact_and_pix_models(name, zeta):
    _check_fx_tracing(name, zeta, "cpu", torch.float64, 1e-12)


@pytest.mark.cuda
@pytest.mark.parametrize("name,zeta", [("vgg11", None), ("resnet29_bottleneck", 4)])
def test_torch_fx_traces_skeleton_compact_and_pix_models_cuda(name, zeta):
    _check_fx_tracing(name, zeta, "cuda", torch.float32, 1e-3)


def _check_fx_tracing(name: str, zeta: int | None, device: str, dtype: torch.dtype, rtol: float) -> None:
    """torch.fx.symbolic_trace and torchvision's create_feature_extractor (a detection backbone's usual way in)
    on skeleton, compact and PiX models: SkeletonConv2d read autocast state off a Proxy (RuntimeError), and
    StripeConv2d, PiXBlock and ZeroChannels branched on the input (TraceError). Traced, the layers are op calls;
    the graph module equals the model, and a ZeroChannels (a fully pruned PiX branch) is a leaf call."""
    from torchvision.models.feature_extraction import create_feature_extractor

    from compress.compaction import ZeroChannels

    torch.manual_seed(0)
    skeleton = compress.create_model(name, num_classes=5, input_size=8)
    if zeta is not None:
        compress.apply_pix(skeleton, zeta)
    compress.attach_skeletons(skeleton)
    random_bn_(skeleton, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for module in skeleton.modules():
            if hasattr(module, "skeleton"):
                module.skeleton.copy_(torch.rand_like(module.skeleton))
        if zeta is not None:  # the first block's branch fully pruned: its PiX block becomes a ZeroChannels
            skeleton.layer1[1].conv2.skeleton.zero_()
    skeleton = skeleton.to(device, dtype).eval()
    small = compress.compact(copy.deepcopy(skeleton), threshold=0.5, fold_bn=True, fuse_relu=True)
    assert (zeta is not None) == any(isinstance(m, ZeroChannels) for m in small.modules())
    x = torch.randn(2, 3, 8, 8, dtype=dtype, generator=torch.Generator().manual_seed(3)).to(device)
    for model in (skeleton, small):
        graph = torch.fx.symbolic_trace(model)
        _assert_close({"y": graph(x)}, {"y": model(x)}, rtol)
        targets = {getattr(node.target, "__name__", str(node.target)) for node in graph.graph.nodes
                   if node.op == "call_function"}
        if model is small:
            assert "traced_stripe_conv2d" in targets, targets
        if zeta is not None:
            assert "pix_squeeze" in targets, targets
        stage = "features.3" if name == "vgg11" else "layer2"
        seen = {}
        hook = model.get_submodule(stage).register_forward_hook(lambda m, i, o, seen=seen: seen.update(out=o))
        model(x)
        hook.remove()
        _assert_close(create_feature_extractor(model, return_nodes={stage: "out"})(x), seen, rtol)


def test_a_traced_stripe_conv_runs_under_autocast_and_on_unbatched_inputs_as_eager():
    """A torch.fx graph of a stripe conv took neither autocast (its op was recorded without the casts the forward
    makes: a dtype error after a float32 layer, float32 outputs elsewhere) nor an unbatched input."""
    torch.manual_seed(0)
    stripe = StripeConv2d.from_dense(nn.Conv2d(8, 16, 3, padding=1), torch.rand(16, 3, 3) > 0.5)
    stripe.mode = "stripe"
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), stripe).eval()
    graph = torch.fx.symbolic_trace(model)
    x = torch.randn(2, 3, 10, 10)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = model(x), graph(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(torch.fx.symbolic_trace(stripe)(x[0, :1].expand(8, 10, 10)),
                                   stripe(x[0, :1].expand(8, 10, 10)))


def test_functional_call_with_other_indices_is_refused_and_with_their_plan_matches_them():
    """The plan and rows buffers (not in the state dict) place the stripes: a functional_call with another layer's
    state dict, or an assignment of other indices, ran the old plan (outputs off by O(1)); now it is refused, and a
    call that also swaps in the other layer's plan and rows (its named_buffers) computes the other layer."""
    gen = torch.Generator().manual_seed(21)
    conv = nn.Conv2d(6, 8, 3, padding=1)
    masks = [torch.rand(8, 3, 3, generator=gen) < 0.5 for _ in range(2)]
    masks[1] = masks[0].flatten()[torch.randperm(72, generator=gen)].view(8, 3, 3)  # the same count, other places
    a, b = (StripeConv2d.from_dense(conv, m).eval() for m in masks)
    x = torch.randn(2, 6, 7, 7, generator=gen)
    want = F.conv2d(x, conv.weight * masks[1][:, None], conv.bias, padding=1)
    for mode in ("stripe", "dense", "gemm"):
        a.mode = b.mode = mode
        a(x)  # (dense mode's direct call bound to a's weight)
        with pytest.raises(ValueError, match="out_index/offset are not the tensors its index plan was built from"):
            torch.func.functional_call(a, b.state_dict(), (x,))
        got = torch.func.functional_call(a, {**dict(b.named_parameters()), **dict(b.named_buffers())}, (x,))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a(x), F.conv2d(x, conv.weight * masks[0][:, None], conv.bias, padding=1),
                                   rtol=1e-5, atol=1e-5)  # a itself is unchanged after both calls
    c = StripeConv2d.from_dense(conv, masks[0]).eval()
    c(x)
    c.out_index, c.offset = b.out_index.clone(), b.offset.clone()
    with pytest.raises(ValueError, match="Load other indices with load_state_dict"):
        c(x)
    c.load_state_dict(b.state_dict())
    torch.testing.assert_close(c(x), want, rtol=1e-5, atol=1e-5)
    d = copy.deepcopy(c).double()  # copies and conversions keep the record of the plan's indices
    torch.testing.assert_close(d(x.double()), want.double(), rtol=1e-5, atol=1e-5)
