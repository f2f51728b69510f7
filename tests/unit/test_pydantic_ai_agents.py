"""The Pydantic AI adapter's mapping (charlie/agents/), against Pydantic AI's FunctionModel:
what the agent's model is sent, how its answer becomes Charlie's items and calls, how a tool
call runs through Pydantic AI and comes back as the part its model is shown (I34). No worker,
no database: a transcript is built by hand, as call_model would hand it over."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai import Agent, Choice, Choices, ModelRetry, RunContext
from pydantic_ai import messages as pm
from pydantic_ai.capabilities import ProcessEventStream, ProcessHistory
from pydantic_ai.exceptions import UnexpectedModelBehavior
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.test import TestModel
from pydantic_ai.output import NativeOutput, PromptedOutput, TextOutput, ToolOutput
from pydantic_ai.toolsets import AbstractToolset
from pydantic_ai.usage import UsageLimits

from charlie import agents
from charlie.agents import pydantic_ai as adapter
from charlie.domain import Effect, Item, ItemKind, NewItem
from charlie.models.base import ModelError, ModelRequest
from charlie.tools.context import ToolContext, ToolError
from charlie.tools.registry import ToolRegistry

pytestmark = pytest.mark.backend_free

HERE = "tests.unit.test_pydantic_ai_agents"


class Out(BaseModel):
    account: str
    cents: int


@dataclass
class Deps:
    who: str


def make_deps() -> Deps:
    return Deps(who="ana")


#: what the FunctionModel answers: set by each test; it records what it was sent
SCRIPT: list[pm.ModelResponse] = []
SEEN: list[tuple[list[pm.ModelMessage], AgentInfo]] = []


def scripted(messages: list[pm.ModelMessage], info: AgentInfo) -> pm.ModelResponse:
    SEEN.append((messages, info))
    return SCRIPT.pop(0)


agent = Agent(
    FunctionModel(scripted, model_name="fn"),
    output_type=Out,
    deps_type=Deps,
    instructions="be exact",
    model_settings={"temperature": 0.25},
)


@agent.system_prompt
def who(ctx: RunContext[Deps]) -> str:
    return f"working for {ctx.deps.who}"


@agent.tool_plain(metadata={"effect": "read"})
def lookup(account: str) -> str:
    return f"{account} owes 5"


@agent.tool(metadata={"reconcile": f"{HERE}:found_charge"})
def charge(ctx: RunContext[Deps], account: str, cents: int) -> str:
    if cents > 100:
        raise ModelRetry("at most 100 cents")
    return f"charged {cents} for {ctx.deps.who}"


def found_charge(account: str, cents: int) -> None:
    return None


@agent.tool_plain(requires_approval=True)
def refund(account: str) -> str:
    return f"refunded {account}"


@agent.output_validator
def positive(output: Out) -> Out:
    if output.cents < 0:
        raise ModelRetry("cents must not be negative")
    return output


plain = Agent(TestModel(custom_output_text="all done"), instructions="say it")


@pytest.fixture(autouse=True)
def _fresh() -> None:
    SCRIPT.clear()
    SEEN.clear()


def _model(ref: str = f"{HERE}:agent", deps: str | None = f"{HERE}:make_deps") -> Any:
    spec = agents.AgentSpec("function:fn", ref, deps).render()
    return agents.model_for(spec, ToolRegistry())


class Transcript:
    """Items as call_model hands them over: the prompt, then what each turn added."""

    def __init__(self, prompt: str) -> None:
        self.items: list[Item] = []
        self.turn = 0
        self.add(
            NewItem(ItemKind.INPUT, {"role": "system", "content": "Charlie's own"}),
            NewItem(ItemKind.INPUT, {"role": "user", "content": prompt}),
        )

    def add(self, *new: NewItem) -> None:
        for item in new:
            self.items.append(
                Item(len(self.items), self.turn, item.kind, item.call_id, item.payload)
            )

    def request(self) -> ModelRequest:
        return ModelRequest("t1", "t1:x", self.turn, list(self.items), [])


def _ctx(call_id: str, deps: str | None = f"{HERE}:make_deps") -> ToolContext:
    return ToolContext(
        task_id="t1",
        execution_id="t1:x",
        call_id=call_id,
        turn=0,
        workspace=Path("."),
        metadata={agents.METADATA_KEY: {"agent": f"{HERE}:agent", "deps": deps}},
        resumed=False,
        handle=None,
        _record_handle=lambda h: None,
    )


def _result(name: str, call_id: str, run: Callable[[], Any]) -> NewItem:
    """The tool_result item Charlie records for a call, as the executor makes it."""
    try:
        outcome, result = "ok", run()
    except ToolError as exc:
        outcome, result = "error", exc.as_result()
    content = result if isinstance(result, str) else json.dumps(result)
    return NewItem(
        ItemKind.TOOL_RESULT,
        {"name": name, "outcome": outcome, "result": result, "content": content},
        call_id=call_id,
    )


def test_submission_names_the_model_the_tools_and_maps_the_approve_list() -> None:
    made = agents.prepare_submission(f"{HERE}:agent", f"{HERE}:make_deps", ["charge"], {"k": 1})
    assert made.model == f"function:fn#agent={HERE}:agent&deps={HERE}:make_deps"
    assert agents.parse_spec(made.model) == agents.AgentSpec(
        "function:fn", f"{HERE}:agent", f"{HERE}:make_deps"
    )
    assert agents.base_model(made.model) == "function:fn"
    assert made.tools == sorted(
        f"{HERE}:agent.{n}"
        for n in ("lookup", "charge", "refund", "final_result", adapter.TEXT_OUTPUT)
    )
    assert made.approve == [f"{HERE}:agent.charge"]
    assert made.metadata == {
        "k": 1,
        agents.METADATA_KEY: {"agent": f"{HERE}:agent", "deps": f"{HERE}:make_deps"},
    }
    with pytest.raises(agents.AgentRefused, match=r"approve names tool.*nope"):
        agents.prepare_submission(f"{HERE}:agent", None, ["nope"], None)


def test_effects_reconcile_and_approval_come_from_the_tools_metadata() -> None:
    registry = ToolRegistry()
    assert agents.find_tool(registry, f"{HERE}:agent.lookup")
    get = registry.get_registered
    lookup_def, charge_def = get(f"{HERE}:agent.lookup"), get(f"{HERE}:agent.charge")
    refund_def, output_def = get(f"{HERE}:agent.refund"), get(f"{HERE}:agent.final_result")
    assert lookup_def and charge_def and refund_def and output_def
    assert lookup_def.effect is Effect.READ
    assert charge_def.effect is Effect.WRITE  # unmarked: a write
    assert charge_def.reconcile is not None and lookup_def.reconcile is None
    assert refund_def.approval and not charge_def.approval
    assert output_def.effect is Effect.READ
    assert charge_def.implementation == f"{HERE}:agent:charge"


class Opaque(AbstractToolset[Any]):
    @property
    def id(self) -> str:
        return "opaque-server"

    async def get_tools(self, ctx: Any) -> dict[str, Any]:
        return {}

    async def call_tool(self, name: str, tool_args: Any, ctx: Any, tool: Any) -> Any:
        return None


async def _handler(ctx: Any, events: Any) -> None:
    return None


def divide(a: int, b: int) -> float:
    return a / b


def shout(text: str) -> str:
    return text.upper()


with_toolset = Agent(TestModel(), toolsets=[Opaque()])


def _keep(messages: list[pm.ModelMessage]) -> list[pm.ModelMessage]:
    return messages


with_handler = Agent(TestModel(), capabilities=[ProcessEventStream(_handler)])
with_history = Agent(TestModel(), capabilities=[ProcessHistory(_keep)])
with_output_function = Agent(TestModel(), output_type=divide)
# output functions wherever an output spec can hold one: Pydantic AI calls each while it
# validates an output, unrecorded
with_tool_output_function = Agent(TestModel(), output_type=ToolOutput(divide, name="div"))
with_listed_output_function = Agent(TestModel(), output_type=[Out, divide])
with_text_output_function = Agent(TestModel(), output_type=TextOutput(shout))
with_native_output_function = Agent(TestModel(), output_type=NativeOutput(divide))
with_prompted_output_function = Agent(TestModel(), output_type=PromptedOutput([Out, divide]))
with_choice_actions = Agent(
    TestModel(), output_type=Choices({"go": Choice("go on", value=lambda: "went")}, name="Step")
)
# what an output spec holds that is no function: types it validates (each may run)
with_native_output = Agent(TestModel(), output_type=NativeOutput(Out))
with_choices = Agent(TestModel(), output_type=Choices({"a": Choice("one", value=1), "b": "two"}))
not_an_agent = object()


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("with_toolset", "toolset Opaque 'opaque-server'"),
        ("with_handler", "capability ProcessEventStream"),
        ("with_history", "capability ProcessHistory"),
        ("with_output_function", "output function 'divide'"),
        ("with_tool_output_function", "output function 'divide'"),
        ("with_listed_output_function", "output function 'divide'"),
        ("with_text_output_function", "output function 'shout'"),
        ("with_native_output_function", "output function 'divide'"),
        ("with_prompted_output_function", "output function 'divide'"),
        ("with_choice_actions", "output function 'Step (a Choices set whose values are actions)'"),
        ("not_an_agent", "not a pydantic_ai.Agent"),
        ("missing", "has no 'missing'"),
    ],
)
def test_what_cannot_be_made_durable_is_refused_by_name(name: str, says: str) -> None:
    with pytest.raises(agents.AgentRefused, match=re.escape(says)):
        agents.prepare_submission(f"{HERE}:{name}", None, None, None)


@pytest.mark.parametrize("name", ["with_native_output", "with_choices", "agent", "plain"])
def test_an_output_spec_of_types_only_is_not_refused(name: str) -> None:
    assert adapter.refusals(getattr(sys.modules[HERE], name)) == []


def test_the_private_names_of_pydantic_ai_the_adapter_reads_are_checked(monkeypatch) -> None:
    """The adapter reads the names of an agent's output tools from names Pydantic AI keeps
    private (no public API gives them without a run): a release that renames one fails the
    import-time check by name."""
    assert adapter.private_names_missing() == []

    class Renamed(Agent[Any, Any]):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            del self._output_toolset

    monkeypatch.setattr(adapter, "Agent", Renamed)
    assert adapter.private_names_missing() == ["Agent._output_toolset"]


def test_a_turn_sends_what_agent_run_would_and_maps_calls_to_charlie_names() -> None:
    model = _model()
    t = Transcript("settle acme")
    SCRIPT.append(
        pm.ModelResponse(
            parts=[
                pm.TextPart("looking"),
                pm.ToolCallPart("lookup", {"account": "acme"}, "c1"),
                pm.ToolCallPart("charge", '{"account": "acme", "cents": 5}', "c2"),
            ],
            usage=pm.RequestUsage(input_tokens=11, output_tokens=3),
        )
    )
    response = model.complete(t.request())
    messages, info = SEEN[0]
    first = messages[0]
    assert isinstance(first, pm.ModelRequest)
    # the agent's own system prompt (given RunContext and the deps), never Charlie's
    assert [p.content for p in first.parts if isinstance(p, pm.SystemPromptPart)] == [
        "working for ana"
    ]
    assert [p.content for p in first.parts if isinstance(p, pm.UserPromptPart)] == ["settle acme"]
    assert info.instructions == "be exact"
    assert info.model_settings is not None and info.model_settings.get("temperature") == 0.25
    assert sorted(t.name for t in info.function_tools) == ["charge", "lookup", "refund"]
    assert [t.name for t in info.output_tools] == ["final_result"]
    assert [(i.kind, i.payload.get("name")) for i in response.output] == [
        (ItemKind.MESSAGE, None),
        (ItemKind.TOOL_CALL, f"{HERE}:agent.lookup"),
        (ItemKind.TOOL_CALL, f"{HERE}:agent.charge"),
    ]
    assert response.output[2].payload["arguments"] == {"account": "acme", "cents": 5}
    assert response.usage.input_tokens == 11 and response.usage.output_tokens == 3


def test_tool_calls_run_through_pydantic_ai_and_the_model_sees_its_parts() -> None:
    registry = ToolRegistry()
    agents.find_tool(registry, f"{HERE}:agent.lookup")
    model = _model()
    t = Transcript("settle acme")
    SCRIPT.append(
        pm.ModelResponse(
            parts=[
                pm.ToolCallPart("lookup", {"account": "acme"}, "c1"),
                pm.ToolCallPart("charge", {"account": "acme", "cents": 500}, "c2"),
            ]
        )
    )
    t.add(*model.complete(t.request()).output)
    t.turn = 1

    def call(name: str, call_id: str, args: dict[str, Any]) -> Any:
        definition = registry.get_registered(f"{HERE}:agent.{name}")
        assert definition is not None
        return definition.handler(**args, _charlie_ctx=_ctx(call_id))

    ok = _result(f"{HERE}:agent.lookup", "c1", lambda: call("lookup", "c1", {"account": "acme"}))
    assert ok.payload["result"] == "acme owes 5"
    retried = _result(
        f"{HERE}:agent.charge",
        "c2",
        lambda: call("charge", "c2", {"account": "acme", "cents": 500}),
    )
    assert retried.payload["outcome"] == "error"  # ModelRetry: a retry part, not a run's end
    assert retried.payload["result"]["error"] == "at most 100 cents"
    t.add(ok, retried)
    SCRIPT.append(pm.ModelResponse(parts=[pm.ToolCallPart("lookup", {"account": "b"}, "c3")]))
    model.complete(t.request())
    sent = SEEN[-1][0][-1]
    assert isinstance(sent, pm.ModelRequest)
    returned = {getattr(p, "tool_call_id", None): p for p in sent.parts}
    assert returned["c1"].content == "acme owes 5"
    assert getattr(returned["c2"], "outcome", None) == "retried"
    assert returned["c2"].content == "at most 100 cents"
    # the tool with RunContext gets the deps the task's factory built
    assert call("charge", "c4", {"account": "acme", "cents": 5}) == "charged 5 for ana"
    # an approved call of a requires_approval tool runs
    assert call("refund", "c5", {"account": "acme"}) == "refunded acme"
    # arguments Pydantic AI does not accept: a validation retry, as agent.run would send
    with pytest.raises(ToolError) as bad:
        call("charge", "c6", {"account": "acme"})
    assert bad.value.details["pydantic_ai_part"]["retry"]["cause"] == "validation_error"


def test_a_valid_output_ends_the_run_with_it_as_json() -> None:
    model = _model()
    t = Transcript("settle acme")
    SCRIPT.append(
        pm.ModelResponse(
            parts=[pm.ToolCallPart("final_result", {"account": "acme", "cents": 7}, "f")]
        )
    )
    response = model.complete(t.request())
    assert response.tool_calls == []
    assert json.loads(response.output[-1].payload["content"]) == {"account": "acme", "cents": 7}


def test_an_output_its_validator_refuses_is_a_call_whose_retry_the_model_sees() -> None:
    registry = ToolRegistry()
    agents.find_tool(registry, f"{HERE}:agent.final_result")
    model = _model()
    t = Transcript("settle acme")
    SCRIPT.append(
        pm.ModelResponse(
            parts=[pm.ToolCallPart("final_result", {"account": "acme", "cents": -1}, "f1")]
        )
    )
    response = model.complete(t.request())
    assert [c.payload["name"] for c in response.tool_calls] == [f"{HERE}:agent.final_result"]
    t.add(*response.output)
    t.turn = 1
    definition = registry.get_registered(f"{HERE}:agent.final_result")
    assert definition is not None
    result = _result(
        definition.name,
        "f1",
        lambda: definition.handler(account="acme", cents=-1, _charlie_ctx=_ctx("f1")),
    )
    assert result.payload["result"]["error"] == "cents must not be negative"
    t.add(result)
    SCRIPT.append(
        pm.ModelResponse(
            parts=[pm.ToolCallPart("final_result", {"account": "acme", "cents": 3}, "f2")]
        )
    )
    final = model.complete(t.request())
    assert json.loads(final.output[-1].payload["content"])["cents"] == 3
    # a second refusal past the output's retries (1) ends the run, as agent.run ends
    t.turn = 2
    t.add(*response.output)
    t.add(result)
    with pytest.raises(ModelError, match="exceeded max retries count of 1"):
        model.complete(t.request())


def test_a_text_agent_ends_with_its_text() -> None:
    spec = agents.AgentSpec("test:test", f"{HERE}:plain", None).render()
    model = agents.model_for(spec, ToolRegistry())
    response = model.complete(Transcript("hi").request())
    assert response.output[-1].payload["content"] == "all done"


def test_the_registry_finds_an_agents_tools_by_name_and_nothing_else() -> None:
    registry = ToolRegistry()
    registry.add_finder(agents.find_tool)
    assert registry.find("no_such_tool") is None
    assert registry.find(f"{HERE}:nothing.tool") is None
    # a name a model chose is looked up with get(), which imports nothing
    assert registry.get(f"{HERE}:agent.lookup") is None
    found = registry.find(f"{HERE}:agent.lookup")
    assert found is not None and found.source == f"agent:{HERE}:agent"
    assert [d.name for d in registry.enabled([f"{HERE}:agent.charge", "gone"])] == [
        f"{HERE}:agent.charge"
    ]
    assert adapter.load(f"{HERE}:agent") is adapter.load(f"{HERE}:agent")


async def _stream(messages: list[pm.ModelMessage], info: AgentInfo) -> Any:
    for piece in ("all ", "settled"):
        yield piece


streamer = Agent(FunctionModel(stream_function=_stream), instructions="say it")


class Watched:
    def __init__(self) -> None:
        self.texts: list[str] = []

    def text(self, delta: str) -> None:
        self.texts.append(delta)

    def reasoning(self, delta: str) -> None:
        pass

    def tool_call(self, call_id: str, name: str | None, arguments_delta: str) -> None:
        pass

    def restart(self, reason: str) -> None:
        pass


def test_people_watching_see_the_agents_text_as_it_streams_and_the_answer_is_whole() -> None:
    spec = agents.AgentSpec("function:x", f"{HERE}:streamer", None).render()
    model = agents.model_for(spec, ToolRegistry())
    watched = Watched()
    request = replace(Transcript("hi").request(), deltas=watched)
    response = model.complete(request)
    assert "".join(watched.texts) == "all settled"
    assert response.output[-1].payload["content"] == "all settled"


def test_a_text_the_output_refuses_is_recorded_and_the_model_is_told_as_agent_run_tells_it() -> (
    None
):
    registry = ToolRegistry()
    agents.find_tool(registry, f"{HERE}:agent.lookup")
    model = _model()
    t = Transcript("settle acme")
    SCRIPT.append(pm.ModelResponse(parts=[pm.TextPart("it is settled")]))
    response = model.complete(t.request())
    [call] = response.tool_calls
    assert call.payload["name"] == f"{HERE}:agent.{adapter.TEXT_OUTPUT}"
    assert call.payload["arguments"] == {"text": "it is settled"}
    t.add(*response.output)
    t.turn = 1
    definition = registry.get_registered(call.payload["name"])
    assert definition is not None
    refused = _result(
        definition.name,
        call.call_id or "",
        lambda: definition.handler(text="it is settled", _charlie_ctx=_ctx("x")),
    )
    assert refused.payload["outcome"] == "error"
    t.add(refused)
    SCRIPT.append(
        pm.ModelResponse(parts=[pm.ToolCallPart("final_result", {"account": "a", "cents": 1}, "f")])
    )
    final = model.complete(t.request())
    assert json.loads(final.output[-1].payload["content"]) == {"account": "a", "cents": 1}
    sent = SEEN[-1][0]
    # the model saw its text, then Pydantic AI's own feedback; never a call it did not make
    assert isinstance(sent[-2], pm.ModelResponse)
    assert [type(p) for p in sent[-2].parts] == [pm.TextPart]
    feedback = sent[-1].parts[-1]
    assert isinstance(feedback, pm.UserPromptPart) and "validation" in str(feedback.content)
    # refused again, past the output's retries (1): the task ends as agent.run ends
    t.turn = 2
    t.add(*response.output)
    t.add(refused)
    with pytest.raises(ModelError, match="Exceeded maximum output retries"):
        model.complete(t.request())


patient = Agent(FunctionModel(scripted, model_name="fn"), output_type=Out, retries={"output": 2})


def test_a_text_refused_past_the_outputs_own_retry_budget_ends_the_task_as_agent_run_ends() -> None:
    """The output's retry budget (here 2, not the default 1) is Pydantic AI's own, read from
    the feedback part it gave each refused text (``RetryInfo.max_retries``): the task ends at
    the request where agent.run ends, with its message."""
    texts = [pm.ModelResponse(parts=[pm.TextPart(f"settled {n}")]) for n in range(4)]
    SCRIPT[:] = list(texts)
    with pytest.raises(UnexpectedModelBehavior, match=r"Exceeded maximum output retries \(2\)"):
        patient.run_sync("settle acme")
    sent_by_run = len(SEEN)
    assert sent_by_run == 3

    SCRIPT[:] = list(texts)
    SEEN.clear()
    registry = ToolRegistry()
    agents.find_tool(registry, f"{HERE}:patient.{adapter.TEXT_OUTPUT}")
    model = _model(f"{HERE}:patient", deps=None)
    definition = registry.get_registered(f"{HERE}:patient.{adapter.TEXT_OUTPUT}")
    assert definition is not None
    t = Transcript("settle acme")
    with pytest.raises(ModelError, match=r"Exceeded maximum output retries \(2\)"):
        for turn in range(4):
            t.turn = turn
            response = model.complete(t.request())
            [call] = response.tool_calls
            t.add(*response.output)
            text = call.payload["arguments"]["text"]
            refused = _result(
                definition.name,
                call.call_id or "",
                lambda text=text: definition.handler(text=text, _charlie_ctx=_ctx("x", deps=None)),
            )
            assert refused.payload["outcome"] == "error"
            # Pydantic AI's feedback part, as a run keeps it, with the budget it checked
            [part] = refused.payload["result"]["pydantic_ai_parts"]
            assert part["part_kind"] == "retry-feedback" and part["retry"]["max_retries"] == 2
            t.add(refused)
    assert len(SEEN) == sent_by_run  # the request past the budget is never sent


no_model_here = Agent("nonexistent-provider:model", defer_model_check=True)


def test_an_agent_whose_model_cannot_be_made_is_refused_and_a_tool_module_still_loads() -> None:
    with pytest.raises(agents.AgentRefused, match="its model cannot be made here"):
        agents.prepare_submission(f"{HERE}:no_model_here", None, None, None)
    registry = ToolRegistry()
    import sys

    agents.register_module_agents(sys.modules[HERE], registry)  # a worker's start: no raise
    assert registry.get_registered(f"{HERE}:agent.lookup") is not None


def test_an_agent_tasks_spec_is_priced_limited_and_windowed_as_its_model() -> None:
    from charlie import limits, pricing
    from charlie.executor import context
    from charlie.ports import PhaseLimits

    spec = agents.AgentSpec("openai:gpt-4.1", f"{HERE}:agent", f"{HERE}:make_deps").render()
    prices = pricing.parse_prices('{"openai:gpt-4.1": {"input": 2, "output": 8}}')
    assert pricing.price_for(spec, prices) == pricing.price_for("openai:gpt-4.1", prices)
    assert pricing.price_for(spec, prices) is not None
    table = limits.parse_limits('{"openai:gpt-4.1": {"concurrency": 2}}')
    assert limits.limit_for(spec, table) == limits.limit_for("openai:gpt-4.1", table)
    assert limits.limit_for(spec, table) is not None
    own = PhaseLimits(context_tokens_by_model={"GPT_4_1": 5000})
    window = context.window_for(spec, own, {})
    assert window is not None and window.tokens == 5000


# -- usage limits --------------------------------------------------------------------------------


def _limited(**limits: int) -> Any:
    made = agents.prepare_submission(
        f"{HERE}:agent", f"{HERE}:make_deps", None, None, UsageLimits(**limits)
    )
    return agents.model_for(made.model, ToolRegistry())


def test_usage_limits_ride_in_the_spec_and_what_a_task_cannot_enforce_is_refused() -> None:
    made = agents.prepare_submission(
        f"{HERE}:agent", None, None, None, {"request_limit": 3, "tool_calls_limit": 2}
    )
    assert made.model.endswith("&usage_limits=request_limit:3,tool_calls_limit:2")
    assert agents.parse_spec(made.model).usage_limits == (
        ("request_limit", 3),
        ("tool_calls_limit", 2),
    )
    same = agents.prepare_submission(
        f"{HERE}:agent", None, None, None, UsageLimits(request_limit=3, tool_calls_limit=2)
    )
    assert same.model == made.model
    with pytest.raises(agents.AgentRefused, match="cost_limit"):
        agents.prepare_submission(f"{HERE}:agent", None, None, None, UsageLimits(cost_limit=1.0))
    with pytest.raises(agents.AgentRefused, match="whole number"):
        agents.prepare_submission(f"{HERE}:agent", None, None, None, {"request_limit": -1})


def test_request_limit_is_checked_before_each_request_from_the_transcript() -> None:
    t = Transcript("settle acme")
    SCRIPT.append(pm.ModelResponse(parts=[pm.ToolCallPart("lookup", {"account": "acme"}, "c1")]))
    t.add(*_limited(request_limit=1).complete(t.request()).output)
    t.turn = 1
    t.add(_result(f"{HERE}:agent.lookup", "c1", lambda: "acme owes 5"))
    SCRIPT.append(pm.ModelResponse(parts=[pm.TextPart("never sent")]))
    # a fresh model, as another worker after a crash: the count is the transcript's
    with pytest.raises(ModelError, match=r"UsageLimitExceeded: .*request_limit of 1"):
        _limited(request_limit=1).complete(t.request())
    assert len(SEEN) == 1 and len(SCRIPT) == 1  # the second request was never sent


def test_tool_calls_limit_is_checked_before_the_calls_are_planned() -> None:
    t = Transcript("settle acme")
    SCRIPT.append(pm.ModelResponse(parts=[pm.ToolCallPart("lookup", {"account": "a"}, "c1")]))
    t.add(*_limited(tool_calls_limit=2).complete(t.request()).output)
    t.turn = 1
    t.add(_result(f"{HERE}:agent.lookup", "c1", lambda: "a owes 5"))
    SCRIPT.append(
        pm.ModelResponse(
            parts=[
                pm.ToolCallPart("lookup", {"account": "b"}, "c2"),
                pm.ToolCallPart("lookup", {"account": "c"}, "c3"),
            ]
        )
    )
    with pytest.raises(ModelError, match=r"tool_calls_limit of 2 \(tool_calls=3\)"):
        _limited(tool_calls_limit=2).complete(t.request())


def test_token_limits_are_checked_after_each_answer_as_agent_run_checks_them() -> None:
    t = Transcript("settle acme")
    SCRIPT.append(
        pm.ModelResponse(
            parts=[pm.ToolCallPart("lookup", {"account": "a"}, "c1")],
            usage=pm.RequestUsage(input_tokens=10, output_tokens=4),
        )
    )
    t.add(*_limited(total_tokens_limit=20).complete(t.request()).output)
    t.turn = 1
    t.add(_result(f"{HERE}:agent.lookup", "c1", lambda: "a owes 5"))
    SCRIPT.append(
        pm.ModelResponse(
            parts=[pm.ToolCallPart("final_result", {"account": "a", "cents": 5}, "c2")],
            usage=pm.RequestUsage(input_tokens=5, output_tokens=2),
        )
    )
    with pytest.raises(ModelError, match=r"Exceeded the total_tokens_limit of 20"):
        _limited(total_tokens_limit=20).complete(t.request())


# -- RunContext inside a tool --------------------------------------------------------------------

watched = Agent(FunctionModel(scripted, model_name="fn"), output_type=Out)
#: what ``probe`` saw of its RunContext, one (retry, messages) per run
PROBED: list[tuple[int, list[pm.ModelMessage]]] = []


@watched.tool(retries=2, metadata={"effect": "read"})
def probe(ctx: RunContext[None], n: int) -> str:
    PROBED.append((ctx.retry, list(ctx.messages)))
    if n < 0:
        raise ModelRetry(f"n={n} is negative")
    return f"n={n}"


@dataclass
class Recorded:
    """The Record port over a hand-built transcript, as the worker's reads the run's."""

    transcript: Transcript

    def result_of(self, execution_id: str, call_id: str) -> Any:
        return None

    def items(self, execution_id: str) -> list[Item]:
        return list(self.transcript.items)


def _probe_turn(model: Any, t: Transcript, registry: ToolRegistry, call_id: str, n: int) -> Any:
    """The model calls probe(n); Charlie runs the call from the transcript; its result is added."""
    SCRIPT.append(pm.ModelResponse(parts=[pm.ToolCallPart("probe", {"n": n}, call_id)]))
    t.add(*model.complete(t.request()).output)
    t.turn += 1
    definition = registry.get_registered(f"{HERE}:watched.probe")
    assert definition is not None
    ctx = replace(_ctx(call_id, deps=None), record=Recorded(t))
    result = _result(
        f"{HERE}:watched.probe", call_id, lambda: definition.handler(n=n, _charlie_ctx=ctx)
    )
    t.add(result)
    return result


def test_a_tools_run_context_has_its_retry_count_and_the_messages_so_far() -> None:
    PROBED.clear()
    registry = ToolRegistry()
    agents.find_tool(registry, f"{HERE}:watched.probe")
    model = _model(f"{HERE}:watched", deps=None)
    t = Transcript("probe it")
    _probe_turn(model, t, registry, "c1", -1)
    _probe_turn(model, t, registry, "c2", -2)
    assert _probe_turn(model, t, registry, "c3", 3).payload["result"] == "n=3"
    # Pydantic AI's count: the tool failed in the two steps before, as agent.run counts it
    assert [retry for retry, _ in PROBED] == [0, 1, 2]
    _, messages = PROBED[-1]
    first = messages[0]
    assert isinstance(first, pm.ModelRequest)
    assert [p.content for p in first.parts if isinstance(p, pm.UserPromptPart)] == ["probe it"]
    last = messages[-1]
    assert isinstance(last, pm.ModelResponse)
    assert [
        (p.tool_name, p.tool_call_id) for p in last.parts if isinstance(p, pm.ToolCallPart)
    ] == [("probe", "c3")]
    shown = [
        p
        for m in messages
        if isinstance(m, pm.ModelRequest)
        for p in m.parts
        if getattr(p, "tool_call_id", None) in ("c1", "c2")
    ]
    assert [getattr(p, "outcome", None) for p in shown] == ["retried", "retried"]
    assert len(messages) == 6  # prompt, call, retry, call, retry, this call


def test_a_tool_past_its_retries_ends_the_task_as_agent_run_ends() -> None:
    PROBED.clear()
    registry = ToolRegistry()
    agents.find_tool(registry, f"{HERE}:watched.probe")
    model = _model(f"{HERE}:watched", deps=None)
    t = Transcript("probe it")
    for n, call_id in enumerate(("c1", "c2", "c3")):
        assert _probe_turn(model, t, registry, call_id, -1 - n).payload["outcome"] == "error"
    assert [retry for retry, _ in PROBED] == [0, 1, 2]
    SCRIPT.append(pm.ModelResponse(parts=[pm.TextPart("never sent")]))
    with pytest.raises(ModelError, match=r"probe.*exceeded max retries count of 2"):
        model.complete(t.request())
    assert len(SCRIPT) == 1


RAN: list[str] = []


def _ending(strategy: Any) -> Agent[None, Out]:
    made = Agent(FunctionModel(scripted, model_name="fn"), output_type=Out, end_strategy=strategy)

    @made.tool_plain(metadata={"effect": "read"})
    def note(account: str) -> str:
        RAN.append(account)
        return f"noted {account}"

    @made.output_validator
    def known(output: Out) -> Out:
        if output.account != "acme":
            raise ModelRetry("unknown account")
        return output

    return made


early = _ending("early")
exhaustive = _ending("exhaustive")


def _charging(strategy: str) -> Agent[None, Out]:
    made = Agent(FunctionModel(scripted, model_name="fn"), output_type=Out, end_strategy=strategy)

    @made.tool_plain(metadata={"effect": "write"})
    def charge(account: str, cents: int) -> str:
        if cents > 100:
            raise ModelRetry("at most 100 cents")
        return f"charged {cents}"

    return made


graceful_charge = _charging("graceful")
exhaustive_charge = _charging("exhaustive")


def _note_and_output(ref: str, account: str) -> tuple[Any, Transcript, Any]:
    """The model answers note() and the output in one response; Charlie runs both calls from
    the transcript, as the executor does; the note's recorded result is returned."""
    registry = ToolRegistry()
    agents.find_tool(registry, f"{HERE}:{ref}.note")
    model = _model(f"{HERE}:{ref}", deps=None)
    t = Transcript("settle")
    SCRIPT.append(
        pm.ModelResponse(
            parts=[
                pm.ToolCallPart("note", {"account": account}, "n"),
                pm.ToolCallPart("final_result", {"account": account, "cents": 1}, "f"),
            ]
        )
    )
    t.add(*model.complete(t.request()).output)
    t.turn = 1
    results = []
    for name, call_id, args in (
        ("note", "n", {"account": account}),
        ("final_result", "f", {"account": account, "cents": 1}),
    ):
        definition = registry.get_registered(f"{HERE}:{ref}.{name}")
        assert definition is not None
        ctx = replace(_ctx(call_id, deps=None), record=Recorded(t))
        results.append(
            _result(
                f"{HERE}:{ref}.{name}",
                call_id,
                lambda d=definition, c=ctx, a=args: d.handler(**a, _charlie_ctx=c),
            )
        )
    t.add(*results)
    return model, t, results[0]


def test_end_strategy_early_runs_no_function_tool_beside_a_valid_output() -> None:
    """As agent.run with end_strategy="early": the answer's valid output ends the run; its
    function call never runs and gets Pydantic AI's own "not executed" part; with an output
    its validator refuses, the function call runs so the model can correct."""
    RAN.clear()
    model, t, note = _note_and_output("early", "acme")
    assert RAN == []
    assert note.payload["outcome"] == "ok" and "not executed" in note.payload["result"]
    done = model.complete(t.request())
    assert json.loads(done.output[-1].payload["content"]) == {"account": "acme", "cents": 1}
    _, _, note = _note_and_output("early", "other")
    assert RAN == ["other"] and note.payload["result"] == "noted other"


def test_end_strategy_exhaustive_runs_every_function_tool_beside_a_valid_output() -> None:
    RAN.clear()
    model, t, note = _note_and_output("exhaustive", "acme")
    assert RAN == ["acme"] and note.payload["result"] == "noted acme"
    done = model.complete(t.request())
    assert json.loads(done.output[-1].payload["content"]) == {"account": "acme", "cents": 1}


def _parts_shown(messages: list[pm.ModelMessage]) -> list[tuple[str, str, str]]:
    """The tool parts of the last request a model was sent: (kind, call id, what it reads)."""
    last = messages[-1]
    assert isinstance(last, pm.ModelRequest)
    shown = []
    for part in last.parts:
        call_id = getattr(part, "tool_call_id", None)
        if call_id is None:
            continue
        text = part.model_response() if hasattr(part, "model_response") else str(part.content)
        shown.append((type(part).__name__, call_id, text))
    return shown


@pytest.mark.parametrize("strategy", ["graceful", "exhaustive"])
def test_a_function_tools_retry_beside_a_valid_output_goes_on_as_agent_run_goes_on(
    strategy: str,
) -> None:
    """Under "graceful" (the default) and "exhaustive", Pydantic AI's retry-wins: a function
    tool's ModelRetry in the answer that holds a valid output call keeps that output from
    ending the run; the model is shown the retry and, for the output call, that it was not
    used. The same script through agent.run and through the Charlie task: the same requests,
    the same parts shown, the same output."""
    ref = f"{HERE}:{strategy}_charge"
    ending: Agent[Any, Out] = getattr(sys.modules[HERE], f"{strategy}_charge")
    both = pm.ModelResponse(
        parts=[
            pm.ToolCallPart("charge", {"account": "a", "cents": 500}, "c"),
            pm.ToolCallPart("final_result", {"account": "a", "cents": 1}, "f"),
        ]
    )
    again = pm.ModelResponse(
        parts=[pm.ToolCallPart("final_result", {"account": "a", "cents": 2}, "g")]
    )
    SCRIPT[:] = [both, again]
    assert ending.run_sync("settle").output == Out(account="a", cents=2)
    assert len(SEEN) == 2
    by_run = _parts_shown(SEEN[1][0])
    assert [(kind, call_id) for kind, call_id, _ in by_run] == [
        ("ToolReturnPart", "c"),
        ("ToolReturnPart", "f"),
    ]
    assert "at most 100 cents" in by_run[0][2]
    assert by_run[1][2].startswith("Output not used as the final result")

    SCRIPT[:] = [both, again]
    SEEN.clear()
    registry = ToolRegistry()
    agents.find_tool(registry, f"{ref}.charge")
    model = _model(ref, deps=None)
    t = Transcript("settle")
    t.add(*model.complete(t.request()).output)
    t.turn = 1
    results = []
    for name, call_id, args in (
        ("charge", "c", {"account": "a", "cents": 500}),
        ("final_result", "f", {"account": "a", "cents": 1}),
    ):
        definition = registry.get_registered(f"{ref}.{name}")
        assert definition is not None
        ctx = replace(_ctx(call_id, deps=None), record=Recorded(t))
        ctx.metadata[agents.METADATA_KEY]["agent"] = ref
        results.append(
            _result(
                f"{ref}.{name}",
                call_id,
                lambda d=definition, c=ctx, a=args: d.handler(**a, _charlie_ctx=c),
            )
        )
    t.add(*results)
    t.turn = 2
    second = model.complete(t.request())
    assert len(SEEN) == 2, "the task ended with the output agent.run set aside"
    assert _parts_shown(SEEN[1][0]) == by_run
    assert json.loads(second.output[-1].payload["content"]) == {"account": "a", "cents": 2}


class _Holder:
    """An agent reached through a dotted reference (``module:holder.agent``) whose tool's own
    name holds a dot, as an MCP server's tools may (``fs.read``)."""

    agent = Agent(TestModel(), name="dotted")


@_Holder.agent.tool_plain(name="fs.read", metadata={"effect": "read"})
def _fs_read(path: str) -> str:
    return path


def test_a_tool_is_found_when_its_name_and_its_agents_reference_both_hold_dots() -> None:
    # (a take-over in a fresh worker finds an agent's tool by this name alone, I10)
    registry = ToolRegistry()
    name = f"{HERE}:_Holder.agent.fs.read"
    assert agents.find_tool(registry, name)
    found = registry.get_registered(name)
    assert found is not None and found.effect is Effect.READ
    assert not agents.find_tool(registry, f"{HERE}:_Holder.agent.fs.nothing")
