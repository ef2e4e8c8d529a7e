"""The command's progress bar (tqdm on stderr): clean redraws on a terminal, silence elsewhere."""

import io
import os
import re
import select

import pytest

from npattn.tools.progress import ProgressBar, is_terminal


class FakeTerminal(io.StringIO):
    """A text stream that says it is a terminal, and keeps what was written."""

    def isatty(self):
        return True


def screen(text):
    """What a terminal shows after ``text``: ``\\r`` returns to column 0 and overwrites."""
    assert "\x1b" not in text  # no cursor movement beyond \r and \n
    lines, col = [[]], 0
    for ch in text:
        if ch == "\r":
            col = 0
        elif ch == "\n":
            lines.append([])
            col = 0
        else:
            line = lines[-1]
            if col < len(line):
                line[col] = ch
            else:
                line.append(ch)
            col += 1
    return ["".join(line).rstrip() for line in lines]


def test_a_short_note_after_a_long_one_leaves_no_stale_characters():
    term = FakeTerminal()
    bar = ProgressBar(10, "demo", stream=term)
    long = "batch loss 2.3026  batch acc 0.100  a long note indeed"
    bar.update(0, long)
    assert screen(term.getvalue())[-1].endswith(f"{long}]")  # drawn whole, not cut short
    bar.update(0, "short")
    visible = screen(term.getvalue())[-1]
    assert visible.endswith("short]"), visible
    assert "indeed" not in visible and "acc" not in visible
    bar.update(10, "done")
    bar.close()
    lines = screen(term.getvalue())
    assert lines[-1] == ""  # the bar ends its line
    assert lines[-2].startswith("demo: 100%") and lines[-2].endswith("done]"), lines[-2]
    assert "10/10" in lines[-2]


def test_the_note_can_be_set_as_an_attribute():
    term = FakeTerminal()
    with ProgressBar(3, "check", stream=term) as bar:
        bar.note = "linear, bias"
        bar.update(1)
        assert bar.n == 1 and bar.note == "linear, bias"
    assert "check:" in term.getvalue() and "linear, bias" in term.getvalue()


def test_nothing_is_written_when_the_stream_is_not_a_terminal(tmp_path):
    plain = io.StringIO()
    with open(tmp_path / "log.txt", "w") as f:
        for stream in (plain, f):
            assert not is_terminal(stream)
            with ProgressBar(4, "check", stream=stream) as bar:
                bar.update(2, "note")
                bar.update(2)
    assert plain.getvalue() == ""
    assert (tmp_path / "log.txt").read_text() == ""


def test_disabled_writes_nothing_even_on_a_terminal():
    term = FakeTerminal()
    with ProgressBar(4, "check", stream=term, enabled=False) as bar:
        bar.update(4, "note")
    assert term.getvalue() == ""


def test_write_prints_a_line_past_the_bar():
    term, out = FakeTerminal(), io.StringIO()
    with ProgressBar(2, "bench", stream=term) as bar:
        bar.update(1, "2x8x8x2")
        bar.write("a table row", file=out)
    assert out.getvalue() == "a table row\n"
    quiet = io.StringIO()
    with ProgressBar(2, "bench", stream=quiet) as bar:  # not a terminal: plain print
        bar.write("a table row", file=out)
    assert out.getvalue() == "a table row\na table row\n" and quiet.getvalue() == ""


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_a_real_terminal_that_reports_no_size_still_shows_the_bar():
    master, slave = os.openpty()  # a fresh pty reports 0 rows and 0 columns
    try:
        with os.fdopen(os.dup(slave), "w") as stream:
            with ProgressBar(5, "check", stream=stream) as bar:
                bar.update(5, "done")
        written = ""
        while select.select([master], [], [], 0.5)[0]:  # all of it: a pty may hand it out in pieces
            chunk = os.read(master, 65536)
            if not chunk:
                break
            written += chunk.decode()
    finally:
        os.close(master)
        os.close(slave)
    assert "check: 100%" in written and "5/5" in written, repr(written)


@pytest.mark.parametrize("total,error", [(-5, ValueError), (2.7, TypeError), ("3", TypeError),
                                         (True, TypeError)])
def test_a_total_that_is_not_a_count_is_refused(total, error):
    """ProgressBar(-5) drew a bar of 1 step, 2.7 one of 2 and "3" one of 3 (int() of each)."""
    with pytest.raises(error, match=rf"^total: expected an int >= 0, got .*{re.escape(repr(total))}"):
        ProgressBar(total, "demo", stream=FakeTerminal())


def test_a_total_of_zero_or_a_numpy_int_is_a_count():
    import numpy as np

    for total, drawn in ((0, 1), (np.int64(3), 3)):
        term = FakeTerminal()
        with ProgressBar(total, "demo", stream=term) as bar:
            bar.update(drawn)
        assert f"{drawn}/{drawn}" in screen(term.getvalue())[-2]


def test_a_terminal_that_reports_one_size_but_not_the_other_gets_the_fallback(monkeypatch):
    """A terminal of 100 columns and 0 rows gets 24 rows (tqdm hides a bar below the last
    row); one of 0 x 0 gets 80 x 24; a fully sized one follows its width."""
    from npattn.tools import progress

    class Tty(FakeTerminal):
        def fileno(self):
            return 99

    for size, layout in (((100, 0), {"ncols": 100, "nrows": 24}), ((0, 30), {"ncols": 80, "nrows": 24}),
                         ((0, 0), {"ncols": 80, "nrows": 24}), ((100, 30), {"dynamic_ncols": True})):
        monkeypatch.setattr(progress.os, "get_terminal_size", lambda fd, s=size: os.terminal_size(s))
        assert progress._layout(Tty()) == layout, size


def test_a_closed_stream_is_no_terminal(tmp_path):
    """is_terminal of a closed file is False (its isatty() raises ValueError), so a bar given
    one stays silent instead of writing into it."""
    for stream in (io.StringIO(), open(tmp_path / "log.txt", "w")):
        stream.close()
        assert is_terminal(stream) is False
        with ProgressBar(3, "check", stream=stream) as bar:
            bar.update(3, "done")
        assert bar.enabled is False


def test_a_terminal_without_a_file_descriptor_still_shows_the_bar():
    """A stream that says it is a terminal but has no fileno() at all (a wrapper of a
    terminal's text) gets the bar with the fallback layout, not an AttributeError."""

    class Wrapped:
        def __init__(self):
            self.text = io.StringIO()

        def isatty(self):
            return True

        def write(self, s):
            return self.text.write(s)

        def flush(self):
            pass

    stream = Wrapped()
    assert not hasattr(stream, "fileno")
    with ProgressBar(4, "check", stream=stream) as bar:
        bar.update(4, "done")
    assert "check: 100%" in stream.text.getvalue() and "4/4" in stream.text.getvalue()


def test_write_goes_to_standard_output_by_default(capsys):
    """write() without a file prints to standard output (the results), the bar's own stream
    being standard error, on a terminal or not."""
    for stream in (FakeTerminal(), io.StringIO()):
        with ProgressBar(2, "bench", stream=stream) as bar:
            bar.update(1, "2x8x8x2")
            bar.write("a table row")
        captured = capsys.readouterr()
        assert captured.out == "a table row\n" and captured.err == ""
        assert "a table row" not in stream.getvalue()


def test_the_steps_done_are_counted_with_the_bar_hidden_too():
    """n is the steps done so far whether or not the bar is drawn: into a pipe, or with
    enabled=False, it counted nothing (tqdm, disabled, keeps no count)."""
    for stream, enabled in ((io.StringIO(), True), (FakeTerminal(), False), (FakeTerminal(), True)):
        with ProgressBar(5, "check", stream=stream, enabled=enabled) as bar:
            bar.update(2)
            bar.update(0, "a note only")
            bar.update(1)
            assert bar.n == 3, (stream, enabled)
