"""The Celery app: the bare object that carries ticks and tool invocations between processes.

Its settings come from ``celeryconfig`` (each with its reason); the tasks and signal hooks it
runs are all declared in :mod:`charlie.worker`, which it includes by name, so importing the app
(a producer publishing, the CLI starting a worker) imports nothing else of Charlie.

With message signing configured (CHARLIE_SECURITY_*, celeryconfig's ``auth`` serializer), the
app sets up Celery's signing serializer as soon as it is configured, in every process that
uses it: workers, beat, producers, the console and the CLI all publish signed.
"""

from __future__ import annotations

from celery import Celery

app = Celery("charlie")
app.config_from_object("celeryconfig")
app.conf.include = ["charlie.worker"]

if app.conf.task_serializer == "auth":
    # Message signing (celeryconfig: CHARLIE_SECURITY_*), as Celery documents it: the "auth"
    # serializer, registered with this process's key, certificate and store. Called here, not
    # from a signal whose errors Celery would only log: a key that cannot be read stops the
    # process at once. JSON stays decodable for what is not a task message (Flower's events);
    # task messages are held to accept_content, "auth" alone.
    app.setup_security(allowed_serializers=["json"])
