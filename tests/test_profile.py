"""compress.profile: hand-counted small nets, documented totals of standard nets, fvcore cross-check."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from compress.models import create_model
from compress.profile import compare, profile


class ClaimedWork(nn.Module):
    """A custom module following the `macs()` protocol: a 1x1 conv child that it accounts for itself, claiming
    `claim(inp, out)` MACs."""

    def __init__(self, in_channels: int, out_channels: int, claim):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 1, bias=False)
        self.claim = claim

    def forward(self, x):
        return self.conv(x)

    def macs(self, inp, out):
        return self.claim(inp, out)


def _half_work() -> ClaimedWork:
    """A 1x1 conv 4 -> 6 that claims half its dense work."""
    return ClaimedWork(4, 6, lambda inp, out: out.numel() * 4 // 2)


def _small_net():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2, padding=1),  # (4, 4, 4): 64 outputs * 3*9 = 1728 MACs
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),  # in place: no new activation
        nn.Conv2d(4, 4, 3, padding=1, groups=2, bias=False),  # 64 * 2*9 = 1152 MACs
        _half_work(),  # (6, 4, 4): 96 * 4 / 2 = 192 MACs
        nn.Flatten(),  # a view: no new activation
        nn.Linear(96, 5),  # 5 * 96 = 480 MACs
    )


def test_small_net_by_hand():
    model = _small_net()
    rep = profile(model, (3, 8, 8), latency=False)
    assert rep.macs == 1728 + 1152 + 192 + 480
    layers = {row.name: row for row in rep.layers}
    assert [row.macs for row in rep.layers] == [1728, 0, 0, 1152, 192, 0, 480]
    assert "4.conv" not in layers  # a module with macs() is profiled whole
    assert layers["4"].params == 24
    params = (4 * 27 + 4) + 8 + 4 * 2 * 9 + 24 + (96 * 5 + 5)
    assert rep.params == params
    # weights: params and BN running stats (float32), not num_batches_tracked
    assert rep.weight_bytes == 4 * (params + 8)
    # new activations (float32): conv 64, bn 64, grouped conv 64, half-work conv 96, linear 5
    assert [row.activation_bytes for row in rep.layers] == [256, 256, 0, 256, 384, 0, 20]
    assert rep.activation_bytes == {"max": 384, "sum": 256 * 3 + 384 + 20}
    assert rep.latency_ms is None and rep.device == "cpu"


class SharedReLU(nn.Module):
    """conv (3 -> 8) -> ReLU -> conv (8 -> 16, stride 2) -> the same (out-of-place) ReLU module again."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2, self.relu = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 16, 3, 2, 1), nn.ReLU()

    def forward(self, x):
        return self.relu(self.conv2(self.relu(self.conv1(x))))


def test_a_module_called_twice_sums_its_calls_but_not_into_the_largest_activation():
    rep = profile(SharedReLU(), (3, 16, 16), latency=False)
    big, small = 8 * 16 * 16 * 4, 16 * 8 * 8 * 4  # float32 outputs at 16x16 and 8x8: 8192 and 4096 bytes
    assert {row.name: row.activation_bytes for row in rep.layers} == {"conv1": big, "conv2": small,
                                                                      "relu": big + small}
    assert rep.activation_bytes == {"max": big, "sum": 2 * (big + small)}


def test_a_shared_relu_counts_each_call_and_meta_models_count_activations():
    """In the paper convention a ReLU module called twice counts the elements of both calls; a model built on the
    meta device gets the activation bytes of a real one (every meta tensor's data pointer is 0)."""
    rep = profile(SharedReLU(), (3, 16, 16), latency=False, convention="paper")
    assert next(row.macs for row in rep.layers if row.name == "relu") == 8 * 16 * 16 + 16 * 8 * 8
    real = profile(SharedReLU(), (3, 16, 16), latency=False)
    with torch.device("meta"):
        meta = profile(SharedReLU(), (3, 16, 16), latency=False)
    assert meta.activation_bytes == real.activation_bytes and real.activation_bytes["max"] > 0
    assert [row.activation_bytes for row in meta.layers] == [row.activation_bytes for row in real.layers]


class _ClaimsSeven(nn.Module):
    def forward(self, x):
        return x

    def macs(self, x, out):  # its own count
        return 7


def test_rows_of_siblings_whose_names_extend_another_and_in_place_ops_on_the_input():
    """Module "10" is not inside module "1" (which counts itself); an in-place op on the input allocates nothing."""
    model = nn.Sequential(nn.Conv2d(3, 4, 1), _ClaimsSeven(), *[nn.Identity() for _ in range(8)],
                          nn.Conv2d(4, 2, 1, bias=False))
    rep = profile(model, (3, 5, 5), latency=False)
    assert next(row.macs for row in rep.layers if row.name == "10") == 200
    assert rep.macs == 300 + 7 + 200
    rep = profile(nn.Sequential(nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(48, 5)), (3, 4, 4), latency=False)
    assert [row.activation_bytes for row in rep.layers] == [0, 0, 20]


def test_weight_bytes_leave_out_non_persistent_buffers_and_layers_get_latencies():
    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)
            self.register_buffer("cache", torch.randn(1000), persistent=False)  # rebuilt, never stored

        def forward(self, x):
            return self.conv(x)

    rep = profile(Cached(), (3, 4, 4), latency=False)
    assert rep.weight_bytes == 4 * 16 == sum(row.weight_bytes for row in rep.layers)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 5))
    rep = profile(model, (3, 8, 8), batch_size=2, repeats=2, warmup=0)
    assert all(row.latency_ms > 0 for row in rep.layers)


def test_small_net_paper_convention():
    """convention="paper" adds conv/Linear bias (1 per output), BN (2 per element), ReLU (1 per element),
    pooling (1 per input element); custom macs() modules and the rest are unchanged."""
    model = nn.Sequential(*_small_net()[:5], nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 5))
    rep = profile(model, (3, 8, 8), latency=False, convention="paper")
    assert rep.convention == "paper"
    assert [row.macs for row in rep.layers] == [1728 + 64, 128, 64, 1152, 192, 96, 0, 30 + 5]
    assert profile(model, (3, 8, 8), latency=False).macs == 1728 + 1152 + 192 + 30
    with pytest.raises(ValueError, match="convention must be one of"):
        profile(model, (3, 8, 8), latency=False, convention="ptflops")


def test_a_root_module_with_macs_is_counted_once_and_transposed_convs_by_hand():
    root = ClaimedWork(3, 4, lambda inp, out: 7)  # the model's root has macs(): 7 MACs in all, its conv not again
    assert profile(root, (3, 2, 2), latency=False).macs == 7
    # each of the 3*4*4 input elements goes to out_channels/groups * 3*3 = 2*9 outputs: 48 * 18 = 864 MACs;
    # the paper convention adds one bias add per output element (4 x 9 x 9 = 324)
    up = nn.ConvTranspose2d(3, 4, 3, stride=2, groups=1, bias=True)
    up_grouped = nn.ConvTranspose2d(4, 4, 3, stride=2, groups=2, bias=False)  # 64 inputs * 2*9 = 1152 MACs
    assert profile(up, (3, 4, 4), latency=False).macs == 48 * 4 * 9
    assert profile(up, (3, 4, 4), latency=False, convention="paper").macs == 48 * 4 * 9 + 4 * 9 * 9
    assert profile(up_grouped, (4, 4, 4), latency=False).macs == 1152


def test_layers_called_with_a_keyword_input_are_counted():
    """module(input=x) is a legal call: the layers that read their input to count (transposed conv, pooling in the
    paper convention) find it among the keyword arguments."""

    class Keywords(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.pool = nn.ConvTranspose2d(3, 4, 2, stride=2), nn.MaxPool2d(2)

        def forward(self, x):
            return self.pool(input=self.up(input=x))

    # each of the 3*8*8 inputs goes to 4 * 2*2 outputs; the paper convention adds the bias per output (4*16*16) and
    # the pool's one per input element
    assert profile(Keywords(), (3, 8, 8), latency=False).macs == 3 * 64 * 16
    assert profile(Keywords(), (3, 8, 8), latency=False, convention="paper").macs == 3 * 64 * 16 + 2 * 4 * 16 * 16


def test_tied_weights_count_in_one_row_and_an_expanded_output_by_its_storage():
    """A weight shared by two layers is in the first row only, so the rows add up to the totals; a layer whose output
    is an expanded view of a small new tensor is charged that tensor's bytes."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    rep = profile(Tied(), (1, 3, 4), latency=False)
    rows = {row.name: row for row in rep.layers}
    assert (rows["a"].params, rows["b"].params) == (20, 4)  # b: its own bias
    assert rep.params == sum(r.params for r in rep.layers) == 24
    assert rep.weight_bytes == sum(r.weight_bytes for r in rep.layers) == 4 * 24

    class Expanded(nn.Module):
        def forward(self, x):
            return x.mean((2, 3), keepdim=True).expand(-1, -1, 16, 16)

    model = nn.Sequential(Expanded(), nn.Conv2d(3, 3, 1))
    rows = {row.name: row for row in profile(model, (3, 16, 16), latency=False).layers}
    assert (rows["0"].activation_bytes, rows["1"].activation_bytes) == (3 * 4, 3 * 16 * 16 * 4)


def test_paper_convention_counts_a_stripe_convs_bias_as_a_convs():
    """A StripeConv2d that keeps every stripe of a biased conv counts, in the paper convention, what the conv does."""
    from compress.stripe import StripeConv2d

    conv = nn.Conv2d(4, 8, 3, padding=1, bias=True)
    stripe = StripeConv2d.from_dense(conv, torch.ones(8, 3, 3, dtype=torch.bool))
    for convention in ("layers", "paper"):
        want = profile(conv, (4, 6, 6), latency=False, convention=convention).macs
        assert profile(stripe, (4, 6, 6), latency=False, convention=convention).macs == want


def test_latency_and_mode_restored():
    """A train-mode model is profiled in eval mode (its BatchNorm statistics untouched: in train mode every counted
    and timed forward would update them) and handed back in train mode."""
    model = _small_net().train()
    bn = model[1]
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    rep = profile(model, (3, 8, 8), batch_size=4, repeats=3)
    assert rep.latency_ms > 0 and rep.batch_size == 4
    assert model.training
    assert all(torch.equal(bn.state_dict()[k], v) for k, v in before.items())


def test_to_dict_and_compare():
    dense = profile(_small_net(), (3, 8, 8), latency=False)
    smaller = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.Flatten(), nn.Linear(64, 5))
    compact = profile(smaller, (3, 8, 8), latency=False)
    d = dense.to_dict()
    assert d["macs"] == dense.macs and d["layers"][0]["macs"] == 1728 and d["activation_bytes"]["sum"] > 0
    rows = {row["metric"]: row for row in compare(dense, compact)}
    assert rows["macs"]["dense"] == dense.macs and rows["macs"]["compact"] == 1728 + 320
    assert rows["macs"]["ratio"] == pytest.approx((1728 + 320) / dense.macs)
    assert rows["latency_ms"]["ratio"] is None


@pytest.mark.parametrize(
    "name, kwargs, size, macs, params",
    [
        ("resnet50", {"num_classes": 1000}, 224, 4.10e9, 25.56e6),  # torchvision: 4.09-4.12 GMACs
        ("resnet56", {}, 32, 125e6, 0.85e6),  # He et al. 2016 CIFAR
        ("vgg16", {}, 32, 313e6, None),  # CIFAR VGG16 (BN), as in SWP's table
    ],
)
def test_documented_totals(name, kwargs, size, macs, params):
    rep = profile(create_model(name, input_size=size, **kwargs), (3, size, size), latency=False)
    assert rep.macs == pytest.approx(macs, rel=0.01)
    if params is not None:
        assert rep.params == pytest.approx(params, rel=0.01)


@pytest.mark.parametrize("name", ["resnet18", "vgg11_bn", "mobilenet_v2"])
def test_dense_macs_match_fvcore(name):
    from fvcore.nn import FlopCountAnalysis  # a dev dependency; imported here so GPU-only runs collect

    model = create_model(name, num_classes=10, input_size=64).eval()
    x = torch.randn(1, 3, 64, 64)
    flops = FlopCountAnalysis(model, x)
    flops.unsupported_ops_warnings(False)
    flops.uncalled_modules_warnings(False)
    by_op = flops.by_operator()
    fv_macs = by_op["conv"] + by_op.get("linear", 0) + by_op.get("addmm", 0)  # fvcore counts 1 FMA as 1
    assert profile(model, (3, 64, 64), latency=False).macs == fv_macs


def test_bad_input_size_is_clear():
    with pytest.raises(ValueError, match="input_size is"):
        profile(_small_net(), (8, 8), latency=False)


@pytest.mark.cuda
def test_cuda_profile_matches_cpu_counts():
    model = create_model("resnet20")
    cpu = profile(model, (3, 32, 32), latency=False)
    gpu = profile(model, (3, 32, 32), batch_size=8, device="cuda", repeats=3)
    assert gpu.device.startswith("cuda") and gpu.latency_ms > 0
    assert (gpu.macs, gpu.params, gpu.weight_bytes) == (cpu.macs, cpu.params, cpu.weight_bytes)
    assert all(row.latency_ms is not None for row in gpu.layers)


@pytest.mark.cuda
def test_cuda_profile_of_compact_pix_and_stripe_models_matches_cpu_and_sees_no_functional_ops():
    """The kernels' CUDA paths under the count pass's dispatcher watch: a compact SWP + PiX model (stripe convs with
    fused epilogues, PiX blocks, fused residual tails) counts as on the CPU, and nothing inside those layers counts
    as a functional op."""
    from compress import compact
    from compress.pix import apply_pix
    from compress.skeleton import attach_skeletons

    model = create_model("resnet29_bottleneck")
    apply_pix(model, 4)
    attach_skeletons(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "skeleton"):
                m.skeleton.copy_((torch.rand(m.skeleton.shape, generator=gen) > 0.5).float())
    small = compact(model.eval(), fold_bn=True, fuse_relu=True)
    cpu = profile(small, (3, 32, 32), latency=False)
    gpu = profile(small, (3, 32, 32), batch_size=4, device="cuda", repeats=2)
    assert (gpu.macs, gpu.params, gpu.functional_macs) == (cpu.macs, cpu.params, 0) and cpu.functional_macs == 0
    assert gpu.macs < profile(model.cpu(), (3, 32, 32), latency=False).macs


def _vgg11_with_fused_pools():
    """(plain, compact): VGG11 compacted with BN folded and ReLUs fused, without skeletons (convs and separate pools)
    and with a stripe dropped in each of the first conv's filters (its stripe conv takes its pool)."""
    from compress import attach_skeletons, compact

    model = create_model("vgg11", num_classes=10).eval()
    plain = compact(model, fold_bn=True, fuse_relu=True)
    attach_skeletons(model)
    with torch.no_grad():
        model.features[0].skeleton[:, 0, 0] = 0
    small = compact(model.eval(), fold_bn=True, fuse_relu=True)
    assert small.compress_compaction["pool_fused"] == 1 and plain.compress_compaction["pool_fused"] == 0
    return plain, small


def test_a_stripe_conv_that_pools_after_its_conv_counts_that_conv_output():
    """On the CPU a stripe conv with a fused 2x2 pool writes its full-size conv output, then pools it: the
    activations count it, so the compact VGG11 shows the dense one's largest and summed activations (it reported
    half the largest before), and features.0's row holds its 64x32x32 conv output and its 64x16x16 pooled one."""
    plain, small = _vgg11_with_fused_pools()
    dense, compact_ = profile(plain, (3, 32, 32), latency=False), profile(small, (3, 32, 32), latency=False)
    assert compact_.activation_bytes == dense.activation_bytes
    row = next(r for r in compact_.layers if r.name == "features.0")
    assert row.activation_bytes == 4 * 64 * (32 * 32 + 16 * 16) and compact_.activation_bytes["max"] == 4 * 64 * 32 * 32


@pytest.mark.cuda
def test_a_stripe_conv_that_pools_in_its_kernel_counts_only_the_pooled_output():
    """In eager CUDA inference in stripe mode the kernel's epilogue pools even-sized outputs: the full-size conv
    output is never written, and features.0's row counts the pooled output only."""
    _, small = _vgg11_with_fused_pools()
    small.features[0].mode = "stripe"
    rep = profile(small.cuda(), (3, 32, 32), batch_size=2, device="cuda", repeats=2)
    with torch.no_grad():  # (recorded by autograd, the general path runs and pools after)
        assert small.features[0].pools_in_kernel(torch.randn(1, 3, 32, 32, device="cuda"))
    assert next(r for r in rep.layers if r.name == "features.0").activation_bytes == 4 * 64 * 16 * 16


def test_str_gives_the_totals():
    report = profile(create_model("resnet20"), input_size=(3, 32, 32), latency=False)
    text = str(report)
    assert f"MACs              {report.macs / 1e6:.2f} M" in text and "latency           not measured" in text
    assert f"params            {report.params / 1e6:.3f} M" in text and len(text.splitlines()) == 6


@pytest.mark.parametrize("kwargs", [{"batch_size": 0}, {"repeats": 0}, {"warmup": -1}])
def test_bad_latency_settings_are_clear(kwargs):
    with pytest.raises(ValueError, match="latency needs batch_size >= 1, repeats >= 1 and warmup >= 0"):
        profile(_small_net(), (3, 8, 8), **kwargs)


class ScaledBlock(nn.Module):
    """A block with children and a tensor of its own (a layer-scale gamma, as timm's ConvNeXtBlock):
    x + gamma * conv(x), conv 4 -> 4, 3x3, bias."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.gamma = nn.Parameter(torch.rand(4, 1, 1))

    def forward(self, x):
        return x + self.gamma * self.conv(x)


def test_modules_with_children_and_tensors_of_their_own_get_rows_that_add_up():
    """timm's BatchNormAct2d (a BN with an activation child) and a layer-scale block: their own tensors get a row, so
    the rows add up to the totals, and the paper convention counts the BN's 2 per element."""
    from timm.layers import BatchNormAct2d

    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), BatchNormAct2d(4), ScaledBlock())
    rep = profile(model, (3, 5, 6), latency=False)
    rows = {row.name: row for row in rep.layers}
    assert sorted(rows) == ["0", "1", "1.act", "1.drop", "2", "2.conv"]  # (rows come in the order calls end)
    assert (rows["1"].params, rows["1"].weight_bytes) == (8, 4 * 16)  # weight, bias; running mean and var
    assert (rows["2"].params, rows["2"].weight_bytes, rows["2.conv"].params) == (4, 16, 4 * 4 * 9 + 4)
    assert rep.params == sum(r.params for r in rep.layers) == 3 * 4 * 9 + 8 + 4 + 148
    assert rep.weight_bytes == sum(r.weight_bytes for r in rep.layers) == 4 * (rep.params + 8)
    elements = 4 * 5 * 6  # every layer's output
    assert rows["2"].activation_bytes == 4 * elements  # x + ...: a new tensor
    assert rep.macs == elements * 27 + elements * 36  # the two convs
    paper = {row.name: row.macs for row in profile(model, (3, 5, 6), latency=False, convention="paper").layers}
    assert paper == {"0": elements * 27, "1": 2 * elements, "1.drop": 0, "1.act": elements, "2": 0,
                     "2.conv": elements * 36 + elements}


def test_a_parametrized_conv_or_linear_is_one_row_counting_its_work_and_its_parametrizations_tensors():
    """torch.nn.utils.parametrizations (weight_norm, spectral_norm) move a module's weight into a `parametrizations`
    child: without a bias such a conv had no tensors of its own, got no row, and its MACs were never counted (a
    ResNet-20 with weight-normed convs reported 640 MACs)."""
    from torch.nn.utils import parametrizations

    model = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.Conv2d(8, 4, 3), nn.Flatten(), nn.Linear(4 * 26 * 26, 5,
                                                                                                    bias=False))
    parametrizations.weight_norm(model[0])  # weight = g * v / |v|: g (8, 1, 1, 1) and v
    parametrizations.spectral_norm(model[1])  # (its u and v vectors are buffers of the parametrization)
    parametrizations.weight_norm(model[3])
    rep = profile(model, (3, 30, 30), latency=False)
    rows = {row.name: row for row in rep.layers}
    assert sorted(rows) == ["0", "1", "2", "3"]
    assert rows["0"].macs == 28 * 28 * 8 * 27 and rows["0"].params == 8 * 27 + 8
    assert rows["1"].macs == 26 * 26 * 4 * 72 and rows["1"].params == 4 * 72 + 4
    assert rows["3"].macs == 4 * 26 * 26 * 5 and rows["3"].params == 4 * 26 * 26 * 5 + 5
    assert rep.macs == sum(r.macs for r in rep.layers) and rep.params == sum(r.params for r in rep.layers)
    # a parametrized container (its own tensor parametrized) is no layer: its children keep their rows
    block = ScaledBlock()
    torch.nn.utils.parametrize.register_parametrization(block, "gamma", nn.Softplus())
    rep = profile(nn.Sequential(block), (4, 5, 6), latency=False)
    assert {row.name: row.macs for row in rep.layers}["0.conv"] == 5 * 6 * 4 * 36 and rep.params == 148 + 4


def test_latency_leaves_the_global_rng_alone_and_takes_the_memory_format():
    seen = []
    model = nn.Sequential(nn.Conv2d(3, 4, 3))
    model[0].register_forward_pre_hook(lambda m, inp: seen.append(inp[0].is_contiguous(memory_format=torch.channels_last)))
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    profile(model, (3, 5, 5), batch_size=2, repeats=2, warmup=1, memory_format=torch.channels_last)
    assert torch.equal(torch.rand(3), want)
    assert seen and all(seen)


class FunctionalOps(nn.Module):
    """Convolutions and products its forward calls itself: F.conv2d on a child conv's weight (4 -> 6, 3x3, pad 1),
    a transposed conv on a weight of its own, a matrix product, an einsum, fused self- and cross-attention (keys and
    values of other sizes than the queries), mv, dot, baddbmm, addbmm and F.linear with a bias (addmm)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3, padding=1)
        self.up = nn.Parameter(torch.randn(6, 2, 2, 2))  # conv_transpose2d weight (C_in 6, C_out 2, 2x2)
        self.proj = nn.Parameter(torch.randn(5, 3))
        self.lin_w, self.lin_b = nn.Parameter(torch.randn(5, 48)), nn.Parameter(torch.randn(5))

    def forward(self, x):  # x (1, 4, 5, 5)
        y = self.conv(x)  # a module call: counted by the conv's row
        y = y + F.conv2d(x, self.conv.weight, padding=1)  # 150 outputs * 4*9 = 5400
        z = F.conv_transpose2d(y, self.up, stride=2)  # 150 inputs * 2*2*2 = 1200
        rows = z.flatten(2)  # (1, 2, 100)
        t = rows.transpose(1, 2)[..., :1].expand(1, 100, 5) @ self.proj  # (1, 100, 3): 300 outputs * 5 = 1500
        e = torch.einsum("bik,bjk->bij", t, t)  # (1, 100, 100): 10000 outputs * 3 = 30000
        q = t.view(1, 1, 100, 3)
        a = F.scaled_dot_product_attention(q, q, q)  # 100 * 100 * (3 + 3) = 60000
        # cross-attention: 2 queries, 7 keys of 3 and values of 5: 2 * 7 * (3 + 5) = 112
        kv = x.flatten(1)[:, :56].view(1, 1, 7, 8)
        c = F.scaled_dot_product_attention(q[:, :, :2], kv[..., :3], kv[..., 3:])
        mat, vec, b1, b2 = x[0, 0, :3, :4], x[0, 1, 0, :4], x[0, :2, :3, :4], x[0, 2:, :4, :]
        products = (torch.mv(mat, vec).sum() + torch.dot(vec, vec)  # 3 * 4 + 4 = 16
                    + torch.baddbmm(torch.zeros(2, 3, 5), b1, b2).sum()  # 2 * 3 * 5 * 4 = 120
                    + torch.addbmm(torch.zeros(3, 5), b1, b2).sum()  # 120
                    + F.linear(x.flatten(1)[:, :48], self.lin_w, self.lin_b).sum())  # 48 -> 5: 240 (not 5 * 1)
        return e.mean() + a.mean() + c.mean() + products


def test_functional_convs_and_products_count_in_the_row_of_the_module_that_calls_them():
    model = FunctionalOps()
    functional = 5400 + 1200 + 1500 + 30000 + 60000 + 112 + 16 + 120 + 120 + 240
    for convention in ("layers", "paper"):
        rep = profile(model, (4, 5, 5), latency=False, convention=convention)
        rows = {row.name: row for row in rep.layers}
        conv = 150 * 36 + (150 if convention == "paper" else 0)  # the paper convention adds the conv's bias
        assert rows["conv"].macs == conv  # the module call only
        assert rows[""].macs == functional and rows[""].type == "FunctionalOps"
        assert rep.functional_macs == functional and rep.macs == conv + functional
    assert (rows[""].params, rows[""].weight_bytes) == (48 + 15 + 245, 4 * 308)  # its own up, proj and lin_w/b
    assert "in ops forward code calls itself" in str(rep)


class KernelOps(nn.Module):
    """Our kernels' conv modules (8 -> 8 depthwise 3x3 with bias, 8 -> 12 3x3 im2col with bias, padding 1) and their
    ops called functionally: depthwise 3x3 (no bias, padding 1), im2col 12 -> 6 3x3 (no padding), a stripe conv
    6 -> 4 with 5 kept stripes (3x3, no padding), the PiX block op (zeta 2) and the pix op (zeta 2)."""

    def __init__(self):
        super().__init__()
        import kernels

        self.k = kernels
        self.dw, self.conv = kernels.DepthwiseConv2d(8, 3, padding=1), kernels.Im2colConv2d(8, 12, 3, padding=1)
        self.w_dw, self.w = nn.Parameter(torch.randn(8, 1, 3, 3)), nn.Parameter(torch.randn(6, 12, 3, 3))
        self.stripes = nn.Parameter(torch.randn(5, 6))
        self.register_buffer("out_index", torch.tensor([0, 3, 0, 2, 1]))  # (canonical order: by offset, channel)
        self.register_buffer("offset", torch.tensor([[0, 0], [0, 2], [1, 1], [1, 1], [2, 0]]))
        self.pix_w = nn.Parameter(torch.randn(2, 4, 1, 1))

    def forward(self, x):
        k = self.k
        x = k.depthwise_conv2d(self.conv(self.dw(x)).narrow(1, 0, 8), self.w_dw, None, 1, 1)
        y = k.conv2d(torch.cat([x, x[:, :4]], 1), self.w, None, 1, 0)
        y = k.stripe_conv2d(y, self.stripes, self.out_index, self.offset, None, 4, 3)
        return k.pix(k.pix_squeeze(y, self.pix_w, 2), torch.rand(y.shape[0], 1, 1, 1), 2)


def test_our_kernels_conv_modules_and_ops_count_as_convs_by_hand():
    """Input (8, 10, 10): the modules count as nn.Conv2d (the paper convention adds their bias), the ops forward
    code calls itself in the caller's row."""
    modules = 800 * 9 + 1200 * 72  # depthwise: 8x10x10 outputs x 9; im2col: 12x10x10 outputs x 8*9
    functional = (800 * 9 + 6 * 8 * 8 * 108  # depthwise again; 12 -> 6 3x3 on 10x10 -> 8x8
                  + 6 * 6 * 5 * 6  # the stripe conv on 8x8 -> 6x6: 5 stripes of 6 channels per position
                  + (2 * 4 * 36 + 4 * 2)  # pix_squeeze of (4, 6, 6): pool + fusion 4x36 each, predictor 4 x 2
                  + 2 * 36)  # pix of (2, 6, 6)
    for convention, bias in (("layers", 0), ("paper", 1)):  # paper: a bias add per output element
        rep = profile(KernelOps(), (8, 10, 10), latency=False, convention=convention)
        rows = {row.name: row for row in rep.layers}
        assert (rows["dw"].macs, rows["conv"].macs) == (800 * (9 + bias), 1200 * (72 + bias))
        assert rows[""].macs == rep.functional_macs == functional
        assert rep.macs == modules + bias * (800 + 1200) + functional


class DirectRead(nn.Module):
    """Holds only a conv (3 -> 5, 3x3, no padding) and calls F.conv2d on its weight instead of calling it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, bias=False)

    def forward(self, x):
        return F.conv2d(x, self.conv.weight)


def test_a_module_with_no_row_gets_one_for_its_functional_ops():
    rep = profile(nn.Sequential(DirectRead(), nn.Flatten()), (3, 6, 6), latency=False)
    rows = {row.name: row for row in rep.layers}
    assert sorted(rows) == ["0", "1"]  # the uncalled conv has no row; its container one for its F.conv2d
    assert (rows["0"].type, rows["0"].macs, rows["0"].params, rows["0"].output_shape) == ("DirectRead", 80 * 27, 0,
                                                                                          [1, 5, 4, 4])
    assert rep.macs == rep.functional_macs == 80 * 27 and rep.params == 5 * 27


def test_ops_inside_a_layer_that_counts_itself_are_not_counted_again():
    """A module with macs() (here claiming 7) owns every op its forward runs, functional ones included; an
    nn.Conv2d's own aten.convolution is its row's, not a functional op."""

    class Claims(ClaimedWork):
        def forward(self, x):
            return F.conv2d(self.conv(x), torch.ones(6, 6, 1, 1))

    rep = profile(nn.Sequential(Claims(3, 6, lambda inp, out: 7), nn.Conv2d(6, 2, 1)), (3, 4, 4), latency=False)
    assert rep.functional_macs == 0 and rep.macs == 7 + 16 * 2 * 6
    assert profile(create_model("resnet20"), (3, 32, 32), latency=False).functional_macs == 0


class SelfAttention(nn.Module):
    """nn.MultiheadAttention (embed 8, 4 heads: an even count takes its fused inference fast path) over the 5 rows of a
    (1, 5, 8) input: in-projection 5 * 8 * 24 = 960, q @ k^T and weights @ v 2 * 4 heads * 5 * 5 * 2 = 400,
    out-projection 5 * 8 * 8 = 320 MACs."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 4, batch_first=True)

    def forward(self, x):
        return self.mha(x[:, 0], x[:, 0], x[:, 0])[0]


def test_multihead_attention_counts_its_products_though_its_fast_path_is_one_fused_op():
    rep = profile(SelfAttention(), (1, 5, 8), latency=False)
    assert rep.macs == rep.functional_macs == 960 + 400 + 320
    assert torch.backends.mha.get_fastpath_enabled()  # restored


class InferenceInside(nn.Module):
    """Composite ops inside the forward's own inference_mode block, dispatched whole: F.conv2d (4 x 3x3 of a 3x5x5
    input: 36 outputs * 27 = 972), F.linear (36 -> 5: 180) and an einsum (1x5 by 5x1: 5)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Parameter(torch.randn(4, 3, 3, 3))
        self.fc = nn.Parameter(torch.randn(5, 36))

    def forward(self, x):
        with torch.inference_mode():
            z = F.linear(F.conv2d(x, self.conv).flatten(1), self.fc)
            return torch.einsum("ij,kj->ik", z, z).clone()


def test_ops_in_a_forwards_own_inference_mode_and_in_hooks_count():
    assert profile(InferenceInside(), (3, 5, 5), latency=False).functional_macs == 972 + 180 + 5
    w = torch.randn(8, 8)
    model = nn.Sequential(nn.Linear(8, 8))
    model.register_forward_pre_hook(lambda mod, inp: (inp[0] @ w,))  # before any forward runs: the model's row
    model[0].register_forward_hook(lambda mod, inp, out: out @ w)  # after the Linear's call: its caller's row
    rep = profile(model, (1, 2, 8), latency=False)
    assert {row.name: row.macs for row in rep.layers} == {"0": 128, "": 256} and rep.functional_macs == 256


class CatchesAnError(nn.Module):
    """A child Linear that raises, caught by the forward, then x @ after (2 x 8 by 8 x 8: 128 MACs)."""

    def __init__(self):
        super().__init__()
        self.fails = nn.Linear(8, 8)
        self.fails.register_forward_pre_hook(lambda mod, inp: 1 / 0)
        self.after = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        try:
            self.fails(x)
        except ZeroDivisionError:
            pass
        return x @ self.after


def test_a_call_that_raises_inside_the_forward_does_not_stop_the_count():
    assert profile(CatchesAnError(), (1, 2, 8), latency=False).functional_macs == 128


def test_profile_leaves_each_modules_own_mode():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).train()
    model[1].eval()  # a frozen BN
    profile(model, (3, 6, 6), batch_size=2, repeats=1, warmup=0)
    assert model.training and not model[1].training


def test_flop_counter_mode_counts_the_compress_ops():
    """torch.utils.flop_counter.FlopCounterMode saw 0 FLOPs in the custom ops (a stripe-mode layer, a PiX block,
    the custom convs): their formulas count what aten's count for the same products (2 per multiply-add), and
    their backward ops each gradient's products."""
    from torch.utils.flop_counter import FlopCounterMode

    import kernels

    def flops(fn, *tensors):
        for t in tensors:
            t.grad = None
        with FlopCounterMode(display=False) as counter:
            out = fn()
            out.backward(torch.randn_like(out))
        return counter.get_total_flops()

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 7, 9, generator=gen, requires_grad=True)
    w = torch.randn(5, 6, 3, 3, generator=gen, requires_grad=True)
    aten = flops(lambda: F.conv2d(x, w, None, 2, 1), x, w)  # forward + grad_x + grad_weight
    assert aten == 3 * 2 * (2 * 5 * 4 * 5) * (6 * 9)
    assert flops(lambda: kernels.conv2d(x, w, None, 2, 1), x, w) == aten
    wd = torch.randn(6, 1, 3, 3, generator=gen, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        F.conv2d(x, wd, None, 1, 1, 1, 6)  # (aten's grouped grad_x formula counts C times the products: forward only)
    assert flops(lambda: kernels.depthwise_conv2d(x, wd, None, 1, 1), x, wd) == 3 * counter.get_total_flops()

    keep = torch.rand(5, 3, 3, generator=gen) < 0.4  # stripes (filter, offset) in canonical order
    out_index, offset = keep.permute(1, 2, 0).nonzero()[:, 2], keep.permute(1, 2, 0).nonzero()[:, :2]
    ws = torch.randn(len(out_index), 6, generator=gen, requires_grad=True)
    stripe = flops(lambda: kernels.stripe_conv2d(x, ws, out_index, offset, None, 5, 3, 2, 1), x, ws)
    assert stripe == 3 * 2 * (2 * 4 * 5) * len(out_index) * 6  # each kept stripe: a 6-long product per pixel
    frozen = x.detach()  # no grad_x: forward + grad_weight only (the stripe backward computes only what is needed)
    assert flops(lambda: kernels.stripe_conv2d(frozen, ws, out_index, offset, None, 5, 3, 2, 1), ws) == 2 * stripe // 3

    wp = torch.randn(3, 6, 1, 1, generator=gen, requires_grad=True)  # zeta 2
    pooled_product = flops(lambda: torch.sigmoid(x.mean((2, 3)) @ wp.flatten(1).t()), x, wp)
    assert flops(lambda: kernels.pix_squeeze(x, wp, 2), x, wp) == pooled_product == 3 * 2 * 2 * 6 * 3


def test_estimate_macs_scales_each_skeleton_conv_by_its_kept_stripes_by_hand():
    """train.py's macs/pruned_estimate (and summary.json's): conv 3 -> 4 3x3 on 8x8 (4 * 36 * 27 = 3888 MACs) keeps
    filter 0's 9 of 36 stripes, a quarter; the Linear 144 -> 5 (720) has no skeleton and counts whole."""
    from compress._macs import estimate_macs
    from compress.skeleton import attach_skeletons

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 5))
    attach_skeletons(model)
    with torch.no_grad():
        model[0].skeleton.copy_(torch.rand(4, 3, 3) * 0.5 + 0.5)
        model[0].skeleton[1:] = 0.005  # below the threshold
    assert estimate_macs(model, (3, 8, 8), 0.01) == (3888 + 720, 3888 // 4 + 720)


def test_a_strided_depthwise_conv_counts_its_outputs_not_its_inputs():
    """kernels.DepthwiseConv2d costs prod(kernel_size) MACs per output element: with stride 2 an 8x10x10 input gives
    8x5x5 outputs, 8*5*5*9 MACs (counting per input element would give 4x that)."""
    import kernels

    dw = kernels.DepthwiseConv2d(8, 3, stride=2, padding=1, bias=False)
    assert profile(dw, (8, 10, 10), latency=False).macs == 8 * 5 * 5 * 9


def test_paper_convention_counts_a_stripe_convs_fused_relu_and_pool_as_the_modules_they_replace():
    """A StripeConv2d keeping every stripe, with a ReLU and a 2x2 max-pool fused in, counts in the paper convention
    what conv + nn.ReLU + nn.MaxPool2d(2) count: conv 8x6x6 * 36 + bias 288 + ReLU 288 + pool 288 (per input)."""
    from compress.stripe import StripeConv2d

    torch.manual_seed(0)
    conv = nn.Conv2d(4, 8, 3, padding=1)
    stripe = StripeConv2d.from_dense(conv, torch.ones(8, 3, 3, dtype=torch.bool))
    stripe.relu = stripe.pool = True
    dense = nn.Sequential(conv, nn.ReLU(), nn.MaxPool2d(2))
    want = profile(dense, (4, 6, 6), latency=False, convention="paper").macs
    assert want == 288 * 36 + 3 * 288 == 11232
    assert profile(stripe, (4, 6, 6), latency=False, convention="paper").macs == want


class _FunctionalConv(nn.Module):
    """Calls F.conv2d itself on a weight of its own (3 -> 3, 3x3, padding 1)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3, 3, 3, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return F.conv2d(x, self.w, padding=1)


def test_functional_ops_of_a_module_called_twice_count_in_its_row_for_each_call():
    """The second call of a module adds its functional ops to its row too: 2 calls * 3x4x4 outputs * 27 MACs."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.t = _FunctionalConv()

        def forward(self, x):
            return self.t(self.t(x))

    rep = profile(Twice(), (3, 4, 4), latency=False)
    rows = {row.name: row for row in rep.layers}
    assert rows["t"].macs == 2 * 3 * 16 * 27
    assert rep.macs == rep.functional_macs == 2 * 3 * 16 * 27


class _ClaimsSevenWithAChild(_ClaimsSeven):
    """Counts itself (7 MACs) and holds a child that its count covers (so its name is among the covered ones)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Identity()


def test_a_sibling_whose_name_extends_a_covering_modules_name_keeps_its_row():
    """Module "1" has a child and macs(): its descendants ("1.inner") get no rows, but sibling "10" is not one of
    them (a bare prefix test on "1" would skip it). On 3x5x5: 1x1 convs 3 -> 4 (4*25*3 = 300) and 4 -> 2 (200)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 1), _ClaimsSevenWithAChild(), *[nn.Identity() for _ in range(8)],
                          nn.Conv2d(4, 2, 1, bias=False))
    rep = profile(model, (3, 5, 5), latency=False)
    rows = {row.name: row for row in rep.layers}
    assert "1.inner" not in rows and rows["1"].macs == 7
    assert rows["10"].macs == 2 * 25 * 4
    assert rep.macs == 300 + 7 + 200
