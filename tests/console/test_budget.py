"""The run console shows a task's cost and budget, in its header and the list."""

from __future__ import annotations

import html
import uuid

import pytest

import charlie
from tests.console.conftest import Console
from tests.support.cluster import Cluster

pytestmark = pytest.mark.timeout(120)


def test_the_task_page_and_the_list_show_cost_and_budget(
    console: Console, cluster: Cluster, script
) -> None:
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "a", "name": "sleep_then", "arguments": {"seconds": 0, "value": "v"}}
                ]
            },
            {"say": "done", "tool_calls": []},
        ]
    )
    task_id = f"cb-{uuid.uuid4().hex[:10]}"
    charlie.submit("<b>costly</b>", model=model, task_id=task_id, budget={"model_calls": 1})
    info = charlie.wait(task_id, timeout=60)
    assert info.error["budget"] == "model_calls"
    with console.bearer() as http:
        page = http.get(f"/tasks/{task_id}").text
        listing = http.get(f"/?search={task_id}").text
    # scripted models cost 0 by the built-in price table
    assert '<dd id="cost">$0.0000</dd>' in page
    assert '<dd id="budget">model_calls 1 of 1</dd>' in page
    assert "budget exceeded" in html.unescape(page)
    assert '<td class="num cost">$0.0000</td>' in listing
    assert "model_calls 1 of 1" in listing
    assert "<b>costly</b>" not in listing and "&lt;b&gt;costly&lt;/b&gt;" in listing


def test_the_task_header_shows_prompt_cache_tokens(
    console: Console, cluster: Cluster, anthropic_server
) -> None:
    from tests.support.fake_anthropic import message, text, usage

    anthropic_server.enqueue(message(text("cached"), use=usage(10, 4, cache_read=900)))
    task_id = charlie.submit("hello", model="anthropic:claude-fake")
    info = charlie.wait(task_id, timeout=60)
    assert info.result["answer"] == "cached", info.error
    with console.bearer() as http:
        page = http.get(f"/tasks/{task_id}").text
    tokens = "in 910 · out 4 · reasoning 0 · cache read 900 · cache write 0"
    assert f'<dd id="tokens">{tokens}</dd>' in page
