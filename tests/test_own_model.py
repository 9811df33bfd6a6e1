"""Your own architecture: a model registered in the user's module trains with train.py (imports=), exports, saves and
loads; nothing imports a module because a file names it."""

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli import run_script
from hydra import compose, initialize_config_dir

import compress
from compress.checkpoint import unregistered_module
from compress.engine import run
from compress.export import load_training_checkpoint
from compress.models import create_model, import_modules
from compress.models._registry import _entrypoints

ROOT = Path(__file__).resolve().parents[1]
_serial = itertools.count()

# a user's module: a small ConvNet not in the registry, whose head pools with x.mean
MODULE = '''
import torch.nn as nn
import compress


class Net(nn.Module):
    def __init__(self, num_classes, in_chans, width):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_chans, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),
                                  nn.BatchNorm2d(2 * width), nn.ReLU())
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        return self.head(self.body(self.stem(x)).mean((2, 3)))


@compress.register_model
def {name}(num_classes=10, in_chans=3, width=8):
    return Net(num_classes, in_chans, width)
'''


def _user_module(folder: Path) -> tuple[str, str]:
    """(module name, model name), unique in this process: a module file in `folder` registering a model."""
    n = next(_serial)
    module, model = f"own_nets_{n}", f"own_net_{n}"
    (folder / f"{module}.py").write_text(MODULE.replace("{name}", model))
    return module, model


TINY = ["data=fake", "data.input_size=8", "data.num_classes=3", "data.train_size=16", "data.test_size=8",
        "data.batch_size=8", "optim=sgd_multistep", "optim.epochs=2", "optim.milestones=[1]", "prune=swp", "prune.alpha=0.04", "prune.threshold=0.95"]


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose("train", overrides=list(overrides))


def test_import_modules_registers_the_models_of_a_module_in_the_launch_directory(tmp_path):
    module, model_name = _user_module(tmp_path)
    assert import_modules(module, tmp_path) == [module]  # one name may be given as a string
    model = create_model(model_name, num_classes=4, width=6)
    assert model.compress_arch == {"name": model_name, "module": module,
                                   "kwargs": {"num_classes": 4, "input_size": 32, "in_chans": 3, "width": 6}}
    assert "module" not in create_model("resnet20").compress_arch  # the library's own models name no module
    assert unregistered_module(model.compress_arch) is None


def test_import_modules_searches_the_launch_directory_first(tmp_path, monkeypatch):
    """A module of the same name in the launch directory and in a folder earlier on sys.path: the launch directory's
    is imported, also when the launch directory is on sys.path already, behind the other."""
    launch, other = tmp_path.resolve() / "launch", tmp_path.resolve() / "other"
    launch.mkdir(), other.mkdir()
    module, model_name = _user_module(launch)
    (other / f"{module}.py").write_text("raise ImportError('the module outside the launch directory')\n")
    monkeypatch.setattr(sys, "path", [str(other), *sys.path, str(launch)])
    assert import_modules([module], launch) == [module]
    assert model_name in _entrypoints and sys.path[0] == str(launch)
    assert sys.path.count(str(launch)) == 1


def test_import_modules_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match=r"'nets/my_nets.py' is not a Python module name.*nets\.my_nets"):
        import_modules(["nets/my_nets.py"], tmp_path)
    with pytest.raises(ValueError, match=r"no module named 'not_there_anywhere' in .*PYTHONPATH"):
        import_modules(["not_there_anywhere"], tmp_path)
    with pytest.raises(ValueError, match="not a module name or a list of them"):
        import_modules(5, tmp_path)
    (tmp_path / "broken_nets_mod.py").write_text("import torch\nraise RuntimeError('bug in the user module')\n")
    with pytest.raises(RuntimeError, match="bug in the user module") as info:
        import_modules(["broken_nets_mod"], tmp_path)
    assert "named in imports=" in " ".join(info.value.__notes__)
    (tmp_path / "needs_missing_mod.py").write_text("import a_dependency_not_installed\n")
    with pytest.raises(ModuleNotFoundError, match="a_dependency_not_installed") as info:  # the module's own error
        import_modules(["needs_missing_mod"], tmp_path)
    assert "'needs_missing_mod', named in imports=" in " ".join(info.value.__notes__)
    (tmp_path / "file_given_mod.py").write_text("raise RuntimeError('a file path must not be imported')\n")
    with pytest.raises(ValueError, match=r"'file_given_mod.py' is not a Python module name.*imports=\[file_given_mod\]"):
        import_modules(["file_given_mod.py"], tmp_path)
    with pytest.raises(ValueError, match=r"'/abs/nets.py' is not a Python module name.*add its folder to PYTHONPATH"):
        import_modules("/abs/nets.py", tmp_path)
    with pytest.raises(ValueError, match=r"'nets/my-nets.py' is not a Python module name.*must be Python names"):
        import_modules("nets/my-nets.py", tmp_path)  # no dotted name to suggest: nets.my-nets is none
    with pytest.raises(ValueError, match="not a module name or a list of them"):
        import_modules({"my_nets": 1}, tmp_path)  # (a dict once passed as its keys)
    with pytest.raises(ValueError, match=r"no module named 'no_such_pkg_here.nets' in"):
        import_modules(["no_such_pkg_here.nets"], tmp_path)  # its package missing


def test_the_launch_directory_is_searched_first(tmp_path, monkeypatch):
    for folder in ("other", "launch"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "shadowed_nets_mod.py").write_text(f"WHERE = {folder!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path / "other"))
    monkeypatch.delitem(sys.modules, "shadowed_nets_mod", raising=False)
    import_modules("shadowed_nets_mod", tmp_path / "launch")
    assert sys.modules["shadowed_nets_mod"].WHERE == "launch"


def test_saving_a_model_registered_by_a_script_warns_that_no_other_process_can_load_it(tmp_path):
    exec("import compress, torch.nn as nn\n@compress.register_model\ndef script_net(num_classes=10, in_chans=3):\n"
         "    return nn.Sequential(nn.Conv2d(in_chans, 4, 3), nn.Flatten(), nn.LazyLinear(num_classes))\n",
         {"__name__": "__main__"})
    model = create_model("script_net")
    model(torch.randn(1, 3, 8, 8))  # LazyLinear takes its size
    with pytest.warns(UserWarning, match=r"'script_net' was registered by a script \(__main__\); only a process"):
        compress.save(model, tmp_path / "s.safetensors")


def test_an_unregistered_model_names_the_module_to_import():
    assert "import it first: `import my_nets`" in unregistered_module({"name": "never_registered", "module": "my_nets"})
    assert "registered by a script (__main__)" in unregistered_module({"name": "never_registered", "module": "__main__"})
    with pytest.raises(ValueError, match=r"unknown model 'never_registered'.*@compress.register_model.*imports="):
        create_model("never_registered")


OVERFLOW = """
import torch.nn as nn
import compress


class Overflowing(nn.Module):
    # finite weights, eval-mode logits that overflow to inf (as a diverging run's BatchNorm statistics make them)
    def __init__(self, num_classes, in_chans):
        super().__init__()
        self.conv, self.head = nn.Conv2d(in_chans, 4, 3, padding=1), nn.Linear(4, num_classes)

    def forward(self, x):
        y = self.head(self.conv(x).mean((2, 3)))
        return y if self.training else y * 1e38 * 1e38


@compress.register_model
def {name}(num_classes=10, in_chans=3):
    return Overflowing(num_classes, in_chans)
"""


def test_a_test_loss_that_is_not_finite_is_noted(tmp_path, monkeypatch, capsys):
    """Eval outputs that overflow with finite weights (the run diverging): the epoch says so and what to lower; the
    run went on silently, its summary.json's test_loss null."""
    monkeypatch.chdir(tmp_path)
    n = next(_serial)
    module, name = f"overflow_nets_{n}", f"overflow_net_{n}"
    (tmp_path / f"{module}.py").write_text(OVERFLOW.replace("{name}", name))
    summary = run(_compose(*TINY, f"imports=[{module}]", f"model.name={name}", "trainer.max_steps=1"),
                  run_dir=tmp_path / "run")
    assert summary["steps"] == 1 and summary["test_loss"] != summary["test_loss"]  # NaN (null in summary.json)
    assert "note: the test loss after epoch 1 is not finite: the eval-mode outputs overflow" in capsys.readouterr().out


FAILING = """
import torch.nn as nn

import compress


class Failing(nn.Module):
    def __init__(self, num_classes, in_chans):
        super().__init__()
        self.conv = nn.Conv2d(in_chans, num_classes, 3)

    def forward(self, x):
        raise RuntimeError("boom in the user's forward")


@compress.register_model
def {name}(num_classes=10, in_chans=3):
    return Failing(num_classes, in_chans)
"""


def test_an_error_in_a_registered_models_forward_names_the_model_not_the_input_size(tmp_path, monkeypatch):
    """The first forward's error of a model of your own was reported as an input size it cannot take, with advice
    about data.input_size; an error that is not about sizes names the model and its own message."""
    monkeypatch.chdir(tmp_path)
    n = next(_serial)
    module, name = f"failing_nets_{n}", f"failing_net_{n}"
    (tmp_path / f"{module}.py").write_text(FAILING.replace("{name}", name))
    with pytest.raises(ValueError, match=rf"^the model {name}'s forward failed on one 3x8x8 image: RuntimeError: boom "
                                         r"in the user's forward$"):
        run(_compose(*TINY, f"imports=[{module}]", f"model.name={name}"), run_dir=tmp_path / "run")


def test_own_model_trains_exports_and_resumes_only_with_its_imports(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the launch directory: imports are searched there
    module, model_name = _user_module(tmp_path)
    cfg = _compose(*TINY, f"imports=[{module}]", f"model.name={model_name}", "+model.kwargs.width=6",
                   "trainer.max_steps=1")
    summary = run(cfg, run_dir=tmp_path / "run")
    assert summary["steps"] == 1
    ckpt = tmp_path / "run" / "checkpoints" / "last.pt"
    model, _ = load_training_checkpoint(ckpt)
    assert model.compress_arch["module"] == module and model.stem[0].out_channels == 6

    monkeypatch.delitem(_entrypoints, model_name)  # a new process that has not imported the module
    with pytest.raises(ValueError, match=rf"export: .*last.pt: the model '{model_name}' is built by module '{module}', "
                                         rf"which this process has not imported.*imports=\[{module}\]"):
        load_training_checkpoint(ckpt)
    resume = _compose(*TINY, f"model.name={model_name}", "+model.kwargs.width=6", "resume=true")
    with pytest.raises(ValueError, match=rf"resume: the model '{model_name}' is built by module '{module}'"):
        run(resume, run_dir=tmp_path / "run")  # a config built in Python: the checkpoint's imports are not run either
    # a checkpoint older than the arch's "module" names the run's imports instead
    state = torch.load(ckpt, weights_only=True)
    del state["arch"]["module"], state["sha256"]  # (an edited file drops its digest: files before digests load)
    torch.save(state, tmp_path / "old.pt")
    with pytest.raises(ValueError, match=rf"'{model_name}' is not registered in this process; its run imported "
                                         rf"\['{module}'\]: pass imports=\[{module}\]"):
        load_training_checkpoint(tmp_path / "old.pt")


def test_imports_of_a_run_of_a_library_model_are_not_needed_again_and_a_bare_name_is_a_list(tmp_path, monkeypatch):
    """imports= given to a run of a library model: resume and export need not repeat it. A single module given as a
    bare string is one module name (not its letters) when resume and export read the run's config back."""
    monkeypatch.chdir(tmp_path)
    module, _ = _user_module(tmp_path)
    cfg = _compose(*TINY, f"imports={module}", "model=resnet20", "trainer.max_steps=1")
    run(cfg, run_dir=tmp_path / "run")
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["config"]
    assert saved["imports"] == module
    model, _ = load_training_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert model.compress_arch["name"] == "resnet20"
    assert run(_compose(*TINY, "resume=true", "trainer.max_steps=2"), run_dir=tmp_path / "run")["steps"] == 2


def test_builders_that_return_no_module_or_ignore_num_classes_or_in_chans_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "odd_builders_mod.py").write_text(
        "import torch.nn as nn, compress\n"
        "@compress.register_model\ndef returns_a_string(num_classes=10, in_chans=3):\n    return 'a model'\n"
        "@compress.register_model\ndef fixed_classes(num_classes=10, in_chans=3):\n"
        "    return nn.Sequential(nn.Conv2d(in_chans, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 7))\n"
        "@compress.register_model\ndef fixed_chans(num_classes=10, in_chans=3):\n"
        "    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, num_classes))\n"
        "@compress.register_model\ndef buggy_net(num_classes=10, in_chans=3, width=8):\n"
        "    return nn.Sequential(nn.Conv2d(in_chans, width, 3, paddin=1))\n")
    import_modules(["odd_builders_mod"], tmp_path)
    # a TypeError of the builder's own code is raised as it is (it was blamed on model.kwargs, its traceback gone)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'paddin'"):
        run(_compose(*TINY, "model.name=buggy_net", "+model.kwargs.width=4", "trainer.max_steps=1"),
            run_dir=tmp_path / "buggy")
    with pytest.raises(ValueError, match=r"builder odd_builders_mod.returns_a_string returned a str, not a torch.nn"):
        create_model("returns_a_string")
    cfg = _compose(*TINY, "model.name=fixed_classes", "trainer.max_steps=1")
    with pytest.raises(ValueError, match=r"gives \(1, 7\) for one image, not \(1, 3\).*must use its num_classes"):
        run(cfg, run_dir=tmp_path / "run")
    cfg = _compose(*TINY, "+data.in_chans=1", "model.name=fixed_chans", "trainer.max_steps=1")
    with pytest.raises(ValueError, match=r"first layer takes 3 input channels and the data gives 1 \(data.in_chans=1\)"
                                         r".*must use its in_chans argument"):
        run(cfg, run_dir=tmp_path / "chans")


def test_train_py_and_export_py_take_imports_and_load_names_the_module(tmp_path, monkeypatch):
    """The user's path: train.py and export.py started in the folder of their module; the compact file then loads in
    a process that imports the module, and in one that does not, fails naming it."""
    module, model_name = _user_module(tmp_path)
    train = [*TINY, f"imports=[{module}]", f"model.name={model_name}", "trainer.max_steps=2",
             "prune.threshold=0.988", f"hydra.run.dir={tmp_path / 'run'}"]  # about half
    proc = run_script("train.py", *train, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_script("export.py", "ckpt=run/checkpoints/last.pt", "out=exp", "profile.latency=false",
                      "onnx.enabled=false", f"imports=[{module}]", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    compact_file = tmp_path / "exp" / "model.compact.safetensors"
    # fine-tuning it without imports= (in a process that has not imported the module): refused naming the module,
    # before any note, so no run dir is left behind
    monkeypatch.delitem(_entrypoints, model_name)
    monkeypatch.delitem(sys.modules, module)
    refused = ["data=fake", "data.input_size=8", "data.num_classes=3", "prune.alpha=0.1", f"init={compact_file}",
               f"hydra.run.dir={tmp_path / 'refused'}"]
    proc = run_script("train.py", *refused, cwd=tmp_path)
    assert proc.returncode != 0 and f"is built by module '{module}'" in proc.stderr
    assert "note:" not in proc.stdout and not (tmp_path / "refused").exists()

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    torch.save(x, tmp_path / "x.pt")
    script = (f"import sys, torch, compress\nx = torch.load('x.pt')\n"
              f"try:\n    compress.load('{compact_file}')\nexcept ValueError as err:\n    print('REFUSED', err)\n"
              f"import {module}\nm = compress.load('{compact_file}').double()\n"
              "with torch.no_grad():\n    torch.save(m(x), 'y.pt')\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"REFUSED compress.load({compact_file}): the model '{model_name}' is built by module '{module}'" in proc.stdout

    # the compact model computes the trained model with the stripes at or below prune.threshold zeroed (float64)
    import_modules([module], tmp_path)
    trained, cfg = load_training_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    trained = trained.double()
    pruned = 0
    with torch.no_grad():
        for conv in (m for m in trained.modules() if isinstance(m, compress.SkeletonConv2d)):
            drop = conv.skeleton.abs() <= cfg["prune"]["threshold"]
            conv.skeleton[drop] = 0
            pruned += int(drop.sum())
        want = trained(x)
    got = torch.load(tmp_path / "y.pt")
    assert 0 < pruned < 162 and want.std() > 0  # 162 stripes: 8 and 16 filters of 9
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max()), (got - want).abs().max()
    assert compress.load(compact_file).compress_arch["module"] == module


def test_a_definition_run_again_replaces_itself_and_another_of_the_same_name_is_refused():
    """A notebook cell run twice registers the same builder again; a different function under a taken name (or a
    library model's name) is refused."""
    source = "import compress\n@compress.register_model\ndef rerun_net(num_classes=10, in_chans=3, width=2):\n" \
             "    return __import__('torch').nn.Conv2d(in_chans, width, 3)\n"
    for width_default in (2, 5):  # the second run redefines it: the new definition is the one built
        exec(source.replace("width=2", f"width={width_default}"), {"__name__": "notebook_cell"})
        assert create_model("rerun_net").out_channels == width_default
    with pytest.raises(ValueError, match=r"'rerun_net' is already registered \(by notebook_cell\); give yours another"):
        exec(source, {"__name__": "another_module"})
    with pytest.raises(ValueError, match="'resnet56' is already registered"):
        exec(source.replace("rerun_net", "resnet56"), {"__name__": "notebook_cell"})


def test_a_run_finds_direct_weight_reads_in_a_forward_fx_cannot_trace(tmp_path, monkeypatch):
    """The run gives attach_skeletons a random image of the data's size, so a conv whose weight an untraceable forward
    also reads itself gets no skeleton (it would not act on that read)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reads_mod.py").write_text(
        "import torch, torch.nn as nn, torch.nn.functional as F, compress\n"
        "class Net(nn.Module):\n"
        "    def __init__(self, num_classes):\n"
        "        super().__init__()\n"
        "        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)\n"
        "        self.head = nn.Linear(4, num_classes)\n"
        "    def forward(self, x):\n"
        "        y = self.a(x)\n"
        "        y = self.b(y) + F.conv2d(y, self.b.weight, padding=1)\n"
        "        return self.head(y.mean((2, 3))) if y.sum() > 0 else -self.head(y.mean((2, 3)))\n"
        "@compress.register_model\n"
        "def reads_net(num_classes=10, in_chans=3):\n"
        "    return Net(num_classes)\n")
    cfg = _compose(*TINY, "imports=[reads_mod]", "model.name=reads_net", "trainer.max_steps=1")
    with pytest.warns(UserWarning, match=r"attach_skeletons: b: the forward also reads the weight"):
        run(cfg, run_dir=tmp_path / "run")
    model, _ = load_training_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert isinstance(model.a, compress.SkeletonConv2d) and type(model.b) is torch.nn.Conv2d


@compress.register_model
def _test_sized_net(num_classes=10, in_chans=3, input_size=32):
    """A builder whose layers depend on the input size (a classifier over the flattened map, as torchvision's
    maxvit_t(input_size=...))."""
    return torch.nn.Sequential(torch.nn.Conv2d(in_chans, 4, 3, padding=1), torch.nn.Flatten(),
                               torch.nn.Linear(4 * input_size * input_size, num_classes))


def test_a_builder_with_an_input_size_parameter_is_built_for_the_size_asked():
    """create_model recorded input_size but never passed it: a builder that takes it was built for its default (and
    passing it again as a kwarg was Python's 'multiple values' error). Builders without the parameter are unchanged."""
    model = compress.create_model("_test_sized_net", num_classes=3, input_size=12)
    assert model[2].in_features == 4 * 12 * 12 and model.compress_arch["kwargs"]["input_size"] == 12
    assert model(torch.randn(2, 3, 12, 12)).shape == (2, 3)
    assert compress.create_model("resnet20", input_size=12).compress_arch["kwargs"]["input_size"] == 12
