"""What a model call costs the client itself: ``openai:`` (the official SDK; a plain JSON answer,
and streamed as when someone may watch) and ``anthropic:`` (the official SDK, streamed) against the
test suite's fake servers on 127.0.0.1, run in another process so this process's CPU time is the
client's alone.

    python scripts/bench_model_clients.py [CALLS]

Per call: wall time of ``complete`` (client plus server plus loopback), the client's CPU time,
and the same for a bare ``httpx`` POST of the same request (the floor any client pays).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KEY = "sk-bench-0123456789"


class _Watcher:
    """Deltas nobody reads: the call streams as it does when someone may watch."""

    def text(self, delta: str) -> None:
        pass

    def reasoning(self, delta: str) -> None:
        pass

    def tool_call(self, call_id: str, name: str | None, arguments_delta: str) -> None:
        pass

    def restart(self, reason: str) -> None:
        pass


def _serve(kind: str, port: Any, calls: int) -> None:
    if kind == "openai":
        from tests.support.fake_openai import FakeOpenAI, chat_tool_calls

        server: Any = FakeOpenAI().start()
        reply = chat_tool_calls([("c1", "read_file", '{"path": "a.txt"}')], text="Reading.")
    elif kind == "openai-stream":
        from tests.support.fake_openai import FakeOpenAI, chat_stream

        server = FakeOpenAI().start()
        reply = chat_stream("Reading.", [("c1", "read_file", '{"path": "a.txt"}')])
    else:
        from tests.support.fake_anthropic import FakeAnthropic, message, text, tool_use

        server = FakeAnthropic(key=KEY).start()
        reply = message(text("Reading."), tool_use("t1", "read_file", {"path": "a.txt"}))
    # no Nagle on the fake's sockets (accepted ones inherit it): a 40 ms delayed ACK would
    # hide what the clients cost
    server._server.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    server.enqueue(*[reply] * (calls * 3))
    port.value = server.port
    while True:
        time.sleep(3600)


def _measure(label: str, calls: int, call: Callable[[], Any]) -> None:
    call()  # warm: connection, imports
    walls: list[float] = []
    cpu0 = time.process_time()
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        walls.append(time.perf_counter() - t0)
    cpu = (time.process_time() - cpu0) / calls
    print(
        f"{label:<34} wall median {statistics.median(walls) * 1000:6.2f} ms, "
        f"p90 {sorted(walls)[int(calls * 0.9)] * 1000:6.2f} ms, client CPU {cpu * 1000:6.2f} ms"
    )


def main() -> None:
    if set(sys.argv[1:]) & {"-h", "--help"}:
        print(__doc__)
        return
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    import httpx

    from charlie.domain import Item, ItemKind
    from charlie.models.base import ModelRequest, ToolSpec

    items = [
        Item(1, 0, ItemKind.INPUT, None, {"role": "system", "content": "You are Charlie."}),
        Item(2, 0, ItemKind.INPUT, None, {"role": "user", "content": "Read a.txt."}),
    ]
    tool = ToolSpec(
        "read_file",
        "Read a file.",
        {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    )
    request = ModelRequest("bench", "bench", 0, items, [tool])
    for kind in ("openai", "openai-stream", "anthropic"):
        port = multiprocessing.Value("i", 0)
        proc = multiprocessing.Process(target=_serve, args=(kind, port, calls), daemon=True)
        proc.start()
        while not port.value:
            time.sleep(0.01)
        try:
            call = request
            if kind.startswith("openai"):
                from charlie.models.openai import client_for

                url = f"http://127.0.0.1:{port.value}/v1"
                env = {"CHARLIE_MODEL_BASE_URL": url, "CHARLIE_MODEL_API_KEY": KEY}
                model: Any = client_for("openai", "m", "openai:m", environ=env)
                body = model.build(request)
                if kind == "openai-stream":
                    call = replace(request, deltas=_Watcher())
                    body = model.streaming(body)
                raw_url, headers = url + "/chat/completions", {"Authorization": f"Bearer {KEY}"}
            else:
                from charlie.models import anthropic

                url = f"http://127.0.0.1:{port.value}"
                env = {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": KEY}
                model = anthropic.client_for("m", "anthropic:m", environ=env)
                body = {**model.build(request), "stream": True}
                raw_url = url + "/v1/messages"
                headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
            with httpx.Client() as bare:

                def post(c: Any = bare, u: str = raw_url, b: Any = body, h: Any = headers) -> Any:
                    return c.post(u, json=b, headers=h).read()

                _measure(f"{kind}: bare httpx POST", calls, post)
            _measure(f"{kind}: Charlie client complete()", calls, partial(model.complete, call))
            model.close()
        finally:
            proc.kill()
            proc.join()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
