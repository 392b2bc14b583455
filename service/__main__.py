"""python -m service: the supervisor, which runs the worker and the front ends until
SIGTERM/SIGINT, then drains and exits 0."""

from __future__ import annotations

import asyncio
import logging
import sys

from service.app.children import exit_now, initial_log_state
from service.app.lifecycle import serve
from service.observability import logs
from service.settings import describe, load_settings

log = logging.getLogger("service")


def main(argv: list[str] | None = None) -> int:
    settings = load_settings(argv)
    logs.configure("supervisor", initial_log_state(settings))
    log.info("settings: %s", describe(settings))
    exit_now(asyncio.run(serve(settings)))


if __name__ == "__main__":
    sys.exit(main())
