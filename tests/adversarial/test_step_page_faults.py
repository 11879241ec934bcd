"""A CPU engine must not page-fault its activations afresh on every step (``cpu_malloc``).

glibc unmaps freed blocks over its dynamic mmap threshold, so without ``keep_freed_memory``
each prefill step faults all of its activations in again. Measured in fresh processes (the
settings are process-wide), on a 2-layer model of SmolLM2-135M's widths with 2,048-token steps, with the tuning and
without it (``KVSERVE_MALLOC_TUNE=0``): the second must fault at least 4x as much, which also
shows this test can fail.
"""
import os
import subprocess
import sys
import textwrap

import pytest


pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")

_SCRIPT = textwrap.dedent("""
    import resource, sys
    from kvserve import LLM, SamplingParams

    llm = LLM(model=sys.argv[1], device="cpu", dtype="float32", max_model_len=1024,
              max_num_batched_tokens=2048, num_gpu_blocks=1024, num_cpu_blocks=0)
    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 200 for j in range(500 + i)]} for i in range(8)]
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: every buffer size once
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        llm.generate(prompts, params, use_tqdm=False)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
""")


def _faults(model_dir, tune: bool) -> int:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               KVSERVE_MALLOC_TUNE="1" if tune else "0")
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(model_dir)], cwd=root, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return int(r.stdout.split()[-1])


def test_prefill_steps_reuse_freed_activation_memory(tmp_path_factory, default_tokenizer_dir):
    from transformers import LlamaConfig

    from tests.conftest import _save_tiny

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model_dir = _save_tiny(tmp_path_factory, default_tokenizer_dir, "tiny-llama-1k", config)
    tuned, untuned = _faults(model_dir, True), _faults(model_dir, False)
    assert untuned >= 4 * max(tuned, 100), f"minor faults over 3 passes: tuned {tuned}, untuned {untuned}"
