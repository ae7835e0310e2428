"""Checkpoints that resume exactly and never unpickle anything.

A checkpoint is a directory ``ckpt-<round>/`` holding ``tensors.safetensors``
(model parameters and any other tensors) and ``state.json`` (schema
``privkit.checkpoint/1``: round, configuration, generator states, ledger
pointer). It is written as ``ckpt-<round>.partial/``, every file fsynced, then
renamed, and only then does the ``LATEST`` pointer move (atomic replace).
Readers follow ``LATEST`` and ignore stale ``.partial`` directories, so a crash
at any point leaves the previous checkpoint or the new one. A write the file system
refuses (a full disk) removes the partial directory and raises :class:`CheckpointError`,
one line naming the path and the error (ENOSPC).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from privkit.errors import PrivkitError
from privkit.ledger import atomic_write_bytes

__all__ = ["SCHEMA", "CheckpointError", "save", "load_latest", "latest_round"]

SCHEMA = "privkit.checkpoint/1"


class CheckpointError(PrivkitError):
    """A checkpoint is missing, malformed, or of an unknown schema."""


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory: str | os.PathLike[str], round_: int, tensors: dict[str, Any],
         state: dict[str, Any]) -> Path:
    """Write checkpoint ``round_`` atomically and point ``LATEST`` at it.

    Raises:
        CheckpointError: the file system refused a write (a full disk, ENOSPC; no
            permission; ...): one line naming the path and the error. The partial checkpoint
            is removed first, so the directory holds the previous checkpoints only and the
            run can continue from them with ``--resume``.
    """
    root = Path(directory)
    final = root / f"ckpt-{round_:06d}"
    partial = root / f"ckpt-{round_:06d}.partial"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        _save_tensors(tensors, partial / "tensors.safetensors")
        body = json.dumps({"schema": SCHEMA, "round": round_, **state}, sort_keys=True,
                          allow_nan=False, indent=1).encode("utf-8")
        (partial / "state.json").write_bytes(body)
        for f in partial.iterdir():
            _fsync_file(f)
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
    except BaseException as exc:
        shutil.rmtree(partial, ignore_errors=True)
        failure = _write_failure(exc, partial / "tensors.safetensors")
        if failure is None:
            raise
        path, code, why = failure
        raise CheckpointError(_not_written(path, round_, code, why)) from None
    try:
        atomic_write_bytes(root / "LATEST", final.name.encode("utf-8"))
    except OSError as exc:  # LATEST still names the previous checkpoint
        code, why = _errno(exc)
        raise CheckpointError(_not_written(Path(exc.filename or root / "LATEST"), round_,
                                           code, why)) from None
    return final


def _save_tensors(tensors: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))


def _not_written(path: Path, round_: int, code: int | None, why: str) -> str:
    name = f" ({errno.errorcode[code]})" if code in errno.errorcode else ""
    resume = ("; free some space, then continue with --resume" if code == errno.ENOSPC
              else "; the run can continue with --resume")
    return (f"{path}: checkpoint {round_} not written: {why}{name}; nothing partial is left, "
            f"the earlier checkpoints and the ledger are intact{resume}")


def _errno(exc: BaseException) -> tuple[int | None, str]:
    """(errno, reason) of an operating-system error, or of the one a library error carries
    in its message (safetensors: ``... No space left on device (os error 28)``)."""
    if isinstance(exc, OSError):
        return exc.errno, exc.strerror or str(exc)
    found = re.search(r"os error (\d+)", str(exc))
    if found is None:
        return None, " ".join(str(exc).split())
    code = int(found.group(1))
    return code, os.strerror(code)


def _write_failure(exc: BaseException, tensors_path: Path) -> tuple[Path, int | None, str] | None:
    """(path, errno, reason) when ``exc`` is a refused write, else None (a bug: re-raised)."""
    if isinstance(exc, OSError):
        code, why = _errno(exc)
        return Path(exc.filename) if exc.filename else tensors_path, code, why
    if type(exc).__name__ == "SafetensorError":  # safetensors' own I/O error (Rust)
        code, why = _errno(exc)
        return tensors_path, code, why
    return None


def latest_round(directory: str | os.PathLike[str]) -> int | None:
    """The round of the checkpoint ``LATEST`` points at, or None if there is none."""
    pointer = Path(directory) / "LATEST"
    if not pointer.exists():
        return None
    return int(_load_state(Path(directory) / pointer.read_text().strip())["round"])


def _load_state(ckpt: Path) -> dict[str, Any]:
    try:
        state = json.loads((ckpt / "state.json").read_text(encoding="utf-8"),
                           parse_constant=_refuse_constant)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{ckpt / 'state.json'}: unreadable checkpoint state ({exc})"
        ) from None
    if not isinstance(state, dict) or state.get("schema") != SCHEMA:
        raise CheckpointError(
            f"{ckpt / 'state.json'}: schema must be {SCHEMA!r}, got {state.get('schema')!r}"
            if isinstance(state, dict) else f"{ckpt}: state.json is not an object")
    return state


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} in checkpoint")


def load_latest(directory: str | os.PathLike[str], device: Any = "cpu"
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, state) of the checkpoint ``LATEST`` points at (tensors on ``device``)."""
    from safetensors.torch import load_file

    root = Path(directory)
    pointer = root / "LATEST"
    if not pointer.exists():
        raise CheckpointError(f"{root}: no checkpoint (LATEST missing)")
    ckpt = root / pointer.read_text(encoding="utf-8").strip()
    state = _load_state(ckpt)
    try:
        tensors = load_file(str(ckpt / "tensors.safetensors"), device=str(device))
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(f"{ckpt / 'tensors.safetensors'}: unreadable ({exc})") from None
    return tensors, state
