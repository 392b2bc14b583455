"""How many restarts a process may make of its children: --max-restarts within
--restart-window-s, one rule for the supervisor (worker, front ends) and for each front end
(its gRPC gateway)."""

from __future__ import annotations

import time
from collections import deque


class RestartBudget:
    """take() says whether one more restart fits in the window, and counts it if so."""

    def __init__(self, max_restarts: int, window_s: float) -> None:
        self._max = max_restarts
        self._window_s = window_s
        self._times: deque[float] = deque()

    def take(self) -> bool:
        now = time.monotonic()
        while self._times and self._times[0] < now - self._window_s:
            self._times.popleft()
        if len(self._times) >= self._max:
            return False
        self._times.append(now)
        return True
