"""The run console shows a task's cost and budget (issue 16), in its header and the list."""

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
