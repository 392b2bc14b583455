"""python -m service: the supervisor, which runs the worker and the front ends until
SIGTERM/SIGINT, then drains and exits 0."""

from __future__ import annotations

import asyncio
import logging
import sys

from service.app.children import LOG_FORMAT, exit_now
from service.app.lifecycle import serve
from service.settings import describe, load_settings

log = logging.getLogger("service")


def main(argv: list[str] | None = None) -> int:
    settings = load_settings(argv)
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    log.info("settings: %s", describe(settings))
    exit_now(asyncio.run(serve(settings)))


if __name__ == "__main__":
    sys.exit(main())
