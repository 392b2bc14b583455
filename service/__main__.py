"""python -m service: the supervisor, which runs the worker and the front ends until
SIGTERM/SIGINT, then drains and exits (0 when every child ended cleanly)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from service.app.children import exit_now, initial_log_state
from service.app.lifecycle import serve
from service.app.loops import event_loop_factory
from service.observability import logs
from service.settings import SECRET_FIELDS, describe, env_name, load_settings

log = logging.getLogger("service")


def main(argv: list[str] | None = None) -> int:
    # No process here forks to go on using gRPC (children are spawned, the gateway is
    # exec'd). gRPC's fork handlers, run when uvloop forks to start the gateway, print a line
    # outside --log-format json, and when enabled they stopped the gateway from starting.
    os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"
    settings = load_settings(argv)
    # Read: the children are given the settings, so a key set in the environment is not
    # handed on in theirs (/proc/PID/environ), the gateway's included.
    for field in SECRET_FIELDS:
        os.environ.pop(env_name(field), None)
    logs.configure("supervisor", initial_log_state(settings))
    log.info("settings: %s", describe(settings))
    uvloop = event_loop_factory(settings.event_loop) is not None  # asked for, absent: exits
    log.info("event loop of the worker and front ends: %s", "uvloop" if uvloop else "asyncio")
    exit_now(asyncio.run(serve(settings)))


if __name__ == "__main__":
    sys.exit(main())
