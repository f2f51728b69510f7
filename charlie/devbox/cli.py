"""``devbox`` click group: ``charlie devbox serve`` (or ``python -m charlie.devbox serve``)."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from types import FrameType

import click

from charlie import logs
from charlie.devbox.credentials import WeakToken, check_token
from charlie.devbox.policy import DEFAULT_DENY, MIB, CommandPolicy, Limits, RepoPolicy
from charlie.devbox.server import DevboxServer
from charlie.sandbox import (
    NETWORK_STACKS,
    SandboxUnavailable,
    check_mode,
    networks_from_env,
    paths_from_env,
)


def _default_root() -> Path:
    # next to the rest of Charlie's state unless told otherwise
    return Path(os.environ.get("CHARLIE_HOME", ".charlie")) / "devbox"


@click.group(name="devbox")
def devbox() -> None:
    """The devbox: where agent commands run and workspaces live (it holds no run truth)."""


@devbox.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8765, show_default=True, type=int, help="0 picks a free port.")
@click.option(
    "--root",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="CHARLIE_DEVBOX_ROOT",
    default=None,
    help="Directory for workspaces and command records [env CHARLIE_DEVBOX_ROOT; "
    "default $CHARLIE_HOME/devbox].",
)
@click.option(
    "--token",
    envvar="CHARLIE_DEVBOX_TOKEN",
    default=None,
    help="Bearer token clients must send [env CHARLIE_DEVBOX_TOKEN; prefer the env var, "
    "since arguments are visible in ps].",
)
@click.option(
    "--allow-repo",
    "allow_repos",
    multiple=True,
    metavar="PATH_OR_GLOB",
    help="Where workspaces may be cloned or copied from (repeatable): a local directory "
    "(it and everything under it, by real path), a glob of paths, or a URL pattern such as "
    "'https://github.com/acme/*'. Default: none (only empty workspaces).",
)
@click.option("--allow", multiple=True, help="Only these programs may run (repeatable).")
@click.option(
    "--deny",
    multiple=True,
    help=f"Programs refused (repeatable; replaces the default {', '.join(DEFAULT_DENY)}).",
)
@click.option(
    "--command-timeout",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds a command may run before it is killed (a request may ask for less, not more).",
)
@click.option(
    "--output-bytes",
    type=int,
    default=MIB,
    show_default=True,
    help="Bytes kept of each of a command's output streams; the rest is dropped, and says so.",
)
@click.option(
    "--workspace-bytes",
    type=int,
    default=200 * MIB,
    show_default=True,
    help="A workspace's disk cap: a command that grows it past this is killed.",
)
@click.option(
    "--no-sandbox",
    is_flag=True,
    help="Run commands without bubblewrap, with the devbox's rights (an explicit opt-out).",
)
@click.option(
    "--allow-network", is_flag=True, help="Let a command keep the network when its task asks."
)
@click.option("-v", "--verbose", is_flag=True, help="Log every request.")
def serve(
    host: str,
    port: int,
    root: Path | None,
    token: str | None,
    allow_repos: tuple[str, ...],
    allow: tuple[str, ...],
    deny: tuple[str, ...],
    command_timeout: float,
    output_bytes: int,
    workspace_bytes: int,
    no_sandbox: bool,
    allow_network: bool,
    verbose: bool,
) -> None:
    """Serve the devbox HTTP API until SIGTERM or Ctrl-C."""
    try:
        check_token(token, "CHARLIE_DEVBOX_TOKEN or --token")
    except WeakToken as exc:
        raise click.UsageError(f"refusing to start: {exc}") from None
    assert token is not None
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # a traceback or a request line can quote a workspace's files or a command's output: shown,
    # not obeyed, by the terminal that tails this log (charlie.terminal)
    logs.install(logging.getLogger())
    policy = CommandPolicy(
        allow=list(allow) if allow else None, deny=list(deny) if deny else list(DEFAULT_DENY)
    )
    if not no_sandbox:
        try:
            check_mode("bwrap")
        except SandboxUnavailable as exc:
            raise click.ClickException(f"refusing to start: {exc}") from exc
    stack = os.environ.get("CHARLIE_SANDBOX_NETWORK", "auto").strip() or "auto"
    if stack not in NETWORK_STACKS:
        raise click.ClickException(
            f"CHARLIE_SANDBOX_NETWORK={stack!r} is not one of {', '.join(NETWORK_STACKS)}"
        )
    try:
        unreachable = networks_from_env(os.environ.get("CHARLIE_SANDBOX_NET_DENY"))
    except ValueError as exc:
        raise click.ClickException(f"CHARLIE_SANDBOX_NET_DENY: {exc}") from exc
    limits = Limits(
        output_bytes=output_bytes,
        command_timeout=command_timeout,
        workspace_bytes=workspace_bytes,
        sandbox="off" if no_sandbox else "bwrap",
        allow_network=allow_network,
        hidden=_charlie_state_from_env(),
        readable=paths_from_env(os.environ.get("CHARLIE_SANDBOX_READ")),
        network_stack=stack,
        unreachable=unreachable,
    )
    try:
        server = DevboxServer(
            root or _default_root(), token, host, port, policy, limits, RepoPolicy(allow_repos)
        )
    except (RuntimeError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    _stop_on_sigterm(server)
    # tests and supervisors read this line to learn the port when --port 0
    click.echo(f"devbox listening on {server.url} root={server.root}", err=False)
    if no_sandbox:
        click.echo("warning: --no-sandbox: commands run with the devbox's rights", err=True)
    if not allow_repos:
        click.echo(
            "note: no --allow-repo: workspaces can only be empty (no clone, no copy)", err=True
        )
    if server.lost_on_start:
        click.echo(f"marked {len(server.lost_on_start)} command(s) lost after restart")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


def _charlie_state_from_env() -> tuple[Path, ...]:
    """A devbox beside a worker hides the worker's state too: its home, an SQLite database and
    the operator's CHARLIE_SANDBOX_HIDE (read from the environment the devbox was started in)."""
    hidden = [Path(p) for p in os.environ.get("CHARLIE_SANDBOX_HIDE", "").split(":") if p]
    if os.environ.get("CHARLIE_HOME"):
        hidden.append(Path(os.environ["CHARLIE_HOME"]))
    db = os.environ.get("CHARLIE_DATABASE_URL", "")
    if db.startswith("sqlite:///"):
        hidden.append(Path(db.removeprefix("sqlite:///")))
    return tuple(hidden)


def _stop_on_sigterm(server: DevboxServer) -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        # shutdown() waits for serve_forever to return, so it cannot run on the serving thread
        threading.Thread(target=server.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, handler)
