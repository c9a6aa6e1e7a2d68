"""A status line on stderr for work that takes more than a couple of seconds: how long it has
run and the step it is on (the latest log record of recycle_planner, whatever -v says). Shown
only on a terminal, so that pipes and log files stay clean; plan-all has its own bar."""

from __future__ import annotations

import logging
import sys
import threading
import time

AFTER = 2.0     # seconds of silence before the line appears
EVERY = 0.5     # seconds between updates


class Ticker(logging.Handler):
    """`with Ticker("planning"):` around long work."""

    def __init__(self, what: str, logger: str = "recycle_planner", stream=None):
        super().__init__(logging.INFO)
        self.what, self.step = what, ""
        self.logger = logging.getLogger(logger)
        self.stream = stream or sys.stderr
        self.done = threading.Event()
        self.shown = False

    def emit(self, record: logging.LogRecord) -> None:
        self.step = record.getMessage()

    def __enter__(self) -> "Ticker":
        self.t0 = time.monotonic()
        self.logger.addHandler(self)
        if self.stream.isatty():
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.logger.removeHandler(self)
        if getattr(self, "thread", None) is not None:
            self.thread.join()
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def _run(self) -> None:
        if self.done.wait(AFTER):
            return
        while not self.done.is_set():
            elapsed = time.monotonic() - self.t0
            line = f"{self.what} ({elapsed:.0f} s)" + (f": {self.step}" if self.step else "")
            self.stream.write("\r\033[K" + line[:120])
            self.stream.flush()
            self.shown = True
            self.done.wait(EVERY)
