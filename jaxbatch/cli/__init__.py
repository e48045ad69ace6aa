"""`jaxbatch` console script: serve | batch | plan | generate | models | build-kernels.

Each subcommand is a module of this package with a `main(argv) -> int` that owns its arguments;
the engine options common to all come from `engine_args` (a leaf: it imports only the config).
Nothing outside `cli/` imports this package.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from jaxbatch.cli import batch, generate, kernels, models, plan, serve

# name -> (entry point, one-line description); each module imports jax only when it runs
SUBCOMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "serve": (serve.main, "OpenAI-compatible HTTP server"),
    "batch": (batch.main, "offline JSONL batch job (OpenAI Batch format)"),
    "plan": (plan.main, "inspect padding plans of a workload or trace"),
    "generate": (generate.main, "one-shot generation from the command line"),
    "models": (models.main, "built-in models and the supported architectures"),
    "build-kernels": (kernels.main, "build this machine's C++ CPU kernels (an install step)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        print("usage: jaxbatch {" + ",".join(SUBCOMMANDS) + "} [options]\n")
        for name, (_, doc) in SUBCOMMANDS.items():
            print(f"  {name:10s} {doc}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return int(SUBCOMMANDS[argv[0]][0](argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
