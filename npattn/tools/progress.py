"""A dependency-free text progress bar on stderr.

On a terminal it redraws one line (at most ten times a second); into a pipe or
file it writes only the finished bar, so logs stay readable.
"""

from __future__ import annotations

import sys
import time

__all__ = ["ProgressBar"]


class ProgressBar:
    """``with ProgressBar(total, "check") as bar: bar.update(1, "loss 0.3")``.

    Parameters
    ----------
    total : int
        Number of steps.
    desc : str
        Label in front of the bar.
    stream : file, optional
        Default ``sys.stderr``.
    enabled : bool, optional
        Default: on. ``False`` prints nothing at all.
    width : int
        Characters of the bar itself.
    """

    def __init__(self, total: int, desc: str = "", *, stream=None, enabled: bool = True,
                 width: int = 30):
        self.total = max(int(total), 1)
        self.desc = desc
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.width = width
        self.n = 0
        self.note = ""
        self.start = time.perf_counter()
        self._last_draw = 0.0
        isatty = getattr(self.stream, "isatty", None)
        self._tty = bool(isatty and isatty())

    def update(self, n: int = 1, note: str | None = None):
        self.n = min(self.n + n, self.total)
        if note is not None:
            self.note = note
        now = time.perf_counter()
        if self.enabled and self._tty and (now - self._last_draw > 0.1 or self.n == self.total):
            self._last_draw = now
            self.stream.write("\r" + self.line())
            self.stream.flush()

    def line(self) -> str:
        filled = int(self.width * self.n / self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        note = f"  {self.note}" if self.note else ""
        return f"{self.desc} [{bar}] {self.n}/{self.total} {elapsed:5.1f}s{note}"

    def close(self):
        if not self.enabled:
            return
        if self._tty:
            self.stream.write("\r" + self.line() + "\n")
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()
        self.enabled = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
