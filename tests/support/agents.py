"""Pydantic AI agents the test workers run as Charlie tasks (``agent="tests.support.agents:..."``).

Their model is Pydantic AI's own ``OpenAIChatModel`` pointed at the session's fake
Chat Completions server (CHARLIE_MODEL_BASE_URL), its SDK's own retries off: a failed request
is Charlie's to retry. Every real run of a tool is written to the test ledger
(tests/support/tools.py), so a test counts runs whatever Charlie's records say.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from openai import AsyncOpenAI
from pydantic import BaseModel
from pydantic_ai import Agent, ModelRetry, RunContext
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from tests.support.tools import ledger_path, record


class Settled(BaseModel):
    account: str
    charged_cents: int


@dataclass
class Deps:
    currency: str


def make_deps() -> Deps:
    return Deps(currency="EUR")


def hold_path() -> Path:
    """While this file exists, ``charge`` keeps running after its side effect (a kill point)."""
    return ledger_path().parent / "agent-charge-hold"


async def _say_who_asks(request: httpx.Request) -> None:
    # which process sends a request (a forked pool process: read when it is sent), so that a
    # test kills the worker that is waiting for its answer and no other
    request.headers["x-test-pid"] = str(os.getpid())


def _model() -> OpenAIChatModel:
    client = AsyncOpenAI(
        base_url=os.environ.get("CHARLIE_MODEL_BASE_URL", "http://127.0.0.1:9/v1"),
        api_key=os.environ.get("CHARLIE_MODEL_API_KEY", "test"),
        max_retries=0,
        timeout=10,
        http_client=httpx.AsyncClient(event_hooks={"request": [_say_who_asks]}),
    )
    return OpenAIChatModel("gpt-4.1", provider=OpenAIProvider(openai_client=client))


support = Agent(
    _model(),
    output_type=Settled,
    deps_type=Deps,
    instructions="Settle the account: look it up, charge what it owes, report.",
)


@support.system_prompt
def currency(ctx: RunContext[Deps]) -> str:
    return f"Amounts are in {ctx.deps.currency} cents."


@support.tool_plain(metadata={"effect": "read"})
def lookup(account: str) -> str:
    """The balance an account owes."""
    record("agent.lookup", account=account)
    return f"{account} owes 1200"


@support.tool
def charge(ctx: RunContext[Deps], account: str, cents: int) -> str:
    """Charge an account (a write: unmarked)."""
    if cents <= 0:
        raise ModelRetry("cents must be positive")
    record("agent.charge", account=account, cents=cents)
    end = time.monotonic() + 60
    while hold_path().exists() and time.monotonic() < end:
        time.sleep(0.05)
    return f"charged {cents} {ctx.deps.currency} cents to {account}"


@support.tool_plain(requires_approval=True, metadata={"effect": "write"})
def refund(account: str, cents: int) -> str:
    """Refund an account; a person approves every refund first."""
    record("agent.refund", account=account, cents=cents)
    return f"refunded {cents} to {account}"


@support.output_validator
def not_negative(output: Settled) -> Settled:
    if output.charged_cents < 0:
        raise ModelRetry("charged_cents cannot be negative")
    return output
