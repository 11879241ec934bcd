#!/usr/bin/env python
"""Multi-LoRA serving: w64 over 4 adapters (max_loras=4) and over 16 adapters cycling through 4
slots, against the same run without adapters, in float32 and bfloat16.

    python benchmarks/lora.py [any `kvserve bench lora` flag]

Same as ``kvserve bench lora`` (see ``kvserve/benchmarks/lora.py``). The full run takes long on
a small machine; a smoke run: ``--num-prompts 4 --max-output 4 --dtypes float32``.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvserve.benchmarks.lora import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
