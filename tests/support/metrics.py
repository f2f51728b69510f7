"""Scraping a process's Prometheus metrics in tests."""

from __future__ import annotations

import time
from collections.abc import Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def scrape(port: int, timeout: float = 5.0) -> list[Sample]:
    """Every sample http://127.0.0.1:PORT/metrics serves."""
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=timeout)
    response.raise_for_status()
    return [s for family in text_string_to_metric_families(response.text) for s in family.samples]


def scrape_all(ports: Iterable[int]) -> list[Sample]:
    return [s for port in ports for s in scrape(port)]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def by(samples: list[Sample], name: str, label: str, **labels: str) -> dict[str, float]:
    """``name``'s samples summed by one label's value."""
    out: dict[str, float] = {}
    for s in samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
    return out


def wait_serving(ports: Iterable[int], timeout: float = 30.0) -> None:
    """Until every port answers /metrics."""
    deadline = time.monotonic() + timeout
    for port in ports:
        while True:
            try:
                scrape(port, timeout=1.0)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
