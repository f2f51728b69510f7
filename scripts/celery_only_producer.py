"""A producer that has only Celery: no Charlie import, no routing configuration.

It sends ``charlie.submit`` by name, as docs/production/index.md shows, twice: once with the
task id in the keyword arguments and once as the Celery message's own id. CI runs it from a
virtualenv with a plain ``pip install .`` against workers on PostgreSQL + Redis and + RabbitMQ.

    python scripts/celery_only_producer.py BROKER_URL MODEL TASK_ID [TASK_ID ...]
"""

from __future__ import annotations

import sys

from celery import Celery


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    broker_url, model, *task_ids = argv
    app = Celery(broker=broker_url)
    for n, task_id in enumerate(task_ids):
        prompt = f"List the files of the workspace ({task_id})."
        if n % 2 == 0:
            app.send_task(
                "charlie.submit", kwargs={"prompt": prompt, "model": model, "task_id": task_id}
            )
        else:
            app.send_task(
                "charlie.submit", kwargs={"prompt": prompt, "model": model}, task_id=task_id
            )
        print(task_id)
    # The point of this producer: nothing of Charlie's was needed to start the tasks.
    assert not any(m == "charlie" or m.startswith("charlie.") for m in sys.modules), "imported"
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
