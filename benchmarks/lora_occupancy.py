#!/usr/bin/env python
"""Adapter-slot occupancy of the multi-LoRA benchmark's workload on the simulator (virtual
clock: the figures do not depend on the machine's load).

    python benchmarks/lora_occupancy.py [--adapters 16 --max-loras 4 --slot-preemptions 0,1,2]

See ``kvserve/benchmarks/lora_occupancy.py``.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvserve.benchmarks.lora_occupancy import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
