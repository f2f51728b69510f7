"""Run the demo: the release engineer's story from the design, through a real devbox.

On the embedded default it needs no servers: it builds a small git repository from the bundled
sample (a 2.3 commit and the 2.4 configuration change that broke '#' comments), starts a devbox
in this process (a generated token; its URL and token go to the worker through its environment),
starts a worker with beat, and submits a task whose metadata names the repository, a branch and
the base commit. The scripted model inspects the parser, runs the focused failing test, patches,
delegates a compatibility check to a child task (which runs the ';' comment test in the same
workspace) and waits for it, revises the patch, runs the suite, commits and reports. Every
command, file and git operation goes through the devbox; the transcript printed here shows each
command's execution id and how it was observed.

With ``CHARLIE_DEVBOX_URL``/``CHARLIE_DEVBOX_TOKEN`` set, that devbox is used instead of starting
one (it must be able to read the repository path the demo creates under ``CHARLIE_HOME``, and
allow it: ``--allow-repo`` with that directory or one above it).

``charlie demo --model openai:NAME`` (or ``openai-responses:NAME``, ``anthropic:NAME``) gives the
same task, repository, devbox and tools to a real provider's model instead of the script (it may
delegate to that same model): the provider's key and base URL as the model clients read them
(:func:`provider_settings`). What a real model does is its own: the demo succeeds when the task
does, and says whether it committed a fix.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import click

from charlie import api
from charlie.config import settings
from charlie.devbox import DevboxClient, DevboxServer, Limits, RepoPolicy
from charlie.home import prepare as prepare_home
from charlie.sandbox import bwrap_problem
from charlie.terminal import printable
from charlie.tools.devbox_tools import devbox_metadata, workspace_id_for
from charlie.views import short

HERE = Path(__file__).parent
BRANCH = "fix/hash-comments"
PROMPT = (
    "The 2.4 configuration change broke parsing of existing config files. Find the regression "
    "in the confparse repository, fix it without losing the new behaviour, prove it with the "
    "test suite, and commit the fix."
)

#: confparse as released in 2.3, before the configuration change.
SETTINGS_2_3 = '''"""Parser settings."""

# Lines starting with one of these are comments.
COMMENT_PREFIXES = ("#",)

# Whitespace around keys and values is stripped.
STRIP_WHITESPACE = True
'''
TESTS_2_3 = """import unittest

from confparse import parse


class ParserTest(unittest.TestCase):
    def test_pairs(self) -> None:
        self.assertEqual(parse("a = 1\\nb=2"), {"a": "1", "b": "2"})

    def test_hash_comments_are_ignored(self) -> None:
        self.assertEqual(parse("# note\\na = 1"), {"a": "1"})


if __name__ == "__main__":
    unittest.main()
"""


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=Release Bot", "-c", "user.email=release@confparse.test", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def make_repository(dest: Path) -> Path:
    """The sample as a git repository: 2.3, then the 2.4 change that introduced the bug."""
    shutil.copytree(HERE / "sample_repo", dest)
    changed = ("confparse/settings.py", "tests/test_parser.py")
    released = {path: (dest / path).read_text() for path in changed}
    (dest / "confparse/settings.py").write_text(SETTINGS_2_3)
    (dest / "tests/test_parser.py").write_text(TESTS_2_3)
    _git(dest, "init", "-q", "-b", "main")
    _git(dest, "add", "-A")
    _git(dest, "commit", "-q", "-m", "confparse 2.3")
    for path, text in released.items():
        (dest / path).write_text(text)
    _git(dest, "commit", "-q", "-am", "2.4: configurable comment prefixes (support ';' comments)")
    return dest


def _write_scripts(into: Path) -> str:
    """The parent's script, pointing its delegation at the child's script; returns its spec."""
    child = into / "compat_check.json"
    shutil.copyfile(HERE / "compat_check.json", child)
    turns = json.loads((HERE / "script.json").read_text())
    for turn in turns:
        for call in turn.get("tool_calls", []):
            if call["name"] == "delegate":
                call["arguments"]["model"] = f"scripted:{child}"
    parent = into / "script.json"
    parent.write_text(json.dumps(turns, indent=1))
    return f"scripted:{parent}"


def _start_worker(home: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(home / "demo-worker.log", "ab") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "charlie",
                "worker",
                "-c",
                "2",
                "-B",
                "--schedule",
                str(home / "demo-beat-schedule"),
                "--loglevel",
                "WARNING",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        # TERM to the main process only: it shuts its pool down; signalling the whole group
        # makes the children die under it and the warm shutdown wait for them.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- the transcript, with what the devbox did ------------------------------------------------


def _tail_lines(result: dict[str, Any], count: int = 5) -> list[str]:
    text = "\n".join(str(result.get(k) or "") for k in ("stdout", "stderr"))
    lines = [line for line in text.splitlines() if line.strip() and not set(line) <= {"-", "="}]
    return lines[-count:]


def _details(call: api.CallRecord) -> list[str]:
    """What one tool call did, in a line or two (the devbox's side of it)."""
    result: Any = call.result
    data = result if isinstance(result, dict) else {}
    out: list[str] = []
    if call.name == "run_command" and data.get("execution_id"):
        how = (
            f"it ran on in the devbox while no worker waited for it; worker "
            f"{data.get('observed_by')} saw it end"
            if data.get("resumed")
            else f"worker {data.get('observed_by')} saw it end"
        )
        status = data.get("status")
        code = f"exit {data.get('exit_code')}" if status == "exited" else status
        out.append(f"devbox execution {data['execution_id']} — {code}; {how}")
        out += [f"| {line}" for line in _tail_lines(data)]
    elif call.name == "delegate" and "task_id" in data:
        out.append(f"child task {data['task_id']}")
    elif call.name == "apply_patch" and data.get("applied"):
        out.append(f"patched {', '.join(data.get('files', []))}")
    elif call.name == "git_diff" and "diff" in data:
        out += [
            f"| {line}"
            for line in str(data["diff"]).splitlines()
            if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))
        ]
    elif call.name == "git_commit" and "commit" in data:
        out.append(
            f"commit {data['commit'][:12]} on {data.get('branch')} "
            f"(idempotency key {data.get('idempotency_key')})"
        )
    elif call.name == "list_files" and isinstance(result, list):
        out.append(", ".join(str(r) for r in result))
    elif call.name == "read_file" and isinstance(result, str):
        out.append(f"{len(result.splitlines())} lines")
    elif call.name == "wait_for_task" and "status" in data:
        out.append(f"child {data.get('status')}: {short(data.get('result', {}).get('answer'), 90)}")
    elif "error" in data:
        out.append(short(data["error"], 110))
    return out


def transcript_lines(task_id: str, after_seq: int = -1, indent: str = "") -> list[tuple[int, str]]:
    """(seq, text) for the task's settled transcript after ``after_seq``: messages, and each tool
    call with its outcome and the devbox's side of it; a delegated child's transcript is shown
    where the parent's wait for it returns."""
    entries = api.transcript(task_id)
    by_call = {(c.turn, c.call_id): c for c in api.calls(task_id)}
    results = {(e.turn, e.call_id) for e in entries if e.kind == "tool_result"}
    rows: list[tuple[int, str]] = []
    for entry in entries:
        if entry.seq <= after_seq or entry.kind in ("tool_result", "input"):
            continue
        payload = entry.payload
        nested: list[str] = []
        if entry.kind == "tool_call":
            key = (entry.turn, entry.call_id or "")
            if key not in results:
                break  # shown once the turn has settled, so nothing printed ever changes
            call = by_call[key]
            took = (
                f"{(call.settled_at - call.started_at).total_seconds():.1f} s"
                if call.settled_at and call.started_at
                else "-"
            )
            args = short(payload.get("raw_arguments", ""), 70)
            lines = [f"  ↳ {call.name}({args})  [{call.outcome}, {took}]"]
            lines += [f"      {d}" for d in _details(call)]
            if call.name == "wait_for_task" and call.outcome == "ok":
                child = str(call.arguments.get("task_id"))
                inner = indent + " " * 11
                nested.append(f"{inner}┌ child task {child}")
                nested += [text for _, text in transcript_lines(child, indent=inner + "│ ")]
                nested.append(f"{inner}└")
        elif entry.kind == "final":
            lines = [f"final: {payload.get('content')}"]
        else:
            text = payload.get("content") or payload.get("summary") or ""
            lines = [f"{entry.kind}: {short(text, 140)}"]
        prefix = f"{entry.seq:>3} t{entry.turn}  "
        pad = " " * len(prefix)
        own = [indent + (prefix if i == 0 else pad) + line for i, line in enumerate(lines)]
        rows.append((entry.seq, "\n".join(own + nested)))
    return rows


# -- a real provider ---------------------------------------------------------------------------


class NoProvider(ValueError):
    """The demo cannot call the provider a model names: no key, or not a provider's model."""


def provider_settings(spec: str, environ: dict[str, str]) -> dict[str, str]:
    """What the demo's worker needs in its environment to call ``spec``'s provider: nothing
    for a key the model clients read already (``CHARLIE_MODEL_API_KEY`` with
    ``CHARLIE_MODEL_BASE_URL``, or ``CHARLIE_MODEL_<NAME>_API_KEY``, for ``openai:`` and
    ``openai-responses:``; ``ANTHROPIC_API_KEY`` with ``ANTHROPIC_BASE_URL``, or the per-model
    key, for ``anthropic:``); for OpenAI, the ``OPENAI_API_KEY`` (with ``OPENAI_BASE_URL``, the
    pair the OpenAI SDK reads) as those, when no CHARLIE_MODEL_ setting is made. A key goes only
    with its own base URL. Raises NoProvider naming what to set."""
    from charlie.models.retry import env_name

    provider, _, name = spec.partition(":")
    # the model's own key, as the model clients read it (charlie/models/openai.py)
    own = f"CHARLIE_MODEL_{env_name(name)}_API_KEY"
    if provider == "anthropic":
        if environ.get(own) or environ.get("ANTHROPIC_API_KEY"):
            return {}
        raise NoProvider(f"{spec} needs a key: set ANTHROPIC_API_KEY (or {own})")
    if provider not in ("openai", "openai-responses"):
        raise NoProvider(
            f"{spec!r} is not a provider's model: openai:NAME, openai-responses:NAME or "
            "anthropic:NAME"
        )
    if environ.get(own) or environ.get("CHARLIE_MODEL_API_KEY"):
        return {}
    key = environ.get("OPENAI_API_KEY", "").strip()
    if key and not environ.get("CHARLIE_MODEL_BASE_URL"):
        shared = {"CHARLIE_MODEL_API_KEY": key}
        url = environ.get("OPENAI_BASE_URL", "").strip()
        return {**shared, "CHARLIE_MODEL_BASE_URL": url} if url else shared
    raise NoProvider(
        f"{spec} needs a key: set OPENAI_API_KEY (and OPENAI_BASE_URL for another endpoint), "
        f"or CHARLIE_MODEL_API_KEY with CHARLIE_MODEL_BASE_URL, or {own}"
    )


# -- the run -----------------------------------------------------------------------------------


def run_demo(timeout: float = 120.0, model_spec: str | None = None) -> int:
    """The demo's task with its scripted model, or ``model_spec``'s (a real provider's)."""
    s = settings()
    provider_env: dict[str, str] = {}
    if model_spec is not None:
        try:
            provider_env = provider_settings(model_spec, dict(os.environ))
        except NoProvider as exc:
            click.echo(f"charlie demo: {exc}", err=True)
            return 2
    prepare_home(s.home)
    task_id = f"demo-{uuid.uuid4().hex[:8]}"
    here = s.home / "demo" / task_id
    here.mkdir(parents=True)
    if shutil.which("git") is None:
        click.echo("the demo needs git (the devbox keeps workspaces as git checkouts)", err=True)
        return 2
    repo = make_repository(here / "confparse")
    model = model_spec or _write_scripts(here)
    # a real model may delegate the compatibility check to itself; the script to its child's
    delegates = model_spec or f"scripted:{here / 'compat_check.json'}"
    started_devbox: DevboxServer | None = None
    if s.devbox_url and s.devbox_token:
        url, token = s.devbox_url, s.devbox_token
        where = f"devbox {url} (from CHARLIE_DEVBOX_URL)"
    else:
        token = secrets.token_urlsafe(24)
        no_sandbox = bwrap_problem()
        if no_sandbox:
            # The demo's own bundled commands only; a devbox started by an operator refuses to
            # run without a sandbox unless told --no-sandbox.
            click.echo(f"note: {no_sandbox}; the demo's commands run without a sandbox", err=True)
        # the devbox runs beside the demo's worker: its commands must not see the worker's state
        limits = Limits(sandbox="off" if no_sandbox else "bwrap", hidden=(s.home,))
        # the one repository the demo clones is the one it just made
        repos = RepoPolicy((str(repo),))
        started_devbox = DevboxServer(here / "devbox", token, limits=limits, repos=repos).start()
        url = started_devbox.url
        where = f"devbox {url} (started for the demo, root {started_devbox.root}, token generated)"
    metadata = {"devbox": devbox_metadata(str(repo), branch=BRANCH)}
    click.echo(
        f"Charlie demo — home {s.home}, database {s.database_url.split('://')[0]}, "
        f"broker {s.broker_url.split('://')[0]}"
    )
    click.echo(where)
    if model_spec is not None:
        click.echo(f"model {model_spec} (a real provider's, instead of the demo's script)")
    click.echo(
        f"repository {repo} @ {metadata['devbox']['base_commit'][:12]}, branch {BRANCH} "
        "(recorded in the task's metadata)"
    )
    env = {
        **os.environ,
        **provider_env,
        "CHARLIE_DEVBOX_URL": url,
        "CHARLIE_DEVBOX_TOKEN": token,
        # the compatibility check is delegated to a model of its own (its script), which a
        # child may use only when the operator allows it
        "CHARLIE_DELEGATE_MODELS": delegates,
        # every command is started, parked, and observed to its end by a later poll, the way a
        # long build would be; the sweep polls parked calls twice a second
        "CHARLIE_DEVBOX_INLINE_WAIT": os.environ.get("CHARLIE_DEVBOX_INLINE_WAIT", "0"),
        "CHARLIE_DEVBOX_POLL_INTERVAL": os.environ.get("CHARLIE_DEVBOX_POLL_INTERVAL", "0.3"),
        "CHARLIE_SWEEP_INTERVAL": os.environ.get("CHARLIE_SWEEP_INTERVAL", "0.5"),
    }
    worker = _start_worker(s.home, env)
    try:
        api.submit(PROMPT, model=model, task_id=task_id, metadata=metadata, timeout=timeout)
        click.echo(f"task {task_id} submitted\n")
        click.echo(f"user: {PROMPT}")
        shown = -1
        deadline = time.monotonic() + timeout + 10
        while time.monotonic() < deadline:
            for seq, line in transcript_lines(task_id, after_seq=shown):
                click.echo(printable(line, multiline=True))
                shown = seq
            if api.get_task(task_id).terminal:
                break
            if worker.poll() is not None:
                click.echo("the worker exited; see demo-worker.log", err=True)
                return 1
            time.sleep(0.2)
        for _, line in transcript_lines(task_id, after_seq=shown):
            click.echo(printable(line, multiline=True))
        return _summary(task_id, url, token, scripted=model_spec is None)
    finally:
        _stop(worker)
        if started_devbox is not None:
            started_devbox.stop()


def _summary(task_id: str, url: str, token: str, *, scripted: bool = True) -> int:
    info = api.get_task(task_id)
    elapsed = (info.finished_at - info.created_at).total_seconds() if info.finished_at else None
    click.echo(
        f"\ntask {task_id}: {info.status.value}"
        + (f" in {elapsed:.1f} s" if elapsed is not None else "")
        + f" — {info.model_calls} model calls, phase {info.phase}"
    )
    family = [task_id, f"{task_id}.4.compat"]
    commands = [
        c for t in family for c in _calls_or_none(t) if c.name == "run_command" and c.handle
    ]
    click.echo(
        f"devbox commands: {len(commands)}, each started once and observed by its execution id "
        f"({sum(1 for c in commands if (c.result or {}).get('resumed'))} picked up by a later poll)"
    )
    with DevboxClient(url, token) as devbox:
        workspace = devbox.get_workspace(workspace_id_for(task_id))
    commit = next((c.result for c in api.calls(task_id) if c.name == "git_commit"), None)
    committed = isinstance(commit, dict) and commit.get("commit") == workspace.head
    click.echo(  # the branch is the devbox's word, which a task's commands can set
        printable(
            f"devbox workspace {workspace.workspace_id}: branch {workspace.branch}, "
            f"HEAD {(workspace.head or '-')[:12]}" + (" (the fix commit)" if committed else "")
        )
    )
    click.echo(f"inspect it again with: charlie show {task_id}")
    click.echo(f"or in the run console: charlie ui --task {task_id}  (then open the address)")
    if not scripted:
        # a real model's run is its own: the task's end is the demo's
        click.echo("a fix was committed" if committed else "no fix commit was made")
        return 0 if info.status.value == "succeeded" else 1
    return 0 if info.status.value == "succeeded" and committed else 1


def _calls_or_none(task_id: str) -> list[api.CallRecord]:
    try:
        return api.calls(task_id)
    except Exception:
        return []
