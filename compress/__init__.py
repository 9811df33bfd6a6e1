"""compress: stripe-wise pruning (Filter Skeletons), PiX and compact-model export for ConvNets.

The public surface, imported explicitly. One name is both: `compress.profile` is the function, which hides its
module as an attribute, so `import compress.profile as P` binds the function; reach the module's other names with
`from compress.profile import register_macs_handler, ProfileReport, measure_latencies` (the import system finds
the module). Every other submodule is importable under its own name:

    create_model, list_models, register_model                         compress.models
    build_data                         compress.data
    SkeletonConv2d, attach_skeletons, swp_update, skeleton_stats     compress.skeleton
    StripeConv2d                       compress.stripe
    compact, choose_modes              compress.compaction
    PiXBlock, apply_pix, insert_pix, downscale_pix                   compress.pix
    profile, compare                   compress.profile
    save, load                         compress.checkpoint
    CUDAGraphModel                     compress.graphs
"""

from compress.checkpoint import load, save
from compress.compaction import choose_modes, compact
from compress.data import build_data
from compress.graphs import CUDAGraphModel
from compress.models import create_model, list_models, register_model
from compress.pix import PiXBlock, apply_pix, downscale_pix, insert_pix
from compress.profile import compare, profile
from compress.skeleton import SkeletonConv2d, attach_skeletons, skeleton_stats, swp_update
from compress.stripe import StripeConv2d

__all__ = [
    "CUDAGraphModel",
    "PiXBlock",
    "SkeletonConv2d",
    "StripeConv2d",
    "apply_pix",
    "attach_skeletons",
    "build_data",
    "choose_modes",
    "compact",
    "compare",
    "create_model",
    "downscale_pix",
    "insert_pix",
    "list_models",
    "load",
    "profile",
    "register_model",
    "save",
    "skeleton_stats",
    "swp_update",
]
