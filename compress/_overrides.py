"""Command-line overrides of a Hydra app (train.py, export.py) that add keys to its config.

Both scripts refuse keys a user adds that nothing reads (a misspelt ``+prune.alpah=1`` would otherwise be ignored
without a word). Hydra has two ways to add a key: ``+key=value`` (add; an error when the key holds a value, but a
plain set when it holds null, as ``+pix.zeta=4`` does) and ``++key=value`` (add, or set when it exists). Both have
been applied by the time the config is seen, so whether one added its key is told by composing the config again
without them.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf


def command_line_overrides() -> list | None:
    """This Hydra app's command-line overrides, parsed (Hydra's task overrides, hydra.* excluded); None outside a
    Hydra app (`compress.engine.run(cfg, run_dir)` called from Python)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not HydraConfig.initialized():
        return None
    return OverridesParser.create().parse_overrides(list(HydraConfig.get().overrides.task))


def app_config_name() -> str:
    """The running Hydra app's config name (train, export)."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().job.config_name


def adding_overrides(overrides: list, config_name: str | None = None) -> list:
    """The overrides in `overrides` (Hydra's parsed ones) that add a key to the config: each ``+key=value`` and
    ``++key=value`` whose key the config composed without those overrides lacks; hydra.* ones left out. `config_name`:
    the app's config (default: the running app's, `app_config_name`). Composing needs Hydra initialised (inside
    @hydra.main, or hydra's initialize_config_dir)."""
    import hydra

    overrides = [o for o in overrides if not o.is_hydra_override()]
    adds = [o for o in overrides if o.is_add() or o.is_force_add()]
    if not adds:
        return []
    base = hydra.compose(config_name or app_config_name(), [o.input_line for o in overrides if o not in adds])
    return [o for o in adds if not has_key(base, o.key_or_group)]


def has_key(cfg: DictConfig, key: str) -> bool:
    """Whether dotted `key` names a key of `cfg` (one whose value is missing, ???, too)."""
    parent, _, last = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return isinstance(node, DictConfig) and last in node.keys()  # (`in node` is False for a ??? value)


def typed(override) -> str:
    """The override's key as typed: '+prune.alpah' or '++prune.alpah'."""
    return ("++" if override.is_force_add() else "+") + override.key_or_group


def require_sections(cfg: DictConfig, examples: dict[str, tuple[str, type]], app: str) -> None:
    """ValueError where a section of settings (a node of keys; `examples` maps each to one of its keys and that key's
    type) was given a plain value on the command line (``pix=4``, ``onnx=false``), which Hydra takes as replacing the
    whole node: every setting read from it then failed with an AttributeError. The message names the key to set."""
    for section, (key, kind) in examples.items():
        if section in cfg and not isinstance(cfg[section], DictConfig):
            value = OmegaConf.to_container(cfg, resolve=False)[section]
            shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
            fits = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
            raise ValueError(f"{app}: {section}={shown} sets the whole {section} section, which holds settings of its "
                             f"own; set one of them instead, e.g. {section}.{key}={shown if fits else '<value>'} "
                             f"(conf/{app}.yaml lists them)")
