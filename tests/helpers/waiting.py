"""Waiting in tests: a bounded wait for a condition, never a bare sleep."""

import time
from typing import Callable


def wait_for(predicate: Callable[[], bool], timeout: float, step: float = 0.01) -> bool:
    """Until `predicate()` holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True
