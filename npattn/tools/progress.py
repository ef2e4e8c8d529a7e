"""The ``npattn`` command's progress bar: tqdm on stderr, only on a terminal.

On a terminal tqdm redraws one line with the count, rate and ETA, padding
each redraw to the previous line's length so that a short note leaves no
characters of a longer one. Into a pipe or a file nothing is written at all,
so logs and ``2>&1`` captures hold only the results.
"""

from __future__ import annotations

import io
import os
import sys

from tqdm import tqdm

from ..validation import check_size

__all__ = ["ProgressBar", "is_terminal"]


def is_terminal(stream) -> bool:
    """True when ``stream`` is an open terminal (its ``isatty()`` says so)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed file
        return False


def _size(stream):
    """``os.terminal_size`` of ``stream``, or None for a stream with no file descriptor."""
    try:
        return os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


def _layout(stream) -> dict:
    """tqdm's width options: follow a sized terminal; 80 x 24 for one that reports 0 x 0.

    (A pty that nobody sized reports 0 rows, and tqdm hides a bar below the
    last row.)
    """
    size = _size(stream)
    if size is None:
        return {"nrows": 24}
    if size.columns and size.lines:
        return {"dynamic_ncols": True}
    return {"ncols": size.columns or 80, "nrows": 24}


class ProgressBar:
    """``with ProgressBar(total, "check") as bar: bar.update(1, "loss 0.3")``.

    Parameters
    ----------
    total : int >= 0
        Number of steps (0 is drawn as one).
    desc : str
        Label in front of the bar.
    stream : file, optional
        Default ``sys.stderr``. Nothing is written unless it is a terminal.
    enabled : bool, optional
        Default: on (on a terminal). ``False`` writes nothing at all.
    unit : str
        What one step is, for the rate (``"step/s"``).
    """

    def __init__(self, total: int, desc: str = "", *, stream=None, enabled: bool = True,
                 unit: str = "step"):
        total = check_size("total", total)  # int("3") and int(2.7) were taken, -5 drawn as 1
        self.stream = sys.stderr if stream is None else stream
        self.enabled = bool(enabled) and is_terminal(self.stream)
        self._note = ""
        self._n = 0  # counted here: a disabled tqdm counts nothing
        self._bar = tqdm(total=max(total, 1), desc=desc, file=self.stream, unit=unit,
                         disable=not self.enabled, leave=True, mininterval=0.1,
                         **_layout(self.stream))

    @property
    def n(self) -> int:
        """Steps done so far (counted with the bar shown or not)."""
        return self._n

    @property
    def note(self) -> str:
        """Text after the bar (the current loss, the check running...)."""
        return self._note

    @note.setter
    def note(self, text: str):
        self._note = text
        self._bar.set_postfix_str(text, refresh=False)

    def update(self, n: int = 1, note: str | None = None):
        """Advance by ``n`` steps (0 to change only the note)."""
        if note is not None:
            self.note = note
        if n:
            self._n += n
            self._bar.update(n)
        elif note is not None:
            self._bar.refresh()

    def write(self, text: str, file=None):
        """Print a line to ``file`` (default stdout) without garbling the bar."""
        file = sys.stdout if file is None else file
        if self.enabled:
            self._bar.write(text, file=file)
        else:
            print(text, file=file, flush=True)

    def close(self):
        self._bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
