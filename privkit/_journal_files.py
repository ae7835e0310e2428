"""The journal's files: a new journal, atomic whole-file writes, file-system errors.

:func:`create_file` creates a journal with its head record (:mod:`privkit._head`), safe against
a crash and against another creator; :func:`atomic_write_bytes` replaces a file atomically (the
trainers write their checkpoints and reports with it too); :func:`fs_error` and
:func:`errno_text` word a file-system error, and :func:`as_path` checks a journal's path. Apart
from appending to a journal (:class:`privkit._journal.Journal`, whose module re-exports every
public name here): these write whole files, never an entry.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Mapping
from typing import Any

from privkit import _head
from privkit._journal_format import canonical_json
from privkit.errors import InvalidParameterError, LedgerError


def errno_text(exc: OSError) -> str:
    """``ENOSPC: No space left on device`` for an OSError (its text if it has no errno)."""
    code = exc.errno
    name = errno.errorcode.get(code) if isinstance(code, int) else None
    if code is None or name is None:
        return str(exc.strerror or exc)
    return f"{name}: {exc.strerror or os.strerror(code)}"


def fs_error(path: str, action: str, exc: OSError, then: str = "") -> LedgerError:
    """The :class:`LedgerError` for a file-system error: ``<path>: cannot <action> (<errno
    name>: <strerror>)`` and ``then`` (e.g. what was or was not changed)."""
    return LedgerError(f"{path}: cannot {action} ({errno_text(exc)}){then}")


def as_path(value: Any) -> str:
    """``value`` as a journal path (a non-empty str or os.PathLike of one).

    Raises:
        InvalidParameterError: anything else (naming ``path``).
    """
    try:
        path = os.fspath(value)
    except TypeError:
        path = None
    if not (isinstance(path, str) and path and "\0" not in path):
        raise InvalidParameterError("path", value, "a file path (a non-empty str or "
                                    "os.PathLike)")
    return path


# ------------------------------------------------------------------- files
def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _temp_file(path: str) -> tuple[int, str]:
    """A new temporary file beside ``path``, open for writing, with the mode an ordinary file
    gets (0o666 less the umask, like the plots and the head record beside it) rather than
    ``mkstemp``'s 0o600: nothing privkit writes is meant to be more private than the directory
    it is in."""
    directory = os.path.dirname(os.path.abspath(path))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary file name", path)


def _durable_temp(path: str, data: bytes) -> str:
    fd, tmp = _temp_file(path)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically (temp file, fsync, rename, fsync directory)."""
    path = os.fspath(path)
    tmp = _durable_temp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    _head.fsync_dir(os.path.dirname(os.path.abspath(path)))


def create_file(path: str, header: Mapping[str, Any], key: bytes | None = None) -> int:
    """Create the journal ``path`` holding the (hashed) ``header`` whole; return its size.

    The head record (seq -1) is written first and the journal linked into place after it,
    so a crash leaves either no journal or a journal with its head record. Creation in one
    directory is serialised by a lock on the directory. A failed write leaves no journal (at
    most a head record at seq -1, which a later creation replaces).

    Raises:
        LedgerError: ``path`` exists (it is never clobbered), or it does not but a head
            record says entries of it were committed (the journal was deleted or moved); its
            directory does not exist; a file cannot be written (names it and the error).
    """
    data = (canonical_json(header) + "\n").encode("utf-8")
    head_file = _head.head_path(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.lexists(directory) else "does not exist"
        raise LedgerError(f"{path}: cannot create the ledger: its directory {directory!r} "
                          f"{what}")
    nothing = "; nothing was created"
    try:
        tmp = _durable_temp(path, data)
    except OSError as exc:
        raise fs_error(path, "create the ledger", exc, nothing) from exc
    try:
        with _head.dir_lock(directory):
            if os.path.lexists(path):
                raise _exists(path)
            try:
                old = _head.read_file(head_file)
            except _head.HeadUnreadable as exc:
                raise LedgerError(f"{path}: cannot create the ledger: {exc}; remove "
                                  f"{head_file} to start a new ledger deliberately") from None
            except OSError as exc:
                raise fs_error(head_file, "read", exc, nothing) from exc
            seq = -1 if old is None else max(
                [s.head.seq for s in old.whole()] or [old.current().seq])
            if seq >= 0:
                raise LedgerError(
                    f"{path} is missing but its head record {head_file} says entries up to "
                    f"seq {seq} were committed: the journal was deleted or moved; restore "
                    f"it (spend is never reset), or remove {head_file} too to start a new "
                    "ledger deliberately")
            try:
                _head.write_head(head_file, _head.Head(-1, header["hash"], len(data),
                                                       header["hash"]), key, fresh=True)
            except OSError as exc:
                raise fs_error(head_file, "write", exc, nothing) from exc
            try:
                os.link(tmp, path)  # atomic, never clobbers (needs a POSIX file system)
            except FileExistsError:
                raise _exists(path) from None
            except OSError as exc:
                raise fs_error(path, "create the ledger", exc, nothing) from exc
            try:
                _head.fsync_dir(directory)
            except OSError as exc:  # not durable: undo, so that a retry starts afresh
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise fs_error(path, "create the ledger (syncing its directory)", exc,
                               nothing) from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return len(data)


def _exists(path: str) -> LedgerError:
    return LedgerError(f"ledger {path!r} already exists; use Ledger.open to continue it "
                       "(spend is never reset)")

