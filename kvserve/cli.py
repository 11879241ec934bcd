"""The ``kvserve`` console script (and ``python -m kvserve``): the product's commands
(``generate``, ``serve``, ``doctor``: ``kvserve.entrypoints.cli``) plus the tooling's, which stand
beside the product: ``bench`` (``kvserve.benchmarks.cli``), ``simulate`` (``kvserve.sim.cli``)
and ``profile`` (``kvserve.sim.profile``). A tool's module is imported only when its command
runs, so ``kvserve serve`` loads no benchmark or simulator code."""

from __future__ import annotations

import sys

from kvserve.benchmarks.cli import COMMANDS as BENCH_COMMANDS
from kvserve.entrypoints import cli as product_cli

#: ``(command, module, help)``: each command's arguments go to ``module.main(argv)``.
TOOLS: tuple[tuple[str, str, str], ...] = (
    ("bench", "kvserve.benchmarks.cli", f"benchmarks ({', '.join(BENCH_COMMANDS)})"),
    ("simulate", "kvserve.sim.cli", "replay a trace on the simulator"),
    ("profile", "kvserve.sim.profile", "measure this host's engine steps; write a cost model"),
)


def main(argv: list[str] | None = None) -> int:
    """Run one ``kvserve`` command line (``sys.argv[1:]`` when ``argv`` is None); returns the
    exit status."""
    return product_cli.main(argv, tools=TOOLS)


if __name__ == "__main__":
    sys.exit(main())
