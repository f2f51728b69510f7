"""MCP tools as Charlie tools: names, effects, and how one call runs.

Every tool a configured server lists is registered as ``mcp__SERVER__TOOL``, with the server's
description and input schema (what the model is shown and what arguments are validated
against). The model-facing name keeps to what model APIs accept for a function name
(``[A-Za-z0-9_-]``, at most 64 characters): a tool name with other characters, or too long to
fit, has them replaced by ``_``, is cut to fit and gets ``_`` plus the first 8 hex digits of the
SHA-256 of its real name, so the name is the same in every process and two tools do not meet
on one name. The implementation a call records is ``mcp:SERVER:TOOL``, with
the real names.

Recovery comes from what the server says and what the operator decides: a tool is a
``read`` when its ``readOnlyHint`` says so, otherwise a ``write``; the configuration overrides
that, per server and per tool (``effect``, ``approval``, ``on_interrupt``, ``deadline``), and
``ignore_hints`` makes every tool of a server a write unless overridden. Either way the tool is
never resumable by itself: a call found started without a result after a crash is
``interrupted`` (or held, ``on_interrupt="hold"``), never sent again (I10). It becomes a
resumable wait only once its work has an identity outside the worker (I20):

- the server answers the call with a **task** (the tasks extension): its id is recorded as the
  call's handle (``task:ID``) and the call parks; any worker polls ``tasks/get`` with that id,
  after a crash too; the task's end is the call's result;
- the server needs **input** (``input_required``, a form elicitation; in a task, its
  ``inputRequests``): the call parks asking a person (``charlie reply``), and goes on with the
  answer (a ``tools/call`` retry carrying it, or ``tasks/update``). Before sending an answer the
  call records that it does (handle ``input:ROUND``), so an attempt after a crash that finds it
  knows the answer may have been acted on, and reports the call ``interrupted``.

Failures: no session (the server is down, refused, did not start) is a tool error
saying the call was not sent; a call whose connection died or that timed out is
``interrupted`` for a write (what the server did is unknown) and a tool error for a read; an
error the server answered is a tool error, and so is an answer too large to read (it says the
call ran and its answer was dropped). Nothing any of these show contains a configured
secret (config.McpConfig.scrub).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema
import mcp_types

from charlie import faults
from charlie.domain import JSON, Effect, OnInterrupt
from charlie.mcp.config import McpConfig, ServerConfig
from charlie.mcp.connections import (
    MAX_MESSAGE_BYTES,
    Abandoned,
    Connections,
    CreatedTask,
    Lost,
    McpFailure,
    Refused,
    TooLarge,
    Unavailable,
    connections,
)
from charlie.tools.context import (
    AskPerson,
    Interrupted,
    LeaseLost,
    Pending,
    ToolContext,
    ToolError,
)
from charlie.tools.registry import ToolDef, ToolRegistry

log = logging.getLogger("charlie.mcp")

PREFIX = "mcp__"
SEPARATOR = "__"
MAX_NAME = 64
SAFE = re.compile(r"^[A-Za-z0-9_-]+$")
#: the keyword a handler takes its context by (not a name an MCP schema is likely to use).
CONTEXT_PARAM = "_charlie_ctx"
#: how often a parked task is polled at most / at least (seconds), whatever it suggests.
MIN_POLL, MAX_POLL = 0.5, 30.0
#: rounds of input a call answers by itself (roots) before it gives up.
MAX_AUTO_ROUNDS = 5
MAX_HANDLE = 200

HANDLE = re.compile(r"^task(?:\+(?P<seen>[0-9a-f]{8}))?:(?P<id>.+)$")


def tool_name(server: str, tool: str) -> str:
    """The Charlie name of ``server``'s tool ``tool``: ``mcp__SERVER__TOOL``, kept to what
    model APIs accept as a function name (see the module's docstring)."""
    prefix = f"{PREFIX}{server}{SEPARATOR}"
    if SAFE.match(tool) and len(prefix) + len(tool) <= MAX_NAME:
        return prefix + tool
    digest = hashlib.sha256(tool.encode()).hexdigest()[:8]
    clean = re.sub(r"[^A-Za-z0-9_-]", "_", tool)
    room = MAX_NAME - len(prefix) - len(digest) - 1
    return f"{prefix}{clean[:room]}_{digest}"


def server_of(name: str) -> str | None:
    """The server part of an ``mcp__SERVER__TOOL`` name, or None for any other name."""
    if not name.startswith(PREFIX):
        return None
    server, sep, _ = name[len(PREFIX) :].partition(SEPARATOR)
    return server if sep and server else None


def effect_of(server: ServerConfig, tool: mcp_types.Tool) -> Effect:
    """The operator's effect for the tool if set; else the server's word (``readOnlyHint``),
    unless the operator said not to trust it; else a write."""
    chosen = server.override_for(tool.name).effect
    if chosen is not None:
        return chosen
    hints = tool.annotations
    if not server.ignore_hints and hints is not None and hints.read_only_hint is True:
        return Effect.READ
    return Effect.WRITE


def _schema(tool: mcp_types.Tool) -> JSON | None:
    schema = dict(tool.input_schema or {})
    schema.setdefault("type", "object")
    schema.setdefault("properties", {})
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError:
        return None
    return schema


@dataclass
class Servers:
    """What the MCP tools run on: the configuration, and this process's connections for it
    (looked up at each call, so tools registered before a fork connect from the child)."""

    config: McpConfig
    #: seconds to connect to a server (CHARLIE_MCP_TIMEOUT, unless the server sets one).
    timeout: float
    #: the deadline of a tool with none of its own (CHARLIE_TOOL_DEADLINE).
    default_deadline: float
    #: the most of one message from a server that is read (CHARLIE_MCP_MAX_MESSAGE_BYTES).
    max_message_bytes: int = MAX_MESSAGE_BYTES

    @property
    def connections(self) -> Connections:
        return connections(self.config, self.timeout, self.max_message_bytes)

    def scrub(self, text: str) -> str:
        return self.config.scrub(text)


def definition(servers: Servers, server: ServerConfig, tool: mcp_types.Tool) -> ToolDef | None:
    """The Charlie tool for one of a server's tools, or None when its schema is unusable."""
    schema = _schema(tool)
    if schema is None:
        log.warning(
            "MCP tool skipped: its input schema is not a valid JSON Schema",
            extra={"server": server.name, "tool": tool.name},
        )
        return None
    settings = server.override_for(tool.name)
    effect = effect_of(server, tool)
    name = tool_name(server.name, tool.name)
    description = " ".join((tool.description or tool.title or "").split())
    if not description:
        description = f"Tool {tool.name} of the MCP server {server.name}."
    handler = _handler(servers, server.name, tool.name, effect, settings.deadline)
    cancel = _canceller(servers, server.name, tool.name, effect, settings.deadline)
    return ToolDef(
        name=name,
        handler=handler,
        description=servers.scrub(description),
        parameters=schema,
        effect=effect,
        deadline=settings.deadline,
        resumable=False,
        reconcile=None,
        context_param=CONTEXT_PARAM,
        implementation=f"mcp:{server.name}:{tool.name}",
        approval=bool(settings.approval),
        on_interrupt=settings.on_interrupt or OnInterrupt.REPORT,
        parks=True,
        source=f"mcp:{server.name}",
        cancel=cancel,
        # one session per server and process, which takes concurrent requests (its event loop
        # runs in a thread of its own, connections.py)
        threadsafe=True,
        # a replay never calls the deployment's MCP servers: the recorded result stands in (I35)
        remote=f"MCP server {server.name}",
    )


def register(registry: ToolRegistry, definitions: list[ToolDef]) -> list[ToolDef]:
    """Register (or refresh) a server's tools; a name another kind of tool holds stays its."""
    done = []
    for d in definitions:
        existing = registry.get(d.name)
        if existing is not None and not existing.source.startswith("mcp:"):
            log.error(
                "MCP tool not registered: a %s tool already has its name", existing.source,
                extra={"tool": d.name},
            )  # fmt: skip
            continue
        registry.replace(d)
        done.append(d)
    return done


# -- one call ---------------------------------------------------------------------------------


def _handler(
    servers: Servers, server: str, tool: str, effect: Effect, deadline: float | None
) -> Any:
    def call(_charlie_ctx: ToolContext, **arguments: Any) -> Any:
        try:
            return McpCall(
                servers, server, tool, effect, deadline or servers.default_deadline, arguments,
                _charlie_ctx,
            ).run()  # fmt: skip
        except ToolError:  # (Interrupted and LeaseLost too)
            raise
        except Exception as exc:
            # Anything else (an SDK's surprise, a bug here): said without a traceback, and
            # scrubbed, since its text may carry what the server or the transport said.
            text = servers.scrub(f"{type(exc).__name__}: {exc}")[:2000]
            if _charlie_ctx.overdue:
                raise RuntimeError(text) from None  # a failed look: looked at again later
            if effect is Effect.READ:
                raise ToolError(f"the call to MCP server {server!r} failed: {text}") from None
            raise Interrupted(
                f"the call to MCP server {server!r} failed unexpectedly ({text}); Charlie "
                "cannot tell whether it took effect, and does not send it again",
                server=server,
                tool=tool,
            ) from None

    call.__qualname__ = f"mcp:{server}:{tool}"
    return call


def _canceller(
    servers: Servers, server: str, tool: str, effect: Effect, deadline: float | None
) -> Any:
    """The cancel hook: Charlie canceled a call parked on a task; tasks/cancel asks the server
    to stop it (cooperative: the server may finish anyway, SEP-2663)."""

    def cancel(_charlie_ctx: ToolContext, **arguments: Any) -> None:
        task = HANDLE.match(_charlie_ctx.handle or "")
        if task is None:
            return  # an input round: nothing at the server has an identity to cancel
        McpCall(
            servers, server, tool, effect, deadline or servers.default_deadline, arguments,
            _charlie_ctx,
        ).cancel_task(task.group("id"))  # fmt: skip

    return cancel


def _hash(keys: list[str]) -> str:
    return hashlib.sha256("\0".join(sorted(keys)).encode()).hexdigest()[:8]


def _text_of(blocks: list[Any]) -> str:
    parts = []
    for block in blocks:
        if isinstance(block, mcp_types.TextContent):
            parts.append(block.text)
        elif isinstance(block, mcp_types.ImageContent | mcp_types.AudioContent):
            parts.append(f"[{block.type}: {block.mime_type}]")
        elif isinstance(block, mcp_types.ResourceLink):
            parts.append(f"[resource: {block.uri}]")
        elif isinstance(block, mcp_types.EmbeddedResource):
            inner = block.resource
            text = getattr(inner, "text", None)
            parts.append(text if isinstance(text, str) else f"[resource: {inner.uri}]")
    return "\n".join(parts)


@dataclass
class McpCall:
    servers: Servers
    server: str
    tool: str
    effect: Effect
    timeout: float
    arguments: JSON
    ctx: ToolContext

    # -- entry --------------------------------------------------------------------------------

    def run(self) -> Any:
        ctx = self.ctx
        handle = ctx.handle or ""
        task = HANDLE.match(handle)
        if ctx.overdue:
            return self._observe(task)
        if task is not None:
            if ctx.answer is not None and (ctx.asked or {}).get("kind") == "task":
                return self._answer_task(task.group("id"))
            return self._poll(task.group("id"), task.group("seen"))
        asked = ctx.asked or {}
        if ctx.answer is not None and asked.get("kind") == "input":
            return self._answer_input(asked)
        if ctx.resumed:
            # Resumed with nothing to go on: an earlier attempt sent something (a call, an
            # answer) and did not live to hear back (I10).
            raise self._interrupted(
                "an earlier attempt of this call sent it to the server and stopped before the "
                "answer came",
                handle=ctx.handle,
            )
        return self._outcome(self._send())

    # -- talking to the server -----------------------------------------------------------------

    def _send(self, responses: dict[str, Any] | None = None, state: str | None = None) -> Any:
        try:
            return self.servers.connections.call_tool(
                self.server,
                self.tool,
                self.arguments,
                timeout=self.timeout,
                input_responses=responses,
                request_state=state,
                stop=self.ctx.lease_lost,
            )
        except McpFailure as failure:
            raise self._failed(failure) from None
        except Abandoned:
            raise LeaseLost("this attempt lost the call while the MCP server worked") from None

    def _task_request(
        self, method: str, task_id: str, responses: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return self.servers.connections.request(
            self.server,
            method,
            task_id,
            timeout=min(self.timeout, 60.0),
            input_responses=responses,
            stop=self.ctx.lease_lost,
        )

    def _failed(self, failure: McpFailure) -> ToolError:
        reason = self.servers.scrub(failure.reason)
        where = {"server": self.server, "tool": self.tool}
        if isinstance(failure, Unavailable):
            return ToolError(
                f"MCP server {self.server!r} is unavailable: {reason}; the call was not sent",
                **where,
            )
        if isinstance(failure, Refused):
            return ToolError(
                f"MCP server {self.server!r} refused the call: {reason}",
                code=failure.code,
                **where,
            )
        if isinstance(failure, TooLarge):
            # The server ran the call and answered: the outcome is that answer's loss, said
            # plainly, not an interruption to hold (I15).
            return ToolError(
                f"MCP server {self.server!r} ran the call, but {reason}", truncated=True, **where
            )
        if self.effect is Effect.READ:
            return ToolError(
                f"MCP server {self.server!r} did not answer the call: {reason}", **where
            )
        return self._interrupted(reason)

    def _interrupted(self, reason: str, **evidence: Any) -> Interrupted:
        return Interrupted(
            f"the call to MCP server {self.server!r} was interrupted: {reason}; Charlie cannot "
            "tell whether it took effect, and does not send it again",
            server=self.server,
            tool=self.tool,
            **evidence,
        )

    # -- what the server answered ---------------------------------------------------------------

    def _outcome(self, result: Any, rounds: int = 0) -> Any:
        if isinstance(result, CreatedTask):
            return self._follow(result)
        if isinstance(result, mcp_types.InputRequiredResult):
            requests = {k: _request_json(v) for k, v in (result.input_requests or {}).items()}
            auto = _auto_responses(requests)
            if auto is not None and rounds < MAX_AUTO_ROUNDS:
                # Nothing a person must answer (roots): answered here, at once.
                return self._outcome(self._send(auto, result.request_state), rounds + 1)
            return self._ask(
                requests,
                {"kind": "input", "request_state": result.request_state},
                handle=None,
            )
        if isinstance(result, mcp_types.CallToolResult):
            return self._result(result)
        raise ToolError(f"MCP server {self.server!r} answered with {type(result).__name__}")

    def _result(self, result: mcp_types.CallToolResult) -> Any:
        text = self.servers.scrub(_text_of(result.content))
        if result.is_error:
            raise ToolError(text or f"MCP tool {self.tool!r} failed", server=self.server)
        if result.structured_content is None:
            return text
        # (each string scrubbed as it is, not the JSON text: there a secret may be escaped)
        structured = self.servers.config.scrub_value(result.structured_content)
        if structured == {"result": text}:
            # (the SDK's servers wrap a plain return value so: nothing more than the text)
            return text
        return {"text": text, "structured_content": structured}

    def _ask(self, requests: dict[str, JSON], state: JSON, handle: str | None) -> AskPerson:
        unsupported = [
            r.get("method") for r in requests.values() if r.get("method") != "elicitation/create"
            and r.get("method") != "roots/list"
        ]  # fmt: skip
        if unsupported:
            message = (
                f"MCP server {self.server!r} asks for {', '.join(map(str, unsupported))}, which "
                "Charlie does not provide"
            )
            raise ToolError(message, server=self.server)
        asked = {**state, "requests": requests, "round": uuid.uuid4().hex[:12]}
        question = _question(self.server, self.tool, requests)
        if state.get("problem"):
            question = f"(The last answer could not be used: {state['problem']}.) {question}"
        return AskPerson(question=self.servers.scrub(question), state=asked, handle=handle)

    # -- input_required outside a task (a tools/call retry carries the answer) ----------------

    def _answer_input(self, asked: JSON) -> Any:
        ctx = self.ctx
        marker = f"input:{asked.get('round')}"
        if ctx.handle == marker:
            raise self._interrupted(
                "an earlier attempt sent a person's answer to the server and stopped before "
                "the server's reply came",
                handle=ctx.handle,
            )
        requests: dict[str, JSON] = asked.get("requests") or {}
        try:
            responses = _responses(requests, ctx.answer or "")
        except BadAnswer as bad:
            return self._ask(requests, {**asked, "problem": str(bad)}, handle=None)
        # I9: the answer is acted on once it is sent, so its sending is recorded first.
        ctx.record_handle(marker)
        state = asked.get("request_state")
        try:
            result = self.servers.connections.call_tool(
                self.server,
                self.tool,
                self.arguments,
                timeout=self.timeout,
                input_responses=responses,
                request_state=state,
                stop=ctx.lease_lost,
            )
        except Refused as refused:
            if state is None or refused.code != mcp_types.INVALID_PARAMS:
                raise self._failed(refused) from None
            # The server no longer knows the state it asked with (a restarted server): it ran
            # nothing on it, so the call is made afresh, carrying the answer.
            log.info(
                "MCP server refused the request state; calling afresh with the answer",
                extra={"server": self.server, "tool": self.tool},
            )
            result = self._send(responses, None)
        except McpFailure as failure:
            raise self._failed(failure) from None
        except Abandoned:
            raise LeaseLost("this attempt lost the call while the MCP server worked") from None
        return self._outcome(result)

    # -- tasks (the tasks extension) -----------------------------------------

    def _follow(self, created: CreatedTask) -> Any:
        handle = f"task:{created.task_id}"
        if len(handle) > MAX_HANDLE:
            raise self._interrupted(
                "the server started a task whose id is too long to record",
                task_id=created.task_id[:500],
            )
        # I20: the task's id is durable before the call waits on it, as evidence; the park
        # that follows makes the call a resumable wait on it.
        self.ctx.record_handle(handle)
        faults.hit("mcp.task_created", tool=self.tool)
        return Pending(handle, poll_after=_poll_after(created.poll_interval_ms))

    def _poll(self, task_id: str, seen: str | None = None) -> Any:
        handle = f"task:{task_id}"
        try:
            state = self._task_request("tasks/get", task_id)
        except TooLarge as failure:
            raise self._failed(failure) from None
        except (Unavailable, Lost) as failure:
            log.info(
                "MCP task not polled, polling again later: %s",
                self.servers.scrub(failure.reason),
                extra={"server": self.server, "task_id": task_id},
            )
            return Pending(f"task+{seen}:{task_id}" if seen else handle, poll_after=MAX_POLL)
        except Refused as refused:
            raise self._lost_task(task_id, refused) from None
        except Abandoned:
            raise LeaseLost("this attempt lost the call while polling its task") from None
        faults.hit("mcp.after_poll", tool=self.tool, status=state.get("status"))
        return self._task_state(task_id, state, seen)

    def _task_state(self, task_id: str, state: JSON, seen: str | None) -> Any:
        status = state.get("status")
        handle = f"task:{task_id}"
        poll = _poll_after(state.get("pollIntervalMs"))
        if status == "working" or status is None:
            return Pending(f"task+{seen}:{task_id}" if seen else handle, poll_after=poll)
        if status == "input_required":
            requests = {
                str(k): v
                for k, v in (state.get("inputRequests") or {}).items()
                if isinstance(v, dict)
            }
            if not requests or (seen is not None and _hash(list(requests)) == seen):
                # answered already, and the server has not caught up (it is eventually
                # consistent): ask nobody twice
                return Pending(f"task+{seen}:{task_id}" if seen else handle, poll_after=poll)
            return self._ask(requests, {"kind": "task", "task_id": task_id}, handle=handle)
        if status == "completed":
            try:
                result = mcp_types.CallToolResult.model_validate(state.get("result") or {})
            except Exception:
                raise ToolError(
                    f"MCP server {self.server!r} ended the task with an unreadable result",
                    task_id=task_id,
                ) from None
            return self._result(result)
        message = state.get("statusMessage") or (state.get("error") or {}).get("message") or ""
        message = self.servers.scrub(str(message))
        if status == "cancelled":
            raise ToolError(
                f"the MCP task {task_id} was cancelled" + (f": {message}" if message else ""),
                server=self.server,
                task_id=task_id,
            )
        raise ToolError(
            f"the MCP task {task_id} failed" + (f": {message}" if message else ""),
            server=self.server,
            task_id=task_id,
        )

    def _lost_task(self, task_id: str, refused: Refused) -> ToolError:
        reason = self.servers.scrub(refused.reason)
        if self.effect is Effect.READ:
            return ToolError(
                f"MCP server {self.server!r} no longer knows the task {task_id}: {reason}",
                task_id=task_id,
            )
        return self._interrupted(
            f"the server no longer knows the task {task_id} ({reason})", task_id=task_id
        )

    def _answer_task(self, task_id: str) -> Any:
        asked = self.ctx.asked or {}
        requests: dict[str, JSON] = asked.get("requests") or {}
        try:
            responses = _responses(requests, self.ctx.answer or "")
        except BadAnswer as bad:
            return self._ask(requests, {**asked, "problem": str(bad)}, handle=f"task:{task_id}")
        try:
            # tasks/update is safe to send again: a server ignores answers to keys it no
            # longer waits for (SEP-2663), so a crash before its reply repeats nothing.
            self._task_request("tasks/update", task_id, responses)
        except McpFailure as failure:
            if isinstance(failure, Refused):
                raise self._lost_task(task_id, failure) from None
            # Not delivered, or not known to be: the answer stays, and is sent on the next try.
            raise ToolError(
                f"could not give MCP server {self.server!r} the answer: "
                f"{self.servers.scrub(failure.reason)}",
                task_id=task_id,
            ) from None
        except Abandoned:
            raise LeaseLost("this attempt lost the call while answering its task") from None
        return self._poll(task_id, _hash(list(requests)))

    def _observe(self, task: re.Match[str] | None) -> Any:
        """One look at a call that settled past its deadline (I13): only a task can be looked
        at; any other work has no identity at the server, and is still running as far as
        Charlie knows."""
        if task is None:
            return Pending(self.ctx.handle or "", poll_after=MAX_POLL)
        try:
            state = self._task_request("tasks/get", task.group("id"))
        except Refused as refused:
            raise ToolError(
                f"MCP server {self.server!r} no longer knows the task: "
                f"{self.servers.scrub(refused.reason)}"
            ) from None
        except (McpFailure, Abandoned) as failure:
            raise RuntimeError(f"could not look at the task: {failure}") from None
        result = self._task_state(task.group("id"), state, task.group("seen"))
        if isinstance(result, AskPerson):
            return Pending(self.ctx.handle or "", poll_after=MAX_POLL)
        return result

    def cancel_task(self, task_id: str) -> None:
        try:
            self._task_request("tasks/cancel", task_id)
        except McpFailure as failure:
            raise RuntimeError(
                f"tasks/cancel of {task_id} on MCP server {self.server!r} failed: "
                f"{self.servers.scrub(failure.reason)}"
            ) from None


def _poll_after(ms: Any) -> float:
    if isinstance(ms, int | float) and not isinstance(ms, bool) and ms > 0:
        return max(MIN_POLL, min(MAX_POLL, ms / 1000))
    return 2.0


# -- input requests ----------------------------------------------------------------------------


class BadAnswer(ValueError):
    pass


def _request_json(request: Any) -> JSON:
    if isinstance(request, dict):
        return request
    dumped: JSON = request.model_dump(by_alias=True, mode="json", exclude_none=True)
    return dumped


def _auto_responses(requests: Mapping[str, JSON]) -> dict[str, Any] | None:
    """Responses Charlie gives without a person (it has no roots to offer), or None when any
    request needs a person."""
    if not requests or any(r.get("method") != "roots/list" for r in requests.values()):
        return None
    return {key: mcp_types.ListRootsResult(roots=[]) for key in requests}


def _fields(request: JSON) -> dict[str, JSON]:
    schema = (request.get("params") or {}).get("requestedSchema") or {}
    props = schema.get("properties") if isinstance(schema, dict) else None
    return {str(k): v for k, v in (props or {}).items() if isinstance(v, dict)}


def _describe_field(name: str, prop: JSON) -> str:
    kind = prop.get("type", "string")
    if "enum" in prop:
        kind = "one of " + ", ".join(map(str, prop["enum"]))
    title = str(prop.get("title") or prop.get("description") or "").rstrip(" .")
    return f'"{name}" ({kind})' + (f", {title}" if title and title != name else "")


def _question(server: str, tool: str, requests: Mapping[str, JSON]) -> str:
    asks = {k: r for k, r in requests.items() if r.get("method") == "elicitation/create"}
    lines = [f"The MCP server {server!r} asks, for its tool {tool!r}:"]
    for key, request in asks.items():
        params = request.get("params") or {}
        message = str(params.get("message") or "")
        prefix = f"[{key}] " if len(asks) > 1 else ""
        if params.get("mode") == "url":
            lines.append(f"{prefix}{message} Open {params.get('url')} and reply done.")
            continue
        fields = _fields(request)
        if len(fields) == 1:
            ((name, prop),) = fields.items()
            lines.append(f"{prefix}{message} Reply with {_describe_field(name, prop)}.")
        elif fields:
            shown = "; ".join(_describe_field(n, p) for n, p in fields.items())
            lines.append(f"{prefix}{message} Reply with a JSON object of {shown}.")
        else:
            lines.append(f"{prefix}{message} Reply yes to accept.")
    if len(asks) > 1:
        lines.append("Reply with a JSON object mapping each [key] to its answer.")
    lines.append("Reply /decline to decline, /cancel to cancel.")
    return " ".join(lines)


def _coerce(name: str, prop: JSON, value: Any) -> Any:
    kind = prop.get("type", "string")
    if "enum" in prop:
        if value not in prop["enum"]:
            raise BadAnswer(f'"{name}" must be one of {", ".join(map(str, prop["enum"]))}')
        return value
    if kind == "boolean":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("yes", "y", "true", "1", "ok", "accept"):
            return True
        if text in ("no", "n", "false", "0"):
            return False
        raise BadAnswer(f'"{name}" must be yes or no')
    if kind in ("integer", "number"):
        try:
            number = float(value) if kind == "number" else int(str(value).strip())
        except ValueError:
            article = "an integer" if kind == "integer" else "a number"
            raise BadAnswer(f'"{name}" must be {article}') from None
        return number
    if kind == "array":
        if isinstance(value, list):
            return [str(v) for v in value]
        return [p.strip() for p in str(value).split(",") if p.strip()]
    return value if isinstance(value, str) else json.dumps(value)


def _one_response(request: JSON, answer: Any) -> Any:
    if isinstance(answer, str) and answer.strip().lower() in ("/decline", "/cancel"):
        return mcp_types.ElicitResult(action="decline" if "decline" in answer else "cancel")
    params = request.get("params") or {}
    if params.get("mode") == "url":
        return mcp_types.ElicitResult(action="accept")
    fields = _fields(request)
    if not fields:
        return mcp_types.ElicitResult(action="accept")
    parsed = answer
    if isinstance(answer, str):
        try:
            parsed = json.loads(answer)
        except ValueError:
            parsed = answer
    if isinstance(parsed, dict) and set(parsed) <= set(fields):
        content = {k: _coerce(k, fields[k], v) for k, v in parsed.items()}
    elif len(fields) == 1:
        ((name, prop),) = fields.items()
        content = {name: _coerce(name, prop, answer.strip() if isinstance(answer, str) else answer)}
    else:
        raise BadAnswer(f"the answer must be a JSON object of {', '.join(fields)}")
    required = (params.get("requestedSchema") or {}).get("required") or []
    missing = [r for r in required if r not in content]
    if missing:
        raise BadAnswer(f"the answer lacks {', '.join(map(str, missing))}")
    return mcp_types.ElicitResult(action="accept", content=content)


def _responses(requests: Mapping[str, JSON], answer: str) -> dict[str, Any]:
    """The person's answer as the input responses the server asked for."""
    auto = {k: mcp_types.ListRootsResult(roots=[]) for k, r in requests.items()
            if r.get("method") == "roots/list"}  # fmt: skip
    asks = {k: r for k, r in requests.items() if r.get("method") == "elicitation/create"}
    if len(asks) == 1:
        ((key, request),) = asks.items()
        return {**auto, key: _one_response(request, answer)}
    try:
        parsed = json.loads(answer)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict) or not set(asks) <= set(map(str, parsed)):
        raise BadAnswer(f"the answer must be a JSON object with the keys {', '.join(asks)}")
    return {**auto, **{k: _one_response(r, parsed[k]) for k, r in asks.items()}}
