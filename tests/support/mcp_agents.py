"""A Pydantic AI agent holding an MCP server (``MCPToolset``, prefixed ``rec``), run as a Charlie
task by the test workers: its model is the fake Chat Completions server's (tests/support/agents.py),
its server the test MCP server over streamable HTTP on ``CHARLIE_TEST_AGENT_MCP_PORT`` (started by
the ``agent_mcp_server`` fixture), which writes every execution to its own ledger."""

from __future__ import annotations

import os

from pydantic_ai import Agent
from pydantic_ai.mcp import MCPToolset

from tests.support.agents import _model
from tests.support.cluster import MCP_HTTP_TOKEN


def _url() -> str:
    return f"http://127.0.0.1:{os.environ.get('CHARLIE_TEST_AGENT_MCP_PORT', '9')}/mcp"


records = MCPToolset(_url(), id="records", headers={"Authorization": f"Bearer {MCP_HTTP_TOKEN}"})

with_mcp = Agent(
    _model(),
    toolsets=[records.prefixed("rec")],
    instructions="Look the record up, then delete it.",
)
