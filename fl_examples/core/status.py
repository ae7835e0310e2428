"""A status line on stderr for a phase that runs before (or after) the progress bar.

Calibrating a noise multiplier to ``--noise-for-epsilon`` can take tens of seconds (DP-REC's
with-replacement bound, record-level DP-SGD over many clients), and so can pricing a run's
epsilon at every evaluation for its plots: without a line saying so the command looks hung.
:func:`status` prints what is starting, then on the same line its result and how long it
took::

    privkit: calibrating z to epsilon 8 (delta 1e-05, 100 rounds)... z = 0.656 (24.1 s)

It follows the progress bar's rules (:func:`fl_examples.core.report.progress_disabled`):
shown on a terminal only, never under ``--quiet`` (:func:`~fl_examples.core.report.quiet`) or
with ``TQDM_DISABLE`` set, so that logs, pipes and ``--json`` output stay as they are. When
the phase fails, the line is erased: the error stays the only line on stderr.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import TextIO

from fl_examples.core.report import progress_disabled

__all__ = ["Status", "status", "shown"]

PREFIX = "privkit: "


def shown(stream: TextIO | None = None) -> bool:
    """Whether a status line is printed on ``stream`` (default stderr): a terminal, outside
    :func:`~fl_examples.core.report.quiet` and without ``TQDM_DISABLE``."""
    if progress_disabled():
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Status:
    """One status line: :meth:`done` completes it with the phase's result."""

    def __init__(self, text: str, stream: TextIO | None, visible: bool) -> None:
        self.text = text
        self.stream = stream
        self.visible = visible
        self.result: str | None = None
        self.seconds = 0.0
        self._start = time.perf_counter()

    def done(self, result: str) -> None:
        """The phase's result (``z = 0.656``), printed after the start text with the time
        taken when the phase ends."""
        self.result = result

    def _begin(self) -> None:
        if self.visible:
            assert self.stream is not None
            self.stream.write(f"{PREFIX}{self.text}...")
            self.stream.flush()

    def _end(self, failed: bool) -> None:
        self.seconds = time.perf_counter() - self._start
        if not self.visible:
            return
        assert self.stream is not None
        if failed:  # the error is the only line: erase ours
            self.stream.write("\r\033[K")
        else:
            result = f" {self.result}" if self.result else " done"
            self.stream.write(f"{result} ({self.seconds:.1f} s)\n")
        self.stream.flush()


@contextlib.contextmanager
def status(text: str, *, stream: TextIO | None = None) -> Iterator[Status]:
    """Say on stderr that ``text`` is starting; when the block ends, its result (given to
    :meth:`Status.done`) and duration, on the same line.

    Example:
        >>> with status("calibrating z to epsilon 8 (delta 1e-05, 100 rounds)") as line:
        ...     z = 0.656
        ...     line.done(f"z = {z:.3g}")
        >>> line.result
        'z = 0.656'
    """
    stream = sys.stderr if stream is None else stream
    line = Status(text, stream, shown(stream))
    line._begin()
    try:
        yield line
    except BaseException:
        line._end(failed=True)
        raise
    line._end(failed=False)
