"""lm-evaluation-harness, unchanged, against ``kvserve serve``, with transformers as the reference.

Runs two local tasks (``tasks/``: a multiple-choice loglikelihood task and a ``generate_until``
task, data written for this benchmark, nothing downloaded) through lm-eval twice on the same
weights (the default model unless ``--model``):

1. ``local-completions`` against a ``kvserve serve`` started here (lm-eval's OpenAI-completions
   client: loglikelihoods through ``echo`` + ``logprobs``, generation through ``stop``);
2. lm-eval's ``hf`` backend (transformers on CPU, float32): the reference.

Prints a table (metric per task for both, wall time) and the largest difference between the
two runs' per-choice loglikelihoods, and writes it all as JSON (``--json-out``).

Setup once: ``bash benchmarks/lm_eval/setup.sh`` (lm-eval in its own venv, ``$LMEVAL_VENV``).
Run: ``.venv/bin/python benchmarks/lm_eval/run.py --json-out benchmarks/results/lm_eval.json``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASKS = ("kvserve_mc", "kvserve_gen")
MODEL_NAME = "kvserve-lm-eval"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvserve serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError("kvserve serve did not become healthy")


def _lm_eval(lmeval: Path, model: str, model_args: str, out: Path, extra: list[str]) -> float:
    cmd = [
        str(lmeval),
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        ",".join(TASKS),
        "--include_path",
        str(HERE / "tasks"),
        "--output_path",
        str(out),
        "--log_samples",
        *extra,
    ]
    t0 = time.perf_counter()
    # the tasks' data_files are relative to the task folder
    subprocess.run(cmd, check=True, cwd=HERE / "tasks")
    return time.perf_counter() - t0


def _results(out: Path) -> tuple[dict, dict[str, list]]:
    """(metrics per task, samples per task) of one lm-eval output folder."""
    res = json.loads(
        Path(sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))[-1]).read_text()
    )
    samples = {}
    for task in TASKS:
        f = sorted(glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True))[-1]
        samples[task] = [json.loads(line) for line in Path(f).read_text().splitlines()]
    return res["results"], samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF directory (default: the default model)")
    p.add_argument(
        "--lmeval-venv",
        default=os.environ.get("LMEVAL_VENV", str(Path(__file__).resolve().parents[2] / ".lmeval-venv")),
        help="lm-eval's venv (default: .lmeval-venv in the repository, where setup.sh puts it)",
    )
    p.add_argument("--json-out", default=None)
    p.add_argument("--num-concurrent", type=int, default=4)
    ns = p.parse_args(argv)

    from kvserve.model_executor.model_loader import resolve_model_dir

    model_dir = str(resolve_model_dir(ns.model))
    lmeval = Path(ns.lmeval_venv) / "bin" / "lm_eval"
    if not lmeval.exists():
        sys.exit(f"{lmeval} not found: run `bash benchmarks/lm_eval/setup.sh` first")
    work = Path(tempfile.mkdtemp(prefix="kvserve-lm-eval-"))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvserve",
            "serve",
            "--port",
            str(port),
            "--model",
            model_dir,
            "--served-model-name",
            MODEL_NAME,
            "--dtype",
            "float32",
        ],
    )
    try:
        _wait_healthy(url, server)
        kv_args = (
            f"model={MODEL_NAME},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={model_dir},num_concurrent={ns.num_concurrent},max_retries=1"
        )
        kv_s = _lm_eval(lmeval, "local-completions", kv_args, work / "kvserve", [])
    finally:
        server.terminate()
        server.wait(timeout=60)
    hf_s = _lm_eval(
        lmeval,
        "hf",
        f"pretrained={model_dir},dtype=float32",
        work / "hf",
        ["--device", "cpu", "--batch_size", "8"],
    )
    kv_res, kv_samples = _results(work / "kvserve")
    hf_res, hf_samples = _results(work / "hf")

    # Per-choice loglikelihoods of the multiple-choice task: resps[i][0] = [loglikelihood, is_greedy]
    def lls(samples):
        return {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in samples}

    kv_ll, hf_ll = lls(kv_samples["kvserve_mc"]), lls(hf_samples["kvserve_mc"])
    max_diff = max(abs(a - b) for d in kv_ll for a, b in zip(kv_ll[d], hf_ll[d]))
    kv_gen = {s["doc_id"]: s["filtered_resps"] for s in kv_samples["kvserve_gen"]}
    hf_gen = {s["doc_id"]: s["filtered_resps"] for s in hf_samples["kvserve_gen"]}
    same_gen = sum(kv_gen[d] == hf_gen[d] for d in kv_gen)

    rows = []
    for task, metric in (
        ("kvserve_mc", "acc,none"),
        ("kvserve_mc", "acc_norm,none"),
        ("kvserve_gen", "exact_match,strip"),
    ):
        rows.append(
            {"task": task, "metric": metric, "kvserve": kv_res[task][metric], "hf": hf_res[task][metric]}
        )
    print(f"\nlm-eval {TASKS} on {model_dir} (float32)")
    print(f"{'task':14} {'metric':22} {'kvserve serve':>14} {'transformers':>13}")
    for r in rows:
        print(f"{r['task']:14} {r['metric']:22} {r['kvserve']:14.3f} {r['hf']:13.3f}")
    print(f"wall time: kvserve serve {kv_s:.1f} s (server start excluded), transformers {hf_s:.1f} s")
    print(
        f"multiple choice: max |loglikelihood difference| over {sum(map(len, kv_ll.values()))} choices = {max_diff:.2e}"
    )
    print(f"generate_until: {same_gen} of {len(kv_gen)} filtered answers identical")
    result = {
        "model": model_dir,
        "rows": rows,
        "wall_s": {"kvserve": kv_s, "hf": hf_s},
        "mc_max_abs_loglikelihood_diff": max_diff,
        "gen_identical": same_gen,
        "gen_total": len(kv_gen),
    }
    if ns.json_out:
        Path(ns.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.json_out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
