"""CHARLIE_HOME, private to the user Charlie runs as.

The home holds the embedded SQLite database (every prompt, transcript, tool result and
approval), the embedded broker's queue (task messages) and the tasks' workspaces: nothing in it
is for another user of the machine. So the home is created with mode 0700, and the files Charlie
creates in it (the database, the broker's messages, the migration lock) with 0600, whatever the
umask says; SQLite gives the database's -wal and -shm files the database file's mode.

An existing home or database that group or others may read is tightened, with a warning, when
it belongs to this user; one that belongs to another user, or a shared directory with the sticky
bit (``/tmp`` itself), is left as it is, with a warning that says what to do. Run the worker,
beat and `charlie` commands of one home as one user.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("charlie.home")

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
#: group and other permission bits: none of them on anything of the home.
_SHARED = 0o077


def prepare(home: Path) -> Path:
    """Create the home private, or make an existing one private (see the module's docstring);
    returns it."""
    home.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    _tighten(home, "CHARLIE_HOME")
    return home


def private_dir(path: Path) -> Path:
    """A directory of Charlie's own state (the broker's folders): created 0700, and so is each
    missing folder above it (``mkdir(parents=True)`` would give those the umask's mode)."""
    missing = []
    folder = path
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for folder in reversed(missing):
        folder.mkdir(mode=PRIVATE_DIR, exist_ok=True)
    return path


def private_file(path: Path) -> Path:
    """A file of Charlie's own state (the SQLite database): created empty with 0600 when it does
    not exist yet, so that whatever creates its content later finds it private; an existing one
    open to group or others is tightened (see the module's docstring)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE))
    except FileExistsError:
        _tighten(path, "the database file")
    return path


def open_private(path: Path, flags: int) -> int:
    """``os.open`` of a new file of Charlie's own state, with mode 0600."""
    return os.open(path, flags | os.O_CREAT, PRIVATE_FILE)


def _tighten(path: Path, what: str) -> None:
    info = os.stat(path)
    mode = stat.S_IMODE(info.st_mode)
    if not mode & _SHARED:
        return
    if info.st_uid != os.geteuid() or mode & stat.S_ISVTX:
        log.warning(
            "%s %s is open to group or others (mode %04o) and belongs to %s; left as it is: "
            "give Charlie a home of its own (CHARLIE_HOME), private to the user it runs as",
            what,
            path,
            mode,
            "another user" if info.st_uid != os.geteuid() else "a shared directory",
        )
        return
    try:
        os.chmod(path, mode & ~_SHARED)
    except OSError as exc:
        log.warning(
            "%s %s is open to group or others (mode %04o) and cannot be made private: %s",
            what,
            path,
            mode,
            exc,
        )
        return
    log.warning(
        "%s %s was open to group or others (mode %04o); made it private (mode %04o)",
        what,
        path,
        mode,
        mode & ~_SHARED,
    )
