"""compress: stripe-wise pruning (Filter Skeletons), PiX and compact-model export for ConvNets.

The public surface is re-exported here; submodules are imported on first use so that
`import compress` stays cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "create_model": "compress.models",
    "list_models": "compress.models",
    "build_data": "compress.data",
    "SkeletonConv2d": "compress.skeleton",
    "attach_skeletons": "compress.skeleton",
    "swp_update": "compress.skeleton",
    "skeleton_stats": "compress.skeleton",
    "StripeConv2d": "compress.stripe",
    "compact": "compress.compaction",
    "choose_modes": "compress.compaction",
    "profile": "compress.profile",
    "compare": "compress.profile",
    "save": "compress.checkpoint",
    "load": "compress.checkpoint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'compress' has no attribute {name!r}")
