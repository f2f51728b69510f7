"""Clients for OpenAI-compatible endpoints: ``openai:NAME`` (Chat Completions) and
``openai-responses:NAME`` (Responses), through the official ``openai`` SDK.

Configuration is read from the environment when a client is built:

- ``CHARLIE_MODEL_BASE_URL``: the endpoint's base URL (default ``https://api.openai.com/v1``);
- ``CHARLIE_MODEL_API_KEY``: the key, sent as a bearer token to ``CHARLIE_MODEL_BASE_URL`` only;
- per model, ``CHARLIE_MODEL_<NAME>_BASE_URL`` and ``CHARLIE_MODEL_<NAME>_API_KEY``, where
  ``<NAME>`` is the model name upper-cased with every other character than A-Z and 0-9 turned to
  ``_`` (``gpt-4.1-mini`` -> ``CHARLIE_MODEL_GPT_4_1_MINI_API_KEY``);
- ``CHARLIE_MODEL_TIMEOUT``: the read timeout in seconds (default 120; connecting gets 10);
- ``CHARLIE_MODEL_MAX_ATTEMPTS``: HTTP attempts per ``complete`` call (default 5).

The SDK's own environment is not Charlie's: the key and the base URL are given to it, so
``OPENAI_API_KEY``, ``OPENAI_ADMIN_KEY`` and ``OPENAI_BASE_URL`` are never used, no
``OPENAI_ORG_ID`` / ``OPENAI_PROJECT_ID`` header is sent, and an ``Authorization`` in
``OPENAI_CUSTOM_HEADERS`` is replaced by the configured key (or dropped without one; its other
headers are sent, as the SDK does). Besides Charlie's ``User-Agent`` the SDK sends its
``X-Stainless-*`` headers (language, package and runtime versions, OS, retry count, read
timeout).

Retries are Charlie's (:mod:`charlie.models.retry`, shared with the ``anthropic:`` client), the
SDK's own are off (``max_retries=0``): 408, 409, 429 and 5xx answers and connection or timeout
errors are retried with exponential backoff and full jitter, or after the server's
``Retry-After`` (``retry-after-ms``, seconds or an HTTP date). A wait is slept inside the call
only while it is short (``max_sleep``, 5 s); a longer one, or running out of attempts, raises
:class:`TransientModelError` with ``retry_after`` so the executor stores a wake-up time instead of
sleeping in a tick. Other answers (400, 401, 403, 404, 413, 422, a 429 for exhausted quota, ...)
raise :class:`ModelError` with the status and the first 4 KiB of the body as evidence.

Streaming: when someone may be watching (``request.deltas`` is not ``NO_DELTAS``) the request
asks for a stream (``stream: true``); the SDK decodes the server-sent events and the text,
reasoning and tool-call argument pieces go to ``request.deltas`` as they come
(charlie/models/openai_stream.py); the answer is still built from the whole stream, never from
part of one (I16, I28). A stream cut or stalled mid-way (past the read timeout) is a transient
failure like a dropped connection, retried the same way; the watchers are told its pieces are
void (``Deltas.restart``). A server that answers a streamed request with plain JSON is read as
before. Answers are read as the JSON the server sent, not the SDK's typed models: what is kept in
the transcript (a Responses reasoning item, say) is exactly what comes back next turn.

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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from charlie.domain import JSON
from charlie.models.base import NO_DELTAS, Deltas, ModelError, ModelRequest, ModelResponse
from charlie.models.openai_chat import MalformedResponse, chat_request_body, parse_chat_completion
from charlie.models.openai_responses import parse_response, responses_request_body
from charlie.models.openai_stream import ChatStream, ResponsesStream, StreamFailed
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

if TYPE_CHECKING:
    import openai

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


def _error_detail(error: object) -> tuple[str | None, str | None]:
    """The provider's error ``(code, message)`` from an OpenAI-style error object (what the SDK
    gives as ``APIError.body``)."""
    if not isinstance(error, dict):
        return None, None
    code = error.get("code") or error.get("type")
    message = error.get("message")
    return (
        code if isinstance(code, str) else None,
        message if isinstance(message, str) else None,
    )


def _cause(exc: BaseException) -> str:
    """What went wrong on the wire: the transport error the SDK wrapped (``ReadTimeout``,
    ``ConnectError``, ``RemoteProtocolError``), named."""
    cause = exc.__cause__ or exc
    return f"{type(cause).__name__}: {cause}"


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
        self._sdk: openai.OpenAI | None = None
        self._sdk_pid = 0

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
            if self._sdk is not None and self._sdk_pid == os.getpid():
                self._sdk.close()
            self._sdk = None

    # -- HTTP, through the SDK -------------------------------------------------------------------

    def _client(self) -> openai.OpenAI:
        """One SDK client (and its connection pool) per process; one inherited across a fork is
        left alone."""
        import httpx2
        import openai

        with self._lock:
            if self._sdk is None or self._sdk_pid != os.getpid():
                self._sdk = openai.OpenAI(
                    # given, never None: the SDK would read OPENAI_API_KEY / OPENAI_ADMIN_KEY
                    api_key=self.config.api_key or "",
                    admin_api_key="",
                    base_url=self.config.base_url,
                    max_retries=0,  # Charlie's retry policy decides (charlie.models.retry)
                    timeout=httpx2.Timeout(
                        self.config.read_timeout, connect=self.config.connect_timeout
                    ),
                    default_headers={"User-Agent": USER_AGENT},
                )
                self._sdk_pid = os.getpid()
            return self._sdk

    def _headers(self) -> dict[str, Any]:
        """Per request, over whatever the SDK took from its environment: the key goes only where
        it was configured (an ``Authorization`` in OPENAI_CUSTOM_HEADERS is dropped, none is sent
        without a key), and no OPENAI_ORG_ID / OPENAI_PROJECT_ID header goes to any host."""
        from openai import Omit

        key = self.config.api_key
        return {
            "Authorization": f"Bearer {key}" if key else Omit(),
            "OpenAI-Organization": Omit(),
            "OpenAI-Project": Omit(),
        }

    def _truncate(self, text: str) -> str:
        return self.redact.truncate(text)

    def _extra(self, request: ModelRequest, **more: Any) -> dict[str, Any]:
        return {"task_id": request.task_id, "turn": request.turn, "model": self.spec, **more}

    def _attempt(self, body: JSON, deltas: Deltas) -> tuple[Any, str] | Failure:
        import httpx2
        import openai

        # The SDK's generic POST sends the body as built: its typed ``create`` would walk every
        # message of the transcript through its parameter types (about a millisecond each) only
        # to send the same JSON.
        # A redirect is an answer, as it always was (the SDK would follow it).
        options: openai.RequestOptions = {"headers": self._headers(), "follow_redirects": False}
        try:
            if body.get("stream"):
                stream = self._client().post(
                    self.path,
                    cast_to=object,
                    body=body,
                    options=options,
                    stream=True,
                    stream_cls=openai.Stream[object],
                )
                with stream:
                    response = stream.response
                    if "event-stream" in response.headers.get("content-type", ""):
                        return self._read_stream(stream, deltas)
                    response.read()
            else:
                response = self._client().post(
                    self.path, cast_to=httpx2.Response, body=body, options=options
                )
        except openai.APIStatusError as exc:
            return self._status_failure(exc)
        except (openai.APIConnectionError, httpx2.TransportError) as exc:
            # timeouts, connection, protocol and decoding errors
            timeout = isinstance(exc, openai.APITimeoutError | httpx2.TimeoutException)
            detail = self.redact(_cause(exc))
            what = "timed out" if timeout else "failed"
            return Failure(f"request {what} ({detail})", {"error": detail})
        text = response.text
        try:
            return json.loads(text), text
        except ValueError:
            status = response.status_code
            raise ModelError(
                f"{self.spec}: HTTP {status} with a body that is not JSON",
                evidence={"status": status, "body": self._truncate(text)},
            ) from None

    def _status_failure(self, exc: openai.APIStatusError) -> Failure:
        status = exc.status_code
        evidence: JSON = {"status": status, "body": self._truncate(exc.response.text)}
        if exc.request_id:
            evidence["request_id"] = exc.request_id
        code, message = _error_detail(exc.body)
        summary = f"HTTP {status}" + (f" {code}" if code else "")
        if message:
            summary += ": " + self.redact(message[:500])
        if status in RETRYABLE_STATUSES and code not in UNRETRYABLE_CODES:
            return Failure(summary, evidence, status, parse_retry_after(exc.response.headers))
        if code == "context_length_exceeded":
            summary = "context length exceeded: " + summary
        return Failure(summary, evidence, status, retryable=False)

    def _read_stream(self, events: Iterable[Any], deltas: Deltas) -> tuple[Any, str] | Failure:
        """The answer a whole stream adds up to; a stream cut, stalled or ended early, or one
        that reports an error, is a failure, never an answer (I16)."""
        import openai

        reader = self.reader(deltas)
        try:
            for event in events:
                reader.feed(event)
        except (StreamFailed, openai.APIError) as exc:
            if isinstance(exc, openai.APIConnectionError):
                timeout = isinstance(exc, openai.APITimeoutError)
                detail = self.redact(_cause(exc))
                what = "stalled" if timeout else "was cut"
                return Failure(f"the stream {what} ({detail})", {"error": detail}, streamed=True)
            if isinstance(exc, StreamFailed):
                code, text = exc.code, str(exc)
            else:  # an error object in place of a chunk
                code, said = _error_detail(exc.body)
                text = f"the stream reported an error: {said or exc.message}"
            message = self.redact(text)[:500]
            retryable = code not in UNRETRYABLE_CODES and code != "context_length_exceeded"
            evidence: JSON = {"status": 200, "stream_error": message}
            return Failure(message, evidence, retryable=retryable, streamed=True)
        except ValueError as exc:  # an event that is not JSON
            detail = self.redact(f"{type(exc).__name__}: {exc}")[:1000]
            return Failure(f"the stream broke ({detail})", {"error": detail}, streamed=True)
        if not reader.done:
            message = "the stream ended before it was complete"
            return Failure(message, {"error": message}, streamed=True)
        data = reader.answer()
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
