"""``anthropic:NAME``: Anthropic's Messages API through the official ``anthropic`` SDK, streamed.

Configuration is read from the environment when a client is built:

- ``ANTHROPIC_BASE_URL`` (default ``https://api.anthropic.com``) and ``ANTHROPIC_API_KEY``, as
  the SDK reads them; per model, ``CHARLIE_MODEL_<NAME>_BASE_URL`` and
  ``CHARLIE_MODEL_<NAME>_API_KEY`` (``<NAME>`` as for the OpenAI clients:
  ``claude-sonnet-4-5`` -> ``CLAUDE_SONNET_4_5``). ``ANTHROPIC_API_KEY`` goes only to the origin
  of ``ANTHROPIC_BASE_URL``: a model sent elsewhere needs its own key. Nothing else is read for a
  credential (no profile, token file or ``ANTHROPIC_AUTH_TOKEN``): the key is given to the SDK.
- ``CHARLIE_MODEL_<NAME>_MAX_TOKENS``: the API's required ``max_tokens`` (default 8192, plus the
  thinking budget when there is one);
- ``CHARLIE_MODEL_<NAME>_THINKING_BUDGET``: extended thinking, a number of tokens (at least
  1024, below ``max_tokens``), or ``adaptive``; unset or ``0``: no thinking;
- ``CHARLIE_MODEL_<NAME>_PROMPT_CACHE``: ``0`` turns the ``cache_control`` breakpoints off;
- ``CHARLIE_MODEL_TIMEOUT`` and ``CHARLIE_MODEL_MAX_ATTEMPTS`` as for every HTTP model.

Retries are Charlie's (:mod:`charlie.models.retry`), the SDK's own are off (``max_retries=0``):
429 (with ``retry-after``), 529 (overloaded), 408, 409, other 5xx, an ``error`` event in the
stream of the same kinds, connection errors and a stream that breaks before ``message_stop`` are
retried; a long wait becomes a stored wake-up (``TransientModelError.retry_after``). A 400 and the
other client errors fail the run with the status and the response body as evidence.

The turn is streamed (SSE): text, thinking and tool-argument deltas go to ``request.deltas`` as
they arrive; the answer is the complete message the SDK accumulates (I16), never a partial one.
Stop reasons: ``pause_turn`` continues the turn within this call (the partial assistant content
sent back, at most :data:`MAX_CONTINUATIONS` times); ``refusal`` fails the run with the message
as evidence, not retried; ``max_tokens`` fails the run, naming the setting to raise, with the cut
message as evidence (a half-written tool call cannot be run, and a cut answer is not one);
``model_context_window_exceeded`` fails it as a context-length error.

The API key goes only into the request's key header (``Authorization: Bearer`` with SDK 2.x): it
is redacted from every message, evidence and log line, and evidence never holds request headers.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from charlie.domain import JSON
from charlie.models.anthropic_messages import (
    add_usage,
    dumps,
    message_text,
    parse_message,
    request_params,
    usage_of,
)
from charlie.models.base import ModelError, ModelRequest, ModelResponse, Usage
from charlie.models.openai_chat import MalformedResponse
from charlie.models.retry import (
    CONNECT_TIMEOUT,
    DEFAULT_BACKOFF_BASE,
    DEFAULT_BACKOFF_CAP,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_SLEEP,
    DEFAULT_READ_TIMEOUT,
    Failure,
    Redactor,
    RetryPolicy,
    check_key,
    env_name,
    env_number,
    env_whole,
    origin,
    parse_retry_after,
)

if TYPE_CHECKING:
    import anthropic

log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://api.anthropic.com"
DEFAULT_MAX_TOKENS = 8192
MIN_THINKING_BUDGET = 1024
#: how many times one turn is continued after ``pause_turn`` before the call fails.
MAX_CONTINUATIONS = 8
USER_AGENT = "charlie/0.1"

RETRYABLE_STATUSES = frozenset({408, 409, 429}) | frozenset(range(500, 600))
#: error types of an ``error`` event inside a 200 stream that waiting may fix.
RETRYABLE_TYPES = frozenset({"overloaded_error", "api_error", "rate_limit_error", "timeout_error"})


@dataclass(frozen=True)
class AnthropicConfig:
    base_url: str = DEFAULT_BASE_URL
    api_key: str | None = field(default=None, repr=False)
    max_tokens: int = DEFAULT_MAX_TOKENS
    #: the ``thinking`` parameter, or None for no extended thinking
    thinking: JSON | None = None
    prompt_cache: bool = True
    read_timeout: float = DEFAULT_READ_TIMEOUT
    connect_timeout: float = CONNECT_TIMEOUT
    max_attempts: int = DEFAULT_MAX_ATTEMPTS

    @classmethod
    def from_env(cls, model: str, environ: Mapping[str, str] | None = None) -> AnthropicConfig:
        env = os.environ if environ is None else environ
        prefix = f"CHARLIE_MODEL_{env_name(model)}_"

        def own(key: str) -> str | None:
            return env.get(prefix + key, "").strip() or None

        shared_url = (env.get("ANTHROPIC_BASE_URL", "").strip() or DEFAULT_BASE_URL).rstrip("/")
        base_url = (own("BASE_URL") or shared_url).rstrip("/")
        if not base_url.startswith(("http://", "https://")):
            raise ModelError(
                f"model base URL {base_url!r} for {model!r} is not an http:// or https:// URL"
            )
        # A key goes only to the host it was configured for (as for the OpenAI clients).
        api_key = own("API_KEY")
        if api_key is None and origin(base_url) == origin(shared_url):
            api_key = env.get("ANTHROPIC_API_KEY", "").strip() or None
        check_key(api_key, model)
        thinking: JSON | None = None
        budget_raw = (own("THINKING_BUDGET") or "").lower()
        budget = 0
        if budget_raw == "adaptive":
            thinking = {"type": "adaptive"}
        elif budget_raw and budget_raw != "0":
            budget = env_whole(prefix + "THINKING_BUDGET", env, 0)
            if budget < MIN_THINKING_BUDGET:
                raise ModelError(
                    f"{prefix}THINKING_BUDGET={budget} is below the API's minimum of "
                    f"{MIN_THINKING_BUDGET} tokens"
                )
            thinking = {"type": "enabled", "budget_tokens": budget}
        max_tokens = env_whole(prefix + "MAX_TOKENS", env, DEFAULT_MAX_TOKENS + budget)
        if budget and max_tokens <= budget:
            raise ModelError(
                f"{prefix}MAX_TOKENS={max_tokens} must be above the thinking budget ({budget})"
            )
        return cls(
            base_url=base_url,
            api_key=api_key,
            max_tokens=max_tokens,
            thinking=thinking,
            prompt_cache=(own("PROMPT_CACHE") or "1") not in ("0", "false", "no", "off"),
            read_timeout=env_number("CHARLIE_MODEL_TIMEOUT", env, DEFAULT_READ_TIMEOUT),
            max_attempts=env_whole("CHARLIE_MODEL_MAX_ATTEMPTS", env, DEFAULT_MAX_ATTEMPTS),
        )


@dataclass
class _Streamed:
    """One attempt's complete message (as JSON) and the tool arguments as they were streamed."""

    message: JSON
    raw_inputs: dict[int, str]


class AnthropicModel:
    """One model behind Anthropic's Messages API (or a server that speaks it)."""

    def __init__(
        self,
        spec: str,
        name: str,
        config: AnthropicConfig,
        *,
        max_sleep: float = DEFAULT_MAX_SLEEP,
        backoff_base: float = DEFAULT_BACKOFF_BASE,
        backoff_cap: float = DEFAULT_BACKOFF_CAP,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.spec = spec
        self.name = name
        self.config = config
        self.retry = RetryPolicy(
            max_attempts=config.max_attempts,
            max_sleep=max_sleep,
            backoff_base=backoff_base,
            backoff_cap=backoff_cap,
            sleep=sleep,
            rng=rng,
        )
        self.redact = Redactor(config.api_key)
        self._lock = threading.Lock()
        self._sdk: anthropic.Anthropic | None = None
        self._sdk_pid = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r}, base_url={self.config.base_url!r})"

    # -- the Model protocol -------------------------------------------------------------------

    def build(self, request: ModelRequest) -> JSON:
        return request_params(
            self.name,
            request,
            max_tokens=self.config.max_tokens,
            thinking=self.config.thinking,
            cache=self.config.prompt_cache,
        )

    def complete(self, request: ModelRequest) -> ModelResponse:
        params = self.build(request)
        messages: list[JSON] = params["messages"]
        content: list[JSON] = []  # the turn's blocks, over its pause_turn continuations
        raw_inputs: dict[int, str] = {}
        usage = Usage()
        extra = self._extra(request)
        for continuation in range(MAX_CONTINUATIONS + 1):
            streamed = self._stream(params, request, extra)
            message = streamed.message
            offset = len(content)
            blocks = message.get("content")
            content.extend(b for b in blocks or [] if isinstance(b, dict))
            raw_inputs.update({offset + i: raw for i, raw in streamed.raw_inputs.items()})
            usage = add_usage(usage, usage_of(message.get("usage")))
            stop = message.get("stop_reason")
            if stop != "pause_turn":
                break
            if continuation == MAX_CONTINUATIONS:
                raise ModelError(
                    f"{self.spec}: the turn was paused (pause_turn) {continuation + 1} times; "
                    "Charlie gives up on it",
                    evidence=self._evidence(message),
                )
            # Continue the turn: the partial assistant content goes back as the last message.
            params = {
                **params,
                "messages": [*messages, {"role": "assistant", "content": list(content)}],
            }
            log.info("model paused its turn; continuing", extra=extra)
        final = {**message, "content": content}
        self._check_stop(final)
        try:
            response = parse_message(final, raw_inputs, usage)
        except MalformedResponse as exc:
            raise ModelError(
                self.redact(f"{self.spec}: unusable model output: {exc}"),
                evidence=self._evidence(final),
            ) from None
        log.debug("model answered", extra={**extra, "usage": response.usage.as_dict()})
        return response

    def _stream(self, params: JSON, request: ModelRequest, extra: dict[str, Any]) -> _Streamed:
        """One streamed message, within the retry policy."""
        return self.retry.run(
            lambda: self._attempt(params, request),
            spec=self.spec,
            log=log,
            extra=extra,
            deltas=request.deltas,
            throttled=request.throttled,
        )

    def close(self) -> None:
        with self._lock:
            if self._sdk is not None and self._sdk_pid == os.getpid():
                self._sdk.close()
            self._sdk = None

    # -- stop reasons ---------------------------------------------------------------------------

    def _check_stop(self, message: JSON) -> None:
        stop = message.get("stop_reason")
        if stop == "refusal":
            said = message_text(message)
            raise ModelError(
                self.redact(
                    f"{self.spec}: the model refused to go on (stop_reason refusal)"
                    + (f": {said[:500]}" if said else "")
                ),
                evidence=self._evidence(message),
            )
        if stop == "max_tokens":
            raise ModelError(
                f"{self.spec}: the model stopped at max_tokens ({self.config.max_tokens}) before "
                f"finishing its turn; raise CHARLIE_MODEL_{env_name(self.name)}_MAX_TOKENS and "
                "resume the task",
                evidence=self._evidence(message),
            )
        if stop == "model_context_window_exceeded":
            raise ModelError(
                f"{self.spec}: context length exceeded: the model's context window is full",
                evidence=self._evidence(message),
            )

    def _evidence(self, message: JSON) -> JSON:
        return {"status": 200, "body": self.redact.truncate(dumps(message))}

    # -- HTTP, through the SDK -------------------------------------------------------------------

    def _client(self) -> anthropic.Anthropic:
        """One SDK client (and its connection pool) per process; one inherited across a fork is
        left alone."""
        import anthropic

        with self._lock:
            if self._sdk is None or self._sdk_pid != os.getpid():
                if not self.config.api_key:
                    raise ModelError(
                        f"{self.spec}: no API key: set ANTHROPIC_API_KEY (for "
                        f"{self.config.base_url}) or CHARLIE_MODEL_{env_name(self.name)}_API_KEY"
                    )
                import httpx2

                self._sdk = anthropic.Anthropic(
                    api_key=self.config.api_key,
                    base_url=self.config.base_url,
                    max_retries=0,  # Charlie's retry policy decides (charlie.models.retry)
                    timeout=httpx2.Timeout(
                        self.config.read_timeout, connect=self.config.connect_timeout
                    ),
                    default_headers={"User-Agent": USER_AGENT},
                    # Charlie traces the call itself; the SDK's spans could carry content
                    open_telemetry=False,
                )
                self._sdk_pid = os.getpid()
            return self._sdk

    def _extra(self, request: ModelRequest, **more: Any) -> dict[str, Any]:
        return {"task_id": request.task_id, "turn": request.turn, "model": self.spec, **more}

    def _attempt(self, params: JSON, request: ModelRequest) -> _Streamed | Failure:
        import anthropic
        import httpx2

        deltas = request.deltas
        calls: dict[int, str] = {}  # block index -> tool_use id
        raw_inputs: dict[int, str] = {}
        stopped = False
        try:
            with self._client().messages.stream(**params) as stream:
                # the SDK's event unions, read by their type field (Any: a typed walk over
                # a dozen block kinds adds nothing here)
                events: Iterable[Any] = stream
                for event in events:
                    kind = event.type
                    if kind == "content_block_delta":
                        delta = event.delta
                        if delta.type == "text_delta":
                            _say(deltas.text, delta.text)
                        elif delta.type == "thinking_delta":
                            _say(deltas.reasoning, delta.thinking)
                        elif delta.type == "input_json_delta":
                            index = event.index
                            raw_inputs[index] = raw_inputs.get(index, "") + delta.partial_json
                            if index in calls:
                                _say(deltas.tool_call, calls[index], None, delta.partial_json)
                    elif kind == "content_block_start":
                        block = event.content_block
                        if block.type == "tool_use":
                            calls[event.index] = block.id
                            raw_inputs[event.index] = ""
                            _say(deltas.tool_call, block.id, block.name, "")
                    elif kind == "message_stop":
                        stopped = True
                message = stream.get_final_message() if stopped else None
        except anthropic.APIStatusError as exc:
            return self._status_failure(exc)
        except (anthropic.APIConnectionError, httpx2.HTTPError) as exc:
            detail = self.redact(f"{type(exc).__name__}: {exc}")
            what = "timed out" if isinstance(exc, anthropic.APITimeoutError) else "failed"
            # (possibly after part of the stream: a watcher is told to drop it)
            return Failure(f"request {what} ({detail})", {"error": detail}, streamed=True)
        except (ValueError, RuntimeError) as exc:
            # an event the SDK could not read (bad JSON, events out of order): a broken stream
            detail = self.redact(f"{type(exc).__name__}: {exc}")[:1000]
            return Failure(f"the stream broke ({detail})", {"error": detail}, streamed=True)
        except anthropic.AnthropicError as exc:
            detail = self.redact(f"{type(exc).__name__}: {exc}")[:1000]
            return Failure(detail, {"error": detail}, retryable=False)
        if message is None:
            ended = "the stream ended before message_stop"
            return Failure(ended, {"error": "stream ended early"}, streamed=True)
        data: JSON = message.to_dict(mode="json", exclude_none=True)
        # only tool_use blocks keep their streamed argument strings
        blocks: list[Any] = data.get("content") or []
        tool_blocks = {
            i for i, b in enumerate(blocks) if isinstance(b, dict) and b.get("type") == "tool_use"
        }
        return _Streamed(data, {i: s for i, s in raw_inputs.items() if i in tool_blocks})

    def _status_failure(self, exc: anthropic.APIStatusError) -> Failure:
        status = exc.status_code
        body = exc.body
        text = body if isinstance(body, str) else dumps(body)
        evidence: JSON = {"status": status, "body": self.redact.truncate(text)}
        if exc.request_id:
            evidence["request_id"] = exc.request_id
        kind = exc.type if isinstance(exc.type, str) else None
        message = exc.api_message if isinstance(exc.api_message, str) else None
        summary = f"HTTP {status}" + (f" {kind}" if kind else "")
        if 200 <= status < 300:
            summary = "error event in the stream" + (f": {kind}" if kind else "")
        if message:
            summary += ": " + self.redact(message[:500])
        retryable = kind in RETRYABLE_TYPES if 200 <= status < 300 else status in RETRYABLE_STATUSES
        if retryable:
            return Failure(summary, evidence, status, parse_retry_after(exc.response.headers))
        if message and "prompt is too long" in message:
            summary = "context length exceeded: " + summary
        return Failure(summary, evidence, status, retryable=False)


def _say(method: Callable[..., None], *args: Any) -> None:
    """A delta for whoever watches; never a reason for the call to fail."""
    try:
        method(*args)
    except Exception:  # a watcher's failure is not the model's
        log.debug("a deltas watcher failed", exc_info=True)


def client_for(
    name: str,
    spec: str,
    *,
    environ: Mapping[str, str] | None = None,
    **options: Any,
) -> AnthropicModel:
    """The client for ``anthropic:name``, configured from the environment now; ``options`` go to
    :class:`AnthropicModel` (``max_sleep``, ``backoff_base``, ``backoff_cap``, ``sleep``,
    ``rng``)."""
    return AnthropicModel(spec, name, AnthropicConfig.from_env(name, environ), **options)
