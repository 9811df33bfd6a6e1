"""Hydra composition of every config group option, and clear errors for bad settings."""

import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from compress.data import DatasetNotFoundError
from compress.engine import _model_name, run
from compress.models import create_model, list_models

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ("model", "data", "prune", "optim")


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("train", overrides=list(overrides))


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_default_config():
    cfg = _compose()
    assert (cfg.model.name, cfg.data.name, cfg.prune.name) == ("resnet56", "digits", "swp")
    assert cfg.trainer.epochs == cfg.optim.epochs and cfg.pix.zeta is None and cfg.pix.tau == 0.5
    assert cfg.resume is False and cfg.init is None


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_group_option_composes(group, option):
    cfg = _compose(f"{group}={option}")
    node = cfg[group]
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    if group == "model":
        assert node.name == "timm:resnet18" if option == "timm" else node.name == option
        assert option == "timm" or node.name in list_models()
    elif group == "data":
        assert node.name == option and node.batch_size > 0
    elif group == "prune":
        assert node.name == ("none" if option == "none" else "swp")
        if node.name == "swp":
            assert node.alpha >= 0 and node.threshold >= 0 and node.target_flops is None
    else:
        assert node.name == "sgd" and node.schedule in ("multistep", "cosine")


def test_every_registered_model_has_a_config():
    from compress.models._registry import registering_module

    library = {name for name in list_models() if registering_module(name).startswith("compress.")}  # not tests' own
    assert len(library) >= 20 and library <= set(_options("model"))


def test_cifar_configs_keep_the_paper_recipe():
    cfg = _compose("data=cifar10", "optim=sgd_multistep", "prune=swp")
    assert cfg.data.batch_size == 64 and cfg.trainer.epochs == 160
    assert (cfg.optim.lr, cfg.optim.momentum, cfg.optim.weight_decay) == (0.1, 0.9, 1e-4)
    assert list(cfg.optim.milestones) == [80, 120] and cfg.optim.gamma == 0.1
    assert (cfg.prune.alpha, cfg.prune.threshold) == (1e-5, 0.01)


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        (["model.name=resnet57"], ValueError, "resnet56"),  # the message lists the known names
        (["data=cifar10", "data.root=/nonexistent/cifar"], DatasetNotFoundError, "/nonexistent/cifar"),
        (["prune.alpha=-1e-5"], ValueError, "alpha must be a finite number >= 0"),
        (["prune.alpha=inf"], ValueError, "alpha must be a finite number >= 0"),  # every skeleton NaN at step 1
        (["prune.threshold=-0.1"], ValueError, "threshold must be a finite number >= 0"),
        (["trainer.compile=true", "trainer.compile_backend=nonexistent"], ValueError,
         r"trainer.compile_backend='nonexistent' is not a torch.compile backend; use inductor or aot_eager"),
        (["pix.zeta=3"], ValueError, "not divisible by zeta=3"),  # resnet56's 16-channel convs
        (["init=/nonexistent/model.safetensors"], ValueError, "no such file"),
        (["resume=true"], FileNotFoundError, "no checkpoint at .*last.pt"),
        (["optim.schedule=linear"], ValueError, "optim.schedule='linear' is not supported"),
        (["optim=sgd_cosine", "optim.schedule=multistep"], ValueError,
         r"optim.schedule=multistep needs optim.milestones and optim.gamma, .* use optim=sgd_multistep"),
        (["model=vgg11_bn"], ValueError, r"the model cannot take a 3x8x8 input \(data.input_size=8\)"),
        (["model=timm", "model.name=vit_tiny_patch16_224"], ValueError,  # (timm's message ends with a full stop)
         r"cannot take a 3x8x8 input \(data.input_size=8\): .*\(224\)\. Use a data.input_size the model allows"),
        (["trainer.eval_every=0"], ValueError, "trainer.eval_every=0 must be an int >= 1"),
        (["trainer.max_steps=0"], ValueError, r"trainer.max_steps=0 must be an int >= 1, or null \(no step limit\)"),
        (["trainer.max_steps=2.5"], ValueError, "trainer.max_steps=2.5 must be an int >= 1"),
        (["trainer.log_every=0"], ValueError, "trainer.log_every=0 must be an int >= 1"),
        (["trainer.seed=-1"], ValueError, "trainer.seed=-1 must be an int >= 0"),
        (["pix.zeta=4.7"], ValueError, r"pix.zeta=4.7 must be an int >= 1, or null \(no PiX\)"),
        (["pix.zeta=true"], ValueError, "pix.zeta=True must be an int >= 1"),
        (["trainer.amp_dtype=float8"], ValueError, "trainer.amp_dtype='float8'; use bfloat16 or float16"),
        (["trainer.device=gpu"], ValueError, "trainer.device='gpu' is not a device; use auto, cpu, cuda"),
        (["optim.lr=-0.1"], ValueError, r"optim.lr=-0.1 must be a finite number > 0"),
        (["optim.lr=abc"], ValueError, r"optim.lr='abc' must be a finite number > 0"),
        (["optim.lr=nan"], ValueError, r"optim.lr=nan must be a finite number > 0"),  # trained to the end on NaN
        (["optim.lr=inf"], ValueError, r"optim.lr=inf must be a finite number > 0"),
        (["optim.momentum=nan"], ValueError, r"optim.momentum=nan must be a finite number in \[0, 1\)"),
        (["optim.momentum=1.5"], ValueError, r"optim.momentum=1.5 must be a finite number in \[0, 1\)"),
        (["optim.momentum=1"], ValueError, r"optim.momentum=1 must be a finite number in \[0, 1\)"),  # the bounds
        (["optim=sgd_multistep", "optim.gamma=0"], ValueError, r"optim.gamma=0 must be a finite number in \(0, 1\]"),
        (["prune=swp", "prune.threshold=1"], ValueError, "prune.threshold=1 zeroes every stripe"),
        (["trainer.checkpoint_every=0"], ValueError, "trainer.checkpoint_every=0 must be an int >= 1"),
        (["trainer.epochs=0"], ValueError, "trainer.epochs=0 must be an int >= 1"),
        (["optim.epochs=1.5"], ValueError, "optim.epochs=1.5 must be an int >= 1"),  # (trainer.epochs takes it)
        (["optim.weight_decay=nan"], ValueError, r"optim.weight_decay=nan must be a finite number >= 0"),
        (["optim.skeleton_weight_decay=abc"], ValueError, r"optim.skeleton_weight_decay='abc' must be a finite number"),
        (["optim.skeleton_weight_decay=true"], ValueError, r"optim.skeleton_weight_decay=True must be a finite number"),
        (["optim.nesterov=true", "optim.momentum=0"], ValueError, r"optim.nesterov=true needs optim.momentum > 0"),
        (["optim.name=adam"], ValueError, r"optim.name='adam' is not supported"),
        (["optim.warmup_epochs=40"], ValueError, r"optim.warmup_epochs=40 must be smaller than the 40 epochs"),
        (["optim=sgd_multistep", "optim.gamma=-1"], ValueError, r"optim.gamma=-1 must be a finite number in \(0, 1\]"),
        (["optim=sgd_multistep", "optim.gamma=5"], ValueError, r"optim.gamma=5 must be a finite number in \(0, 1\]"),
        (["optim=sgd_multistep", "optim.gamma=nan"], ValueError, r"optim.gamma=nan must be a finite number"),
        (["prune=swp", "prune.threshold=2"], ValueError, "prune.threshold=2 zeroes every stripe"),
        (["prune=swp", "prune.include=layr1.*"], ValueError, r"no conv of resnet56 gets a skeleton with prune.include=\['layr1.\*'\]"),
        (["data.input_size=0"], ValueError, "data.input_size=0; it must be an int >= 1"),
        (["model=resnet29_bottleneck", "pix.zeta=4", "pix.tau=-5"], ValueError, r"pix.tau=-5 must be a number in \[0, 1\]"),
        (["pix.tau=5"], ValueError, r"pix.tau=5 must be a number in \[0, 1\]"),  # checked without pix.zeta too
        (["prune=swp", "prune.target_flops=abc"], ValueError,
         r"prune.target_flops must be a fraction in \(0, 1\] of the dense model's MACs or a MAC count > 1, got 'abc'"),
        (["prune=swp", "prune.target_flops=0"], ValueError, r"prune.target_flops must be a fraction .* got 0"),
        (["prune=swp", "prune.target_flops=1.5"], ValueError,  # a mistyped share, refused before training
         r"prune.target_flops=1.5 is neither a fraction in \(0, 1\] of the dense model's MACs nor a whole count"),
        (["pix.tau=abc"], ValueError, r"pix.tau='abc' must be a number in \[0, 1\]"),
        (["prune=swp", "prune.alpha=abc"], ValueError, r"SWP alpha must be a finite number >= 0, got 'abc'; set prune.alpha to a non-negative number"),
        (["prune=swp", "prune.min_kernel_size=abc"], ValueError, r"prune.min_kernel_size='abc' must be an int >= 1"),
        (["optim.warmup_epochs=1.5"], ValueError, r"optim.warmup_epochs=1.5 must be an int >= 0"),
        (["trainer.seed=4294967296"], ValueError, r"trainer.seed=4294967296 must be an int >= 0 and <= 4294967295"),
        (["+data.seed=abc"], ValueError, r"data.seed='abc'; it must be an int >= 0"),
        (["data.download=no"], ValueError, r"data.download='no'; it must be true or false"),
        (["optim.nesterov=no"], ValueError, r"optim.nesterov='no'; it must be true or false"),
        (["trainer.compile=off"], ValueError, r"trainer.compile='off'; it must be true or false"),
        (["trainer.dump_rank_state=0"], ValueError, r"trainer.dump_rank_state=0; it must be true or false"),
        (["optim=sgd_multistep", "optim.epochs=10"], ValueError,
         r"optim.milestones=\[80, 120\]: a multistep run of 10 epochs lowers the learning rate only at epochs 1..9; "
         r"set milestones inside the run \(e.g. optim.milestones=\[5,7\]\) or run past epoch 120 \(trainer.epochs"),
        (["optim=sgd_multistep", "optim.epochs=1", "optim.milestones=[1]"], ValueError,
         r"a multistep run of 1 epoch lowers the learning rate at no epoch boundary \(it has none\); set milestones "
         r"inside the run \(or optim=sgd_cosine\)"),
        (["optim=sgd_multistep", "optim.milestones=abc"], ValueError,
         r"optim.milestones='abc' must be a list of increasing epoch numbers"),
        (["optim=sgd_multistep", "optim.milestones=[120,80]"], ValueError, "must be a list of increasing epoch numbers"),
        (["optim=sgd_multistep", "optim.gamma=null"], ValueError,  # crashed at the first milestone, after training
         r"optim.gamma=null must be a finite number in \(0, 1\]"),
        (["optim=sgd_multistep", "optim.epochs=5", "optim.milestones=[1,3]", "++optim.warmup_epochs=2"], ValueError,
         r"optim.milestones=\[1, 3\]: the first milestone must come after the optim.warmup_epochs=2 warmup epochs"),
        (["optim=sgd_multistep", "optim.epochs=5", "optim.milestones=[2]", "++optim.warmup_epochs=2"], ValueError,
         r"set milestones after epoch 2, or a shorter warmup"),
        (["+model.kwargs.num_classes=5"], ValueError, r"model.kwargs.num_classes: the data sets it \(data.num_classes\)"),
        (["+model.kwargs.width=2"], ValueError, r"model.kwargs=\{'width': 2\}: resnet56 does not take them"),
        (["data=cifar10", "data.root="], ValueError, r"data.root='' is empty \(an unset shell variable\?\): give a path"),
        (["init="], ValueError, r"init='' is empty"),
        (["pix=4"], ValueError, r"train: pix=4 sets the whole pix section, which holds settings of its own; set one of "
                                r"them instead, e.g. pix.zeta=4"),  # (AttributeError: 'int' object has no attribute)
        (["trainer=false"], ValueError, r"train: trainer=false sets the whole trainer section.* trainer.max_steps=<value>"),
    ],
)
def test_bad_settings_give_clear_errors(tmp_path, overrides, error, match):
    tiny = ["data=fake", "data.input_size=8", "data.train_size=4", "data.test_size=4"]
    cfg = _compose(*([] if overrides[0].startswith("data=") else tiny), *overrides)
    with pytest.raises(error, match=match):
        run(cfg, run_dir=tmp_path)


def _lrs(optim_cfg, epochs: int) -> list[float]:
    import torch

    from compress.engine import build_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optim_cfg.lr)
    sched = build_scheduler(opt, optim_cfg, epochs)
    lrs = []
    for _ in range(epochs):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_optim_warmup_epochs():
    import math

    cfg = _compose("optim=sgd_cosine", "optim.lr=0.1", "++optim.warmup_epochs=2", "optim.epochs=6").optim
    lrs = _lrs(cfg, 6)
    expected = [0.1 / 3, 0.2 / 3] + [0.05 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert lrs == pytest.approx(expected)
    plain = _compose("optim=sgd_cosine", "optim.lr=0.1", "optim.epochs=6").optim
    assert _lrs(plain, 6) == pytest.approx([0.05 * (1 + math.cos(math.pi * k / 6)) for k in range(6)])
    step = _compose("optim=sgd_multistep", "++optim.warmup_epochs=1", "optim.milestones=[2,3]", "optim.epochs=5").optim
    assert _lrs(step, 5) == pytest.approx([0.05, 0.1, 0.01, 0.001, 0.001])
    with pytest.raises(ValueError, match="warmup_epochs"):
        _lrs(_compose("++optim.warmup_epochs=6", "optim.epochs=6").optim, 6)


def test_optim_skeleton_weight_decay():
    from compress.engine import build_optimizer
    from compress.models import create_model
    from compress.skeleton import attach_skeletons

    model = create_model("resnet20", num_classes=10, input_size=32, in_chans=3)
    attach_skeletons(model)
    n_skel = sum(1 for n, _ in model.named_parameters() if n.endswith("skeleton"))
    default = build_optimizer(model, _compose().optim)  # null: one group, the paper's setting
    assert len(default.param_groups) == 1
    opt = build_optimizer(model, _compose("++optim.skeleton_weight_decay=0").optim)
    others, skel = opt.param_groups
    assert len(skel["params"]) == n_skel > 0 and skel["weight_decay"] == 0
    assert others["weight_decay"] == _compose().optim.weight_decay
    assert len(others["params"]) + n_skel == len(list(model.parameters()))
    with pytest.raises(ValueError, match="skeleton_weight_decay"):
        build_optimizer(model, _compose("++optim.skeleton_weight_decay=-1").optim)


@pytest.mark.parametrize("name", ["resnet18", "timm:resnet18"])
def test_timm_config_takes_bare_timm_names(name):
    import timm

    cfg = _compose("model=timm", f"model.name={name}")
    assert _model_name(cfg.model) == "timm:resnet18"
    assert _model_name(_compose("model=resnet18").model) == "resnet18"  # the registry's torchvision resnet18
    model = create_model(_model_name(cfg.model), num_classes=3)
    assert isinstance(model, timm.models.ResNet)


def test_prune_include_takes_one_pattern_as_a_string(tmp_path):
    tiny = ["data=fake", "data.input_size=8", "data.train_size=4", "data.test_size=4", "trainer.max_steps=1"]
    summary = run(_compose(*tiny, "prune=swp", "prune.include=layer1.*"), run_dir=tmp_path)
    assert summary["skeleton_layers"] == 18  # resnet56's layer1: 9 blocks of two 3x3 convs


@pytest.mark.parametrize("override, match", [
    ("+model.pretrained=true", r"\+model.pretrained: model has no key 'pretrained', so it would be ignored \(its keys: "
                               r"kwargs, name, weights\).*model arguments go under \+model.kwargs.<name> "
                               r"\(pretrained weights: model.weights=<a local state dict file>\)"),
    ("+epochs=10", r"\+epochs: the config has no top-level key 'epochs', so it would be ignored \(its keys: data, "
                   r"imports, init, model, optim, pix, prune, resume, trainer\).*optim.epochs"),
    ("+optim.lr_min=0", r"\+optim.lr_min: optim has no key 'lr_min'"),
])
def test_keys_added_with_plus_that_nothing_reads_are_refused(monkeypatch, override, match):
    """train.py's check of its command line (Hydra's parsed overrides, here given directly): a '+' key in the model
    group outside model.kwargs, at the top level, or in a fixed group is refused; +model.kwargs.* (the model's
    constructor takes them) and +data.* (build_data checks them) are not."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    import compress._overrides
    import compress.engine as engine

    def check(*overrides):
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        monkeypatch.setattr(engine, "command_line_overrides", lambda: parsed)
        monkeypatch.setattr(compress._overrides, "app_config_name", lambda: "train")
        cfg = _compose(*overrides)
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            engine._refuse_added_keys(cfg)

    with pytest.raises(ValueError, match=match):
        check(override)
    check("+model.kwargs.drop_rate=0.1", "+data.seed=3")
    check("+pix.zeta=4", "+trainer.max_steps=2")  # keys that hold null: Hydra's + sets them, as a plain override


def test_a_batch_of_one_that_reaches_a_1x1_batchnorm_names_the_fix(tmp_path):
    """torchvision's ResNet-18 on 32x32 images ends at 1x1 feature maps: with one image per batch its BatchNorm
    cannot train, and the error says which settings to change."""
    cfg = _compose("model=resnet18", "data=fake", "data.input_size=32", "data.num_classes=3", "data.train_size=3",
                   "data.test_size=2", "data.batch_size=1", "trainer.max_steps=1", "prune=none")
    with pytest.raises(ValueError, match=r"a training batch of 1 image\(s\) of \(3, 32, 32\) reaches a BatchNorm "
                                         r"with one value per channel.*data.batch_size >= 2"):
        run(cfg, run_dir=tmp_path)


def test_cosine_schedule_with_milestones_warns_once(tmp_path):
    """optim=sgd_multistep with optim.schedule=cosine: its milestones and gamma would be ignored without a word;
    the warning comes once, from the config check (not from each place that checks the optim group again)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run(_compose("data=fake", "data.input_size=8", "data.num_classes=3", "data.train_size=4", "data.test_size=2",
                     "model=resnet20", "optim=sgd_multistep", "optim.schedule=cosine", "trainer.max_steps=1"),
            run_dir=tmp_path)
    cosine = [w for w in seen if "have no effect with optim.schedule=cosine" in str(w.message)]
    assert len(cosine) == 1, [str(w.message) for w in seen]


def test_adding_overrides_tells_a_forced_existing_key_from_a_forced_new_one():
    """'+key' always adds; Hydra's '++key' adds only where the config lacks the key (told by composing without the
    '++' overrides); hydra.* overrides are left out. Order as given."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from compress._overrides import adding_overrides, typed

    def added(*given):
        parsed = OverridesParser.create().parse_overrides(list(given))
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            return [typed(o) for o in adding_overrides(parsed, "train")]

    assert added("++prune.alpha=1e-4", "++prune.alpah=1", "+model.kwargs.drop_rate=0.1", "optim=sgd_multistep",
                 "++optim.gamma=0.2", "++model.kwargs.width=2", "++hydra.verbose=true", "++init=x.safetensors",
                 "++trainer.max_step=3") == ["++prune.alpah", "+model.kwargs.drop_rate", "++model.kwargs.width",
                                             "++trainer.max_step"]
    assert added("++optim.gamma=0.2") == ["++optim.gamma"]  # sgd_digits (the default) has no gamma
    assert added("prune=none", "++prune.alpha=1e-4") == ["++prune.alpha"]  # nor has prune=none an alpha
    assert added("prune.alpha=1", "++data.batch_size=8") == []
    assert added("+pix.zeta=4", "+init=x.safetensors", "+pix.zeta_=4") == ["+pix.zeta_"]  # null-valued keys exist


def test_has_key_counts_a_mandatory_missing_value_as_present():
    """has_key tells whether a dotted key exists: a key whose value is missing ("???", a mandatory setting) exists,
    at the top level and nested (OmegaConf's `in` is False for it, so adding_overrides would take a '++' on it for an
    added key); an absent key, or one under a missing node, does not."""
    from compress._overrides import has_key

    cfg = OmegaConf.create({"a": {"b": "???", "d": 1}, "c": "???"})
    assert has_key(cfg, "a.b") and has_key(cfg, "c") and has_key(cfg, "a.d") and has_key(cfg, "a")
    assert not has_key(cfg, "a.x") and not has_key(cfg, "x") and not has_key(cfg, "x.b")


def test_runs_started_in_one_second_get_run_dirs_of_their_own():
    """train.py's default run dir (and a sweep's) is named to the microsecond, as export's: named to the second, two
    runs started together (a job array, a script) got one dir, and all but the first were refused as in use."""
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfgs = [compose(config_name="train", return_hydra_config=True).hydra for _ in range(2)]
    for key in ("run", "sweep"):
        dirs = [c[key].dir for c in cfgs]
        assert dirs[0] != dirs[1] and all(d.startswith(("outputs/", "multirun/")) for d in dirs), dirs
