"""A model that cannot be reached, through real workers (I36): while its call is retried the
task says so wherever a person looks (status, list, watch's events, doctor), and the retrying
ends at its time bound (CHARLIE_MODEL_RETRY_SECONDS) in a failure that names the bound and the
last error. A failure waiting cannot fix (a 401) fails at once with the provider's message."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
from click.testing import CliRunner

import charlie
from charlie import api, cli
from charlie.domain import TaskStatus
from charlie.models.retrying import attempts_failed
from tests.conftest import wait_for
from tests.support.cluster import Cluster, free_port
from tests.support.fake_openai import FakeOpenAI, Reply

pytestmark = pytest.mark.timeout(180)

T = TypeVar("T")

#: short enough for a test, long enough for status and list to be read while it retries
#: (with one attempt a try, the waits are 1, 2, 4, 8 s: it gives up at about 15 s)
BOUND = "20"


def steady(task_id: str, show: Callable[[], T]) -> tuple[int, T]:
    """What ``show`` gave and the run's count of failed attempts, read while the count did not
    change (a retry lands every few seconds: a view read across one would be compared with
    the wrong count)."""
    for _ in range(30):
        before = charlie.get_task(task_id).retrying
        shown = show()
        after = charlie.get_task(task_id).retrying
        if before is not None and after is not None and before.attempts == after.attempts:
            return before.attempts, shown
    raise AssertionError("the count changed under every read")


def test_an_unreachable_model_shows_retrying_then_fails_at_the_bound(
    cluster: Cluster, request: pytest.FixtureRequest
) -> None:
    closed = free_port()  # nothing listens there: each attempt's connection is refused
    with cluster.configured(
        CHARLIE_MODEL_RETRY_SECONDS=BOUND,
        CHARLIE_MODEL_MAX_ATTEMPTS="1",
        CHARLIE_MODEL_NOWHERE_BASE_URL=f"http://127.0.0.1:{closed}/v1",
        CHARLIE_MODEL_NOWHERE_API_KEY="sk-test-nowhere",
    ):
        task_id = charlie.submit("hi", model="openai:nowhere")
        # if this test fails before the run ends, its run must not go on retrying against the
        # session's model server (the workers lose this model's address when the block ends)
        request.addfinalizer(lambda: charlie.cancel(task_id, note="its test ended"))
        info = wait_for(lambda: (i := charlie.get_task(task_id)).retrying and i, timeout=60)
        assert info.retrying is not None and not info.terminal
        assert "ConnectError" in info.retrying.error and info.retrying.attempts >= 1
        # one count: the run's; the error is the provider's, with no count of its own
        assert "attempt" not in info.retrying.error, info.retrying.error

        # first, while a retry is still to come within the bound: the revision the console's
        # page polls moves with each retry, though a wait commits no new version (its header
        # kept an old count while the live panel said the new one)
        n, first = steady(task_id, lambda: api.revision(task_id))
        wait_for(lambda: (r := charlie.get_task(task_id).retrying) and r.attempts > n, 30)
        assert steady(task_id, lambda: api.revision(task_id))[1] != first

        # in this process, as a person's shell would run them (a process of their own takes
        # seconds to start on a loaded machine: the retrying could end first)
        n, status = steady(task_id, lambda: CliRunner().invoke(cli.main, ["status", task_id]))
        assert status.exit_code == 0, status.output
        row = next(line for line in status.output.splitlines() if "retrying" in line)
        assert f"retrying the model call: {attempts_failed(n)}; next attempt at" in row, row
        assert "gives up at" in row and "ConnectError" in row, row
        assert row.count("attempt") == 2, row  # "N attempts failed", "next attempt at"
        n, listed = steady(
            task_id, lambda: CliRunner().invoke(cli.main, ["list", "--search", task_id])
        )
        assert listed.exit_code == 0, listed.output
        mine = next(line for line in listed.output.splitlines() if task_id in line)
        assert f"[retrying: {n} failed]" in mine, listed.output

        # watch's events count as the state does: the latest says the state's count. The
        # stream is a view its writer sends a moment after the commit (I28): it may trail the
        # state by that moment, so it is read until it has caught up, and it never runs ahead
        def events_caught_up() -> tuple[int, list[dict[str, object]]] | None:
            n, said = steady(
                task_id,
                lambda: [e.data for e in api.events(task_id, follow=False) if e.type == "retrying"],
            )
            assert said, "no retrying event"
            assert said[-1]["attempts"] <= n, (n, said)
            return (n, said) if said[-1]["attempts"] == n else None

        wait_for(events_caught_up, timeout=10)

        from charlie.doctor import Context, check_model_retries
        from charlie.runtime import get_producer

        rt = get_producer()
        n, check = steady(
            task_id,
            lambda: check_model_retries(
                Context(rt.settings, 3.0, engine=rt.engine, schema_ok=True)
            ),
        )
        assert check.status == "WARN" and "retrying a failed model call" in check.detail
        if f"task {task_id}:" in check.detail:  # (another module's run may be the one named)
            assert f"retrying the model call: {attempts_failed(n)};" in check.detail

        done = charlie.wait(task_id, timeout=90)
        assert done.status is TaskStatus.FAILED and done.retrying is None
        message = done.error["message"]
        assert f"CHARLIE_MODEL_RETRY_SECONDS={BOUND}" in message, message
        assert "ConnectError" in message, message
        assert (done.finished_at - done.created_at).total_seconds() < float(BOUND) + 30
        seen = [e.type for e in api.events(task_id, follow=False)]
        assert "retrying" in seen, seen


def test_a_refused_key_fails_at_once_with_the_providers_message(
    cluster: Cluster, model_server: FakeOpenAI
) -> None:
    body = {"error": {"message": "Incorrect API key provided", "code": "invalid_api_key"}}
    model_server.enqueue(Reply(401, body))
    task_id = charlie.submit("hi", model="openai:fake-model")
    done = charlie.wait(task_id, timeout=60)
    assert done.status is TaskStatus.FAILED
    assert "Incorrect API key provided" in done.error["message"], done.error
    assert len(model_server.bodies) == 1  # asked once: waiting cannot fix a refused key
