"""The status line of long steps: what runs, from its first second, on a terminal and in a log."""

from __future__ import annotations

import io
import time

from sparseops.cli._progress import Status, fmt_duration


def test_fmt_duration():
    assert [fmt_duration(s) for s in (0, 59.6, 75, 3725)] == ["0:00", "1:00", "1:15", "1:02:05"]


def test_log_names_the_first_item_at_once_and_long_items_again():
    log = io.StringIO()
    st = Status(3, stream=log, every_s=0.2, tty=False)
    st.begin("first")
    assert "[1/3 0:00] first ..." in log.getvalue()  # before the item has done anything
    time.sleep(0.7)
    st.end()
    st.begin("second")
    st.end()
    st.close()
    text = log.getvalue()
    assert "first: still running after" in text
    assert "second" not in text  # a short item after the first makes no line


def test_terminal_redraws_one_line_with_an_estimate(capsys):
    term = io.StringIO()
    st = Status(5, stream=term, tty=True)
    for i in range(3):
        st.begin(f"item{i}")
        st.end()
        st.write(f"row {i}")
    st.begin("item3")
    time.sleep(0.6)
    st.close()
    text = term.getvalue()
    assert "\r\x1b[K[4/5 " in text and "left] item3" in text
    assert text.endswith("\r\x1b[K")  # closed: the line is cleared
    assert capsys.readouterr().out == "row 0\nrow 1\nrow 2\n"
