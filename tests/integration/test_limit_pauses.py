"""A provider's pause is bounded, visible and can be lifted (I36, I27, I32), through real
workers against a real HTTP server on 127.0.0.1 that answers a 429 asking to wait three years
(``Retry-After: 100000000``): the limit and the throttled call wait CHARLIE_MODEL_RETRY_AFTER_MAX
(600 s by default) at most, with a warning naming the provider's value; `charlie limits` and the
console's list show the pause, and `charlie limits resume` lifts it, recorded with its channel,
and the held call goes at once."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

import charlie
from charlie.domain import TaskStatus, utcnow
from charlie.people import LimitNotPaused, limit_actions, limit_states, resume_limit
from tests.conftest import wait_for
from tests.integration.test_model_limits import MODEL, answer, limited
from tests.support.cluster import REPO, Cluster
from tests.support.fake_openai import FakeOpenAI, ProviderLimit

pytestmark = pytest.mark.timeout(240)


def test_a_providers_pause_is_bounded_shown_and_lifted_by_an_operator(
    cluster: Cluster, model_server: FakeOpenAI
) -> None:
    limit = ProviderLimit(retry_after="100000000", latency=0.05, answer=answer(), refuse_next=1)
    model_server.limit = limit
    with limited(cluster, {"openai:": {"concurrency": 8}}):
        task_id = charlie.submit("paused for years", model=MODEL)
        wait_for(lambda: limit.refused_at, timeout=60)

        def paused() -> Any:
            return next((s for s in limit_states() if s.key == "openai:" and s.paused_until), None)

        wait_for(paused, timeout=60)
        left = (paused().paused_until - utcnow()).total_seconds()
        assert 500 < left <= 601, paused()
        wait_for(lambda: charlie.get_task(task_id).status is TaskStatus.RUNNING, timeout=30)
        assert "100000000" in cluster.logs()  # the warning names the provider's value
        # the console's list shows it (its panel of limits)
        from charlie.console.server import load_list

        listed = load_list([], None, None)["limits"]
        # (another module's test may have left a limit of its own paused on this cluster)
        assert "openai:" in [x.key for x in listed if x.paused_until]

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "charlie", "limits", *args],
                capture_output=True,
                text=True,
                cwd=REPO,
                env={**os.environ, **cluster.settings_env},
                timeout=60,
            )

        shown = cli()
        assert shown.returncode == 0, shown.stderr
        assert "openai:: " in shown.stdout and "paused by the provider until" in shown.stdout
        assert "charlie limits resume openai:" in shown.stdout
        lifted = cli("resume", "openai:", "--note", "the gateway misbehaved")
        assert lifted.returncode == 0, lifted.stderr
        assert "lifted the pause of openai:" in lifted.stdout
        info = charlie.wait(task_id, timeout=60)
        assert info.status is TaskStatus.SUCCEEDED, info.error  # not the 600 s pause
        with pytest.raises(LimitNotPaused, match="is not paused"):
            resume_limit("openai:")
    action = limit_actions("openai:")[0]
    assert action.action == "resume" and action.note == "the gateway misbehaved"
    assert action.channel.value == "cli" and not action.authenticated
    assert "(claimed, via CLI)" in action.by
    assert not [s for s in limit_states() if s.key == "openai:" and s.paused_until]
