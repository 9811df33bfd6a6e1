"""Model registry and families: CIFAR ResNets and VGGs, plus torchvision and timm models by name.

`create_model("resnet56", num_classes=10)` builds a model; `list_models()` gives the registered
names, and any `timm:<name>` is accepted too.
"""

from . import cifar_resnet, cifar_vgg, external  # noqa: F401  (register the entry points)
from ._registry import TIMM_PREFIX, create_model, import_modules, list_models, module_names, register_model
from ._weights import load_weights

__all__ = ["TIMM_PREFIX", "create_model", "import_modules", "list_models", "load_weights", "module_names",
           "register_model"]
