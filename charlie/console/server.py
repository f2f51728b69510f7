"""The console's web server: Tornado, server-rendered pages, a JSON API, one small script.

Routes (every one needs the token; see :mod:`charlie.console.auth`):

- ``GET /``: the tasks, newest first (filter by status, search id and prompt, paged);
  ``GET /live/tasks``: its table alone, which the page polls.
- ``GET /tasks/<id>``: the run; ``GET /live/tasks/<id>``: its regions alone, fetched when
  ``GET /api/tasks/<id>/revision`` changes; ``POST /tasks/<id>/<action>``: a form's action
  (protected by an XSRF token bound to the session), shown on the page it redirects back to.
- ``/api/...``: the Python API's records as JSON (``dataclasses.asdict``, times in ISO 8601);
  ``POST /api/tasks/<id>/<action>`` takes a JSON body and returns the ActionRecord;
  ``GET /api/tasks/<id>/events?after=OFFSET``: the run's stream for people watching
  (``charlie.events``, not following), which the run page's live panel polls.

The API's calls block (SQLAlchemy), so each request runs them on a small thread pool; the
event loop only renders and writes.

Before any of that: a request for a ``Host`` the console does not answer to is refused
(:mod:`charlie.console.guard`), every redirect goes to one of the console's own paths, and
no log line carries the token or a session (:mod:`charlie.console.scrub`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import secrets
import signal
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlencode

import tornado.httpserver
import tornado.httputil
import tornado.netutil
import tornado.web
from tornado.escape import url_escape

from charlie import api, views
from charlie.console import auth, guard, rows, scrub, timeline
from charlie.domain import Channel, TaskStatus, describe_actor
from charlie.models.retrying import attempts_failed

TaskNotFound = api.TaskNotFound
TaskConflict = api.TaskConflict

HERE = Path(__file__).parent
T = TypeVar("T")

#: the statuses the list filters by, in the order a person thinks of them
STATUSES = [s.value for s in TaskStatus]
#: the actions a task page (and the JSON API) can take
ACTIONS = ("cancel", "send", "reply", "approve", "deny", "reconcile", "resume", "fork")
TASK_ID = r"([A-Za-z0-9][A-Za-z0-9._:-]{0,127})"
PAGE = 50
MAX_PAGE = 200

#: what the browser may do with a page: nothing but its own script, style and forms
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    # the first URL carries the token: never send it on
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True)
class ConsoleConfig:
    token: str
    #: who the console's actions are recorded as (I27)
    operator: str
    #: served to browsers over HTTPS by a proxy in front: every cookie is Secure
    behind_tls_proxy: bool = False
    #: ``Host`` names answered besides the listening address and localhost's (``NAME[:PORT]``)
    allowed_hosts: tuple[str, ...] = ()


def to_jsonable(value: Any) -> Any:
    """The API's records as JSON values: dataclasses as dicts, times as ISO strings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Enum):
        return value.value
    return value


def dumps(value: Any) -> str:
    return json.dumps(to_jsonable(value), ensure_ascii=False)


# -- what a page needs, read in one go on the pool ----------------------------------------------


def load_list(
    statuses: list[str], search: str | None, before: str | None, limit: int = PAGE
) -> dict[str, Any]:
    page = api.list_tasks(status=statuses or None, search=search, before=before, limit=limit)
    now = datetime.now(UTC)
    return {
        "tasks": page,
        "now": now,
        "next_before": page[-1].id if len(page) == limit else None,
        "limits": _limits(),
        "pools": _pools(),
    }


def _limits() -> list[Any]:
    """The provider limits used so far, for the list's panel (I36): in flight, waiting, paused
    until (none used: none shown)."""
    return list(api.limits())


def _pools() -> list[tuple[str, dict[str, Any]]]:
    """Each live worker's pool and the calls it had in flight at its last heartbeat, for the
    list's panel (none reported: none shown)."""
    return api.worker_pools()


#: the transcript rows a task page shows at first: the latest ones (``?all=1``: every row)
ROWS_SHOWN = 300


def load_task(task_id: str, all_rows: bool = False) -> dict[str, Any]:
    # The revision first: whatever changes while the rest is read makes the next poll differ.
    revision = api.revision(task_id)
    info = api.get_task(task_id)
    entries = api.transcript(task_id)
    calls = api.calls(task_id)
    history = api.history(task_id)
    done = api.actions(task_id)
    children = api.list_tasks(parent=task_id, limit=100)
    parent = None
    if info.parent_id:
        try:
            parent = api.get_task(info.parent_id)
        except TaskNotFound:
            parent = None
    now = datetime.now(UTC)
    shown = rows.transcript_rows(entries, calls, actions=done)
    earlier = 0 if all_rows else max(0, len(shown) - ROWS_SHOWN)
    return {
        "revision": revision,
        "info": info,
        "rows": shown[earlier:],
        "earlier_rows": earlier,
        "all_rows": all_rows,
        "open_calls": rows.open_calls(calls, now),
        "tl": timeline.build(info, history, calls, done, now),
        "actions": done,
        "children": children,
        "parent": parent,
        "fork_turns": rows.settled_turns(info, entries),
        "now": now,
        "calls_count": len(calls),
        "items_count": len(entries),
    }


# -- actions: the API's, with the console's operator name ---------------------------------------


class BadRequest(ValueError):
    pass


def _field(body: dict[str, Any], name: str, *, required: bool = True) -> Any:
    value = body.get(name)
    if isinstance(value, str) and not value.strip():
        value = None
    if value is None and required:
        raise BadRequest(f"{name} is required")
    return value


#: how the console's actions are recorded: every request that reaches an action has shown the
#: console's token (a signed-in session or the bearer token), so the console's operator name is
#: established by it, not merely claimed (I32)
SIGNED_IN = api.Origin(api.Channel.UI, authenticated=True)


def perform(config: ConsoleConfig, task_id: str, action: str, body: dict[str, Any]) -> Any:
    """Take one action as the API does and return the ActionRecord it recorded (I27)."""
    op = config.operator
    request_id = _field(body, "request_id", required=False) or f"ui-{uuid.uuid4().hex}"
    request_id = str(request_id)[:200]
    if action == "approve":
        return api.approve(
            task_id,
            str(_field(body, "call_id")),
            note=_field(body, "note", required=False),
            operator=op,
            origin=SIGNED_IN,
            request_id=request_id,
        )
    if action == "deny":
        return api.deny(
            task_id,
            str(_field(body, "call_id")),
            _field(body, "reason"),
            operator=op,
            origin=SIGNED_IN,
            request_id=request_id,
        )
    if action == "reply":
        return api.reply(
            task_id, str(_field(body, "call_id")), _field(body, "text"), operator=op,
            request_id=request_id, origin=SIGNED_IN,
        )  # fmt: skip
    if action == "reconcile":
        result = body.get("result")
        if isinstance(result, str):
            # a form's result field is JSON text; empty is none
            result = _json_field(result, "result")
        return api.reconcile(
            task_id,
            str(_field(body, "call_id")),
            str(_field(body, "verdict")),
            result=result,
            note=_field(body, "note", required=False),
            operator=op,
            origin=SIGNED_IN,
            request_id=request_id,
        )
    if action == "resume":
        timeout = _field(body, "timeout", required=False)
        return api.resume(
            task_id,
            timeout=None if timeout is None else _number(timeout, "timeout"),
            note=_field(body, "note", required=False),
            operator=op,
            origin=SIGNED_IN,
            request_id=request_id,
        )
    if action == "cancel":
        changed = api.cancel(
            task_id,
            note=_field(body, "note", required=False),
            operator=op,
            request_id=request_id,
            origin=SIGNED_IN,
        )
        record = api.action_for_request(request_id)
        if record is None:
            if changed:  # a child was canceled but not this task? cannot be: say what it is
                raise api.ActionRefused(f"task {task_id!r} was not canceled")
            status = api.get_task(task_id).status.value
            raise api.ActionRefused(f"task {task_id!r} has already finished ({status})")
        return record
    if action == "send":
        message_id = _field(body, "message_id", required=False)
        sent = api.send(
            task_id,
            _field(body, "text"),
            message_id=None if message_id is None else str(message_id),
            operator=op,
            origin=SIGNED_IN,
            request_id=request_id,
        )
        record = api.action_for_request(request_id)
        if record is None:  # that message id was sent before: its first send is the record
            record = next(
                (
                    a
                    for a in api.actions(task_id)
                    if a.action.value == "send" and (a.detail or {}).get("message_id") == sent
                ),
                None,
            )
        if record is None:
            raise api.ActionRefused(f"message {sent!r} has no record")
        return record
    if action == "fork":
        turn = _field(body, "turn")
        new_id = _field(body, "task_id", required=False)
        if new_id is None:
            new_id = f"{task_id[:100]}.fork-{secrets.token_hex(4)}"
        forked = api.fork(
            task_id,
            turn=int(_number(turn, "turn")),
            message=_field(body, "message", required=False),
            model=_field(body, "model", required=False),
            task_id=str(new_id),
            operator=op,
            origin=SIGNED_IN,
            request_id=request_id,
        )
        record = api.action_for_request(request_id)
        if record is None:
            record = next(
                (
                    a
                    for a in api.actions(task_id)
                    if a.action.value == "fork" and (a.detail or {}).get("fork") == forked
                ),
                None,
            )
        if record is None:
            raise api.ActionRefused(f"fork {forked!r} has no record")
        return record
    raise BadRequest(f"unknown action {action!r}; one of {', '.join(ACTIONS)}")


def _json_field(text: str, name: str) -> Any:
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise BadRequest(f"{name} is not JSON: {exc}") from None


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool):
        raise BadRequest(f"{name} must be a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise BadRequest(f"{name} must be a number, got {value!r}") from None


def refusal(exc: Exception) -> tuple[int, str] | None:
    """The HTTP status and message of an action's refusal (None: not a refusal, a bug)."""
    if isinstance(exc, api.VerdictConflict | TaskConflict):
        return 409, str(exc)
    if isinstance(exc, TaskNotFound):
        return 404, f"no task {exc}" if str(exc) and " " not in str(exc) else str(exc)
    if isinstance(exc, api.CallNotFound):
        return 404, str(exc)
    if isinstance(exc, api.ActionRefused | ValueError):
        return 400, str(exc)
    return None


#: what each action did, in the sentence the page shows after it
DID = {
    "approve": "approved",
    "deny": "denied",
    "reply": "answered",
    "reconcile": "reconciled",
    "send": "sent",
    "cancel": "canceled",
    "resume": "resumed",
    "fork": "forked",
}


def describe(record: Any) -> str:
    """An action's result, as the page shows it after the action: one sentence saying who did
    what to which call, and when (the record, I27)."""
    action = record.action.value
    detail = record.detail or {}
    what = f"call {record.call_id}" if record.call_id else "the task"
    if action == "send":
        what = f"message {detail.get('message_id')}"
    text = f"{record.by} {DID.get(action, action)} {what}"
    if action == "reconcile" and detail.get("verdict"):
        text += f" as {str(detail['verdict']).replace('_', ' ')}"
    text += f" at {record.at.isoformat(timespec='seconds')}"
    if action == "fork" and detail.get("fork"):
        text += f" into new task {detail['fork']}"
    elif action == "send":
        text += "; it enters at the next turn boundary"
    elif action == "reconcile" and detail.get("repeat"):
        text += "; it is dispatched again under the same call id"
    elif detail.get("late"):
        text += "; the question had already settled, so it is recorded as a late report"
    return text + "."


# -- handlers -----------------------------------------------------------------------------------

access_log = logging.getLogger("tornado.access")
app_log = logging.getLogger("tornado.application")
gen_log = logging.getLogger("tornado.general")


class Redacted(tornado.web.RequestHandler):
    """Tornado's log lines about a request, without the token (:mod:`charlie.console.scrub`):
    its summary redacted, and an uncaught exception logged without the request's repr (whose
    URI is the raw one)."""

    def _request_summary(self) -> str:
        config: ConsoleConfig = self.settings["console"]
        return scrub.request_summary(self.request, config.token)

    def log_exception(self, typ: Any, value: BaseException | None, tb: Any) -> None:
        if isinstance(value, tornado.web.HTTPError):
            message = value.get_message()
            if message:
                gen_log.warning("%d %s: %s", value.status_code, self._request_summary(), message)
            return
        app_log.error("Uncaught exception %s", self._request_summary(), exc_info=value)


def log_request(handler: tornado.web.RequestHandler) -> None:
    """The access log's line (Tornado's, with the request's summary redacted)."""
    status = handler.get_status()
    level = logging.INFO if status < 400 else logging.WARNING if status < 500 else logging.ERROR
    if not access_log.isEnabledFor(level):
        return
    config: ConsoleConfig = handler.settings["console"]
    summary = scrub.request_summary(handler.request, config.token)
    access_log.log(level, "%d %s %.2fms", status, summary, 1000.0 * handler.request.request_time())


def cookie_options(
    config: ConsoleConfig, request: tornado.httputil.HTTPServerRequest
) -> dict[str, Any]:
    """What every cookie of the console is: HttpOnly, on every path, Secure when the browser
    reaches the console over HTTPS (directly, or through a TLS proxy it was told of)."""
    return {
        "httponly": True,
        "path": "/",
        "secure": config.behind_tls_proxy or request.protocol == "https",
    }


class Base(Redacted):
    api_handler = False
    #: the session this request started (a login), before its cookie comes back
    _new_session: str | None = None

    @property
    def config(self) -> ConsoleConfig:
        config: ConsoleConfig = self.settings["console"]
        return config

    def set_default_headers(self) -> None:
        for name, value in SECURITY_HEADERS.items():
            self.set_header(name, value)

    def _bearer_ok(self) -> bool:
        return auth.token_matches(
            auth.bearer(self.request.headers.get("Authorization")), self.config.token
        )

    def _session(self) -> str | None:
        if self._new_session is not None:
            return self._new_session
        value = self.get_signed_cookie(auth.SESSION_COOKIE, max_age_days=auth.SESSION_DAYS)
        return auth.session_of(value)

    def _session_ok(self) -> bool:
        return self._session() is not None

    @property
    def xsrf_token(self) -> bytes:
        """The forms' token: this session's (see :mod:`charlie.console.auth`), no cookie of
        its own. Without a session (a page read with the bearer token) it matches nothing."""
        session = self._session() or auth.new_session()
        return auth.xsrf_token(self.settings["xsrf_key"], session).encode()

    def check_xsrf_cookie(self) -> None:
        # A request with the bearer token cannot come from another site's page (a browser
        # sends no Authorization header cross-site without CORS, which the console never
        # allows); everything else must carry the form token of its own session.
        if self.api_handler and self._bearer_ok():
            return
        given = (
            self.get_argument("_xsrf", None)
            or self.request.headers.get("X-Xsrftoken")
            or self.request.headers.get("X-Csrftoken")
        )
        if not given:
            raise tornado.web.HTTPError(403, "'_xsrf' argument missing from POST")
        if not auth.xsrf_matches(given, self.settings["xsrf_key"], self._session()):
            raise tornado.web.HTTPError(403, "the form's XSRF token is not this session's")

    def redirect(self, url: str, permanent: bool = False, status: int | None = None) -> None:
        # every redirect stays on the console (guard.local_path): a target a browser would
        # read as another site is a bug here, never sent
        target = guard.local_path(url)
        if target is None:
            raise ValueError(f"refusing to redirect off the console: {url!r}")
        super().redirect(target, permanent=permanent, status=status)

    def prepare(self) -> None:
        given = self.get_query_argument("token", None)
        if given is not None and not self.api_handler:
            if not auth.token_matches(given, self.config.token):
                self.refuse("that token is not this console's")
                return
            # a login starts a new session (a new id, so new form tokens)
            self._new_session = auth.new_session()
            self.set_signed_cookie(
                auth.SESSION_COOKIE,
                auth.session_value(self._new_session),
                expires_days=auth.SESSION_DAYS,
                # Lax, not Strict: a link to a run from a chat or a ticket opens it logged in;
                # what changes anything is a POST, which Lax does not send cross-site and the
                # session's form token guards besides
                samesite="Lax",
                **cookie_options(self.config, self.request),
            )
            if self.request.method in ("GET", "HEAD"):
                # the token leaves the address bar (and the history) at once, to the same
                # page when its path is one a browser keeps on this site (guard.local_path)
                rest = [
                    (k, v.decode())
                    for k, vs in self.request.query_arguments.items()
                    if k != "token"
                    for v in vs
                ]
                path = guard.local_path(self.request.path) or "/"
                self.redirect(path + (f"?{urlencode(rest)}" if rest else ""), status=303)
            return
        if self._bearer_ok() or self._session_ok():
            return
        self.refuse("this console needs its token")

    def refuse(self, why: str) -> None:
        self.set_status(401)
        if self.api_handler:
            self.set_header("WWW-Authenticate", 'Bearer realm="charlie"')
            self.finish({"error": f"{why}: send Authorization: Bearer TOKEN"})
        else:
            self.set_header("WWW-Authenticate", 'Bearer realm="charlie"')
            self.finish(self.render_string("denied.html", why=why))

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.settings["pool"], fn, *args)

    def get_template_namespace(self) -> dict[str, Any]:
        ns = super().get_template_namespace()
        ns.update(
            fmt=rows,
            short=api_short,
            url_escape=lambda v: url_escape(str(v), plus=False),
            request_id=lambda: f"ui-{secrets.token_hex(12)}",
            # who the page's actions will be recorded as, shown as every record of them is (I32)
            operator=describe_actor(self.config.operator, Channel.UI.value, True),
            STATUSES=STATUSES,
            json_pretty=rows.pretty,
            usd=views.usd,
            budget_text=views.budget_text,
            tokens_text=views.tokens_text,
            attempts_failed=attempts_failed,
        )
        return ns

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        if self.api_handler:
            self.finish({"error": self._reason})
        else:
            self.finish(self.render_string("error.html", status=status_code, why=self._reason))


def api_short(value: Any, limit: int = 100) -> str:
    from charlie.views import short

    return short(value, limit)


class AuthStatic(Redacted, tornado.web.StaticFileHandler):
    """The script and the style, to the token's holder only (nothing is served without it)."""

    def set_default_headers(self) -> None:
        for name, value in SECURITY_HEADERS.items():
            if name != "Cache-Control":
                self.set_header(name, value)

    def prepare(self) -> None:
        config: ConsoleConfig = self.settings["console"]
        cookie = self.get_signed_cookie(auth.SESSION_COOKIE, max_age_days=auth.SESSION_DAYS)
        bearer = auth.bearer(self.request.headers.get("Authorization"))
        if auth.session_of(cookie) is None and not auth.token_matches(bearer, config.token):
            self.set_status(401)
            self.finish("this console needs its token")


class TasksPage(Base):
    template = "tasks.html"

    async def get(self) -> None:
        statuses = [s for s in self.get_query_arguments("status") if s in STATUSES]
        search = self.get_query_argument("q", "").strip() or None
        before = self.get_query_argument("before", None) or None
        try:
            limit = min(max(int(self.get_query_argument("limit", str(PAGE))), 1), MAX_PAGE)
        except ValueError:
            limit = PAGE
        try:
            data = await self.run(load_list, statuses, search, before, limit)
        except TaskNotFound:  # the page's last task is gone: start again from the newest
            before = None
            data = await self.run(load_list, statuses, search, None, limit)
        query = [("status", s) for s in statuses] + ([("q", search)] if search else [])
        query += [("limit", str(limit))] if limit != PAGE else []
        base = urlencode(query)
        live = urlencode(query + ([("before", before)] if before else []))
        self.render(
            self.template,
            statuses=statuses,
            search=search or "",
            before=before,
            base_query=base,
            live_query=live,
            **data,
        )


class TasksFragment(TasksPage):
    template = "fragment_tasks.html"


#: the cookie that carries an action's result to the page it redirects to
FLASH_COOKIE = "charlie_flash"


class TaskPage(Base):
    template = "task.html"

    async def get(self, task_id: str) -> None:
        all_rows = self.get_query_argument("all", "") == "1"
        try:
            data = await self.run(load_task, task_id, all_rows)
        except TaskNotFound:
            raise tornado.web.HTTPError(404, reason=f"no task {task_id}") from None
        flash = None
        if self.template == "task.html":
            raw = self.get_signed_cookie(FLASH_COOKIE, max_age_days=1)
            if raw:
                self.clear_cookie(
                    FLASH_COOKIE, samesite="Strict", **cookie_options(self.config, self.request)
                )
                try:
                    flash = json.loads(raw)
                except ValueError:
                    flash = None
        self.render(self.template, task_id=task_id, flash=flash, **data)


class TaskFragment(TaskPage):
    template = "fragment_task.html"


def load_call(task_id: str, turn: int, call_id: str) -> rows.CallView | None:
    found = rows.transcript_rows(
        api.transcript(task_id), api.calls(task_id), full=True, actions=api.actions(task_id)
    )
    return next(
        (r.call for r in found if r.call and r.call.call_id == call_id and r.turn == turn), None
    )


class CallFragment(Base):
    """One call's whole record (arguments, result, evidence): what an opened row shows."""

    async def get(self, task_id: str, turn: str, call_id: str) -> None:
        try:
            call = await self.run(load_call, task_id, int(turn), call_id)
        except TaskNotFound:
            call = None
        if call is None:
            raise tornado.web.HTTPError(
                404, reason=f"no call {call_id} in turn {turn} of {task_id}"
            )
        self.render("fragment_call.html", c=call)


class TaskForm(Base):
    """A form's action: done as the API does, then back to the page, which shows the result."""

    async def post(self, task_id: str, action: str) -> None:
        body = {k: self.get_body_argument(k) for k in self.request.body_arguments}
        flash: dict[str, Any]
        try:
            record = await self.run(perform, self.config, task_id, action, body)
            flash = {"ok": True, "text": describe(record), "action": record.action.value}
            if record.action.value == "fork" and (record.detail or {}).get("fork"):
                flash["link"] = str(record.detail["fork"])
        except Exception as exc:
            refused = refusal(exc)
            if refused is None:
                raise
            flash = {"ok": False, "text": refused[1], "action": action}
        self.set_signed_cookie(
            FLASH_COOKIE,
            json.dumps(flash),
            expires_days=None,
            samesite="Strict",
            **cookie_options(self.config, self.request),
        )
        self.redirect(f"/tasks/{url_escape(task_id, plus=False)}#result", status=303)


class ApiBase(Base):
    api_handler = True

    def set_default_headers(self) -> None:
        super().set_default_headers()
        self.set_header("Content-Type", "application/json; charset=utf-8")

    def send(self, value: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(dumps(value))

    async def answer(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            value = await self.run(fn, *args)
        except Exception as exc:
            refused = refusal(exc)
            if refused is None:
                raise
            self.send({"error": refused[1]}, refused[0])
            return
        self.send(value)


class ApiTasks(ApiBase):
    async def get(self) -> None:
        def page() -> dict[str, Any]:
            limit = int(self.get_query_argument("limit", str(PAGE)))
            tasks = api.list_tasks(
                status=self.get_query_arguments("status") or None,
                parent=self.get_query_argument("parent", None),
                search=self.get_query_argument("q", None),
                before=self.get_query_argument("before", None),
                limit=limit,
            )
            return {"tasks": tasks, "next_before": tasks[-1].id if len(tasks) == limit else None}

        await self.answer(page)


class ApiTask(ApiBase):
    READS: dict[str | None, Callable[[str], Any]] = {
        None: api.get_task,
        "transcript": api.transcript,
        "calls": api.calls,
        "history": api.history,
        "actions": api.actions,
        "revision": lambda task_id: {"revision": api.revision(task_id)},
        "children": lambda task_id: api.list_tasks(parent=task_id, limit=1000),
    }

    async def get(self, task_id: str, what: str | None = None) -> None:
        reader = self.READS.get(what)
        if reader is None:
            self.send({"error": f"unknown read {what!r}"}, 404)
            return
        await self.answer(reader, task_id)


class ApiExport(ApiBase):
    """The task's record as a case file for `charlie replay` (charlie/replay/export.py): a
    download, secrets blanked (I35)."""

    async def get(self, task_id: str) -> None:
        from charlie.replay.export import export_task

        try:
            case = await self.run(export_task, task_id)
        except Exception as exc:
            refused = refusal(exc)
            if refused is None:
                raise
            self.send({"error": refused[1]}, refused[0])
            return
        name = re.sub(r"[^A-Za-z0-9._-]", "_", task_id)[:100] or "task"
        self.set_header("Content-Disposition", f'attachment; filename="{name}.case.json"')
        self.send(case)


#: at most this many events in one answer of the events read
EVENTS_PAGE = 500


def load_events(task_id: str, after: str | None) -> dict[str, Any]:
    """What streamed since ``after`` (not following: what is there now), and the offset to ask
    from next. Off or unavailable: ``{"off": why}``, and the page hides its live panel."""
    out: list[dict[str, Any]] = []
    try:
        for event in api.events(task_id, after=after or None, follow=False):
            out.append({"offset": event.offset, **event.data})
            after = event.offset
            if len(out) >= EVENTS_PAGE:
                break
    except api.StreamUnavailable as exc:
        return {"events": [], "next": after, "off": str(exc)}
    return {"events": out, "next": after}


class ApiEvents(ApiBase):
    async def get(self, task_id: str) -> None:
        await self.answer(load_events, task_id, self.get_query_argument("after", None))


class ApiAction(ApiBase):
    async def post(self, task_id: str, action: str) -> None:
        try:
            body = json.loads(self.request.body or b"{}")
        except ValueError as exc:
            self.send({"error": f"the body is not JSON: {exc}"}, 400)
            return
        if not isinstance(body, dict):
            self.send({"error": "the body must be a JSON object"}, 400)
            return
        await self.answer(perform, self.config, task_id, action, body)


class NotFound(Base):
    def prepare(self) -> None:
        super().prepare()
        if not self._finished:
            raise tornado.web.HTTPError(404, reason="no such page")


class WrongHost(Redacted):
    """A request for a ``Host`` the console does not answer to (a DNS rebinding page's):
    refused before anything else, a form check or a login included."""

    def set_default_headers(self) -> None:
        for name, value in SECURITY_HEADERS.items():
            self.set_header(name, value)
        self.set_header("Content-Type", "text/plain; charset=utf-8")

    def check_xsrf_cookie(self) -> None:
        pass  # refused in prepare whatever it carries

    def prepare(self) -> None:
        self.set_status(403)
        host = (self.request.host or "")[:100]
        self.finish(
            f"this console does not answer to the host {host!r}; its operator can allow it "
            "with --allowed-host or CHARLIE_UI_ALLOWED_HOSTS\n"
        )


class ConsoleApp(tornado.web.Application):
    """The console's application: a request whose ``Host`` is not allowed goes to WrongHost,
    whatever its path."""

    def find_handler(
        self, request: tornado.httputil.HTTPServerRequest, **kwargs: Any
    ) -> tornado.web._HandlerDelegate:
        hosts: guard.AllowedHosts = self.settings["allowed_hosts"]
        if not hosts.allows(request.headers.get("Host")):
            return self.get_handler_delegate(request, WrongHost)
        return super().find_handler(request, **kwargs)


def make_app(
    config: ConsoleConfig, hosts: guard.AllowedHosts, *, threads: int = 8
) -> tornado.web.Application:
    actions = "(" + "|".join(ACTIONS) + ")"
    reads = "(transcript|calls|history|actions|revision|children)"
    return ConsoleApp(
        [
            (r"/", TasksPage),
            (r"/live/tasks", TasksFragment),
            (rf"/tasks/{TASK_ID}", TaskPage),
            (rf"/live/tasks/{TASK_ID}", TaskFragment),
            (rf"/live/tasks/{TASK_ID}/calls/([0-9]+)/([^/]+)", CallFragment),
            (rf"/tasks/{TASK_ID}/{actions}", TaskForm),
            (r"/api/tasks", ApiTasks),
            (rf"/api/tasks/{TASK_ID}", ApiTask),
            (rf"/api/tasks/{TASK_ID}/{reads}", ApiTask),
            (rf"/api/tasks/{TASK_ID}/events", ApiEvents),
            (rf"/api/tasks/{TASK_ID}/export", ApiExport),
            (rf"/api/tasks/{TASK_ID}/{actions}", ApiAction),
        ],
        template_path=str(HERE / "templates"),
        static_path=str(HERE / "static"),
        static_handler_class=AuthStatic,
        default_handler_class=NotFound,
        cookie_secret=auth.cookie_secret(config.token),
        # every post is checked (Base.check_xsrf_cookie: the session's own form token, no
        # cookie of its own), and a browser's post from another origin is refused besides
        xsrf_cookies=True,
        xsrf_key=auth.xsrf_key(config.token),
        cross_origin_protection=True,
        allowed_hosts=hosts,
        log_function=log_request,
        autoescape="xhtml_escape",
        # the templates' own line breaks and indents, not the data's (a <pre> keeps its text)
        template_whitespace="oneline",
        compiled_template_cache=True,
        console=config,
        pool=ThreadPoolExecutor(max_workers=threads, thread_name_prefix="console"),
    )


def serve(
    config: ConsoleConfig,
    host: str,
    port: int,
    *,
    announce: Callable[[int], None],
) -> None:
    """Serve until SIGTERM or SIGINT. ``announce`` is told the port (``0`` picks a free one).
    The allowed hosts are built with the port bound (guard.AllowedHosts)."""

    async def main() -> None:
        sockets = tornado.netutil.bind_sockets(port, address=host)
        bound = int(sockets[0].getsockname()[1])
        app = make_app(config, guard.AllowedHosts.build(host, bound, config.allowed_hosts))
        server = tornado.httpserver.HTTPServer(app, xheaders=False)
        server.add_sockets(sockets)
        announce(bound)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        server.stop()
        app.settings["pool"].shutdown(wait=False, cancel_futures=True)

    asyncio.run(main())
