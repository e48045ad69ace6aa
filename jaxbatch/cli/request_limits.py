"""The `--max-*` request-limit flags (api.protocol.RequestLimits), shared by `jaxbatch serve`
and `jaxbatch batch` so a body refused by one is refused by the other (a leaf module: it imports
only the protocol's limits)."""

from __future__ import annotations

import argparse
import dataclasses

from jaxbatch.api.protocol import DEFAULT_LIMITS, RequestLimits

# RequestLimits fields -> their flag (the others: --max-stop-strings for max_stop_strings ...)
_LIMIT_FLAGS = {"max_body_bytes": "--max-request-body-bytes"}


def limit_flag(field: str) -> str:
    return _LIMIT_FLAGS.get(field, "--" + field.replace("_", "-"))


def add_request_limit_args(g: argparse._ArgumentGroup | argparse.ArgumentParser,
                           defaults: RequestLimits = DEFAULT_LIMITS) -> None:
    for f in dataclasses.fields(RequestLimits):
        default = getattr(defaults, f.name)
        g.add_argument(limit_flag(f.name), dest="limit_" + f.name, type=type(default),
                       default=default, metavar="N",
                       help=f"RequestLimits.{f.name} (default %(default)s)")


def request_limits_from_args(args: argparse.Namespace) -> RequestLimits:
    """SystemExit naming the flag for a limit below 1."""
    limits = RequestLimits(**{f.name: getattr(args, "limit_" + f.name)
                              for f in dataclasses.fields(RequestLimits)})
    for f in dataclasses.fields(RequestLimits):
        if getattr(limits, f.name) < 1:
            raise SystemExit(f"{limit_flag(f.name)} must be >= 1")
    return limits
