"""What runs now and for how long, from its first second: a status line for long command-line steps.

On a terminal one line on stderr is redrawn twice a second: ``[3/240 0:42, ~2:10 left] label 12 s``. Anywhere
else (a pipe, a log file) the first item gets a line when it starts and any item still running after
``every_s`` seconds gets another, so that a log never stays silent longer than that. With ``announce`` every
item gets a line when it starts (the few long steps of a benchmark). Torch-free.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import threading
import time


def fmt_duration(s: float) -> str:
    """``75.0`` -> ``"1:15"``; ``3725`` -> ``"1:02:05"``."""
    s = int(round(s))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class Status:
    """Progress of ``total`` items run one after the other (``begin``/``end`` around each), with result lines
    printed through :meth:`write` so that they do not tear the status line.

    Args:
        total: the number of items.
        stream: where the status goes (default ``sys.stderr``); results go to ``sys.stdout``.
        every_s: on a non-terminal, the interval of the "still running" lines.
        tty: force terminal (True) or log (False) behaviour; default: ``stream.isatty()``.
        name: a prefix of the status (``[moe 2/7 0:12]``).
        announce: a line for every item when it starts, not only the first.
    """

    def __init__(self, total: int, *, stream=None, every_s: float = 10.0, tty: bool | None = None,
                 name: str = "", announce: bool = False):
        self.total, self.every_s, self.name, self.announce = total, every_s, name, announce
        self.stream = stream if stream is not None else sys.stderr
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty and isatty())
        self.tty = tty
        self.done = 0
        self.label: str | None = None
        self.t0 = time.perf_counter()
        self.t_item = self.t_last_end = self.t0
        self._next_notice = every_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._drawn = False

    def _head(self, now: float) -> str:
        head = f"[{self.name + ' ' if self.name else ''}{min(self.done + 1, self.total)}/{self.total} " \
               f"{fmt_duration(now - self.t0)}"
        if self.done >= 3 and self.done < self.total:
            # the mean of the finished items for each one not finished: steady while a long item runs
            left = (self.t_last_end - self.t0) / self.done * (self.total - self.done)
            head += f", ~{fmt_duration(left)} left"
        return head + "]"

    def _line(self, now: float) -> str:
        return f"{self._head(now)} {self.label} {now - self.t_item:.0f} s"

    def _draw(self) -> None:
        if self.label is None:
            return
        # one line only: a wrapped line would not be cleared by the next redraw
        width = shutil.get_terminal_size().columns - 1
        self.stream.write("\r\x1b[K" + self._line(time.perf_counter())[:width])
        self.stream.flush()
        self._drawn = True

    def _clear(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False

    def _tick(self) -> None:
        while not self._stop.wait(0.5 if self.tty else min(1.0, self.every_s / 2)):
            with self._lock:
                if self.label is None:
                    continue
                if self.tty:
                    self._draw()
                    continue
                now = time.perf_counter()
                if now - self.t_item >= self._next_notice:
                    print(f"{self._head(now)} {self.label}: still running after {now - self.t_item:.0f} s",
                          file=self.stream, flush=True)
                    self._next_notice += self.every_s

    def begin(self, label: str) -> None:
        """Item ``label`` starts now."""
        with self._lock:
            self.label, self.t_item, self._next_notice = label, time.perf_counter(), self.every_s
            if self.announce or (self.done == 0 and not self.tty):
                self._clear()
                print(f"{self._head(self.t_item)} {label} ...", file=self.stream, flush=True)
            if self.tty:
                self._draw()
        if self._thread is None:
            self._thread = threading.Thread(target=self._tick, name="sparseops-status", daemon=True)
            self._thread.start()

    def end(self) -> None:
        """The current item is finished."""
        with self._lock:
            self.done += 1
            self.label = None
            self.t_last_end = time.perf_counter()

    @contextlib.contextmanager
    def step(self, label: str):
        """``begin(label)`` ... ``end()`` around a block."""
        self.begin(label)
        try:
            yield
        finally:
            self.end()

    def write(self, line: str) -> None:
        """Print a result line on stdout, under (not through) the status line."""
        with self._lock:
            self._clear()
            print(line, flush=True)
            if self.label is not None and self.tty:
                self._draw()

    def close(self) -> None:
        """Stop the redraws and clear the status line."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        with self._lock:
            self._clear()
