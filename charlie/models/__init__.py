"""Model clients behind one interface: scripted (turns from a file), OpenAI-compatible HTTP and
Anthropic's Messages API."""

from charlie.models.base import (
    Model,
    ModelError,
    ModelRequest,
    ModelResponse,
    ToolSpec,
    TransientModelError,
    Usage,
)
from charlie.models.resolve import (
    UnknownModelError,
    normalise_model,
    resolve_model,
    validate_model_spec,
)

__all__ = [
    "Model",
    "ModelError",
    "ModelRequest",
    "ModelResponse",
    "ToolSpec",
    "TransientModelError",
    "UnknownModelError",
    "Usage",
    "normalise_model",
    "resolve_model",
    "validate_model_spec",
]
