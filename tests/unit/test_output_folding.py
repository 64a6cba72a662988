"""The agent's output relay shows a traceback another rank already printed as one line."""

from __future__ import annotations

from fastft.launch.procs.output import Tracebacks

TB = [
    b"Traceback (most recent call last):\n",
    b'  File "/x/train.py", line 2, in <module>\n',
    b"    import nope\n",
    b"ModuleNotFoundError: No module named 'nope'\n",
]


def feed(reader, lines, who):
    out = []
    for ln in lines:
        out += reader.feed(ln, who)
    return out


def test_the_first_traceback_is_shown_whole_and_a_repeat_as_one_line():
    tbs = Tracebacks()
    assert feed(tbs.reader(), [b"hello\n", *TB], "rank 0.0") == [b"hello\n", *TB]
    again = feed(tbs.reader(), TB, "rank 1.0")
    assert again == [
        b"ModuleNotFoundError: No module named 'nope' (the same traceback as rank 0.0)\n"
    ]


def test_a_different_traceback_is_shown_whole():
    tbs = Tracebacks()
    feed(tbs.reader(), TB, "rank 0.0")
    other = [*TB[:3], b"ModuleNotFoundError: No module named 'other'\n"]
    assert feed(tbs.reader(), other, "rank 1.0") == other


def test_lines_after_a_traceback_pass_and_an_unfinished_one_is_flushed_at_the_end():
    tbs = Tracebacks()
    r = tbs.reader()
    assert feed(r, [*TB, b"after\n", *TB[:2]], "rank 0.0") == [*TB, b"after\n"]
    assert r.flush() == TB[:2]


def test_an_endless_traceback_is_not_held_back_forever():
    tbs = Tracebacks()
    lines = [TB[0]] + [b"  frame\n"] * 1000
    out = feed(tbs.reader(), lines, "rank 0.0")
    assert len(out) >= 399  # shown once the block passed its limit, not at the end
