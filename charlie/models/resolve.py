"""Model specs (``scripted:PATH``, ``openai:NAME``, ``openai-responses:NAME``,
``anthropic:NAME``) to clients."""

from __future__ import annotations

from pathlib import Path

from charlie.models.base import Model
from charlie.models.scripted import ScriptedModel, load_script

PROVIDERS = ("scripted", "openai", "openai-responses", "anthropic")


class UnknownModelError(ValueError):
    pass


def _split(spec: str) -> tuple[str, str]:
    provider, sep, name = spec.partition(":")
    if not sep or not name or provider not in PROVIDERS:
        raise UnknownModelError(
            f"unknown model {spec!r}: expected one of "
            + ", ".join(f"{p}:NAME" for p in PROVIDERS)
            + " (scripted takes a path to a JSON file of turns)"
        )
    return provider, name


def validate_model_spec(spec: str) -> None:
    """Refuse a model spec that cannot work, before a task is written."""
    provider, name = _split(spec)
    if provider == "scripted":
        load_script(Path(name))


def normalise_model(spec: str) -> str:
    """A validated spec as it is recorded on a task: a script by its absolute path, since
    workers may run elsewhere in the tree."""
    validate_model_spec(spec)
    provider, _, name = spec.partition(":")
    if provider == "scripted":
        return f"scripted:{Path(name).resolve()}"
    return spec


def resolve_model(spec: str) -> Model:
    provider, name = _split(spec)
    if provider == "scripted":
        return ScriptedModel(spec, Path(name))
    if provider == "anthropic":
        from charlie.models import anthropic  # an optional import: the SDK only when used

        return anthropic.client_for(name, spec)
    from charlie.models.openai import client_for  # an optional import: the SDK only when used

    return client_for(provider, name, spec)
