"""Progress of work that takes more than a couple of seconds: how long it has run and the step
it is on (the latest log record of recycle_planner, whatever -v says). On a terminal, a status
line on stderr redrawn in place; elsewhere (a pipe, a log file, a batch job), a log line of
`recycle_planner.progress` every LOG_EVERY seconds, shown at every verbosity, so that a long run
is never silent and the log stays readable. plan-all draws its own bar on a terminal."""

from __future__ import annotations

import logging
import sys
import threading
import time

AFTER = 2.0      # seconds of silence before the terminal line appears
EVERY = 0.5      # seconds between updates of the terminal line
LOG_EVERY = 30.0  # seconds between progress lines in a log
PROGRESS = "recycle_planner.progress"
progress_log = logging.getLogger(PROGRESS)


class Ticker(logging.Handler):
    """`with Ticker("planning"):` around long work. The step is the latest record of `logger`,
    or with `logger=None` what the work sets (`ticker.step = ...`, a text or a function that
    returns one); `terminal=False` when
    something else (plan-all's bar) draws on the terminal."""

    def __init__(self, what: str, logger: str | None = "recycle_planner", stream=None,
                 terminal: bool = True):
        super().__init__(logging.INFO)
        self.what, self.step = what, ""
        self.logger = logging.getLogger(logger) if logger else None
        self.stream = stream or sys.stderr
        self.terminal = terminal
        self.done = threading.Event()
        self.shown = False
        self.thread: threading.Thread | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.name != PROGRESS:
            self.step = record.getMessage()

    def __enter__(self) -> "Ticker":
        self.t0 = time.monotonic()
        if self.logger is not None:
            self.logger.addHandler(self)
        on_terminal = self.stream.isatty()
        if not on_terminal or self.terminal:
            run = self._draw if on_terminal else self._log
            self.thread = threading.Thread(target=run, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        if self.logger is not None:
            self.logger.removeHandler(self)
        if self.thread is not None:
            self.thread.join()
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def line(self) -> str:
        elapsed = time.monotonic() - self.t0
        step = self.step() if callable(self.step) else self.step
        return f"{self.what} ({_elapsed(elapsed)})" + (f": {step}" if step else "")

    def _draw(self) -> None:
        if self.done.wait(AFTER):
            return
        while not self.done.is_set():
            self.stream.write("\r\033[K" + self.line()[:120])
            self.stream.flush()
            self.shown = True
            self.done.wait(EVERY)

    def _log(self) -> None:
        while not self.done.wait(LOG_EVERY):
            progress_log.info("%s", self.line())


def _elapsed(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds // 60:.0f} min {seconds % 60:02.0f} s"


def count_step(done: int, total: int, unit: str, t0: float, first: int = 0) -> str:
    """`40 of 165 situations (24%), about 3 min left`: the estimate from the pace since `t0`,
    when `first` were done (a resumed build starts with some)."""
    line = f"{done:,} of {total:,} {unit} ({done / max(total, 1):.0%})"
    spent = time.monotonic() - t0
    if first < done < total and spent > 1:
        line += f", about {_elapsed(spent / (done - first) * (total - done))} left"
    return line
