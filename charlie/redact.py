"""What task arguments may show where operators look: Flower, `celery events`, worker inspection.

A prompt and a task's metadata can hold anything a producer had (customer data, credentials in a
pasted log); the broker's task events carry a repr of every task's arguments to anyone who can
read the event stream. Those of ``charlie.submit`` are replaced by their shape: the model, the
id, the tools and the timeout stay (what an operator needs to follow a task), the prompt and the
metadata become their size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: keyword arguments of charlie.submit shown as they are.
SHOWN = ("model", "task_id", "tools", "timeout", "approve")

#: arguments of the people-in-the-loop tasks shown as they are (ids, verdicts, who); the
#: texts (a message, a reply, a reason, a note, a result) become their size.
PERSON_SHOWN = (
    "task_id",
    "call_id",
    "verdict",
    "message_id",
    "operator",
    "turn",
    "model",
    "timeout",
)
#: the positional arguments of each, by position (the ids come first).
PERSON_ARGS = {
    "charlie.send": ("task_id", "text"),
    "charlie.reply": ("task_id", "call_id", "text"),
    "charlie.approve": ("task_id", "call_id"),
    "charlie.deny": ("task_id", "call_id", "reason"),
    "charlie.reconcile": ("task_id", "call_id", "verdict"),
    "charlie.resume": ("task_id",),
    "charlie.fork": ("task_id",),
    "charlie.cancel": ("task_id",),
}


def _shape(name: str, value: Any) -> str:
    if isinstance(value, str):
        return f"<{name}: {len(value)} chars>"
    if isinstance(value, Mapping):
        return f"<{name}: {len(value)} keys>"
    return f"<{name}>"


def submit_reprs(args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> tuple[str, str]:
    """``argsrepr`` and ``kwargsrepr`` for a ``charlie.submit`` message."""
    shown_args = [_shape("prompt", a) if i == 0 else "<…>" for i, a in enumerate(args or ())]
    shown: dict[str, Any] = {}
    for key, value in (kwargs or {}).items():
        shown[key] = value if key in SHOWN else _shape(key, value)
    argsrepr = "(" + ", ".join(shown_args) + ("," if len(shown_args) == 1 else "") + ")"
    kwargsrepr = "{" + ", ".join(f"{k!r}: {_r(v)}" for k, v in shown.items()) + "}"
    return argsrepr, kwargsrepr


def _r(value: Any) -> str:
    return value if isinstance(value, str) and value.startswith("<") else repr(value)


def person_reprs(
    name: str, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
) -> tuple[str, str]:
    """``argsrepr`` and ``kwargsrepr`` for a people-in-the-loop task (``charlie.send``, ...)."""
    names = PERSON_ARGS.get(name, ())
    shown_args = []
    for i, value in enumerate(args or ()):
        key = names[i] if i < len(names) else "arg"
        shown_args.append(repr(value) if key in PERSON_SHOWN else _shape(key, value))
    shown = {k: (v if k in PERSON_SHOWN else _shape(k, v)) for k, v in (kwargs or {}).items()}
    argsrepr = "(" + ", ".join(shown_args) + ("," if len(shown_args) == 1 else "") + ")"
    kwargsrepr = "{" + ", ".join(f"{k!r}: {_r(v)}" for k, v in shown.items()) + "}"
    return argsrepr, kwargsrepr
