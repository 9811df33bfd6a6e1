"""compress.save / compress.load: round trips (dense, skeleton, stripe, shrunk and removed modules)
compared against the original model's output, and clear errors for truncated or tampered files."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

import compress
from compress.checkpoint import build_recipe, load, rebuild, register_module_type, save
from compress.compaction import compact
from compress.models import create_model
from compress.skeleton import attach_skeletons
from compress.stripe import StripeConv2d
from compress.surgery import replace_module

ROOT = Path(__file__).resolve().parents[1]


def _randomise(model: nn.Module, keep: float = 0.5, seed: int = 0) -> nn.Module:
    """Random weights, BN statistics and skeletons with about `keep` of the stripes non-zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point():
                continue
            if name.endswith("skeleton"):
                t.copy_((torch.rand(t.shape, generator=g) < keep) * (0.5 + torch.rand(t.shape, generator=g)))
            elif name.endswith("running_var"):
                t.copy_(0.5 + torch.rand(t.shape, generator=g))
            else:
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
    return model.eval()


def _round_trip(model: nn.Module, tmp_path, size: int = 32) -> nn.Module:
    x = torch.randn(2, 3, size, size)
    path = save(model, tmp_path / "m.safetensors")
    loaded = load(path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    assert {k: v.dtype for k, v in loaded.state_dict().items()} == {k: v.dtype for k, v in model.state_dict().items()}
    assert getattr(loaded, "compress_compaction", None) == getattr(model, "compress_compaction", None)
    assert not list(tmp_path.glob(".*tmp*")), "the temporary file of the atomic write was left behind"
    return loaded


def test_dense_round_trip(tmp_path):
    model = _randomise(create_model("resnet20"))
    assert build_recipe(model)["replacements"] == []
    loaded = _round_trip(model, tmp_path)
    assert loaded.compress_arch == model.compress_arch and not loaded.training


def test_skeleton_round_trip(tmp_path):
    model = create_model("resnet18", num_classes=7, input_size=32)
    names = attach_skeletons(model)
    _randomise(model)
    loaded = _round_trip(model, tmp_path)
    assert {e["name"] for e in build_recipe(model)["replacements"]} == set(names)
    torch.testing.assert_close(loaded.layer2[0].conv1.skeleton, model.layer2[0].conv1.skeleton)


def test_stripe_and_shrunk_channels_round_trip(tmp_path):
    """Stripe convs, a conv->BN->conv chain shrunk from 64 to 40 channels, BN folded to Identity."""
    model = create_model("vgg11")
    names = attach_skeletons(model)
    _randomise(model, keep=0.4)
    for name in names[1:]:
        replace_module(model, name, StripeConv2d.from_skeleton(model.get_submodule(name), 0.0))
    replace_module(model, "features.0", nn.Conv2d(3, 40, 3, padding=1, bias=True))
    replace_module(model, "features.1", nn.Identity())
    first = model.get_submodule(names[1])
    replace_module(model, names[1], StripeConv2d.from_dense(nn.Conv2d(40, first.out_channels, 3, padding=1),
                                                             torch.rand(first.out_channels, 3, 3) < 0.5))
    _randomise(model)
    loaded = _round_trip(model, tmp_path)
    assert isinstance(loaded.get_submodule(names[2]), StripeConv2d)
    torch.testing.assert_close(loaded.get_submodule(names[2]).out_index, model.get_submodule(names[2]).out_index)


def test_load_keeps_no_memory_per_call(tmp_path):
    """A service that reloads a model: compress.load (and model.weights' reader) read the file through
    safetensors' safe_open/get_tensor, which kept about 60 bytes per tensor per call for the life of the process
    (2 Python memory blocks per tensor: ~10k blocks over these 60 loads of 78 tensors); now nothing grows."""
    import gc

    from compress.models._weights import read_weights

    path = tmp_path / "m.safetensors"
    model = create_model("resnet20")
    save(model, path)
    plain = tmp_path / "state.safetensors"
    save_file(model.state_dict(), str(plain))
    for read in (load, read_weights):
        for _ in range(5):
            read(path if read is load else plain)
        gc.collect()
        before = sys.getallocatedblocks()
        for _ in range(60):
            read(path if read is load else plain)
        gc.collect()
        assert sys.getallocatedblocks() - before < 1500, read.__name__


def test_gemm_mode_round_trip(tmp_path):
    """A compact VGG whose 2x2 stripe convs run as unrolled GEMMs (mode "gemm", the last one with its pool fused)
    loads with those modes and the same output."""
    model = create_model("vgg11")
    attach_skeletons(model)
    small = compact(_randomise(model, keep=0.4), fold_bn=True, fuse_relu=True)
    gemm = ["features.22", "features.25"]  # at 2x2 for 32x32 inputs
    assert all(isinstance(small.get_submodule(n), StripeConv2d) for n in gemm)
    for n in gemm:
        small.get_submodule(n).mode = "gemm"
    loaded = _round_trip(small, tmp_path)
    assert [n for n, m in loaded.named_modules() if getattr(m, "mode", None) == "gemm"] == gemm
    assert all(loaded.get_submodule(n)._gemm_cache is not None for n in gemm)  # the GEMM ran


@pytest.mark.parametrize("fold_bn", [False, True])
def test_compact_model_round_trip(tmp_path, fold_bn):
    """compress.compact output: stripe convs, dead filters removed, an empty residual branch, folded BN."""
    model = create_model("resnet20")
    attach_skeletons(model)
    _randomise(model, keep=0.4)
    with torch.no_grad():
        model.layer2[1].conv2.skeleton.zero_()  # branch with no stripe left
        model.layer3[2].conv2.skeleton.zero_()  # the last: its empty int64 tensors end the file's int64 block
        model.layer1[0].conv1.skeleton[:5] = 0  # dead filters
    small = compact(model, fold_bn=fold_bn)
    recipe = build_recipe(small)
    assert {e["type"] for e in recipe["replacements"]} >= {"StripeConv2d"}
    loaded = _round_trip(small, tmp_path)
    assert loaded.layer1[0].conv1.out_channels == small.layer1[0].conv1.out_channels < 16
    assert loaded.layer2[1].conv2.num_stripes == 0
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:  # indices stored narrow, loaded as int64
        assert f.get_tensor("layer1.0.conv2.out_index").dtype == torch.int8  # 16 output channels
        assert f.get_tensor("layer1.0.conv2.offset").dtype == torch.int8
    assert loaded.layer1[0].conv2.out_index.dtype == torch.int64
    # the loaded state_dict saves with torch.save (train.py's checkpoints when init= fine-tunes it), empty
    # tensors of a stripe-less layer included, and reads back equal
    torch.save(loaded.state_dict(), tmp_path / "ckpt.pt")
    back = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert back.keys() == loaded.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in loaded.state_dict().items())


def test_a_model_whose_loader_reads_its_state_version_round_trips(tmp_path):
    """torchvision's MNASNet refuses a state dict without each module's version (state_dict()._metadata); load
    passes the rebuilt model's."""
    import torchvision

    def mnasnet_versioned(num_classes: int = 3, in_chans: int = 3) -> nn.Module:
        return torchvision.models.mnasnet0_5(weights=None, num_classes=num_classes)

    compress.register_model(mnasnet_versioned)
    _round_trip(compress.create_model("mnasnet_versioned").eval(), tmp_path)


def test_a_fresh_process_loads_and_runs_a_cifar_model_without_importing_torchvision(tmp_path):
    """Serving a compact CIFAR model needs neither torchvision nor timm: compress imports neither unless the model is
    theirs (seconds each on a CPU; export.py of a CIFAR run went from 8 to 5 s), and load + forward give the saved
    model's output."""
    model = create_model("resnet20")
    attach_skeletons(model)
    _randomise(model, keep=0.4)
    small = compact(model).eval()
    save(small, tmp_path / "m.safetensors")
    x = torch.randn(2, 3, 32, 32)
    torch.save({"x": x, "y": small(x)}, tmp_path / "io.pt")
    script = (
        "import sys, torch, compress\n"
        f"io = torch.load({str(tmp_path / 'io.pt')!r}, weights_only=True)\n"
        f"y = compress.load({str(tmp_path / 'm.safetensors')!r}).eval()(io['x'])\n"
        "torch.testing.assert_close(y, io['y'], rtol=1e-4, atol=1e-5)\n"
        "print(sorted(m for m in ('torchvision', 'timm') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, "mixed"])
def test_16_bit_models_round_trip_in_their_dtypes(tmp_path, dtype):
    """A compact model cast to float16/bfloat16 (or with only its classifier in float16) saves and loads with every
    tensor in its own dtype, and computes what it did."""
    model = create_model("resnet20")
    attach_skeletons(model)
    small = compact(_randomise(model, keep=0.4), fold_bn=True)
    if dtype == "mixed":
        small.fc.half()  # saved and loaded as it is (not run: its input would be float32)
    else:
        small.to(dtype)
    path = save(small, tmp_path / "m.safetensors")
    loaded = load(path)
    want = {k: v.dtype for k, v in small.state_dict().items()}
    assert {k: v.dtype for k, v in loaded.state_dict().items()} == want
    if dtype != "mixed":
        x = torch.randn(2, 3, 32, 32, dtype=dtype)
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), small(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64, "mixed"])
def test_buffers_kept_out_of_the_file_keep_their_dtype(tmp_path, dtype):
    """timm's BlurPool2d keeps its filter out of the state dict (persistent=False): rebuilt in float32, it made a
    loaded bfloat16 / float64 model fail in its first forward (a conv of x and a float32 weight). The recipe
    records such buffers' dtypes, so a model of mixed dtypes (bf16 with float32 BatchNorms) loads as it ran; a
    file without that record (an older version's) takes its one float dtype."""
    model = create_model("timm:resnetblur18", num_classes=3, input_size=32).eval()
    model.to(torch.bfloat16 if dtype == "mixed" else dtype)
    if dtype == "mixed":
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.float()
    path = save(model, tmp_path / "blur.safetensors")
    loaded = load(path)
    x = torch.randn(2, 3, 32, 32, dtype=torch.bfloat16 if dtype == "mixed" else dtype)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    assert "buffer_dtypes" in json.loads(safe_open(str(path), framework="pt").metadata()["compress.recipe"])
    if dtype != "mixed":  # as written before the record (no digests: rewritten)
        _rewrite(path, edit_recipe=lambda r: r.pop("buffer_dtypes"))
        with torch.no_grad():
            torch.testing.assert_close(load(path)(x), model(x), rtol=0, atol=0)


def test_removed_block_round_trip(tmp_path):
    model = _randomise(create_model("resnet18", input_size=32))
    del model.layer3[1]  # a whole residual block removed
    recipe = build_recipe(model)
    assert recipe["removed"] == ["layer3.1"]
    loaded = _round_trip(model, tmp_path)
    assert len(loaded.layer3) == 1


def test_unknown_module_type_cannot_be_saved(tmp_path):
    class Mine(nn.Module):
        def forward(self, x):
            return x

    model = create_model("resnet20")
    replace_module(model, "layer1.0.act1", Mine())
    with pytest.raises(ValueError, match="not an allowed type.*register_module_type"):
        save(model, tmp_path / "m.safetensors")
    # a module of the architecture's own type with other settings: load would rebuild the original one
    for name, changed in (("features.3", nn.MaxPool2d(3, stride=1, padding=1)), ("global_pool", nn.AdaptiveAvgPool2d(2))):
        vgg = create_model("vgg11", input_size=16)
        replace_module(vgg, name, changed)
        with pytest.raises(ValueError, match=f"module '{name}' of type {type(changed).__name__} differs from the "
                                             "rebuilt architecture"):
            save(vgg, tmp_path / "v.safetensors")
    assert not (tmp_path / "v.safetensors").exists()


def test_registered_custom_module_round_trip(tmp_path):
    class Scale(nn.Module):
        def __init__(self, channels: int):
            super().__init__()
            self.channels = channels
            self.weight = nn.Parameter(torch.ones(channels, 1, 1))
            self.register_buffer("tags", torch.zeros(4, dtype=torch.int64))  # stored narrow: negative values too

        def forward(self, x):
            return x * self.weight

        def config(self):
            return {"channels": self.channels}

    register_module_type("test.Scale", Scale)
    model = create_model("resnet20")
    replace_module(model, "layer2.0.act1", Scale(32))
    model.layer2[0].act1.tags.copy_(torch.tensor([-200, 100, -1, 5]))
    loaded = _round_trip(_randomise(model), tmp_path)
    assert torch.equal(loaded.layer2[0].act1.tags, model.layer2[0].act1.tags)


def test_bn_settings_and_the_device_survive_a_round_trip(tmp_path):
    """A BN whose only difference is its eps (timm's tf_* models use 1e-3) keeps it; load(device=) builds there."""
    model = create_model("resnet20")
    replace_module(model, "bn1", nn.BatchNorm2d(16, eps=0.5, momentum=0.3))
    loaded = _round_trip(_randomise(model), tmp_path)
    assert (loaded.bn1.eps, loaded.bn1.momentum) == (0.5, 0.3)
    on_meta = load(tmp_path / "m.safetensors", device="meta")
    assert {t.device.type for t in on_meta.state_dict().values()} == {"meta"}
    on_device = load(tmp_path / "m.safetensors", device=torch.device("cpu"))
    assert on_device.bn1.weight.dtype == torch.float32
    # a dtype given as the device was applied silently (a float16 model)
    with pytest.raises(ValueError, match=r"compress.load: device must be a device .* got torch.float16; to change "
                                         r"the dtype, call .to\(dtype\) on the loaded model"):
        load(tmp_path / "m.safetensors", device=torch.float16)
    with pytest.raises(ValueError, match=r"compress.load: device must be a device .* got None"):
        load(tmp_path / "m.safetensors", device=None)


def test_model_without_arch_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no compress_arch"):
        save(nn.Sequential(nn.Conv2d(3, 4, 3)), tmp_path / "m.safetensors")


# ---- truncated and tampered files --------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    model = create_model("resnet20")
    attach_skeletons(model)
    return save(_randomise(model), tmp_path / "m.safetensors")


def _rewrite(path, edit_tensors=None, edit_recipe=None):
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    recipe = json.loads(metadata["compress.recipe"])
    if edit_tensors:
        edit_tensors(tensors)
    if edit_recipe:
        edit_recipe(recipe)
    save_file(tensors, str(path), metadata={"compress.recipe": json.dumps(recipe)})


def test_truncated_file(saved):
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=rf"{saved.name} is not a readable safetensors file.*truncated"):
        load(saved)


def test_flipped_data_byte_is_detected(saved):
    before = load(saved)
    data = bytearray(saved.read_bytes())
    data[-3] ^= 0x10  # inside the last tensor's bytes: the file still parses
    saved.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{saved.name} is corrupt.*SHA-256"):
        load(saved)
    _rewrite(saved)  # the same tensors without a digest (a file from before it): loads, with the flipped value
    after = load(saved)
    changed = [k for k, v in before.state_dict().items() if not torch.equal(v, after.state_dict()[k])]
    assert len(changed) == 1


def test_bad_header(saved):
    data = bytearray(saved.read_bytes())
    data[8:16] = b"garbage!"
    saved.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{saved.name} is not a safetensors file .*no safetensors header"):
        load(saved)


@pytest.mark.parametrize("kind", ["json", "pickle", "onnx"])
def test_a_file_of_another_kind_is_named_so_not_truncated(tmp_path, kind):
    """export.py's report.json, a pickle or an ONNX file passed to load: the error says it is not a safetensors
    file and names the file to give (it said "truncated or corrupt: export it again")."""
    import pickle

    path = tmp_path / f"model.{kind}"
    data = {"json": json.dumps({"compact": {"macs": 123}}).encode(), "pickle": pickle.dumps({"a": [1, 2, 3]}),
            "onnx": b"\x08\x08\x12\x07pytorch\x1a\x032.0" + bytes(range(40))}[kind]
    path.write_bytes(data)
    with pytest.raises(ValueError, match=rf"{path.name} is not a safetensors file .*model.compact.safetensors"):
        load(path)


def test_missing_tensor(saved):
    _rewrite(saved, edit_tensors=lambda t: t.pop("layer1.0.conv1.weight"))
    with pytest.raises(ValueError, match=r"m.safetensors.*do not fit.*layer1.0.conv1.weight"):
        load(saved)


def test_shape_mismatch(saved):
    def shrink(t):
        t["layer1.0.bn1.weight"] = t["layer1.0.bn1.weight"][:8].clone()

    _rewrite(saved, edit_tensors=shrink)
    with pytest.raises(ValueError, match=r"m.safetensors.*do not fit.*shape or kind differs for layer1.0.bn1.weight"):
        load(saved)


def test_unknown_type_key(saved):
    def evil(recipe):
        recipe["replacements"][0]["type"] = "os:system"

    _rewrite(saved, edit_recipe=evil)
    with pytest.raises(ValueError, match=r"m.safetensors.*unknown module type key 'os:system'"):
        load(saved)


def test_wrong_version_and_missing_recipe(saved, tmp_path):
    _rewrite(saved, edit_recipe=lambda r: r.update(version=99))
    with pytest.raises(ValueError, match="format version 99"):
        load(saved)
    plain = tmp_path / "plain.safetensors"
    save_file({"w": torch.randn(3)}, str(plain))
    with pytest.raises(ValueError, match="no compact-model recipe"):
        load(plain)
    with pytest.raises(FileNotFoundError, match="no compact model file"):
        load(tmp_path / "absent.safetensors")
    with pytest.raises(ValueError, match="is a directory; give the compact model file in it"):
        load(tmp_path)


def test_a_torch_checkpoint_is_named_as_such(tmp_path):
    """init= / compress.load given a train.py checkpoint: the error says to export it first."""
    path = tmp_path / "last.pt"
    torch.save({"model": {}, "config": {}}, path)
    with pytest.raises(ValueError, match=r"is a train.py checkpoint \(.pt\), not a compact model file; .* python "
                                         r"export.py ckpt="):
        load(path)
    # a plain state dict, or a zip of something else: not sent to export.py, which refuses them
    import zipfile

    torch.save(create_model("resnet20").state_dict(), tmp_path / "weights.pt")
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as z:
        z.writestr("readme.txt", "not a model")
    for name in ("weights.pt", "other.zip"):
        with pytest.raises(ValueError, match=rf"{name} is a zip archive but no compact model file .*nor a train.py "
                                             r"checkpoint") as info:
            load(tmp_path / name)
        assert "python export.py" not in str(info.value)


def test_atomic_write_keeps_the_old_file_on_a_failed_write_and_sets_umask_permissions(tmp_path):
    import os

    from compress._files import atomic_write

    path = tmp_path / "m.safetensors"
    save(create_model("resnet20"), path)
    umask = os.umask(0o022)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not safetensors' owner-only default
    before = path.read_bytes()

    def full_disk(tmp):
        tmp.write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    with pytest.raises(OSError, match=r"could not write .*m.safetensors .*unexpected pos.*disk has room.*unchanged"):
        atomic_write(path, full_disk)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]
    from safetensors import SafetensorError

    def full_disk_safetensors(tmp):  # what safetensors' save_file raises on ENOSPC
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    with pytest.raises(OSError, match=r"could not write .*m.safetensors \(SafetensorError: .*No space left"):
        atomic_write(path, full_disk_safetensors)
    assert path.read_bytes() == before
    with pytest.raises(ValueError, match=r"compress.save: .* is a directory; give a file path"):
        save(create_model("resnet20"), tmp_path)
    with pytest.raises(ValueError, match=r"compress.save: .*new/ is a directory; give a file path"):
        save(create_model("resnet20"), f"{tmp_path / 'new'}/")


def test_save_and_load_take_a_leading_tilde_as_the_home_folder(tmp_path, monkeypatch):
    """compress.save("~/models/m.safetensors") made a folder named '~' in the working directory (the missing
    folders of the literal path); save and load take ~ as the home folder, as the command line does."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    model = create_model("resnet20").eval()
    written = save(model, "~/models/m.safetensors")
    assert written == tmp_path / "home" / "models" / "m.safetensors" and written.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]  # no ./~
    again = load(Path("~/models/m.safetensors"))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(again(x), model(x))
    for call in (lambda p: save(model, p), load):  # (pathlib's bare "Could not determine home directory." before)
        with pytest.raises(ValueError, match=r"~no_such_user_x/m.safetensors: no home folder for its '~'"):
            call("~no_such_user_x/m.safetensors")


def _first_stripe(recipe):
    return next(r for r in recipe["replacements"] if r["type"] == "StripeConv2d")


def _set(entry, key, value):
    entry[key] = value


@pytest.mark.parametrize("edit_recipe, edit_tensors, message", [
    (lambda r: _set(r["arch"], "name", 7), None, "cannot rebuild the architecture.*model name must be a string"),
    (lambda r: _set(r["replacements"][0], "name", 3), None, "the recipe is incomplete or malformed"),
    (lambda r: _set(r["replacements"][0], "name", "training"), None,  # an attribute, not a module
     "'training' cannot name a module"),
    (lambda r: _set(r["replacements"][0], "name", "__class__"), None, "'__class__' cannot name a module"),
    (lambda r: _set(_first_stripe(r)["config"], "out_channels", -4), None,
     "module 'conv1': cannot build StripeConv2d from config"),
    (lambda r: _set(r["arch"]["kwargs"], "checkpoint_path", "/etc/passwd"), None,
     r"cannot rebuild the architecture.*\['checkpoint_path'\] would make the constructor read weights"),
    (None, lambda t: t.update({k: v.float() for k, v in t.items() if k.endswith("out_index")}),
     "the tensors do not fit the recipe's model: shape or kind differs for conv1.out_index"),
    (None, lambda t: t.update({k: v + 1000 for k, v in t.items() if k.endswith("out_index")}),
     "the tensors do not fit the recipe's model: StripeConv2d: invalid stripe indices"),
])
def test_tampered_compact_files_are_errors_naming_the_file(tmp_path, edit_recipe, edit_tensors, message):
    """Recipe values of the wrong type or range, a recipe asking the constructor to read a file, and stripe indices
    of the wrong type or range: each a ValueError naming the file and the problem, never another exception or a file
    read."""
    model = create_model("resnet20")
    attach_skeletons(model)
    path = save(compact(_randomise(model)), tmp_path / "m.safetensors")
    _rewrite(path, edit_tensors=edit_tensors, edit_recipe=edit_recipe)
    with pytest.raises(ValueError, match=r"compress.load\(.*m.safetensors\): " + message):
        load(path)


def test_a_shrunk_timm_batchnormact_saves_and_loads(tmp_path):
    """compact(fold_bn=False) shrinks timm's BatchNormAct2d with its conv's dead filters; the file records it (BN
    config and activation) and loads to the same function."""
    model = create_model("timm:regnetx_002", num_classes=10, input_size=32)
    attach_skeletons(model)
    _randomise(model, keep=1.0)
    with torch.no_grad():
        model.get_submodule("stem.conv").skeleton[:8] = 0  # 8 dead filters
    small = compact(model, fold_bn=False)
    assert small.stem.bn.num_features == 24 and type(small.stem.bn).__name__ == "BatchNormAct2d"
    loaded = load(save(small, tmp_path / "m.safetensors"))
    assert type(loaded.stem.bn) is type(small.stem.bn) and type(loaded.stem.bn.act) is type(small.stem.bn.act)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), small(x), rtol=0, atol=0)
        torch.testing.assert_close(small(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("act", [nn.LeakyReLU(0.1, inplace=True), nn.ELU(0.5), nn.Mish(), nn.Hardsigmoid(),
                                 nn.Sigmoid(), nn.Tanh(), nn.GELU("tanh"), nn.SiLU(inplace=True)])
def test_allowlisted_activations_rebuild_from_their_config(act):
    from compress.checkpoint import _build, _config, _type_key

    key = _type_key(act)
    rebuilt = _build(key, _config(act, key), "test")
    x = torch.randn(50)
    assert type(rebuilt) is type(act) and torch.equal(rebuilt(x.clone()), act(x.clone()))


def test_a_folded_timm_leaky_relu_model_saves_and_loads(tmp_path):
    """fold_bn leaves a BatchNormAct2d's LeakyReLU (CSP/Darknet) in the BN's place; the file records it."""
    model = create_model("timm:darknet17", num_classes=10, input_size=32)
    attach_skeletons(model)
    small = compact(_randomise(model, keep=0.6).eval(), fold_bn=True)
    loaded = load(save(small, tmp_path / "m.safetensors"))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), small(x), rtol=0, atol=0)


def test_a_folded_timm_conv2dsame_model_saves_and_loads(tmp_path):
    """BN folding gives timm's Conv2dSame (tf_* models) a bias; the file records it."""
    model = create_model("timm:tf_efficientnet_b0", num_classes=10, input_size=32)
    attach_skeletons(model)
    small = compact(_randomise(model, keep=0.6).eval(), fold_bn=True)
    assert any(type(m).__name__ == "Conv2dSame" and m.bias is not None for m in small.modules())
    loaded = load(save(small, tmp_path / "m.safetensors"))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), small(x), rtol=0, atol=0)


def _rewrite_keeping_digests(path, edit_recipe):
    """Rewrite a saved file with an edited recipe, keeping the metadata (digests) it had."""
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = dict(f.metadata())
    recipe = json.loads(metadata["compress.recipe"])
    edit_recipe(recipe)
    save_file(tensors, str(path), metadata=metadata | {"compress.recipe": json.dumps(recipe)})


def test_a_recipe_naming_huge_layers_fails_before_allocating_them(saved):
    """A few hundred bytes of recipe asking for 64 x 10^12 Linear layers: refused from the meta-device build (it
    compares the recipe's state_dict with the file's tensors), before anything is allocated."""
    huge = [{"name": f"x{i}", "type": "Linear", "config": {"in_features": 64, "out_features": 10**12}} for i in range(3)]
    _rewrite(saved, edit_recipe=lambda r: r["replacements"].extend(huge))
    with pytest.raises(ValueError, match=r"m.safetensors.*do not fit the recipe's model: missing x0.bias, x0.weight"):
        load(saved)


@pytest.mark.parametrize("key, value, match", [
    ("kernel_size", [3000, 3000], r"kernel_size=\(3000, 3000\) x out_channels=16 = 144,000,000 index rows, above"),
    ("dilation", [0, 0], r"dilation=\(0, 0\): not the geometry of a conv layer"),
    ("stride", [1, 0], r"stride=\(1, 0\): not the geometry"),
    ("padding", [-3, -3], r"padding=\(-3, -3\): not the geometry"),
])
def test_a_stripe_conv_of_impossible_geometry_is_refused_before_its_index_table(tmp_path, key, value, match):
    """A stripe conv's kernel size and width are in the recipe only (no tensor has their shape), so the meta-device
    check cannot catch a huge one: a 3000x3000 kernel made load build a 144M-row index table (5.8 GB); a dilation of
    0 divided by zero. Refused by StripeConv2d, naming the file."""
    model = create_model("resnet20")
    attach_skeletons(model)
    path = save(compact(_randomise(model, keep=0.4).eval(), fold_bn=True), tmp_path / "m.safetensors")

    def edit(recipe):
        (first,) = [r for r in recipe["replacements"] if r["name"] == "conv1"]
        assert first["type"] == "StripeConv2d"
        first["config"][key] = value

    _rewrite(path, edit_recipe=edit)
    with pytest.raises(ValueError, match=rf"m.safetensors.*module 'conv1'.*{match}"):
        load(path)


@pytest.mark.parametrize("edit, match", [
    (lambda r: r["arch"]["kwargs"].update(num_classes=-5), r"cannot rebuild the architecture"),
    (lambda r: r["removed"].append("_parameters"), r"removed module '_parameters' is not a module"),
])
def test_recipes_that_no_model_fits_are_errors_naming_the_file(saved, edit, match):
    _rewrite(saved, edit_recipe=edit)
    with pytest.raises(ValueError, match=rf"m.safetensors.*{match}"):
        load(saved)


@pytest.mark.parametrize("raw", ["[" * 100_000 + "]" * 100_000, '{"format": ' + "9" * 5000 + "}"])
def test_recipe_text_python_cannot_read_is_a_corrupt_recipe(saved, raw):
    """Nesting too deep for the JSON reader, an integer literal over Python's digit limit."""
    with safe_open(str(saved), framework="pt") as f:  # no digests: the text itself is what fails
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(saved), metadata={"compress.recipe": raw})
    with pytest.raises(ValueError, match=r"m.safetensors: corrupt recipe"):
        load(saved)


def test_an_edited_recipe_is_detected_by_its_digest(saved):
    """A recipe edit that keeps every tensor's shape (a conv's stride) changes the function; the recipe's SHA-256,
    kept in the file, catches it."""
    _rewrite_keeping_digests(saved, edit_recipe=lambda r: r["replacements"][0]["config"].update(stride=[2, 2]))
    with pytest.raises(ValueError, match=r"m.safetensors is corrupt: its recipe does not match the SHA-256"):
        load(saved)


def test_a_header_that_changes_a_tensors_dtype_is_detected_by_its_digest(tmp_path):
    """A float16 compact file whose safetensors header says BF16 for one tensor (its bytes unchanged, so the
    file still parses and every shape fits) holds other numbers: the tensors' SHA-256 covers each dtype, so load
    refuses it as corrupt instead of loading bfloat16 garbage."""
    from compress._digest import digest

    t = torch.randn(3, 4, dtype=torch.float16)
    assert digest(t) != digest(t.view(torch.bfloat16))
    model = create_model("resnet20")
    attach_skeletons(model)
    path = save(compact(_randomise(model, keep=0.4), fold_bn=True).half(), tmp_path / "m.safetensors")
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    assert header["fc.weight"]["dtype"] == "F16"
    header["fc.weight"]["dtype"] = "BF16"
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= size
    path.write_bytes(data[:8] + text.ljust(size, b" ") + data[8 + size:])
    with safe_open(str(path), framework="pt") as f:  # the edit parses: only the digest can tell
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"m.safetensors is corrupt"):
        load(path)


def test_the_digest_tells_apart_nestings_and_shapes_of_the_same_values():
    """The digest of a checkpoint hashes each list's length and each tensor's shape: without them, [[1], 2] and
    [[1, 2]] (or a tensor and the same bytes reshaped) had one SHA-256, so an edit that regrouped values or
    reshaped a tensor went unnoticed."""
    from compress._digest import digest

    assert digest([[1], 2]) != digest([[1, 2]])
    assert digest(([1, 2], [3])) != digest(([1], [2, 3])) != digest([[1, 2, 3]])
    t = torch.randn(6)
    assert digest(t) != digest(t.reshape(2, -1)) and digest(t) == digest(t.clone())


def test_a_recipe_tying_tensors_of_different_shapes_is_malformed(tmp_path):
    """A recipe whose "tied" record groups two tensors of different shapes (fc.weight and fc.bias) cannot be the
    record save wrote: refused as malformed, naming the file (tying them made one name hold the other's shape)."""
    model = create_model("resnet20")
    attach_skeletons(model)
    path = save(compact(_randomise(model, keep=0.4), fold_bn=True), tmp_path / "m.safetensors")
    _rewrite(path, edit_recipe=lambda r: r.update(tied=[["fc.weight", "fc.bias"]]))
    with pytest.raises(ValueError, match=r"m.safetensors\): the recipe is incomplete or malformed \(tied is "
                                         r"\[\['fc.weight', 'fc.bias'\]\]\)"):
        load(path)


@pytest.mark.parametrize("key, value, match", [
    ("fc.weight", lambda t: t.to(torch.float8_e4m3fn), r"unsupported dtypes: fc.weight \(torch.float8_e4m3fn\)"),
    ("fc.weight", lambda t: t.to(torch.complex64), r"unsupported dtypes: fc.weight \(torch.complex64\)"),
    ("bn1.num_batches_tracked", lambda t: torch.tensor(1.5), r"shape or kind differs for bn1.num_batches_tracked"),
])
def test_tensors_of_dtypes_no_module_computes_in_are_refused(saved, key, value, match):
    """A float8 or complex fc.weight loaded and failed at the first forward; a float step counter loaded as is."""
    _rewrite(saved, edit_tensors=lambda t: t.update({key: value(t[key])}))
    with pytest.raises(ValueError, match=rf"m.safetensors.*{match}"):
        load(saved)


def test_load_warns_of_non_finite_weights(saved):
    _rewrite(saved, edit_tensors=lambda t: t["fc.weight"].view(-1)[:1].fill_(float("nan")))
    with pytest.warns(UserWarning, match=r"m.safetensors.*tensors hold NaN or inf values: fc.weight"):
        load(saved)


def test_save_refuses_wrappers_and_warns_of_hooks(tmp_path):
    model = create_model("resnet20")
    with pytest.raises(ValueError, match=r"OptimizedModule is a wrapper; save the model inside it: model._orig_mod"):
        save(torch.compile(model), tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match=r"DataParallel is a wrapper; save the model inside it: model.module"):
        save(nn.DataParallel(model), tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match=r"CUDAGraphModel is a wrapper; save the model inside it: model.model"):
        save(compress.CUDAGraphModel(model), tmp_path / "m.safetensors")
    model.layer1.register_forward_hook(lambda m, i, o: o * 2)
    with pytest.warns(UserWarning, match=r"forward hooks are not saved \(on layer1\)"):
        save(model, tmp_path / "m.safetensors")
    odd = create_model("resnet20")
    odd.fc.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"compress.save: tensors of unsupported dtypes: fc.weight .*model.float\(\)"):
        save(odd, tmp_path / "odd.safetensors")


class _OptionalHead(nn.Module):
    """A net whose forward reads a plain attribute, as a user's model may (``if self.use_head:``)."""

    def __init__(self, num_classes: int, in_chans: int):
        super().__init__()
        self.use_head, self.scale = False, 1.0
        self.conv = nn.Conv2d(in_chans, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        x = self.conv(x)
        return self.fc((self.head(x) if self.use_head else x).mean((2, 3))) * self.scale


@compress.register_model
def _test_optional_head_net(num_classes=10, in_chans=3):
    return _OptionalHead(num_classes, in_chans)


def test_save_warns_of_attributes_set_after_construction(tmp_path, recwarn):
    """An attribute set after construction (not a constructor argument, not a tensor, not in a module's printed
    settings) was dropped without a word: load rebuilt the constructor's value and the loaded model computed another
    function. save names each such attribute with both values."""
    model = create_model("_test_optional_head_net", num_classes=4).eval()
    save(model, tmp_path / "plain.safetensors")
    assert not [w for w in recwarn if "attributes set after construction" in str(w.message)]
    model.use_head, model.conv.padding_mode_note = True, "kept?"
    with pytest.warns(UserWarning, match=r"attributes set after construction are not saved: use_head = True "
                      r"\(rebuilt: False\), conv.padding_mode_note = 'kept\?' \(rebuilt: absent\); load gives"):
        save(model, tmp_path / "m.safetensors")
    x = torch.randn(2, 3, 8, 8)
    loaded = load(tmp_path / "m.safetensors")
    assert loaded.use_head is False and not torch.allclose(loaded(x), model(x))


class _KeepsItsDevice(nn.Module):
    """A net whose constructor records its device (as some models do, for torch.autocast in their forward)."""

    def __init__(self, num_classes: int, in_chans: int):
        super().__init__()
        self.conv = nn.Conv2d(in_chans, 8, 3)
        self.fc = nn.Linear(8, num_classes)
        self.device_type, self.device = self.conv.weight.device.type, self.conv.weight.device

    def forward(self, x):
        with torch.autocast(self.device_type, enabled=False):
            return self.fc(self.conv(x).mean((2, 3)))


@compress.register_model
def _test_keeps_its_device_net(num_classes=10, in_chans=3):
    return _KeepsItsDevice(num_classes, in_chans)


def test_a_model_that_records_its_device_loads_with_it_and_saves_without_a_warning(tmp_path, recwarn):
    """load built the model on the meta device and kept its constructor's device_type 'meta' (its forward then
    failed: "unsupported scalarType"), and save's check of attributes set after construction named it. Such a model
    is built for real in both."""
    model = create_model("_test_keeps_its_device_net", num_classes=4)
    path = save(model, tmp_path / "m.safetensors")
    assert not [w for w in recwarn if "attributes set after construction" in str(w.message)]
    loaded = load(path)
    assert (loaded.device_type, loaded.device) == ("cpu", torch.device("cpu"))
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


class _TensorValuedWidth(nn.Module):
    """A conv net whose __init__ computes its width with tensors, as torchvision's RegNet does (BlockParams:
    ``.tolist()``); meta tensors hold no values, so it cannot be built on the meta device."""

    def __init__(self, num_classes: int, in_chans: int):
        super().__init__()
        width = int(torch.tensor([15.6]).round().int().tolist()[0])
        self.conv = nn.Conv2d(in_chans, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.fc(self.bn(self.conv(x)).relu().mean((2, 3)))


@compress.register_model
def _test_tensor_valued_width_net(num_classes=10, in_chans=3):
    return _TensorValuedWidth(num_classes, in_chans)


def test_a_model_that_cannot_be_built_on_meta_loads(tmp_path):
    """load checks a file's tensors against the recipe's model built on the meta device; a model whose __init__
    reads tensor values fails there ('Cannot copy out of meta tensor'), and load refused every such file as 'cannot
    rebuild the architecture' (torchvision's regnet_x_400mf). The real build then checks it: skeleton and compact
    files load, and a file whose tensors do not fit is still refused."""
    model = create_model("_test_tensor_valued_width_net", num_classes=4)
    attach_skeletons(model)
    _randomise(model)
    with pytest.raises(NotImplementedError):
        with torch.device("meta"):
            create_model("_test_tensor_valued_width_net", num_classes=4)
    _round_trip(model, tmp_path, size=8)
    _round_trip(compact(model, fold_bn=True), tmp_path, size=8)
    path = save(model, tmp_path / "m.safetensors")
    _rewrite(path, edit_tensors=lambda t: t.update({"fc.weight": t["fc.weight"][:3].clone()}))
    with pytest.raises(ValueError, match=r"m.safetensors.*fc\.weight"):
        load(path)
    # a tensor missing or one too many: the strict load is the only check (no meta-device model to compare with)
    for edit, key in ((lambda t: t.pop("fc.bias"), "fc.bias"), (lambda t: t.update({"extra": t["fc.bias"] * 2}), "extra")):
        path = save(model, tmp_path / "m.safetensors")
        _rewrite(path, edit_tensors=edit)
        with pytest.raises(ValueError, match=rf"m.safetensors.*do not fit the recipe's model.*{key}"):
            load(path)


def test_load_of_a_model_that_cannot_be_built_on_meta_leaves_the_random_stream(tmp_path):
    """A model whose __init__ reads tensor values is built for real by load (no meta-device build), drawing
    initial weights that the file's then replace: without the random state kept around that build, every load
    moved the user's stream (a later dropout or shuffle changed)."""
    model = _randomise(create_model("_test_tensor_valued_width_net", num_classes=4))
    path = save(model, tmp_path / "m.safetensors")
    torch.manual_seed(11)
    before = torch.get_rng_state()
    loaded = load(path)
    assert torch.equal(torch.get_rng_state(), before)
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_save_and_load_build_no_model_with_weights_of_its_own(tmp_path, monkeypatch):
    """save rebuilt the whole architecture with random weights only to compare module structure, and load built
    one with random weights only to replace them by the file's: both use the meta-device model now, drawing
    nothing; a constructor that needs tensor values still saves and loads (the test above), as do modules with
    tensors outside their state dict (BlurPool's filter, buffer_dtypes' test)."""
    model = create_model("vgg11", num_classes=10)
    attach_skeletons(model)
    _randomise(model)
    small = compact(model.eval(), fold_bn=True)

    import compress.checkpoint as checkpoint_module

    built = []

    def recorded(*args, _real=checkpoint_module._reference):
        ref = _real(*args)
        built.append({p.device.type for p in ref.parameters()})
        return ref

    monkeypatch.setattr(checkpoint_module, "_reference", recorded)
    paths = [save(m, tmp_path / f"{i}.safetensors") for i, m in enumerate((model, small))]
    x = torch.randn(2, 3, 32, 32)
    for m, path in zip((model, small), paths):
        loaded = load(path)
        assert {type(a) for a in loaded.modules()} == {type(b) for b in m.modules()}
        torch.testing.assert_close(loaded(x), m.eval()(x), rtol=0, atol=0)
    assert len(built) == 4 and all(devices == {"meta"} for devices in built)  # (two saves, two loads)


def test_paths_that_are_no_regular_file_are_clear_errors(tmp_path):
    """A symlink loop or a FIFO at the path: said so, not "no file there" (load) nor Python's RuntimeError (a
    train.py / export.py path setting, resolved by launch_path)."""
    import os

    from compress._files import launch_path

    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    os.mkfifo(tmp_path / "fifo")
    for name in ("loop", "fifo"):
        with pytest.raises(ValueError, match=rf"compress.load: {tmp_path / name} is not a regular file"):
            load(tmp_path / name)
    with pytest.raises(ValueError, match=rf"{tmp_path / 'loop'}: cannot resolve this path"):
        launch_path(tmp_path / "loop")


def test_atomic_write_goes_through_links_refuses_special_files_and_removes_dead_writers_temporaries(tmp_path):
    """A symbolic link is written through (os.replace replaced the link and left its target old); a FIFO or device
    is refused (as root, compress.save(m, "/dev/null") replaced the device node with a file); a folder that is a
    file gets the "could not write" error (the temporary file's cleanup raised NotADirectoryError over it); a
    killed writer's temporary file (.<name>.tmp<pid>) is removed by the next write of that path, a live one's
    kept; safetensors writes no temporary file of its own beside the target."""
    import os

    m = create_model("resnet20")
    (tmp_path / "disk").mkdir()
    target, link = tmp_path / "disk" / "real.safetensors", tmp_path / "link.safetensors"
    save(m, target)
    link.symlink_to(target)
    with torch.no_grad():
        m.fc.bias.add_(torch.randn(m.fc.bias.shape))
    assert save(m, link) == link and link.is_symlink()
    torch.testing.assert_close(load(link).fc.bias, m.fc.bias, rtol=0, atol=0)
    torch.testing.assert_close(load(target).fc.bias, m.fc.bias, rtol=0, atol=0)

    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match=r"could not write .*pipe.safetensors: it is not a regular file"):
        save(m, fifo)
    with pytest.raises(OSError, match=r"could not write .*real.safetensors/x.safetensors \(FileExistsError"):
        save(m, target / "x.safetensors")

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / "disk" / f".real.safetensors.tmp{dead.pid}.0a1b2c3d"
    live = tmp_path / "disk" / f".real.safetensors.tmp{os.getppid()}.1a2b3c4d"
    # a process this one cannot see (another container or host sharing the folder), writing now: kept
    unseen = tmp_path / "disk" / f".real.safetensors.tmp{dead.pid}.2b3c4d5e"
    for file in (stale, live, unseen):
        file.write_bytes(b"part of a model")
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    os.utime(live, (hour_ago, hour_ago))
    save(m, target)
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == sorted([live.name, unseen.name, "real.safetensors"])


def test_save_refuses_stripe_indices_changed_after_the_layer_was_built(tmp_path):
    """timm's ModelEmaV2 averages every state dict entry, int64 index buffers too: the forward kept reading the
    layer's plan (right outputs), compress.save wrote the truncated indices and compress.load refused the file.
    save names the layer and the cause now; a placeholder layer (stripes never set) is named as such."""
    model = create_model("resnet20")
    attach_skeletons(model)
    with torch.no_grad():
        model.layer1[0].conv1.skeleton.mul_(torch.rand(model.layer1[0].conv1.skeleton.shape) > 0.5)
    compact_model = compact(model.eval())
    ema = compact(model.eval())
    with torch.no_grad():  # ModelEmaV2's update: ema = decay * ema + (1 - decay) * model, on every entry
        for e, m in zip(ema.state_dict().values(), compact_model.state_dict().values()):
            e.copy_(e * 0.9 + (1 - 0.9) * m)
    layer = ema.layer1[0].conv1
    assert not torch.equal(layer.out_index, compact_model.layer1[0].conv1.out_index)
    with pytest.raises(ValueError, match=r"compress.save: layer layer1.0.conv1: its stripe indices .* were changed "
                                         r"after it was built: an EMA .*ModelEmaV3"):
        save(ema, tmp_path / "ema.safetensors")
    assert not (tmp_path / "ema.safetensors").exists()
    save(compact_model, tmp_path / "ok.safetensors")  # untouched indices: saved
    placeholder = StripeConv2d(3, 4, 3, num_stripes=5)
    with pytest.raises(ValueError, match=r"its 5 stripes were never set"):
        placeholder.check_indices()


def test_json_text_writes_non_finite_numbers_as_null():
    """summary.json and report.json: a NaN test loss (BN statistics overflowing after one step) or an ONNX error of
    NaN is written null, so that strict JSON readers accept the file (json.dumps writes a bare NaN)."""
    import json
    import math

    from compress._files import json_text

    value = {"test_loss": float("nan"), "onnx": {"max_rel_error": float("inf"), "opset": 17}, "ms": [1.5, -math.inf],
             "name": "resnet50", "ok": True, "none": None}
    text = json_text(value)
    strict = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert strict == {"test_loss": None, "onnx": {"max_rel_error": None, "opset": 17}, "ms": [1.5, None],
                      "name": "resnet50", "ok": True, "none": None}
    assert text.endswith("}\n") and json_text({"a": 0.25}) == '{\n  "a": 0.25\n}\n'


def test_json_text_writes_non_finite_numbers_in_tuples_as_null():
    """A tuple of metrics (a NaN loss beside an accuracy) is written as a list with null: json.dumps(allow_nan=False)
    raised ValueError on the bare NaN inside the tuple."""
    import json

    from compress._files import json_text

    value = {"a": (float("nan"), 1.0), "b": [(2.5, float("-inf"))]}
    strict = json.loads(json_text(value), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert strict == {"a": [None, 1.0], "b": [[2.5, None]]}


def test_saving_a_model_again_gives_the_same_bytes(tmp_path):
    """Reproducible artifacts: the same model saved six times, and saved again after a load, is one file byte for
    byte (safetensors wrote the three metadata keys in a random order: 4 distinct files of 6 saves)."""
    import hashlib

    model = create_model("resnet20")
    attach_skeletons(model)
    model = compact(_randomise(model, keep=0.4), fold_bn=True)
    files = [save(model, tmp_path / f"m{i}.safetensors") for i in range(6)]
    assert len({hashlib.sha256(f.read_bytes()).hexdigest() for f in files}) == 1
    again = save(load(files[0]), tmp_path / "again.safetensors")
    assert again.read_bytes() == files[0].read_bytes()


class _TiedNet(nn.Module):
    def __init__(self, num_classes: int, in_chans: int):
        super().__init__()
        self.stem = nn.Conv2d(in_chans, 8, 3, padding=1)
        self.a, self.b = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.b.weight = self.a.weight  # one weight, used twice
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.fc(self.b(self.a(self.stem(x).relu()).relu()).mean((2, 3)))


@compress.register_model
def _test_tied_net(num_classes=10, in_chans=3):
    return _TiedNet(num_classes, in_chans)


@compress.register_model
def _test_shared_buffer_net(num_classes=10, in_chans=3):
    model = _TiedNet(num_classes, in_chans)
    model.register_buffer("ref", model.fc.weight)  # a parameter under a buffer's name too
    table = torch.arange(3.0)
    model.a.register_buffer("tab", table, persistent=False)
    model.b.register_buffer("tab", table, persistent=False)
    return model


def test_tied_weights_are_one_tensor_after_load(tmp_path):
    """Tensors that are one in the saved model (tied by its __init__, or by the user later) are one after load:
    load_state_dict(assign=True) gave each name its own copy, so the loaded model had more parameters and one
    fine-tuning step moved the copies apart. A file written before the record gets the ties its __init__ makes;
    a file whose copies of one tensor differ is refused."""
    model = _randomise(create_model("_test_tied_net", num_classes=4))
    model.b.bias = model.a.bias  # tied after construction: only the file's record knows
    x = torch.randn(2, 3, 8, 8)
    path = save(model, tmp_path / "m.safetensors")
    loaded = load(path)
    assert loaded.a.weight is loaded.b.weight and loaded.a.bias is loaded.b.bias
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in model.parameters())
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    opt = torch.optim.SGD(loaded.parameters(), lr=0.1)
    loaded.train()
    loaded(x).square().sum().backward()
    opt.step()
    assert loaded.a.weight is loaded.b.weight and not torch.equal(loaded.a.weight, model.a.weight)

    _rewrite(path, edit_recipe=lambda r: r.pop("tied"))  # as written before the record
    old = load(path)
    assert old.a.weight is old.b.weight and old.a.bias is not old.b.bias
    torch.testing.assert_close(old(x), model(x), rtol=0, atol=0)

    # the record rebuilds the ties for every reader of a recipe (resume and export of an init= run copy weights
    # into the rebuilt model: an untied copy made the resumed optimizer state one parameter short)
    rebuilt = rebuild(build_recipe(model))
    assert rebuilt.a.weight is rebuilt.b.weight and rebuilt.a.bias is rebuilt.b.bias
    rebuilt.load_state_dict(model.state_dict())
    torch.testing.assert_close(rebuilt(x), model(x), rtol=0, atol=0)

    # a tie the constructor makes but the saved model no longer has (BN folding gives each conv its own weight):
    # the file loads untied (it was refused as edited), and so does such a file written before the record
    untied = _randomise(create_model("_test_tied_net", num_classes=4))
    untied.b.weight = nn.Parameter(untied.a.weight.detach() * 2)
    loaded = load(save(untied, tmp_path / "u.safetensors"))
    assert loaded.a.weight is not loaded.b.weight and rebuild(build_recipe(untied)).a.weight is not \
        rebuild(build_recipe(untied)).b.weight
    torch.testing.assert_close(loaded(x), untied(x), rtol=0, atol=0)
    _rewrite(tmp_path / "u.safetensors", edit_recipe=lambda r: r.pop("tied"))
    torch.testing.assert_close(load(tmp_path / "u.safetensors")(x), untied(x), rtol=0, atol=0)

    # a module registered under a second name after construction saves (it was taken for a removed module) and
    # loads with its tensors shared
    aliased = _randomise(create_model("resnet20"))
    aliased.layer1[1].bn1 = aliased.layer1[0].bn1
    back = load(save(aliased.eval(), tmp_path / "a.safetensors"))
    assert back.layer1[1].bn1.weight is back.layer1[0].bn1.weight
    assert back.layer1[1].bn1.running_var is back.layer1[0].bn1.running_var
    xs = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(back(xs), aliased(xs), rtol=0, atol=0)

    # a tied tensor holding NaN (a diverged run) loads, with the NaN warning: NaN != NaN made it "edited"
    diverged = _randomise(create_model("_test_tied_net", num_classes=4))
    with torch.no_grad():
        diverged.a.weight[0, 0, 0, 0] = float("nan")
    with pytest.warns(UserWarning, match=r"tensors hold NaN or inf values: a.weight"):
        back = load(save(diverged, tmp_path / "n.safetensors"))
    assert back.a.weight is back.b.weight and back.a.weight[0, 0, 0, 0].isnan()

    # a parameter its constructor also registers as a buffer (save wrote a record load refused), and a
    # non-persistent buffer two modules share (not in files: it was copied apart)
    odd = _randomise(create_model("_test_shared_buffer_net", num_classes=4))
    for again in (rebuild(build_recipe(odd)), load(save(odd, tmp_path / "o.safetensors"))):
        assert again.ref is again.fc.weight and isinstance(again.fc.weight, nn.Parameter)
        assert again.a.tab is again.b.tab

    # an init= fine-tune's recipe written before the record, whose constructor-made tie training undid: the
    # rebuilt model keeps them apart (load_state_dict wrote one trained weight over the other)
    recipe = build_recipe(untied)
    del recipe["tied"]
    rebuilt = compress.checkpoint.rebuild_for(recipe, untied.state_dict(), "test")
    assert rebuilt.a.weight is not rebuilt.b.weight
    rebuilt.load_state_dict(untied.state_dict())
    torch.testing.assert_close(rebuilt(x), untied(x), rtol=0, atol=0)
    # rebuild itself gives fresh weights, from the global stream (two calls differ)
    assert not torch.equal(rebuild(build_recipe(model)).stem.weight, rebuild(build_recipe(model)).stem.weight)

    save(model, path)
    _rewrite(path, edit_tensors=lambda t: t["b.weight"].add_(1.0))
    with pytest.raises(ValueError, match=r"m.safetensors.*a\.weight, b\.weight are one tensor in the model but "
                                         r"differ in the file"):
        load(path)


def test_a_path_or_none_where_a_model_goes_is_a_type_error_naming_the_function(tmp_path):
    """A path, None or a state dict where the public functions take a model failed with "'str' object has no
    attribute 'named_modules'" (or only at the first call, CUDAGraphModel); swapped save arguments are named."""
    model = create_model("resnet20")
    calls = {"compact": lambda m: compact(m), "profile": lambda m: compress.profile(m, latency=False),
             "attach_skeletons": lambda m: attach_skeletons(m), "choose_modes": lambda m: compress.choose_modes(m, None),
             "insert_pix": lambda m: compress.insert_pix(m, 4), "CUDAGraphModel": lambda m: compress.CUDAGraphModel(m),
             "compress.save": lambda m: save(m, tmp_path / "m.safetensors")}
    for name, call in calls.items():
        with pytest.raises(TypeError, match=rf"{re.escape(name)}: expected a model \(an nn.Module\), got str 'm.safetensors'; "
                                            r"to read a model file, use compress.load\(path\)"):
            call("m.safetensors")
        with pytest.raises(TypeError, match=rf"{re.escape(name)}: expected a model .* got NoneType None$"):
            call(None)
    with pytest.raises(TypeError, match=r"got an object of type OrderedDict; build the model and load_state_dict into it"):
        compact(model.state_dict())
    with pytest.raises(TypeError, match=r"compress.save: the arguments are swapped; call compress.save\(model, path\)"):
        save(tmp_path / "m.safetensors", model)
    skeletons = create_model("resnet20")
    attach_skeletons(skeletons)
    _randomise(skeletons)
    assert compress.profile(model, (3, 32.0, 32), latency=False).macs == compress.profile(model, (3, 32, 32),
                                                                                          latency=False).macs
    for bad in ("332", (3, 0, 32), (3, 32.5, 32), (3, 32)):  # ('332' was taken as (3, 3, 2))
        with pytest.raises(ValueError, match=r"profile: input_size is \(C, H, W\), three positive ints, got"):
            compress.profile(model, bad, latency=False)
        with pytest.raises(ValueError, match=r"compact: input_size is \(C, H, W\), three positive ints"):
            compact(skeletons.eval(), target_macs=0.5, input_size=bad)
    with pytest.raises(ValueError, match=r"compact: target_macs counts MACs on one input of input_size=\(5, 32, 32\), "
                                         r"and the model's forward failed on it \(RuntimeError: .*3 channels.*\); give "
                                         r"input_size=\(C, H, W\) as the model takes it"):
        compact(skeletons, target_macs=0.5, input_size=(5, 32, 32))  # (a raw error from inside the MAC counter)


def test_the_library_calls_leave_the_global_random_stream_alone(tmp_path):
    """attach_skeletons, compact (skeleton convs masked, ReLUs fused), save and load built throw-away modules whose
    initial weights drew from the global generator, so saving a checkpoint in a notebook's training loop changed
    every later dropout, augmentation and shuffle. Each call now leaves the stream where it was."""
    def draws_after(call) -> torch.Tensor:
        torch.manual_seed(7)
        call()
        return torch.rand(4)

    untouched = draws_after(lambda: None)
    model = create_model("resnet20")
    path = tmp_path / "m.safetensors"
    steps = {
        "attach_skeletons": lambda: attach_skeletons(model),
        "compact": lambda: compact(model.eval(), fold_bn=True, fuse_relu=True),
        "save": lambda: save(compact(model, fold_bn=True, fuse_relu=True), path),
        "load": lambda: load(path),
        "save skeleton model": lambda: save(model, path),
        "load skeleton model": lambda: load(path),
    }
    for name, call in steps.items():
        assert torch.equal(draws_after(call), untouched), name


class _DrawsOnTheCPU(nn.Module):
    """A net whose __init__ draws a buffer on an explicit CPU device (which a meta-device build draws too)."""

    def __init__(self, num_classes: int, in_chans: int):
        super().__init__()
        self.conv = nn.Conv2d(in_chans, 8, 3, padding=1)
        self.register_buffer("proj", torch.randn(8, num_classes, device="cpu"))

    def forward(self, x):
        return self.conv(x).mean((2, 3)) @ self.proj


@compress.register_model
def _test_draws_on_the_cpu_net(num_classes=10, in_chans=3):
    return _DrawsOnTheCPU(num_classes, in_chans)


def test_save_and_load_of_a_model_whose_constructor_draws_on_the_cpu_leave_the_random_stream(tmp_path):
    """save and load build their reference on the meta device; a constructor that draws on an explicit CPU device
    still drew from the user's stream there: both keep it as it was."""
    model = create_model("_test_draws_on_the_cpu_net", num_classes=4)
    path = tmp_path / "m.safetensors"
    for call in (lambda: save(model, path), lambda: load(path)):
        torch.manual_seed(7)
        untouched = torch.rand(4)
        torch.manual_seed(7)
        call()
        assert torch.equal(torch.rand(4), untouched)
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(load(path)(x), model(x), rtol=0, atol=0)


def test_attach_skeletons_and_compact_neither_draw_nor_restore_the_random_stream(monkeypatch):
    """Their throwaway convs (skeleton, masked and fused convs, whose tensors are overwritten) were built inside
    `torch.random.fork_rng`, which also undid the draws another thread made meanwhile (its dropout masks repeated).
    They are built uninitialised now (on the meta device): no numbers drawn, the global state never put back."""
    model = create_model("resnet20").eval()
    reference = copy.deepcopy(model)

    def refused(*args, **kwargs):
        raise AssertionError("the global random state was saved to be put back")

    monkeypatch.setattr(torch.random, "fork_rng", refused)
    torch.manual_seed(7)
    untouched = torch.rand(4)
    torch.manual_seed(7)
    attach_skeletons(model)
    assert torch.equal(torch.rand(4), untouched)
    assert all(torch.equal(m.skeleton, torch.ones_like(m.skeleton)) for m in model.modules() if hasattr(m, "skeleton"))
    for m in model.modules():
        if hasattr(m, "skeleton"):
            m.skeleton.data[:, 0, 0] = 0.0  # every filter's top-left stripe pruned
    torch.manual_seed(7)
    small = compact(model, fold_bn=True, fuse_relu=True)
    assert torch.equal(torch.rand(4), untouched)
    for m in reference.modules():
        if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3):
            m.weight.data[:, :, 0, 0] = 0.0
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(small(x), reference(x), rtol=1e-4, atol=1e-4)


def test_save_of_a_pruned_or_reparametrized_conv_names_the_call_that_makes_it_plain(tmp_path):
    """torch's prune, weight_norm and parametrizations keep a conv's weight as other tensors the recipe cannot
    rebuild; the refusal suggested register_module_type (which cannot help). It names the removal call now, and
    after that call the model saves and loads."""
    from torch.nn.utils import parametrizations, prune

    for apply, removal in [(lambda c: prune.l1_unstructured(c, "weight", 0.5), r"torch\.nn\.utils\.prune\.remove"),
                           (parametrizations.weight_norm, r"torch\.nn\.utils\.parametrize\.remove_parametrizations")]:
        model = create_model("resnet20")
        apply(model.layer1[0].conv1)
        with pytest.raises(ValueError, match=rf"Module 'layer1\.0\.conv1' computes its weight from other tensors .*; "
                                             rf"make it plain first: {removal}\(module, 'weight'\)"):
            save(model, tmp_path / "m.safetensors")
    parametrize = torch.nn.utils.parametrize
    parametrize.remove_parametrizations(model.layer1[0].conv1, "weight")
    save(model, tmp_path / "m.safetensors")
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(load(tmp_path / "m.safetensors").eval()(x), model.eval()(x))


def test_a_module_type_defined_again_replaces_itself_and_another_class_is_refused(tmp_path):
    """A notebook cell that defines and registers a module type, run twice, failed with "key 'X' is already taken by
    X"; the same definition (module and qualified name) now replaces its earlier self, as register_model does, and
    the files use the newer class. Another class under a taken key is still an error naming both."""
    from compress.checkpoint import _resolve

    classes = []
    for _ in range(2):  # the same cell, run twice
        class _TestSwish(nn.Module):
            def config(self):
                return {}

            def forward(self, x):
                return x * torch.sigmoid(x)

        register_module_type("_TestSwish", _TestSwish)
        classes.append(_TestSwish)
    assert classes[0] is not classes[1] and _resolve("_TestSwish") is classes[1]

    class _Other(nn.Module):
        def config(self):
            return {}

    with pytest.raises(ValueError, match=r"key '_TestSwish' is already taken by .*_TestSwish; register "
                                         r".*_Other under another key"):
        register_module_type("_TestSwish", _Other)
    # a model holding an instance of the class from before the cell ran again still saves, and loads the newer one
    model = create_model("resnet20")
    model.layer1[0].relu = classes[0]()
    back = load(save(model.eval(), tmp_path / "m.safetensors"))
    assert type(back.layer1[0].relu) is classes[1]


def test_model_weights_with_different_copies_of_a_tied_tensor_are_refused(tmp_path):
    """model.weights into a model whose constructor ties two weights, from a file whose two copies differ (a model
    trained with them untied): the last copy won silently; now the names are given. Equal copies load."""
    from compress.models import load_weights

    model = _randomise(create_model("_test_tied_net", num_classes=4))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(state, tmp_path / "same.pt")
    fresh = create_model("_test_tied_net", num_classes=4)
    load_weights(fresh, tmp_path / "same.pt")
    assert fresh.a.weight is fresh.b.weight and torch.equal(fresh.a.weight, model.a.weight)
    state["b.weight"] = state["b.weight"] + 1
    torch.save(state, tmp_path / "differ.pt")
    with pytest.raises(ValueError, match=r"differ.pt holds different values for a.weight, b.weight, which _TiedNet "
                                         r"ties into one tensor"):
        load_weights(create_model("_test_tied_net", num_classes=4), tmp_path / "differ.pt")


def test_a_timm_model_with_a_reset_classifier_saves_and_loads(tmp_path):
    """timm's reset_classifier() gives some models (MobileNetV3) a timm.layers.Linear head, a subclass of nn.Linear:
    save refused it as "not an allowed type (..., Linear, ...)"; it round-trips as that class."""
    import timm

    torch.manual_seed(0)
    model = create_model("timm:mobilenetv3_small_050", num_classes=10, input_size=64).eval()
    model.reset_classifier(5)
    assert type(model.classifier) is timm.layers.Linear
    loaded = load(save(model, tmp_path / "m.safetensors"))
    assert type(loaded.classifier) is timm.layers.Linear
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_save_while_another_thread_registers_a_module_type(tmp_path, monkeypatch):
    """save looks each module's type up in the allowlist, importing modules as it goes; a type registered meanwhile
    (another thread) made that loop fail with "dictionary changed size during iteration"."""
    from compress import checkpoint

    skeletons = create_model("resnet20")
    attach_skeletons(skeletons)
    _randomise(skeletons, keep=0.4)
    model = compact(skeletons.eval())  # (its stripe convs are looked up in the allowlist)
    resolve = checkpoint._resolve
    registered = []

    def resolve_and_register(key, imported_only=False):  # another thread's registration, mid-loop
        if not registered:
            registered.append(type("Registered", (nn.Identity,), {"config": lambda self: {}}))
            monkeypatch.setitem(checkpoint._TYPES, "test.Registered", (registered[0], lambda m: {}))
        return resolve(key, imported_only)

    monkeypatch.setattr(checkpoint, "_resolve", resolve_and_register)
    loaded = load(save(model, tmp_path / "m.safetensors"))
    assert registered and set(loaded.state_dict()) == set(model.state_dict())
