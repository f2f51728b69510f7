"""A retried model call as every view shows it (I36): one count of attempts, the run's, in the
same words (status, list, watch, the console's header, its live panel and doctor); an error
text that repeats no count; and the console's timeline drawing each failed try and the wait
after it on the lane of the worker that tried, titled with its attempts and its error."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from charlie import api
from charlie.console import timeline
from charlie.domain import Phase, TaskStatus
from charlie.models import retrying
from charlie.models.retrying import Retrying, Wait, attempts_failed
from tests.support.cluster import REPO

pytestmark = pytest.mark.backend_free

T0 = datetime(2026, 1, 1, tzinfo=UTC)
#: provider text is attacker-controlled: the template must show it, never obey it
HOSTILE = 'HTTP 503: <img src=x onerror="alert(1)"> overloaded'


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def wait(worker: str, began: float, failed: float, nxt: float, attempts: int) -> Wait:
    return Wait(worker, 0, at(began), at(failed), at(nxt), attempts, f"openai:x: {HOSTILE}")


def task(retry: Retrying | None) -> api.TaskInfo:
    return api.TaskInfo(
        id="t-1",
        status=TaskStatus.RUNNING,
        result=None,
        error=None,
        parent_id=None,
        model="openai:x",
        prompt="hi",
        metadata={},
        created_at=T0,
        started_at=T0,
        finished_at=None,
        phase=Phase.CALL_MODEL,
        turn=0,
        model_calls=0,
        model_repeats=0,
        usage={},
        retrying=retry,
    )


def test_the_count_is_said_in_one_set_of_words() -> None:
    assert attempts_failed(1) == "1 attempt failed"
    assert attempts_failed(10) == "10 attempts failed"
    retry = Retrying("openai:x: HTTP 503", 10, T0, at(30), 600.0)
    assert "retrying the model call: 10 attempts failed;" in retry.describe(at(20))
    # the console's live panel builds its line from the event in the same words
    js = (REPO / "charlie" / "console" / "static" / "console.js").read_text()
    assert '"retrying the model call: "' in js and '" attempts failed"' in js
    assert "attempts so far" not in js


def test_the_state_keeps_the_latest_waits_only() -> None:
    waits = tuple(wait("w1", n, n + 0.5, n + 1, 5 * (n + 1)) for n in range(20))
    retry = Retrying("e", 100, T0, at(20), 600.0, waits)
    back = retrying.from_state({retrying.STATE_KEY: retry.as_state()})
    assert back is not None and len(back.waits) == retrying.KEPT_WAITS
    assert back.waits == waits[-retrying.KEPT_WAITS :]
    # a state written before waits were kept still reads, with none
    old = {k: v for k, v in retry.as_state().items() if k != "waits"}
    read = retrying.from_state({retrying.STATE_KEY: old})
    assert read is not None and read.waits == () and read.attempts == 100


def test_the_timeline_marks_each_failed_try_and_wait_on_its_workers_lane() -> None:
    waits = (wait("w1", 0.1, 1.0, 3.0, 5), wait("w2", 3.1, 4.0, 8.0, 10))
    retry = Retrying(waits[-1].error, 10, at(1.0), at(8.0), 600.0, waits)
    history = [
        {"from_phase": "load_context", "to_phase": "call_model", "at": at(0.1),
         "worker": "w1", "duration_ms": 2.0, "version": 1},
    ]  # fmt: skip
    tl = timeline.build(task(retry), history, [], [], at(5.0))
    lanes = {lane.label: lane.y for lane in tl.lanes}
    assert set(lanes) == {"run", "w1", "w2"}  # w2 ran no transition: its lane is its wait's
    tried = [m for m in tl.marks if m.css == "retry-tried"]
    waited = [m for m in tl.marks if m.css == "retry-wait"]
    assert len(tried) == len(waited) == 2
    assert [m.y - 9 for m in tried] == [lanes["w1"], lanes["w2"]]
    assert [m.y - 7 for m in waited] == [lanes["w1"], lanes["w2"]]
    assert "attempts 1-5 failed" in tried[0].title and "attempts 6-10 failed" in tried[1].title
    assert "after 5 attempts failed" in waited[0].title and "to attempt 6 at" in waited[0].title
    assert "after 10 attempts failed" in waited[1].title and "to attempt 11 at" in waited[1].title
    assert all(HOSTILE in m.title for m in [*tried, *waited])  # raw here; escaped in the page
    # the wait still running reaches the next attempt's time, past now; the total is so far
    last = waited[-1]
    assert last.x + last.w == pytest.approx(timeline.WIDTH - 10, abs=0.5)
    assert tl.total == "5.0 s"
    assert ("retry-wait", "waiting to retry the model call") in tl.legend


def test_the_page_escapes_the_waits_titles() -> None:
    waits = (wait("w1", 0.1, 1.0, 3.0, 5),)
    retry = Retrying(waits[0].error, 5, at(1.0), at(3.0), 600.0, waits)
    tl = timeline.build(task(retry), [], [], [], at(2.0))
    svg = _timeline_svg(tl)
    assert "<img" not in svg and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in svg


def _timeline_svg(tl: timeline.Timeline) -> str:
    """The timeline section of _task.html, rendered as the page renders it (autoescaped)."""
    from tornado.template import Template

    page = (REPO / "charlie" / "console" / "templates" / "_task.html").read_text()
    start = page.index('<section data-region="timeline"')
    end = page.index("</section>", start) + len("</section>")
    return Template(page[start:end], autoescape="xhtml_escape").generate(tl=tl).decode()


def test_a_finished_task_draws_no_wait() -> None:
    waits = (wait("w1", 0.1, 1.0, 3.0, 5),)
    running = task(Retrying("e", 5, at(1.0), at(3.0), 600.0, waits))
    info = replace(running, status=TaskStatus.FAILED, finished_at=at(2.0))
    tl = timeline.build(info, [], [], [], at(9.0))
    assert not [m for m in tl.marks if m.css.startswith("retry")]


def test_the_oldest_wait_kept_is_titled_with_its_own_attempts() -> None:
    """Past KEPT_WAITS waits the oldest are dropped: the oldest kept says the attempts it
    recorded as its own (its first kept with it), not "attempts 1-N" (I36: what a person is
    shown is true); a state written before the first was kept says where its attempts end."""
    n = retrying.KEPT_WAITS + 3
    waits = tuple(
        replace(wait("w1", k, k + 0.5, k + 1, 2 * (k + 1)), first=2 * k + 1) for k in range(n)
    )
    retry = Retrying(waits[-1].error, 2 * n, T0, at(n), 600.0, waits)
    kept = retrying.from_state({retrying.STATE_KEY: retry.as_state()})
    assert kept is not None and len(kept.waits) == retrying.KEPT_WAITS
    history = [
        {"from_phase": "load_context", "to_phase": "call_model", "at": at(0.1),
         "worker": "w1", "duration_ms": 2.0, "version": 1},
    ]  # fmt: skip
    tl = timeline.build(task(kept), history, [], [], at(n - 0.5))
    tried = [m.title for m in tl.marks if m.css == "retry-tried"]
    assert len(tried) == retrying.KEPT_WAITS
    oldest = waits[n - retrying.KEPT_WAITS]
    assert f"attempts {oldest.first}-{oldest.attempts} failed" in tried[0]
    assert "attempts 1-" not in " ".join(tried)
    # kept before the first attempt was: the oldest says only where it ends
    old = replace(kept, waits=tuple(replace(w, first=0) for w in kept.waits))
    titles = [m.title for m in timeline.build(task(old), history, [], [], at(n - 0.5)).marks]
    assert any(f"attempts up to {oldest.attempts} failed" in t for t in titles)
    assert not any("attempts 1-" in t for t in titles)
