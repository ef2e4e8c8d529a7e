"""Output paths of the ``npattn`` commands, checked before a run that may take minutes.

``--json``, ``--plot`` and ``--markdown`` used to be opened only once the
work was done; an unwritable path then lost the results in a traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, Iterator, Optional

__all__ = ["output_error", "outputs_error", "json_output"]


def output_error(option: str, path: Optional[str]) -> Optional[str]:
    """Why ``path`` cannot be written as a file, as a message naming ``option``; None when it
    can (or is None, or ``-``: standard output)."""
    if path is None or path == "-":
        return None
    if os.path.isdir(path):
        return f"{option}: expected a file path, got the directory {path!r}"
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.exists(parent) and not os.path.isdir(parent):  # was told "does not exist"
        return f"{option}: expected a path in a directory, got {path!r}, whose {parent!r} is a file"
    if not os.path.isdir(parent):
        return f"{option}: the directory {parent!r} does not exist (path {path!r})"
    target = path if os.path.exists(path) else parent
    if not os.access(target, os.W_OK):
        return f"{option}: {path!r} cannot be written (no permission)"
    # os.access answers yes to root whatever the file system: open the path itself (appending
    # writes nothing to a file that exists; a new one is removed again)
    existed = os.path.exists(path)
    try:
        with open(path, "a" if existed else "x"):
            pass
    except OSError as e:
        return f"{option}: {path!r} cannot be written ({e.strerror or type(e).__name__})"
    if not existed:
        os.remove(path)
    return None


def outputs_error(*pairs: tuple, stdout: tuple = ("--json",)) -> Optional[str]:
    """``output_error`` of each ``(option, path)``, and then: ``-`` only for the options in
    ``stdout`` and for one of them, and no file named twice (the later would overwrite the
    earlier one's output). A message naming the options, or None."""
    given = [(option, path) for option, path in pairs if path is not None]
    for option, path in given:
        if path == "-" and option not in stdout:
            return f"{option}: expected a file path, got '-' (standard output takes the text or --json -)"
        why = output_error(option, path)
        if why:
            return why
    for i, (a, path_a) in enumerate(given):
        for b, path_b in given[i + 1:]:
            if path_a == path_b == "-" or (path_a != "-" and path_b != "-" and
                                            os.path.realpath(path_a) == os.path.realpath(path_b)):
                return (f"{a} and {b}: expected two different outputs, got {path_a!r} for both "
                        "(one would overwrite the other)")
    return None


@contextlib.contextmanager
def json_output(path: Optional[str]) -> Iterator[dict]:
    """Run a command's body inside; it fills the dict yielded, written as JSON to ``path`` at the
    end (nothing for None). With ``-`` the JSON goes alone to standard output and what the body
    prints to standard output goes to standard error."""
    result: dict[str, Any] = {}
    if path == "-":
        with contextlib.redirect_stdout(sys.stderr):
            yield result
        sys.stdout.write(json.dumps(result, indent=1, default=str) + "\n")
    else:
        yield result
        if path:
            with open(path, "w") as f:
                f.write(json.dumps(result, indent=1, default=str) + "\n")
