"""Paths beneath a workspace, opened by descriptor (I33).

A command runs in the workspace while the tools read and write it: it can exchange a directory
with a symlink (to ``/proc/self``, to a directory outside) at any moment, so a path checked
first and opened by name after can be opened through a link that was not there at the check.
Here nothing is checked before it is opened: the workspace is opened once as a directory
descriptor, and every path beneath it is resolved by the kernel from that descriptor at the
moment of the open, refusing any step that leaves it (:class:`Outside`); what is created,
renamed and listed is created, renamed and listed relative to the descriptor of the directory
that was opened. A symlink that stays beneath the workspace is followed; one that leaves it, an
absolute one, a ``..`` above the workspace and the kernel's magic links are refused.

Where the kernel has ``openat2`` (Linux 5.6+) the resolution is its ``RESOLVE_BENEATH |
RESOLVE_NO_MAGICLINKS``; elsewhere (an older kernel, a seccomp filter that refuses the call) the
same rules are walked component by component, each directory opened with ``O_NOFOLLOW |
O_DIRECTORY`` from the one before and each symlink read and expanded here, never by the kernel.

The workspace directory itself is opened by its path: it is chosen by the producer within the
operator's workspace roots (or by the devbox), not by a command.
"""

from __future__ import annotations

import errno
import os
import posixpath
import secrets
import stat
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from types import TracebackType

#: openat2's number: one number on every architecture of the unified syscall table.
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "arm64": 437, "riscv64": 437, "ppc64le": 437}
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_BENEATH = 0x08
#: symlinks followed in one resolution before ELOOP, as the kernel counts them.
_MAX_LINKS = 40
#: times an openat2 interrupted by a concurrent rename (EAGAIN) is tried before the walk.
_RETRIES = 16
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class Outside(Exception):
    """The path leads outside the directory it is opened beneath (``..``, an absolute path or
    a symlink that leaves it, at the moment of the open)."""

    def __init__(self, path: str) -> None:
        super().__init__(f"path {path!r} leads outside the workspace")
        self.path = path


#: openat2 as a function, once probed; None: not probed yet, or this process walks.
_openat2: Callable[[int, str, int, int], int] | None = None
#: None: not probed yet; False: this process walks (no openat2, or it was forced off).
_use_openat2: bool | None = None


def openat2_available() -> bool:
    """Whether this process resolves with ``openat2`` (probed once, on first use: ctypes is
    loaded then, not when Charlie is imported)."""
    global _openat2, _use_openat2
    if _use_openat2 is None:
        number = _SYS_OPENAT2.get(os.uname().machine) if sys.platform == "linux" else None
        call = _bind(number) if number is not None else None
        try:
            if call is not None:
                root = os.open("/", _DIR_FLAGS)
                try:
                    os.close(call(root, ".", _DIR_FLAGS, 0))
                finally:
                    os.close(root)
        except OSError:
            call = None  # ENOSYS, or a seccomp filter's EPERM
        _openat2, _use_openat2 = call, call is not None
    return _use_openat2


def force_walk(walk: bool) -> None:
    """Resolve by the component walk even where ``openat2`` exists (tests of the fallback), or
    go back to probing."""
    global _use_openat2
    _use_openat2 = False if walk else None


def _bind(number: int) -> Callable[[int, str, int, int], int] | None:
    """``openat2(dir_fd, rel, how={flags, mode, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS})``
    through libc's ``syscall``, raising OSError as ``os.open`` does."""
    import ctypes

    class OpenHow(ctypes.Structure):
        _fields_ = [
            ("flags", ctypes.c_uint64),
            ("mode", ctypes.c_uint64),
            ("resolve", ctypes.c_uint64),
        ]

    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long

    def openat2(dir_fd: int, rel: str, flags: int, mode: int) -> int:
        how = OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0)
        how.resolve = _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS
        fd = syscall(
            ctypes.c_long(number),
            ctypes.c_int(dir_fd),
            ctypes.c_char_p(os.fsencode(rel)),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), rel)
        return int(fd)

    return openat2


def _parts(rel: str) -> list[str]:
    """The components of a relative path (empty ones and ``.`` dropped, ``..`` kept)."""
    if "\x00" in rel:
        raise ValueError(f"path {rel!r} contains a NUL character")
    if rel.startswith("/"):
        raise Outside(rel)
    return [p for p in rel.split("/") if p not in ("", ".")]


def _is_link(dir_fd: int, name: str) -> str | None:
    """The target of the symlink ``name`` in ``dir_fd``, or None when it is none."""
    try:
        return os.readlink(name, dir_fd=dir_fd)
    except OSError:
        return None


def _walk(root: int, rel: str, flags: int, mode: int) -> int:
    """openat2's rules without openat2: one component at a time from ``root``, never letting
    the kernel follow a symlink (``O_NOFOLLOW`` on every step); a symlink met is read and its
    target walked here, refused when absolute or when a ``..`` climbs above ``root``."""
    todo = _parts(rel)[::-1]  # a stack: the next component last
    stack = [os.dup(root)]  # the directories walked so far; stack[0] is the root
    links = 0
    try:
        while True:
            if not todo:  # the path named a directory already walked (".", "a/..")
                return os.open(".", flags | os.O_CLOEXEC, mode, dir_fd=stack[-1])
            name = todo.pop()
            if name == "..":
                if len(stack) == 1:
                    raise Outside(rel)
                os.close(stack.pop())
                continue
            last = not todo
            step = flags | os.O_NOFOLLOW if last else _DIR_FLAGS | os.O_NOFOLLOW
            try:
                fd = os.open(name, step | os.O_CLOEXEC, mode, dir_fd=stack[-1])
            except OSError as exc:
                # O_NOFOLLOW meets a symlink as ELOOP (ENOTDIR with O_DIRECTORY)
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                target = _is_link(stack[-1], name)
                if target is None or (last and flags & os.O_NOFOLLOW):
                    raise
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), rel) from None
                if target.startswith("/"):
                    raise Outside(rel) from None
                todo += _parts(target)[::-1]  # (a link to "." leaves nothing to add)
                continue
            if last:
                return fd
            stack.append(fd)
    finally:
        for fd in stack:
            os.close(fd)


class Root:
    """A directory opened as a descriptor, and the paths beneath it opened from there.

    Every method takes a path relative to the root (``/``-separated; absolute paths are
    :class:`Outside`), raises :class:`Outside` for a path that leaves it at the moment of the
    open and ``OSError`` as ``open()`` would otherwise. Descriptors returned are the caller's to
    close. Use as a context manager, or call :meth:`close`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.fd = os.open(path, _DIR_FLAGS)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Root:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- opening -------------------------------------------------------------------------------

    def open(self, rel: str, flags: int, mode: int = 0o666) -> int:
        """``openat(root, rel, flags)`` with no step of it outside the root. A final symlink is
        followed (beneath) unless ``flags`` has ``O_NOFOLLOW``."""
        _parts(rel)  # the NUL and absolute checks, the same on both paths
        if openat2_available() and (openat2 := _openat2) is not None:
            for _ in range(_RETRIES):
                try:
                    return openat2(self.fd, rel or ".", flags, mode)
                except OSError as exc:
                    if exc.errno == errno.EXDEV:
                        raise Outside(rel) from None
                    if exc.errno != errno.EAGAIN:
                        raise
            # a rename raced a ".." of the resolution every time: the walk needs no retry
        return _walk(self.fd, rel, flags, mode)

    def opendir(self, rel: str = ".") -> int:
        return self.open(rel, _DIR_FLAGS)

    def parent(self, rel: str, *, create: bool = False) -> tuple[int, str]:
        """The directory that holds ``rel``'s last component, opened (made first, with the
        directories above it, when ``create``), and that component's name. A path naming the
        root itself or ending in ``..`` is refused (IsADirectoryError): it names no entry."""
        parts = _parts(rel)
        if not parts or parts[-1] == "..":
            raise IsADirectoryError(errno.EISDIR, "names a directory, not an entry in one", rel)
        return self._dir(parts[:-1], create), parts[-1]

    def _dir(self, parts: list[str], create: bool) -> int:
        try:
            return self.opendir("/".join(parts) or ".")
        except FileNotFoundError:
            if not create or not parts:
                raise
        above = self._dir(parts[:-1], create=True)
        try:
            os.mkdir(parts[-1], 0o777, dir_fd=above)
        except FileExistsError:
            pass  # made meanwhile (or a link, which the open below resolves beneath or refuses)
        finally:
            os.close(above)
        return self.opendir("/".join(parts))

    def final(self, rel: str) -> str:
        """``rel`` with a symlink in its last component replaced by its target, as often as
        there is one (the path a write through it lands on). The substitution is lexical, so a
        link may not climb above the root even through a directory link; every open of the
        result is beneath the root anyway."""
        for _ in range(_MAX_LINKS):
            try:
                dir_fd, name = self.parent(rel)
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                return rel  # nothing there to follow: the caller's own open says what is wrong
            try:
                target = _is_link(dir_fd, name)
            finally:
                os.close(dir_fd)
            if target is None:
                return rel
            if target.startswith("/"):
                raise Outside(rel)
            followed = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
            if followed == ".." or followed.startswith("../"):
                raise Outside(rel)
            rel = followed
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), rel)

    # -- what the tools do with it -------------------------------------------------------------

    def read_head(self, rel: str, limit: int) -> tuple[bytes, int]:
        """At most ``limit + 1`` bytes of a regular file (the extra byte says there is more) and
        its size. Opened without blocking, so a FIFO is refused rather than waited on
        (IsADirectoryError for a directory, OSError EINVAL for any other non-regular file)."""
        fd = self.open(rel, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb", buffering=0) as f:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), rel)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", rel)
            chunks: list[bytes] = []
            want = limit + 1
            while want > 0 and (chunk := f.read(min(want, 1 << 20))):
                chunks.append(chunk)
                want -= len(chunk)
        data = b"".join(chunks)
        return data, max(st.st_size, len(data))

    def write_atomic(
        self, rel: str, data: bytes, *, mode: int = 0o644, keep_mode: bool = False
    ) -> None:
        """Replace ``rel`` whole (its directories made as needed): a temporary file made
        exclusively, never through a link, in the directory opened beneath, then renamed over
        the name in that same directory, so a crash leaves the old file or the new one and a
        reader never sees half of one. A symlink at ``rel`` is written through (beneath), as
        ``open(rel, "w")`` would. ``keep_mode``: the new file takes the old one's mode."""
        dir_fd, name = self.parent(self.final(rel), create=True)
        try:
            self.write_in(dir_fd, name, data, mode=mode, keep_mode=keep_mode)
        finally:
            os.close(dir_fd)

    @staticmethod
    def write_in(
        dir_fd: int, name: str, data: bytes, *, mode: int = 0o644, keep_mode: bool = False
    ) -> None:
        """:meth:`write_atomic` for a directory already opened beneath the root."""
        if keep_mode:
            with suppress(OSError):
                old = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if stat.S_ISREG(old.st_mode):
                    mode = stat.S_IMODE(old.st_mode)
        # a random name, made exclusively: a command may plant a link at any name it can guess
        tmp = f".{name[:200]}.{secrets.token_hex(8)}.charlie-tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, mode, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as out:
                if keep_mode:
                    os.fchmod(out.fileno(), mode)  # (the umask is not the old file's)
                out.write(data)
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise

    @contextmanager
    def scandir(self, rel: str = ".") -> Iterator[Iterator[os.DirEntry[str]]]:
        """The entries of the directory ``rel``, read from its descriptor. Use them inside the
        block: an entry's ``stat()`` asks the directory's descriptor, closed after it."""
        fd = self.opendir(rel)
        try:
            with os.scandir(fd) as entries:
                yield entries
        finally:
            os.close(fd)

    def is_root(self, fd: int) -> bool:
        """Whether the directory open at ``fd`` is the root itself."""
        a, b = os.fstat(fd), os.fstat(self.fd)
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def tree_bytes(self) -> int:
        """Bytes the files beneath the root take (symlinks not followed), each directory opened
        beneath it: a directory swapped for a link while counted adds nothing from outside."""
        total = 0
        pending = ["."]
        while pending:
            current = pending.pop()
            try:
                with self.scandir(current) as entries:
                    for entry in entries:
                        with suppress(OSError):
                            if entry.is_dir(follow_symlinks=False):
                                pending.append(posixpath.join(current, entry.name))
                            else:
                                total += entry.stat(follow_symlinks=False).st_size
            except (OSError, Outside):
                continue  # vanished, unreadable or swapped: a command may be changing it
        return total
