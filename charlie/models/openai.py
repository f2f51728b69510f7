"""Clients for OpenAI-compatible endpoints: ``openai:NAME`` (Chat Completions) and
``openai-responses:NAME`` (Responses).

Configuration is read from the environment when a client is built:

- ``CHARLIE_MODEL_BASE_URL``: the endpoint's base URL (default ``https://api.openai.com/v1``);
- ``CHARLIE_MODEL_API_KEY``: the key, sent as a bearer token to ``CHARLIE_MODEL_BASE_URL`` only;
- per model, ``CHARLIE_MODEL_<NAME>_BASE_URL`` and ``CHARLIE_MODEL_<NAME>_API_KEY``, where
  ``<NAME>`` is the model name upper-cased with every other character than A-Z and 0-9 turned to
  ``_`` (``gpt-4.1-mini`` -> ``CHARLIE_MODEL_GPT_4_1_MINI_API_KEY``);
- ``CHARLIE_MODEL_TIMEOUT``: the read timeout in seconds (default 120; connecting gets 10);
- ``CHARLIE_MODEL_MAX_ATTEMPTS``: HTTP attempts per ``complete`` call (default 5).

Retries: 408, 409, 429 and 5xx answers and connection or timeout errors are retried with
exponential backoff and full jitter, or after the server's ``Retry-After`` (``retry-after-ms``,
seconds or an HTTP date). A wait is slept inside the call only while it is short (``max_sleep``,
5 s); a longer one, or running out of attempts, raises :class:`TransientModelError` with
``retry_after`` so the executor stores a wake-up time instead of sleeping in a tick (the policy is
:mod:`charlie.models.retry`, shared with the ``anthropic:`` client). Other answers
(400, 401, 403, 404, 413, 422, a 429 for exhausted quota, ...) raise :class:`ModelError` with the
status and the first 4 KiB of the body as evidence.

Streaming: when someone may be watching (``request.deltas`` is not ``NO_DELTAS``) the request
asks for a stream (``stream: true``) and the text, reasoning and tool-call argument pieces go to
``request.deltas`` as they come (charlie/models/openai_stream.py); the answer is still built from
the whole stream, never from part of one (I16, I28). A stream cut or stalled mid-way (past the
read timeout) is a transient failure like a dropped connection, retried the same way; the
watchers are told its pieces are void (``Deltas.restart``). A server that answers a streamed
request with plain JSON is read as before.

The API key goes only into the ``Authorization`` header of the requests: it is redacted from every
message, evidence and log line, and evidence never holds request headers.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from charlie.domain import JSON
from charlie.models.base import NO_DELTAS, Deltas, ModelError, ModelRequest, ModelResponse
from charlie.models.openai_chat import MalformedResponse, chat_request_body, parse_chat_completion
from charlie.models.openai_responses import parse_response, responses_request_body
from charlie.models.openai_stream import (
    ChatStream,
    ResponsesStream,
    StreamFailed,
    server_sent_events,
)
from charlie.models.retry import (
    CONNECT_TIMEOUT,
    DEFAULT_BACKOFF_BASE,
    DEFAULT_BACKOFF_CAP,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_SLEEP,
    DEFAULT_READ_TIMEOUT,
    REDACTED,
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

log = logging.getLogger(__name__)

__all__ = [
    "REDACTED",
    "EndpointConfig",
    "OpenAIModel",
    "client_for",
    "env_name",
    "parse_retry_after",
]

DEFAULT_BASE_URL = "https://api.openai.com/v1"
USER_AGENT = "charlie/0.1"

#: 408 and 409 are retried as the OpenAI SDKs do (a request timeout, a lock conflict).
RETRYABLE_STATUSES = frozenset({408, 409, 429}) | frozenset(range(500, 600))
#: a 429 with one of these error codes will not pass by waiting.
UNRETRYABLE_CODES = frozenset({"insufficient_quota", "billing_hard_limit_reached"})


@dataclass(frozen=True)
class EndpointConfig:
    base_url: str = DEFAULT_BASE_URL
    api_key: str | None = field(default=None, repr=False)
    read_timeout: float = DEFAULT_READ_TIMEOUT
    connect_timeout: float = CONNECT_TIMEOUT
    max_attempts: int = DEFAULT_MAX_ATTEMPTS

    @classmethod
    def from_env(cls, model: str, environ: Mapping[str, str] | None = None) -> EndpointConfig:
        env = os.environ if environ is None else environ
        prefix = f"CHARLIE_MODEL_{env_name(model)}_"

        def own(key: str) -> str | None:
            return env.get(prefix + key, "").strip() or None

        shared_url = (env.get("CHARLIE_MODEL_BASE_URL", "").strip() or DEFAULT_BASE_URL).rstrip("/")
        base_url = (own("BASE_URL") or shared_url).rstrip("/")
        if not base_url.startswith(("http://", "https://")):
            raise ModelError(
                f"model base URL {base_url!r} for {model!r} is not an http:// or https:// URL"
            )
        # A key goes only to the host it was configured for: the shared CHARLIE_MODEL_API_KEY
        # belongs to the shared base URL, so a model sent to another host (its own BASE_URL)
        # gets it only when that host is the same origin; otherwise it needs its own key.
        api_key = own("API_KEY")
        if api_key is None and origin(base_url) == origin(shared_url):
            api_key = env.get("CHARLIE_MODEL_API_KEY", "").strip() or None
        check_key(api_key, model)
        return cls(
            base_url=base_url,
            api_key=api_key,
            read_timeout=env_number("CHARLIE_MODEL_TIMEOUT", env, DEFAULT_READ_TIMEOUT),
            max_attempts=env_whole("CHARLIE_MODEL_MAX_ATTEMPTS", env, DEFAULT_MAX_ATTEMPTS),
        )


def _error_detail(text: str) -> tuple[str | None, str | None]:
    """The provider's error ``(code, message)`` from an OpenAI-style error body."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None, None
    error = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(error, str):
        return None, error
    if not isinstance(error, dict):
        return None, None
    code = error.get("code") or error.get("type")
    message = error.get("message")
    return (
        code if isinstance(code, str) else None,
        message if isinstance(message, str) else None,
    )


class OpenAIModel:
    """One model behind an OpenAI-compatible endpoint; subclasses pick the API."""

    path = ""

    def __init__(
        self,
        spec: str,
        name: str,
        config: EndpointConfig,
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
        self._http: httpx.Client | None = None
        self._http_pid = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r}, base_url={self.config.base_url!r})"

    # -- the API-specific parts ---------------------------------------------------------------

    def build(self, request: ModelRequest) -> JSON:
        raise NotImplementedError

    def parse(self, data: Any) -> ModelResponse:
        raise NotImplementedError

    def streaming(self, body: JSON) -> JSON:
        """The request body that asks for a stream."""
        return {**body, "stream": True}

    def reader(self, deltas: Deltas) -> ChatStream | ResponsesStream:
        raise NotImplementedError

    # -- the Model protocol -------------------------------------------------------------------

    def complete(self, request: ModelRequest) -> ModelResponse:
        body = self.build(request)
        if request.deltas is not NO_DELTAS:
            body = self.streaming(body)
        data, text = self._post(body, request)
        try:
            response = self.parse(data)
        except MalformedResponse as exc:
            raise ModelError(
                self.redact(f"{self.spec}: unusable model output: {exc}"),
                evidence={"status": 200, "body": self._truncate(text)},
            ) from None
        log.debug(
            "model answered",
            extra=self._extra(request, usage=response.usage.as_dict()),
        )
        return response

    def close(self) -> None:
        with self._lock:
            if self._http is not None and self._http_pid == os.getpid():
                self._http.close()
            self._http = None

    # -- HTTP ---------------------------------------------------------------------------------

    def _client(self) -> httpx.Client:
        """One connection pool per process: a pool inherited across a fork is left alone."""
        with self._lock:
            if self._http is None or self._http_pid != os.getpid():
                self._http = httpx.Client(
                    timeout=httpx.Timeout(
                        self.config.read_timeout, connect=self.config.connect_timeout
                    ),
                    headers={"User-Agent": USER_AGENT},
                )
                self._http_pid = os.getpid()
            return self._http

    def _headers(self) -> dict[str, str]:
        if not self.config.api_key:
            return {}
        return {"Authorization": f"Bearer {self.config.api_key}"}

    def _truncate(self, text: str) -> str:
        return self.redact.truncate(text)

    def _extra(self, request: ModelRequest, **more: Any) -> dict[str, Any]:
        return {"task_id": request.task_id, "turn": request.turn, "model": self.spec, **more}

    def _attempt(self, body: JSON, deltas: Deltas) -> tuple[Any, str] | Failure:
        url = self.config.base_url + self.path
        try:
            with self._client().stream("POST", url, json=body, headers=self._headers()) as response:
                status = response.status_code
                kind = response.headers.get("content-type", "")
                if 200 <= status < 300 and body.get("stream") and "event-stream" in kind:
                    return self._read_stream(response, deltas)
                response.read()
        except httpx.RequestError as exc:  # timeouts, connection, protocol and decoding errors
            what = "timed out" if isinstance(exc, httpx.TimeoutException) else "failed"
            detail = self.redact(f"{type(exc).__name__}: {exc}")
            return Failure(f"request {what} ({detail})", {"error": detail})
        text = response.text
        status = response.status_code
        if 200 <= status < 300:
            try:
                return response.json(), text
            except ValueError:
                raise ModelError(
                    f"{self.spec}: HTTP {status} with a body that is not JSON",
                    evidence={"status": status, "body": self._truncate(text)},
                ) from None
        evidence: JSON = {"status": status, "body": self._truncate(text)}
        request_id = response.headers.get("x-request-id")
        if request_id:
            evidence["request_id"] = request_id
        code, message = _error_detail(text)
        summary = f"HTTP {status}" + (f" {code}" if code else "")
        if message:
            summary += ": " + self.redact(message[:500])
        if status in RETRYABLE_STATUSES and code not in UNRETRYABLE_CODES:
            return Failure(summary, evidence, status, parse_retry_after(response.headers))
        if code == "context_length_exceeded":
            summary = "context length exceeded: " + summary
        return Failure(summary, evidence, status, retryable=False)

    def _read_stream(self, response: httpx.Response, deltas: Deltas) -> tuple[Any, str] | Failure:
        """The answer a whole stream adds up to; a stream cut, stalled or ended early, or one
        that reports an error, is a failure, never an answer (I16)."""
        reader = self.reader(deltas)
        try:
            for event in server_sent_events(response.iter_lines()):
                reader.feed(event)
                if reader.done:
                    break
        except StreamFailed as exc:
            message = self.redact(str(exc))[:500]
            evidence: JSON = {"status": response.status_code, "stream_error": message}
            retryable = exc.code not in UNRETRYABLE_CODES and exc.code != "context_length_exceeded"
            return Failure(message, evidence, retryable=retryable, streamed=True)
        except httpx.RequestError as exc:
            what = "stalled" if isinstance(exc, httpx.TimeoutException) else "was cut"
            detail = self.redact(f"{type(exc).__name__}: {exc}")
            return Failure(f"the stream {what} ({detail})", {"error": detail}, streamed=True)
        if not reader.done:
            message = "the stream ended before it was complete"
            return Failure(message, {"error": message}, streamed=True)
        data = reader.response if isinstance(reader, ResponsesStream) else reader.completion()
        return data, json.dumps(data)

    def _post(self, body: JSON, request: ModelRequest) -> tuple[Any, str]:
        return self.retry.run(
            lambda: self._attempt(body, request.deltas),
            spec=self.spec,
            log=log,
            extra=self._extra(request),
            deltas=request.deltas,
            throttled=request.throttled,
        )


class OpenAIChatModel(OpenAIModel):
    """``openai:NAME``: ``POST {base}/chat/completions``."""

    path = "/chat/completions"

    def build(self, request: ModelRequest) -> JSON:
        return chat_request_body(self.name, request)

    def parse(self, data: Any) -> ModelResponse:
        return parse_chat_completion(data)

    def streaming(self, body: JSON) -> JSON:
        return {**body, "stream": True, "stream_options": {"include_usage": True}}

    def reader(self, deltas: Deltas) -> ChatStream:
        return ChatStream(deltas)


class OpenAIResponsesModel(OpenAIModel):
    """``openai-responses:NAME``: ``POST {base}/responses``, stateless (``store: false``)."""

    path = "/responses"

    def build(self, request: ModelRequest) -> JSON:
        return responses_request_body(self.name, request)

    def parse(self, data: Any) -> ModelResponse:
        return parse_response(data)

    def reader(self, deltas: Deltas) -> ResponsesStream:
        return ResponsesStream(deltas)


CLIENTS: dict[str, type[OpenAIModel]] = {
    "openai": OpenAIChatModel,
    "openai-responses": OpenAIResponsesModel,
}


def client_for(
    provider: str,
    name: str,
    spec: str,
    *,
    environ: Mapping[str, str] | None = None,
    **options: Any,
) -> OpenAIModel:
    """The client for ``provider:name``, configured from the environment now.

    ``options`` go to :class:`OpenAIModel` (``max_sleep``, ``backoff_base``, ``backoff_cap``,
    ``sleep``, ``rng``)."""
    try:
        cls = CLIENTS[provider]
    except KeyError:
        raise ModelError(f"unknown OpenAI provider {provider!r} in {spec!r}") from None
    return cls(spec, name, EndpointConfig.from_env(name, environ), **options)
