"""The model input under the context window (charlie/executor/context.py, I29): pure, fast."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any, overload

import pytest

from charlie.domain import Item, ItemKind, Phase
from charlie.executor import context
from charlie.executor.phases import call_model, load_context
from charlie.models.base import ModelError, ModelResponse, NewItem, Usage
from charlie.ports import PhaseLimits
from charlie.tools.registry import build_tool
from tests.unit.test_phases import FakeModel, deps, view

pytestmark = pytest.mark.backend_free

WINDOW = context.Window(5000, "CHARLIE_MODEL_CONTEXT_TOKENS")


def transcript(turns: int, size: int = 4096, goal: str = "read every page") -> list[Item]:
    items = [
        Item(0, 0, ItemKind.INPUT, None, {"role": "system", "content": "be brief"}),
        Item(1, 0, ItemKind.INPUT, None, {"role": "user", "content": goal}),
    ]
    for t in range(turns):
        call_id = f"c{t}"
        args = json.dumps({"path": f"p{t}"})
        payload = {"name": "read", "arguments": {"path": f"p{t}"}, "raw_arguments": args}
        items.append(Item(len(items), t, ItemKind.TOOL_CALL, call_id, payload))
        result = {
            "name": "read",
            "outcome": "ok",
            "result": "r",
            "content": f"{t:04d}" * (size // 4),
        }
        items.append(Item(len(items), t, ItemKind.TOOL_RESULT, call_id, result))
    return items


def compaction(seq: int, turn: int, covers: tuple[int, int], text: str = "S") -> Item:
    payload = {"covers": list(covers), "content": text, "model": "m", "usage": {}}
    return Item(seq, turn, ItemKind.COMPACTION, None, payload)


def results_shown(plan: context.Plan) -> dict[str, str]:
    return {
        i.call_id or "": i.payload["content"] for i in plan.items if i.kind is ItemKind.TOOL_RESULT
    }


def test_without_a_window_the_transcript_is_sent_as_it_is() -> None:
    items = transcript(30)
    plan = context.plan(items, 30, None, {})
    assert plan.items == items and plan.summary is None


def test_the_input_stays_under_the_window_goal_and_newest_turn_whole() -> None:
    items = transcript(12)
    plan = context.plan(items, 12, WINDOW, {}, recall=True)
    assert plan.summary is None
    assert plan.tokens <= WINDOW.tokens * context.HEADROOM
    assert plan.items[:2] == items[:2]  # the system prompt and the goal, always
    shown = results_shown(plan)
    assert shown["c11"] == items[-1].payload["content"]  # the newest turn, whole
    # older results go first, oldest first, each stub saying how to read it again
    stubbed = [c for c, text in shown.items() if text.startswith("[elided")]
    assert stubbed == [f"c{t}" for t in range(len(stubbed))] and stubbed
    assert 'recall` tool with {"call_id": "c0"}' in shown["c0"]
    # every call keeps its result in the input (I8)
    assert [i.call_id for i in plan.items if i.kind is ItemKind.TOOL_CALL] == list(shown)


def test_elision_keeps_one_prefix_across_turns() -> None:
    """Down to the low-water mark: the next turns send the same elided prefix (a provider's
    prompt cache keeps it), until the input outgrows its budget again."""
    first = context.plan(transcript(6), 6, WINDOW, {})
    second = context.plan(transcript(7), 7, WINDOW, {"context": first.state})
    assert second.items[: len(first.items) - 2] == first.items[:-2]


def test_when_stubs_are_not_enough_older_whole_turns_are_summarised() -> None:
    items = transcript(60)
    plan = context.plan(items, 60, WINDOW, {})
    assert plan.summary is not None
    first, last = plan.summary.covers
    assert first == 2  # from the goal on
    assert items[last].kind is ItemKind.TOOL_RESULT and items[last + 1].turn > items[last].turn
    request = plan.summary.request_items
    assert request[0].payload["content"] == context.SUMMARY_PROMPT
    assert context.text_tokens(request[1].payload["content"]) < WINDOW.tokens * context.HEADROOM


def test_a_compaction_stands_for_what_it_covers() -> None:
    items = transcript(60)
    covered = context.plan(items, 60, WINDOW, {}).summary
    assert covered is not None
    items.append(compaction(len(items), 59, covered.covers, "the summary"))
    plan = context.plan(items, 60, WINDOW, {})
    assert plan.summary is None
    assert (
        plan.items[2].kind is ItemKind.INPUT and "the summary" in plan.items[2].payload["content"]
    )
    seqs = [i.seq for i in plan.items]
    assert seqs == sorted(seqs) and covered.covers[1] + 1 in seqs
    assert not any(covered.covers[0] <= s <= covered.covers[1] for s in seqs[3:])


def test_a_later_summary_covers_the_earlier_one() -> None:
    items = transcript(60)
    first = context.plan(items, 60, WINDOW, {}).summary
    assert first is not None
    items.append(compaction(len(items), 59, first.covers, "first summary"))
    items += [
        Item(len(items) + n, i.turn + 60, i.kind, f"d{i.call_id}", i.payload)
        for n, i in enumerate(transcript(60)[2:])
    ]
    second = context.plan(items, 120, WINDOW, {}).summary
    assert second is not None and second.covers[0] == first.covers[0]
    assert second.covers[1] > first.covers[1]
    assert "first summary" in second.request_items[1].payload["content"]


def test_a_result_over_a_share_of_the_window_is_cut_in_the_input_only() -> None:
    items = transcript(2, size=40_000)
    plan = context.plan(items, 2, WINDOW, {})
    shown = results_shown(plan)["c1"]
    assert "[cut to fit the context window" in shown
    assert context.text_tokens(shown) <= WINDOW.tokens * context.RESULT_SHARE
    assert len(items[-1].payload["content"]) == 40_000  # the item itself is untouched


def test_a_window_too_small_for_the_prompt_and_goal_fails_naming_the_setting() -> None:
    items = transcript(0, goal="x" * 20_000)
    with pytest.raises(context.ContextTooSmall, match="CHARLIE_MODEL_CONTEXT_TOKENS"):
        context.plan(items, 0, WINDOW, {})


def test_the_input_is_a_pure_function_of_the_transcript_and_its_state() -> None:
    items = transcript(40)
    a = context.plan(items, 40, WINDOW, {"context": {"elide_through": 9}})
    b = context.plan(list(items), 40, WINDOW, {"context": {"elide_through": 9}})
    assert a == b


class _CountingItems(Sequence[Item]):
    """A transcript that counts the items a planner reads from it (by index, slice or
    iteration): the work of planning a turn, whatever the machine's speed."""

    def __init__(self, items: list[Item]) -> None:
        self.items = items
        self.read = 0

    def __len__(self) -> int:
        return len(self.items)

    @overload
    def __getitem__(self, index: int) -> Item: ...

    @overload
    def __getitem__(self, index: slice) -> list[Item]: ...

    def __getitem__(self, index: int | slice) -> Item | list[Item]:
        got = self.items[index]
        self.read += len(got) if isinstance(got, list) else 1
        return got


def test_assembly_is_bounded_by_the_window_not_the_transcript() -> None:
    """After a compaction only the items after it are read: planning turn 2000 reads the same
    items as planning turn 50 (a scan of the whole transcript would read 40 times as many)."""

    def reads(turns: int) -> int:
        items = transcript(turns)
        items.append(compaction(len(items), turns - 1, (2, len(items) - 9)))
        counted = _CountingItems(items)
        context.plan(counted, turns, WINDOW, {})
        return counted.read

    assert 0 < reads(50) < len(transcript(50)) // 4
    assert reads(2000) == reads(50)


def test_what_is_known_of_a_prefix_spares_the_walk_and_changes_nothing() -> None:
    """A long run's turn without a window reads only the items after the prefix whose
    compactions the worker already knows (the transcript cache's), not the whole transcript;
    the plan is the one a full walk makes. What cannot be of these items is ignored."""
    items = transcript(2000)
    counted = _CountingItems(items)
    context.plan(counted, 2000, None, {})
    known = _CountingItems(items)
    plan = context.plan(known, 2000, None, {}, compaction_known=(len(items) - 2, -1))
    assert plan.items == items and plan.compaction is None
    # (both copy the items once, as the counting sequence is no list: the walk is the rest)
    assert counted.read - known.read >= len(items) - 4

    compacted = [*items[:-2], compaction(len(items) - 2, 1998, (2, 900)), items[-1]]
    compacted[-1] = Item(len(compacted) - 1, 1999, ItemKind.TOOL_RESULT, "c", {"content": "x"})
    full = context.plan(compacted, 2000, None, {})
    for hint in (
        (len(compacted) - 1, len(compacted) - 2),  # the compaction inside the known prefix
        (len(compacted) - 2, -1),  # the compaction after it
        (10, -1),
        (len(compacted) + 5, -1),  # longer than the items: ignored
        (len(compacted) - 1, 7),  # names an item that is no compaction: ignored
    ):
        hinted = context.plan(compacted, 2000, None, {}, compaction_known=hint)
        assert hinted.compaction == full.compaction == compacted[-2], hint
        assert hinted.items == full.items

    # an older compaction inside the known prefix, a newer one after it: the newer wins
    older = compaction(500, 600, (2, 400), "older")
    both = [*compacted[:500], older, *compacted[501:]]
    both[500] = Item(500, 600, ItemKind.COMPACTION, None, older.payload)
    assert context.plan(both, 2000, None, {}, compaction_known=(1000, 500)).compaction == both[-2]
    assert context.plan(both, 2000, None, {}, compaction_known=(len(both), len(both) - 2)) == (
        context.plan(both, 2000, None, {})
    )


def test_a_model_call_plans_with_what_its_view_knows_of_the_compactions() -> None:
    """call_model hands the view's ``compaction_known`` to the planning: told (wrongly, on
    purpose) that the remembered prefix holds no compaction, it sends the items whole; told
    nothing, it finds the compaction and sends its summary."""
    items = transcript(6, size=16)
    items.append(compaction(len(items), 5, (2, len(items) - 1), "the summary"))
    model = FakeModel(ModelResponse(output=[]))
    call_model.run(view(Phase.CALL_MODEL, items=items), deps(model))
    summarised = model.requests[-1].items
    assert any(str(i.payload.get("content")).startswith("[Summary of") for i in summarised)
    assert len(summarised) < len(items)
    told = dataclasses.replace(
        view(Phase.CALL_MODEL, items=items), compaction_known=(len(items), -1)
    )
    call_model.run(told, deps(model))
    assert model.requests[-1].items == items


def test_a_window_per_model_wins_over_the_default_and_a_refusal_lowers_it() -> None:
    limits = PhaseLimits(context_tokens=8000, context_tokens_by_model={"GPT_4_1": 1000})
    own = context.window_for("openai:gpt-4.1", limits, {})
    assert own == context.Window(1000, "CHARLIE_MODEL_GPT_4_1_CONTEXT_TOKENS")
    assert context.window_for("openai:other", limits, {}) == context.Window(
        8000, "CHARLIE_MODEL_CONTEXT_TOKENS"
    )
    learned = context.window_for("openai:other", limits, {"context": {"window": 6000}})
    assert learned is not None and learned.tokens == 6000
    assert context.window_for("openai:other", PhaseLimits(), {}) is None


@pytest.mark.parametrize(
    ("message", "body", "limit", "sent"),
    [
        (
            "context length exceeded: HTTP 400 context_length_exceeded",
            '{"error": {"message": "This model\'s maximum context length is 8192 tokens. However,'
            ' your messages resulted in 9000 tokens.", "code": "context_length_exceeded"}}',
            8192,
            9000,
        ),
        (
            "context length exceeded: HTTP 400 invalid_request_error: prompt is too long: "
            "208000 tokens > 200000 maximum",
            "{}",
            200000,
            208000,
        ),
    ],
)
def test_the_providers_refusals_are_recognised(
    message: str, body: str, limit: int, sent: int
) -> None:
    found = context.refusal(ModelError(message, evidence={"status": 400, "body": body}))
    assert found == context.Refusal(limit, sent)
    assert context.refusal(ModelError("HTTP 401", evidence={"status": 401})) is None


def text(reply: str) -> ModelResponse:
    return ModelResponse([NewItem(ItemKind.MESSAGE, {"role": "assistant", "content": reply})])


def test_call_model_summarises_in_a_step_of_its_own_before_any_input_uses_it() -> None:
    model = FakeModel(text("what happened"))
    items = transcript(60)
    v = view(Phase.CALL_MODEL, items=items)
    v = type(v)(**{**v.__dict__, "turn": 60})
    moved = call_model.run(v, deps(model, context_tokens=5000))
    assert moved.to is Phase.CALL_MODEL and moved.model_calls == 1
    [item] = moved.items
    assert item.kind is ItemKind.COMPACTION and item.payload["content"] == "what happened"
    assert model.requests[0].tools == []  # the summary call: no tools


def test_call_model_learns_the_window_from_a_refusal() -> None:
    refusal = ModelError(
        "context length exceeded: HTTP 400",
        evidence={
            "status": 400,
            "body": "This model's maximum context length is 3000 tokens. However, your "
            "messages resulted in 12000 tokens. context_length_exceeded",
        },
    )
    v = view(Phase.CALL_MODEL, items=transcript(10))
    moved = call_model.run(v, deps(FakeModel(refusal)))
    assert moved.to is Phase.CALL_MODEL and not moved.items
    assert moved.state is not None
    learned: dict[str, Any] = moved.state["context"]
    assert learned["window"] == 3000 and learned["refusals"] == 1 and learned["ratio"] > 1
    # ...and a refusal again and again fails the run rather than looping
    again = view(Phase.CALL_MODEL, items=transcript(10), state={"context": {"refusals": 3}})
    with pytest.raises(ModelError, match="refused the input as too long"):
        call_model.run(again, deps(FakeModel(refusal)))


def test_the_providers_count_calibrates_the_estimate() -> None:
    plan = context.plan(transcript(3), 3, WINDOW, {})
    assert context.after_call(plan, Usage(input_tokens=plan.raw_tokens * 2))["ratio"] == 2.0


def test_a_refused_summary_call_summarises_less_and_fails_only_when_nothing_is_smaller() -> None:
    """A summary call refused for length with no number in the message (I29): the next summary
    call is sent less of the record, never a window of a token; the run fails only when the
    part to summarise cannot be smaller, saying so."""
    refusal = ModelError(
        "context length exceeded: HTTP 400",
        evidence={"status": 400, "body": "context length exceeded"},
    )
    v = view(Phase.CALL_MODEL, items=transcript(60))
    v = type(v)(**{**v.__dict__, "turn": 60})
    model = FakeModel(refusal)
    state: dict[str, Any] = {}
    sizes: list[int] = []
    with pytest.raises(ModelError, match="nothing smaller can be summarised"):
        for _ in range(40):
            v = type(v)(**{**v.__dict__, "state": state})
            moved = call_model.run(v, deps(model, context_tokens=5000))
            assert moved.to is Phase.CALL_MODEL and not moved.items
            assert moved.state is not None
            learned: dict[str, Any] = moved.state["context"]
            assert "window" not in learned  # the turn's window is not learned from a summary
            state = moved.state
            sizes.append(len(str(model.requests[-1].items[-1].payload["content"])))
    # each summary input smaller than the last, down to a part of the record of a few tokens
    record = str(model.requests[-1].items[-1].payload["content"]).split("summarise:\n")[-1]
    assert len(sizes) >= 3 and context.text_tokens(record) < 2 * context.MIN_SUMMARY_TOKENS
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    # ...and a model that takes the smaller input compacts, the run going on
    v = type(v)(**{**v.__dict__, "state": {"context": {"summary_tokens": 300}}})
    moved = call_model.run(v, deps(FakeModel(text("what happened")), context_tokens=5000))
    [item] = moved.items
    assert item.kind is ItemKind.COMPACTION and item.payload["content"] == "what happened"


def test_a_repeat_on_a_worker_with_other_settings_sends_the_same_input() -> None:
    """What planning takes from a worker's settings (the configured window, the tools offered)
    is recorded with the commit before the call (I29): a model call repeated after a crash on
    a worker with another window and more tools sends what the first attempt sent."""
    small = deps(FakeModel(text("ok")), context_tokens=5000)
    started = load_context.run(view(Phase.LOAD_CONTEXT), small)
    first = view(Phase.CALL_MODEL, items=transcript(12), state=started.state or {})
    first = type(first)(**{**first.__dict__, "turn": 12})
    small_model = FakeModel(text("ok"))
    call_model.run(first, deps(small_model, context_tokens=5000))
    # the repeat: another worker, a larger window and a tool the first one did not have
    large_model = FakeModel(text("ok"))
    large = deps(large_model, context_tokens=50000)
    large.tools.add(build_tool(lambda: None, name="extra"))
    again = type(first)(**{**first.__dict__, "attempts": 2})
    moved = call_model.run(again, large)
    [sent], [resent] = small_model.requests, large_model.requests
    assert resent.items == sent.items and any("elided" in str(i.payload) for i in sent.items)
    assert [t.name for t in resent.tools] == [t.name for t in sent.tools] == ["read", "wait"]
    # ...and its commit records its own settings for the next call
    assert moved.state is not None
    planned = moved.state["context"]["planned"]
    assert planned["window"][0] == 50000 and "extra" in planned["tools"]
