"""A vLLM user's offline script (``generate`` with logprobs, ``n=2``, ``chat`` with tools,
``beam_search``) returns objects of vLLM's shapes: every attribute vLLM's results have (recorded
from vLLM's CPU backend by benchmarks/vllm_cpu/record_offline.py into
tests/data/vllm_offline_skeletons.json) exists on kvserve's, with a value of the same type."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: vLLM attributes kvserve does not have, each with why (everything else must match).
ABSENT = {
    "ec_transfer_params": "encoder-cache transfer between disaggregated engines: none here",
    "num_cache_creation_tokens": "vLLM's KV-connector accounting: none here",
    "prompt_token_id_logprobs": "vLLM's logprobs of given prompt token ids: not offered",
    "routed_experts": "vLLM's MoE routing capture: not offered",
    "sampling_mask": "vLLM's per-token sampling mask capture: not offered",
    "spec_decode_metrics": "per-output speculation counters: kvserve's are on RequestOutput (spec_num_*)",
    "weight_versions": "vLLM's RL weight-sync versions: none here",
}


def _recorder():
    spec = importlib.util.spec_from_file_location(
        "record_offline", ROOT / "benchmarks/vllm_cpu/record_offline.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def differences(ref, got, path="") -> list[str]:
    """Where ``got`` lacks an attribute of ``ref`` or holds another type. ``NoneType`` on one
    side matches anything (an optional value left unset in one script's run)."""
    if isinstance(ref, dict) and isinstance(got, dict):
        out = []
        for key, sub in ref.items():
            if key not in got:
                if key not in ABSENT:
                    out.append(f"{path}.{key}: missing")
            else:
                out += differences(sub, got[key], f"{path}.{key}")
        return out
    if isinstance(ref, list) and isinstance(got, list):
        return differences(ref[0], got[0], f"{path}[]") if ref and got else []
    if "NoneType" in (ref, got) or ref == got:
        return []
    return [f"{path}: vLLM {json.dumps(ref)[:80]}, kvserve {json.dumps(got)[:80]}"]


@pytest.fixture(scope="module")
def kvserve_skeletons(tiny_llama_dir):
    from kvserve import LLM, SamplingParams
    from kvserve.sampling_params import BeamSearchParams

    llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256)
    try:
        yield _recorder().run_script(llm, SamplingParams, BeamSearchParams)
    finally:
        llm.shutdown()


def test_offline_results_have_vllms_shapes(kvserve_skeletons):
    recorded = json.loads((ROOT / "tests/data/vllm_offline_skeletons.json").read_text())
    assert recorded["source"].startswith("vllm")
    assert set(recorded["cases"]) == set(kvserve_skeletons)
    problems = [
        p for case, ref in recorded["cases"].items() for p in differences(ref, kvserve_skeletons[case], case)
    ]
    assert not problems, "\n".join(problems)


def test_the_comparison_sees_a_missing_attribute(kvserve_skeletons):
    """The check fails when kvserve lacks one of vLLM's attributes or changes its type."""
    ref = {"outputs": [{"logprobs": [{"<key>": "int", "<value>": {"rank": "int", "extra": "str"}}]}]}
    got = {"outputs": [{"logprobs": [{"<key>": "int", "<value>": {"rank": "float"}}]}]}
    assert differences(ref, got) == [
        '.outputs[].logprobs[].<value>.rank: vLLM "int", kvserve "float"',
        ".outputs[].logprobs[].<value>.extra: missing",
    ]
    generated = kvserve_skeletons["generate_logprobs"]
    assert generated["outputs"][0]["logprobs"][0]["<value>"] == {
        "decoded_token": "str",
        "logprob": "float",
        "rank": "int",
    }
    assert generated["prompt_logprobs"][0]["<value>"]["decoded_token"] == "str"


@pytest.mark.slow  # loads vLLM and the default model in a subprocess (~1-2 min)
def test_offline_results_have_the_installed_vllms_shapes(kvserve_skeletons, tmp_path):
    """The same script run live on the vLLM in ``$VLLM_VENV`` (default /work/vllm-venv), where
    one is installed: catches a vLLM upgrade that adds an attribute kvserve lacks."""
    import os
    import subprocess

    venv = Path(os.environ.get("VLLM_VENV", "/work/vllm-venv"))
    if not (venv / "bin" / "python").exists():
        pytest.skip(f"no vLLM venv at {venv} (set VLLM_VENV)")
    from kvserve.model_executor.model_loader import resolve_model_dir

    out = tmp_path / "vllm.json"
    script = ROOT / "benchmarks/vllm_cpu/record_offline.py"
    cmd = f'source "{ROOT}/benchmarks/vllm_cpu/env.sh" && exec "{venv}/bin/python" "{script}" vllm'
    cmd += f' --model "{resolve_model_dir(None)}" --out "{out}"'
    env = {**os.environ, "VLLM_VENV": str(venv), "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0 and "No module named 'vllm'" in proc.stderr:
        pytest.skip(f"vllm is not importable in {venv}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    live = json.loads(out.read_text())
    problems = [
        p for case, ref in live["cases"].items() for p in differences(ref, kvserve_skeletons[case], case)
    ]
    assert not problems, "\n".join(problems)
