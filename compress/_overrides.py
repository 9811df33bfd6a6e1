"""Command-line overrides of a Hydra app (train.py, export.py) that add keys to its config.

Both scripts refuse keys a user adds that nothing reads (a misspelt ``+prune.alpah=1`` would otherwise be ignored
without a word). Hydra has two ways to add a key: ``+key=value`` (add; an error when the key exists) and
``++key=value`` (add, or set when it exists). A ``++`` override has been applied by the time the config is seen,
so whether it added its key is told by composing the config again without the ``++`` overrides.
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


def adding_overrides(overrides: list, config_name: str | None = None) -> list:
    """The overrides in `overrides` (Hydra's parsed ones) that add a key to the config: each ``+key=value``, and each
    ``++key=value`` whose key the config composed without the ``++`` overrides lacks; hydra.* ones left out.
    `config_name`: the app's config (default: the running app's, e.g. train). Composing needs Hydra initialised
    (inside @hydra.main, or hydra's initialize_config_dir)."""
    import hydra
    from hydra.core.hydra_config import HydraConfig

    overrides = [o for o in overrides if not o.is_hydra_override()]
    forced = [o for o in overrides if o.is_force_add()]
    if forced:
        name = config_name or HydraConfig.get().job.config_name
        base = hydra.compose(name, [o.input_line for o in overrides if not o.is_force_add()])
        forced = [o for o in forced if not has_key(base, o.key_or_group)]
    return [o for o in overrides if o.is_add() or any(o is f for f in forced)]


def has_key(cfg: DictConfig, key: str) -> bool:
    """Whether dotted `key` names a key of `cfg` (one whose value is missing, ???, too)."""
    parent, _, last = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return isinstance(node, DictConfig) and last in node.keys()  # (`in node` is False for a ??? value)


def typed(override) -> str:
    """The override's key as typed: '+prune.alpah' or '++prune.alpah'."""
    return ("++" if override.is_force_add() else "+") + override.key_or_group
