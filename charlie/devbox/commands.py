"""Commands by execution id (I20): start detached, poll from anywhere, survive nothing silently.

Each command gets a uuid execution id and a directory ``root/commands/<id>/`` holding
``meta.json`` (argv, workspace, pid, status, exit code, times; always replaced atomically) and
its ``stdout``/``stderr`` files. Status is read from that directory, so any worker can poll a
command by id, and a devbox restarted on the same root still answers for commands it did not
start.

The process runs in its own session (``start_new_session``) so it is not tied to the request
thread or to any worker, and so one ``killpg`` ends it and everything it spawned. Its output
comes through pipes that a reader thread per stream copies into the files under a byte budget;
past the budget bytes are read and dropped, so a chatty command never blocks on a full pipe.

Outcomes a devbox cannot vouch for are never reported as success: a command that was running
when the devbox stopped or died is ``lost``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from charlie.devbox.errors import ApiError
from charlie.devbox.paths import check_execution_id, tree_bytes
from charlie.sandbox import BWRAP_ENV, SandboxPolicy, wrap

log = logging.getLogger(__name__)

RUNNING = "running"
EXITED = "exited"
TIMED_OUT = "timed_out"
CANCELLED = "cancelled"
LOST = "lost"
#: killed because its workspace grew past the per-workspace disk cap.
KILLED = "killed"

#: how long to wait for a command's output pipes to close after it exits before killing what
#: is left of its process group (a background child still holding stdout).
_DRAIN_SECONDS = 2.0
#: how often a running command's workspace is measured against the disk cap
_DISK_CHECK_SECONDS = 1.0
_CHUNK = 64 * 1024


def now_iso() -> str:
    return datetime.now(UTC).isoformat()


def truncation_marker(limit: int) -> bytes:
    return f"\n[output truncated at {limit} bytes]\n".encode()


def write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` so a reader (or a restart) sees the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def proc_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), or None if it is gone.

    Recorded at start so a restarted devbox can tell its command from an unrelated process that
    later got the same pid.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None  # a zombie has finished; nothing is left to kill
    return int(fields[19])


def kill_group(pid: int) -> None:
    """SIGKILL the command's process group (its pgid is its pid: it leads its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class _Capture:
    """Copies one output pipe into a file, keeping at most ``limit`` bytes and dropping the rest."""

    def __init__(self, pipe: IO[bytes], path: Path, limit: int) -> None:
        self.path = path
        self.limit = limit
        self.total = 0  # bytes the command wrote, dropped ones included
        self.kept = 0
        self.truncated = False
        self._pipe = pipe
        self.thread = threading.Thread(target=self._run, name=f"devbox-capture-{path}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        fd = self._pipe.fileno()
        with open(self.path, "ab") as out:
            while chunk := os.read(fd, _CHUNK):
                self.total += len(chunk)
                room = self.limit - self.kept
                if room > 0:
                    out.write(chunk[:room])
                    self.kept += min(room, len(chunk))
                if len(chunk) > room and not self.truncated:
                    self.truncated = True
                    out.write(truncation_marker(self.limit))
                out.flush()  # pollers read the file while the command runs
        self._pipe.close()


@dataclass
class _Running:
    execution_id: str
    proc: subprocess.Popen[bytes]
    timeout: float
    stdout: _Capture
    stderr: _Capture
    workspace: Path | None = None
    #: set by cancel() or by the devbox stopping; read by the watcher to name the outcome.
    stop_status: str | None = None
    stop_reason: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: set once the outcome is on disk.
    finished: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class StartRequest:
    workspace_id: str
    workspace_path: Path
    #: what is executed; a shell string arrives here as ["/bin/sh", "-c", shell]
    argv: list[str]
    shell: str | None
    cwd: Path
    env: dict[str, str]
    timeout: float
    #: a caller's key for this start: starting again with the same key (in the same workspace)
    #: returns the first command's execution id instead of running it twice.
    idempotency_key: str | None = None
    #: the sandbox's view for this command (None: the operator opted out of the sandbox).
    sandbox: SandboxPolicy | None = None


class CommandRunner:
    """Starts commands, watches them to the end, and answers status by execution id from disk."""

    def __init__(self, root: Path, output_bytes: int, workspace_bytes: int | None = None) -> None:
        self.dir = root / "commands"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.output_bytes = output_bytes
        #: the per-workspace disk cap also binds what commands write, checked as they run
        self.workspace_bytes = workspace_bytes
        self._running: dict[str, _Running] = {}
        self._lock = threading.Lock()
        self._keys = self.dir / "by-key"
        self._keys.mkdir(exist_ok=True)
        self._keys_lock = threading.Lock()
        self._stopping = False

    # -- start ---------------------------------------------------------------------------------

    def start(self, req: StartRequest) -> dict[str, Any]:
        if req.idempotency_key is None:
            return self._start(req)
        # The key file is written, after the command's metadata and before its process, under
        # a lock: a second start with the key finds it (across devbox restarts too) and gets
        # the first command back, so a caller that lost the answer can ask again safely.
        key_file = self._key_file(req.workspace_id, req.idempotency_key)
        with self._keys_lock:
            existing = _read_key(key_file)
            if existing.startswith(SEALED):
                # A lookup found no command under this key and sealed it: the
                # caller settled its call as interrupted, so no start under the key may follow.
                raise ApiError(
                    409,
                    "a lookup found no command with this idempotency key and sealed it; "
                    "the command is not started under this key",
                )
            if existing and (self.dir / existing / "meta.json").is_file():
                meta = self._meta(existing)
                return {
                    "execution_id": existing,
                    "status": meta["status"],
                    "timeout": meta["timeout"],
                    "created": False,
                }
            return self._start(req, key_file)

    def _key_file(self, workspace_id: str, key: str) -> Path:
        digest = hashlib.sha256(f"{workspace_id}\0{key}".encode()).hexdigest()
        return self._keys / digest

    def find(self, workspace_id: str, key: str) -> dict[str, Any]:
        """Find the command started under ``key`` in the workspace, never starting one.

        For a caller that cannot tell whether an earlier attempt started its command (it died
        before recording the execution id): found, it observes that command; not found, the
        key is sealed, so a start with it that is still on its way (from a holder that lost its
        lease, or a retry) is refused rather than run, and the caller may report the command as
        not confirmed without it ever running later (I10)."""
        key_file = self._key_file(workspace_id, key)
        with self._keys_lock:
            existing = _read_key(key_file)
            sealed = existing.startswith(SEALED)
            if existing and not sealed and (self.dir / existing / "meta.json").is_file():
                meta = self._meta(existing)
                return {
                    "execution_id": existing,
                    "status": meta["status"],
                    "timeout": meta["timeout"],
                    "created": False,
                }
            if not sealed:
                _write_text_atomic(key_file, f"{SEALED} {now_iso()}")
            return {"execution_id": None, "sealed": True}

    def _start(self, req: StartRequest, key_file: Path | None = None) -> dict[str, Any]:
        execution_id = str(uuid.uuid4())
        cdir = self.dir / execution_id
        cdir.mkdir()
        meta: dict[str, Any] = {
            "execution_id": execution_id,
            "workspace_id": req.workspace_id,
            "argv": req.argv,
            "shell": req.shell,
            "cwd": str(req.cwd),
            "timeout": req.timeout,
            "started_at": now_iso(),
            "pid": None,
            "status": RUNNING,
            "exit_code": None,
            "finished_at": None,
            "reason": None,
        }
        # Recorded before the process exists: if the devbox dies right after the spawn, a
        # restart finds the id and reports it lost instead of not knowing it at all.
        write_json_atomic(cdir / "meta.json", meta)
        if key_file is not None:
            _write_text_atomic(key_file, execution_id)
        with self._lock:
            if self._stopping:
                _forget(cdir, key_file)
                raise ApiError(503, "the devbox is shutting down")
            try:
                proc = self._spawn(req, cdir)
            except OSError as exc:
                _forget(cdir, key_file)
                raise ApiError(400, f"cannot start command {req.argv[0]!r}: {exc}") from exc
            assert proc.stdout is not None and proc.stderr is not None
            run = _Running(
                execution_id=execution_id,
                proc=proc,
                timeout=req.timeout,
                stdout=_Capture(proc.stdout, cdir / "stdout", self.output_bytes),
                stderr=_Capture(proc.stderr, cdir / "stderr", self.output_bytes),
                workspace=req.workspace_path,
            )
            self._running[execution_id] = run
        meta["pid"] = proc.pid
        meta["proc_start_ticks"] = proc_start_ticks(proc.pid)
        write_json_atomic(cdir / "meta.json", meta)
        threading.Thread(
            target=self._watch, args=(run, meta), name=f"devbox-watch-{execution_id}", daemon=True
        ).start()
        return {
            "execution_id": execution_id,
            "status": RUNNING,
            "timeout": req.timeout,
            "created": True,
        }

    @staticmethod
    def _spawn(req: StartRequest, cdir: Path) -> subprocess.Popen[bytes]:
        # the files exist from the start so a status right after start reads empty output
        (cdir / "stdout").touch()
        (cdir / "stderr").touch()
        argv, env = req.argv, req.env
        if req.sandbox is not None:
            # bubblewrap would start and fail inside; a program that is not there is the
            # caller's error (400), as it is without the sandbox
            if shutil.which(req.argv[0], path=req.env.get("PATH"), mode=os.X_OK) is None and not (
                os.sep in req.argv[0] and os.access(req.cwd / req.argv[0], os.X_OK)
            ):
                raise FileNotFoundError(2, "No such file or directory", req.argv[0])
            # the request's environment is set inside the sandbox; bubblewrap itself (and the
            # network launcher) run with a fixed minimal one, so nothing a request names is
            # acted on outside the sandbox
            argv, env = wrap(req.argv, req.sandbox, req.cwd, env=req.env), dict(BWRAP_ENV)
        return subprocess.Popen(
            argv,
            cwd=req.cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # detached from the devbox and killable as one group
            close_fds=True,  # never inherit the devbox's socket or its root lock
        )

    # -- watch ---------------------------------------------------------------------------------

    def _watch(self, run: _Running, meta: dict[str, Any]) -> None:
        timed_out = False
        exit_code: int | None = None
        deadline = time.monotonic() + run.timeout
        while exit_code is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                kill_group(run.proc.pid)
                exit_code = run.proc.wait()
                break
            try:
                exit_code = run.proc.wait(timeout=min(_DISK_CHECK_SECONDS, remaining))
            except subprocess.TimeoutExpired:
                self._check_disk(run)
        for capture in (run.stdout, run.stderr):
            capture.thread.join(_DRAIN_SECONDS)
        if run.stdout.thread.is_alive() or run.stderr.thread.is_alive():
            # a background child still holds the pipes: it belongs to the finished command
            kill_group(run.proc.pid)
            run.stdout.thread.join()
            run.stderr.thread.join()
        with run.lock:
            status, reason = self._outcome(run, timed_out)
        if status == LOST:
            exit_code = None  # the code is our own SIGKILL, not anything the command did
        meta.update(
            status=status,
            exit_code=exit_code,
            finished_at=now_iso(),
            reason=reason,
            stdout_bytes=run.stdout.total,
            stderr_bytes=run.stderr.total,
            stdout_truncated=run.stdout.truncated,
            stderr_truncated=run.stderr.truncated,
        )
        write_json_atomic(self.dir / run.execution_id / "meta.json", meta)
        with self._lock:
            self._running.pop(run.execution_id, None)
        run.finished.set()

    def _check_disk(self, run: _Running) -> None:
        if self.workspace_bytes is None or run.workspace is None:
            return
        used = tree_bytes(run.workspace)
        if used > self.workspace_bytes:
            with run.lock:
                if run.stop_status is None:
                    run.stop_status = KILLED
                    run.stop_reason = (
                        f"killed: the workspace grew to {used} bytes, over its disk cap of "
                        f"{self.workspace_bytes} bytes"
                    )
            kill_group(run.proc.pid)

    @staticmethod
    def _outcome(run: _Running, timed_out: bool) -> tuple[str, str | None]:
        if run.stop_status is not None:
            return run.stop_status, run.stop_reason
        if timed_out:
            return TIMED_OUT, f"killed after the {run.timeout:g}s timeout"
        return EXITED, None

    # -- status and cancel ---------------------------------------------------------------------

    def status(self, execution_id: str, tail: int) -> dict[str, Any]:
        meta = self._meta(execution_id)
        cdir = self.dir / execution_id
        with self._lock:
            run = self._running.get(execution_id)
        if run is not None and meta["status"] == RUNNING:
            out_bytes, err_bytes = run.stdout.total, run.stderr.total
            truncated = run.stdout.truncated or run.stderr.truncated
        else:
            out_bytes = meta.get("stdout_bytes", _size(cdir / "stdout"))
            err_bytes = meta.get("stderr_bytes", _size(cdir / "stderr"))
            truncated = bool(meta.get("stdout_truncated") or meta.get("stderr_truncated"))
        return {
            "execution_id": execution_id,
            "workspace_id": meta["workspace_id"],
            "status": meta["status"],
            "exit_code": meta["exit_code"],
            "started_at": meta["started_at"],
            "finished_at": meta["finished_at"],
            "reason": meta.get("reason"),
            "pid": meta.get("pid"),
            "stdout_tail": _tail(cdir / "stdout", tail),
            "stderr_tail": _tail(cdir / "stderr", tail),
            "stdout_bytes": out_bytes,
            "stderr_bytes": err_bytes,
            "truncated": truncated,
        }

    def cancel(self, execution_id: str, tail: int) -> dict[str, Any]:
        """Kill the command's process group; a finished command is left as it ended."""
        self._meta(execution_id)  # 404 for unknown ids
        with self._lock:
            run = self._running.get(execution_id)
        if run is not None:
            self._stop_run(run, CANCELLED, "cancelled by request")
            self._wait_finished(run)
        return self.status(execution_id, tail)

    def _stop_run(self, run: _Running, status: str, reason: str) -> None:
        with run.lock:
            if run.stop_status is None:
                run.stop_status, run.stop_reason = status, reason
        kill_group(run.proc.pid)

    @staticmethod
    def _wait_finished(run: _Running, timeout: float = 10.0) -> None:
        """Wait until the watcher has recorded the outcome, so the answer shows it."""
        if not run.finished.wait(timeout):
            log.warning("devbox: command %s did not finish after SIGKILL", run.execution_id)

    def workspace_of(self, execution_id: str) -> str:
        """The workspace a command runs in (404 for unknown ids)."""
        return str(self._meta(execution_id)["workspace_id"])

    def _meta(self, execution_id: str) -> dict[str, Any]:
        check_execution_id(execution_id)
        path = self.dir / execution_id / "meta.json"
        try:
            data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ApiError(404, f"no command with execution id {execution_id!r}") from None
        return data

    # -- lifecycle -----------------------------------------------------------------------------

    def recover(self) -> list[str]:
        """At startup: every command still ``running`` on disk was started by an earlier devbox
        process, whose pipes and watcher died with it, so its outcome is unknowable. Kill what is
        left of it (only if the pid is provably the same process, by its start time, and leads
        its own session) so it cannot keep changing the workspace, and record it ``lost``.
        """
        lost: list[str] = []
        for meta_path in sorted(self.dir.glob("*/meta.json")):
            try:
                meta = json.loads(meta_path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                log.warning("devbox: unreadable command metadata %s", meta_path)
                continue
            if meta.get("status") != RUNNING:
                continue
            killed = _kill_orphan(meta)
            cdir = meta_path.parent
            meta.update(
                status=LOST,
                finished_at=now_iso(),
                reason="the devbox restarted while the command was running; its outcome is "
                "unknown" + (" (its leftover processes were killed)" if killed else ""),
                stdout_bytes=_size(cdir / "stdout"),
                stderr_bytes=_size(cdir / "stderr"),
                stdout_truncated=_size(cdir / "stdout") > self.output_bytes,
                stderr_truncated=_size(cdir / "stderr") > self.output_bytes,
            )
            write_json_atomic(meta_path, meta)
            lost.append(meta["execution_id"])
        if lost:
            log.warning("devbox: marked %d command(s) lost after restart: %s", len(lost), lost)
        return lost

    def shutdown(self) -> None:
        """Stop: kill every running command and record it lost, since no devbox will watch it."""
        with self._lock:
            self._stopping = True
            runs = list(self._running.values())
        for run in runs:
            self._stop_run(run, LOST, "the devbox stopped while the command was running")
        for run in runs:
            self._wait_finished(run)


def _kill_orphan(meta: Mapping[str, Any]) -> bool:
    pid = meta.get("pid")
    if not isinstance(pid, int):
        return False  # never spawned, or died before its pid was recorded
    ticks = proc_start_ticks(pid)
    if ticks is None:
        return False  # already gone
    recorded = meta.get("proc_start_ticks")
    if recorded is not None and recorded != ticks:
        return False  # the pid now belongs to another process
    try:
        if os.getsid(pid) != pid:
            return False  # not a session leader we started
    except ProcessLookupError:
        return False
    kill_group(pid)
    return True


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


#: what a key file holds once a lookup found no command under its key (see CommandRunner.find).
SEALED = "sealed"


def _read_key(key_file: Path) -> str:
    try:
        return key_file.read_text().strip()
    except FileNotFoundError:
        return ""


def _forget(cdir: Path, key_file: Path | None) -> None:
    """Undo a start that never spawned its process."""
    if key_file is not None:
        key_file.unlink(missing_ok=True)
    shutil.rmtree(cdir, ignore_errors=True)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _tail(path: Path, nbytes: int) -> str:
    """The last ``nbytes`` of an output file as text (a split character becomes U+FFFD)."""
    if nbytes <= 0:
        return ""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - nbytes))
            return f.read(nbytes).decode("utf-8", errors="replace")
    except OSError:
        return ""
