"""One task's ticks driven by hand in this process (its own CHARLIE_HOME, SQLite, no workers),
with a message sent just before the turn-0 boundary's transaction: after the boundary's claim
when that claim commits on its own (``durable``, as a redelivered or sweep-republished tick
does), before it otherwise. Prints the transcript's items as JSON lines (I22).

    python -m tests.support.mailbox_window durable|plain
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any


def main(durable: bool) -> None:
    home = tempfile.mkdtemp(prefix="charlie-mailbox-window-")
    for key in [k for k in os.environ if k.startswith("CHARLIE_")]:
        del os.environ[key]
    os.environ.update(
        CHARLIE_HOME=home,
        CHARLIE_TOOL_MODULES="tests.support.tools",
        CHARLIE_TEST_LEDGER=os.path.join(home, "ledger.jsonl"),
        CHARLIE_INLINE_PHASES="0",  # one step per tick: this process runs each
    )
    from sqlalchemy import select

    import charlie
    from charlie.config import settings
    from charlie.domain import Phase, execution_id_for
    from charlie.executor import tick
    from charlie.runtime import get_runtime
    from charlie.store.engine import read, upgrade
    from charlie.store.schema import executions, tool_calls

    upgrade(settings().database_url)
    script = os.path.join(home, "script.json")
    call = {"id": "a", "name": "sleep_then", "arguments": {"seconds": 0, "value": "v"}}
    with open(script, "w") as f:
        json.dump([{"tool_calls": [call]}, {"say": "done"}, {"say": "done again"}], f)
    task_id = charlie.submit("mailbox window", model=f"scripted:{script}", task_id="window")
    rt = get_runtime()
    xid = execution_id_for(task_id)

    def drive(until: Phase) -> int:
        while True:
            with read(rt.engine) as conn:
                e, c = executions.c, tool_calls.c
                row = conn.execute(select(e.phase, e.version).where(e.id == xid)).one()
                open_calls = conn.execute(
                    select(c.turn, c.call_id).where(c.execution_id == xid, c.state != "settled")
                ).all()
            phase = Phase(row.phase)
            if phase in (until, Phase.DONE):
                return int(row.version)
            if phase is Phase.AWAIT_TOOLS and open_calls:
                tick.invoke(rt, xid, open_calls[0].turn, open_calls[0].call_id, "start")
            else:
                tick.run_tick(rt, xid, phase, row.version)

    version = drive(Phase.ADVANCE_TURN)
    real_write, sent = tick.write, []

    def write_after_a_send(engine: Any, *args: Any) -> Any:
        if not sent:
            sent.append(charlie.send(task_id, "hello", message_id="m1"))
        return real_write(engine, *args)

    tick.write = write_after_a_send  # type: ignore[assignment]
    try:
        tick.run_tick(rt, xid, Phase.ADVANCE_TURN, version, durable_claim=durable)
    finally:
        tick.write = real_write  # type: ignore[assignment]
    drive(Phase.DONE)
    for item in charlie.transcript(task_id):
        print(json.dumps({"seq": item.seq, "turn": item.turn, "kind": item.kind,
                          "message_id": item.payload.get("message_id")}))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1] == "durable")
