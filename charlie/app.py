"""The Celery app: the bare object that carries ticks and tool invocations between processes.

Its settings come from ``celeryconfig`` (each with its reason); the tasks and signal hooks it
runs are all declared in :mod:`charlie.worker`, which it includes by name, so importing the app
(a producer publishing, the CLI starting a worker) imports nothing else of Charlie.
"""

from __future__ import annotations

from celery import Celery

app = Celery("charlie")
app.config_from_object("celeryconfig")
app.conf.include = ["charlie.worker"]
