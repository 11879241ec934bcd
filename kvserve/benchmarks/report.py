"""``python -m kvserve.benchmarks.report RESULTS_DIR``: the markdown tables of docs/benchmarks.md
from the JSON files ``benchmarks/run_all.sh`` writes, with each target checked.

Files read (any may be missing): ``offline_kvserve_{float32,bfloat16}.json``,
``offline_vllm_{float32,bfloat16}.json``, ``serve_kvserve.json``, ``serve_vllm.json``,
``cold_start.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: Reference figures (shared/workloads/README.md) and the issue's online targets.
VLLM_REFERENCE_OUT_TOK_S = {"float32": 212.0, "bfloat16": 350.0}
VLLM_REFERENCE_ONLINE = {"ttft_p50_ms": 9700.0, "ttft_p99_ms": 15300.0, "tpot_p50_ms": 170.0}
COLD_START_TARGET_S = 10.0


def _load(d: Path, name: str) -> dict | None:
    p = d / name
    if not p.is_file():
        return None
    with open(p) as f:
        return json.load(f)


def _f(x, nd=1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def _ok(cond: bool | None) -> str:
    return "-" if cond is None else ("PASS" if cond else "FAIL")


def _workload_name(d: Path) -> str:
    for name in ("offline_kvserve_float32.json", "offline_kvserve_bfloat16.json", "serve_kvserve.json"):
        r = _load(d, name)
        if r and r.get("workload"):
            return Path(str(r["workload"]).split(" ")[0]).name
    return "w64.jsonl"


def render(d: Path) -> str:
    out: list[str] = []
    w = _workload_name(d)
    out.append(f"### Offline throughput ({w}, all requests at once; output tokens/s)\n")
    out.append(
        "| dtype | kvserve | vLLM CPU (measured) | vLLM CPU (reference) | kvserve / vLLM | target >= 1.0x |"
    )
    out.append("|---|---|---|---|---|---|")
    for dt in ("float32", "bfloat16"):
        kv = _load(d, f"offline_kvserve_{dt}.json")
        vl = _load(d, f"offline_vllm_{dt}.json")
        k = kv["kvserve"]["output_tokens_per_s"] if kv else None
        v = vl["output_tokens_per_s"] if vl else None
        ref = VLLM_REFERENCE_OUT_TOK_S[dt]
        base = v or ref
        ratio = k / base if k else None
        out.append(
            f"| {dt} | {_f(k)} | {_f(v)} | {_f(ref, 0)} | {_f(ratio, 2) + 'x' if ratio else '-'} | {_ok(None if ratio is None else ratio >= 1.0)} |"
        )
    kv32 = _load(d, "offline_kvserve_float32.json")
    if kv32 and kv32.get("transformers"):
        out.append(f"\n### kvserve vs transformers `generate` (float32, {w})\n")
        out.append("| engine | batching | req/s | output tok/s | total tok/s | peak RSS MiB |")
        out.append("|---|---|---|---|---|---|")
        k = kv32["kvserve"]
        out.append(
            f"| kvserve | continuous | {_f(k['requests_per_s'], 2)} | {_f(k['output_tokens_per_s'])} | "
            f"{_f(k['total_tokens_per_s'])} | {_f(k['peak_rss_mib'], 0)} |"
        )
        for b in kv32["transformers"]:
            out.append(
                f"| transformers | static bs={b['batch_size']} | {_f(b['requests_per_s'], 2)} | "
                f"{_f(b['output_tokens_per_s'])} | {_f(b['total_tokens_per_s'])} | - |"
            )
        if kv32.get("ratio_vs_best_transformers"):
            out.append(f"\nkvserve / best transformers: {kv32['ratio_vs_best_transformers']:.2f}x")
    out.append(f"\n### Online ({w}, all requests at once)\n")
    out.append(
        "| server | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | ITL p50 ms | E2E p50 ms | output tok/s |"
    )
    out.append("|---|---|---|---|---|---|---|---|")
    rows = {}
    for name, label in (("serve_kvserve.json", "kvserve"), ("serve_vllm.json", "vLLM CPU")):
        r = _load(d, name)
        if r and r.get("runs"):
            run = next(
                (x for x in r["runs"] if str(x.get("request_rate")) in ("inf", "Infinity")), r["runs"][0]
            )
            s = run["summary"]
            rows[label] = s
            out.append(
                f"| {label} | {_f(s['ttft_ms']['p50'], 0)} | {_f(s['ttft_ms']['p99'], 0)} | "
                f"{_f(s['tpot_ms']['p50'], 0)} | {_f(s['tpot_ms']['p99'], 0)} | {_f(s['itl_ms']['p50'], 0)} | "
                f"{_f(s['e2e_ms']['p50'], 0)} | {_f(s['output_throughput'])} |"
            )
    online_ref = VLLM_REFERENCE_ONLINE
    out.append(
        f"| vLLM CPU (reference) | {_f(online_ref['ttft_p50_ms'], 0)} | {_f(online_ref['ttft_p99_ms'], 0)} | "
        f"{_f(online_ref['tpot_p50_ms'], 0)} | - | - | - | - |"
    )
    if "kvserve" in rows:
        s = rows["kvserve"]
        v = rows.get("vLLM CPU")
        bound = (
            (v["ttft_ms"]["p50"], v["ttft_ms"]["p99"], v["tpot_ms"]["p50"])
            if v
            else (online_ref["ttft_p50_ms"], online_ref["ttft_p99_ms"], online_ref["tpot_p50_ms"])
        )
        checks = [
            s["ttft_ms"]["p50"] <= bound[0],
            s["ttft_ms"]["p99"] <= bound[1],
            s["tpot_ms"]["p50"] <= bound[2],
        ]
        out.append(
            f"\nTarget (kvserve no worse than vLLM {'measured' if v else 'reference'}): "
            f"TTFT p50 {_ok(checks[0])}, TTFT p99 {_ok(checks[1])}, TPOT p50 {_ok(checks[2])}"
        )
    cs = _load(d, "cold_start.json")
    out.append("\n### Cold start (process start -> first token)\n")
    if cs:
        tries = cs["tries"]
        out.append("| try | start -> first token s | import + LLM() s | generate -> first token s |")
        out.append("|---|---|---|---|")
        for i, t in enumerate(tries, 1):
            out.append(
                f"| {i} | {_f(t['start_to_first_token_s'], 2)} | {_f(t['build_llm_s'], 2)} | "
                f"{_f(t.get('first_token_after_llm_s'), 2)} |"
            )
        last = tries[-1]["start_to_first_token_s"]
        out.append(
            f"\nSecond start {last:.2f} s, target < {COLD_START_TARGET_S:g} s: {_ok(last < COLD_START_TARGET_S)}"
        )
    else:
        out.append("(not measured)")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    if not Path(argv[0]).is_dir():
        print(f"error: results folder {argv[0]!r} does not exist", file=sys.stderr)
        return 2
    print(render(Path(argv[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
