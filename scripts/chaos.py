#!/usr/bin/env python
"""Crash harness: run many agent tasks while SIGKILLing random workers, then check every promise.

    python scripts/chaos.py --tasks 200 --kill-every 2
    python scripts/chaos.py --tasks 30 --broker-url redis://127.0.0.1:6379/13 \
        --database-url postgresql://postgres@127.0.0.1/charlie_chaos
    python scripts/chaos.py --tasks 30 --kill-every 3 --pool threads   # as `charlie worker`

Starts N worker processes (``--workers``; each a prefork pool of 2, or ``--pool threads``: a
threads pool of 8, the pool `charlie worker` starts with, where a kill takes every call the
process held at once) and one beat (default sweep settings), submits tasks whose scripted
models call a mix of tools (quick reads, slow reads, writes recorded in a ledger outside
Charlie's tables, writes with a read-back reconcile hook, delegations with waits), and kills a
random worker's whole process group every few seconds; a supervisor restarts it. Meanwhile a
"person" thread acts on the tasks the way people do: it sends messages to a share of them
(some twice with the same message id, some after the task finished), approves or denies the
calls that need approval (``approved_write``, or a ledger-recorded write named in submit's
``approve=[...]``), answers ``ask_human`` questions, reconciles interrupted ``held_write``
calls from the ledger, tries a second verdict on some calls, and forks a few finished tasks.
A message goes out once its task reached a drawn turn (or while it is queued); since one that
arrives with a final answer makes one more model turn (I22), every script ends with spare final
turns. It prints what it did in a ``people:`` line, then checks every task and exits non-zero
on any violation:

- terminal status reached, and succeeded;
- every tool call has exactly one result, and the transcript's results are in call order (I7, I8);
- no write executed twice according to the ledger (I10);
- every call caught mid-flight by a kill settled interrupted or reconciled, or, for a resumable
  wait, was observed again; never dropped (I10);
- exactly one child per delegation (I19);
- every accepted message is in its task's transcript exactly once, as user input at a turn
  boundary (after all the results of the turn it closes, before the next model call's items),
  at the first boundary committed after its send and in send order; a duplicate send returns
  the same id; a message refused with TaskFinished is nowhere and was refused only after the
  task's final answer was in (I22);
- a call needing approval is never marked started while held, a denied call's tool never ran
  (ledger) and its one result is ``denied``, an approved call's tool ran at most once and only
  after the approve's commit time (ledger timestamp after the action's ``at``); a held
  ``held_write`` did not run between its hold and a ``not_done`` verdict (I23);
- the first verdict on each hold of a call stands: every second attempt is refused with
  VerdictConflict naming a verdict given on the call, and the call's outcome is the first
  verdict's; a call held again (approved, then interrupted: held for a reconcile) takes a
  verdict of its own, a refused one is a violation (the task is canceled) (I24);
- an ``ask_human`` call's result is the person's reply (and the model was shown it);
- calls waiting for a person hold no lease, and while more of them wait than there are worker
  slots (the first tasks ask at once, and the person holds back every answer until then and
  until other tasks finished, or for --hold-back seconds), other runs still move; and the run
  completes (I25);
- a fork of a finished task (``turn=0``) runs no tool call of its source again: the ledger's
  entries under the fork's id are its own turns' calls, the source gets none after the fork,
  its model never plays turn 0, its copied items are marked (I26);
- every action the person took is one operator-action row with its actor; refused ones none
  (I27).
- a share of tasks (``--mcp-share``) also calls an MCP read and an MCP write over stdio (the
  test server of tests/support/mcp_server.py, one per worker process); no MCP write executed
  twice according to the server's own ledger (I10).

The code is the package ``scripts/chaos_kinds/``: one module per fault kind (``kills``,
``messages``, ``verdicts``, ``waiting``, ``forks``, ``mcp``), each with its checker; ``person``
(the people's thread), ``harness`` (plans and shared reads), ``checks`` (the run-wide checker and
its table) and ``runner`` (the options and the run).
"""

from __future__ import annotations

import sys
from pathlib import Path

# run as a script, its directory is on the path already; loaded from a file (the checker's unit
# tests), it is not
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from chaos_kinds.checks import check
from chaos_kinds.forks import check_fork
from chaos_kinds.messages import Sent, check_messages
from chaos_kinds.runner import main
from chaos_kinds.verdicts import check_actions, check_verdicts

__all__ = ["Sent", "check", "check_actions", "check_fork", "check_messages", "check_verdicts"]

if __name__ == "__main__":
    sys.exit(main())
