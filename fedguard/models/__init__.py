"""Models by name: ``build_model("lenet", spec)``. Importing registers them all."""

from fedguard.models import cnn, convnet, lenet, mlp, resnet  # noqa: F401  (registration)
from fedguard.models.registry import MODELS, architecture, build_model, global_model, model_at, register_model

__all__ = ["MODELS", "architecture", "build_model", "global_model", "model_at", "register_model"]
