"""What the standard OpenTelemetry environment asks for, read without importing the SDK: a
process that traces nothing pays no import for it."""

from __future__ import annotations


def wanted(env: dict[str, str]) -> bool:
    """Whether the standard OpenTelemetry environment asks this process for traces."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    named = exporters(env)
    return bool(named) and named != ["none"]


def exporters(env: dict[str, str]) -> list[str]:
    named = [e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
    if named:
        return named
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    return ["otlp"] if endpoint else []


def traces_endpoint(env: dict[str, str]) -> str:
    """Where OTLP/HTTP spans go, as the exporter reads the environment."""
    specific = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if specific:
        return specific
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4318"
    return base.rstrip("/") + "/v1/traces"
