"""``quantization="int8"`` / ``"int4"`` on the families beyond Llama (Qwen3, Phi-3, Gemma 2,
Gemma 3): every linear weight quantized at load gives transformers' greedy tokens, and its
log-probabilities within 1e-4, when transformers runs on the same weights dequantized."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.model_executor.model_loader import load_model
from kvserve.ops import quant
from tests.model_executor.family_checks import hf_greedy, save_family
from tests.model_executor.test_family_gemma import _gemma2, _gemma3
from tests.model_executor.test_family_phi3 import CONFIGS as PHI3_CONFIGS
from tests.model_executor.test_family_phi3 import phi3_config
from tests.model_executor.test_family_qwen3 import CONFIGS as QWEN3_CONFIGS
from tests.model_executor.test_family_qwen3 import qwen3_config
from tests.model_executor.test_gguf_quantized import prefill_logits

#: A small vocabulary: the model is run on token ids, and quantizing a 49,152-row LM head to
#: Q4_1 (a searched scale per block) would take most of the test's time.
VOCAB = 512
#: Tiny configs whose linear layers all take 32-weight blocks (in_features multiples of 32).
FAMILIES = {
    "qwen3": lambda: qwen3_config(**QWEN3_CONFIGS["gqa-untied"], vocab_size=VOCAB),
    "qwen3-tied": lambda: qwen3_config(**QWEN3_CONFIGS["mqa-tied"], vocab_size=VOCAB),
    "phi3": lambda: phi3_config(**PHI3_CONFIGS["gqa-longrope"], vocab_size=VOCAB),
    "phi4-mini-like": lambda: phi3_config(**PHI3_CONFIGS["phi4-mini-like"], vocab_size=VOCAB),
    "gemma3": lambda: _gemma3(vocab_size=VOCAB),
    # Gemma 2 with hidden 64 and 4 heads of 16 (its family test's 48 / 6 heads are off the blocks)
    "gemma2": lambda: _gemma2(hidden_size=64, intermediate_size=96, num_attention_heads=4, vocab_size=VOCAB),
}
#: Family x method pairs of the quick tier: every family once, each method on half; the
#: others are in the slow tier.
QUICK = {
    ("qwen3", "int8"),
    ("qwen3-tied", "int4"),
    ("phi3", "int4"),
    ("phi4-mini-like", "int8"),
    ("gemma3", "int8"),
    ("gemma2", "int4"),
}
MAX_TOKENS = 10


@pytest.fixture(autouse=True, scope="module")
def float_activations():
    """The references are float-activation results: run the quantized kernels in that mode
    (int8 activations are checked by perplexity in test_int8_quantization.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(quant.ACT_ENV, "float")
        yield


@pytest.fixture(scope="module")
def saved(tmp_path_factory, default_tokenizer_dir):
    """family -> (checkpoint directory, its transformers model), saved on first use."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            path = tmp_path_factory.mktemp(f"quant-{name}")
            cache[name] = (path, save_family(path, FAMILIES[name](), default_tokenizer_dir))
        return cache[name]

    return get


def _set(linear: nn.Linear, w: torch.Tensor) -> None:
    linear.weight = nn.Parameter(w.to(linear.weight.dtype).clone(), requires_grad=False)


def dequantized_reference(hf, model):
    """A copy of transformers model ``hf`` whose linear weights (and LM head: a tied one gets
    its own, the embedding stays float as in ``model``) are ``model``'s quantized weights
    dequantized, the fused q/k/v and gate/up split back into the checkpoint's tensors."""
    import copy

    ref = copy.deepcopy(hf)
    for layer, ours in zip(ref.model.layers, model.layers):
        a, mlp = ours.self_attn, ours.mlp
        qkv = quant.dequantize(a.qkv_weight)
        gate_up = quant.dequantize(mlp.gate_up_weight)
        if hasattr(layer.self_attn, "qkv_proj"):  # Phi-3 keeps them fused
            _set(layer.self_attn.qkv_proj, qkv)
            _set(layer.mlp.gate_up_proj, gate_up)
        else:
            q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size])
            for name, w in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                _set(getattr(layer.self_attn, name), w)
            _set(layer.mlp.gate_proj, gate_up[: mlp.inter])
            _set(layer.mlp.up_proj, gate_up[mlp.inter :])
        _set(layer.self_attn.o_proj, quant.dequantize(a.o_weight))
        _set(layer.mlp.down_proj, quant.dequantize(mlp.down_weight))
    _set(ref.lm_head, quant.dequantize(model.lm_head)[: hf.config.vocab_size])
    return ref.eval()


def _greedy_with_logprobs(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """kvserve's greedy tokens (one prefill, then single-token decode steps through the paged
    cache) and each chosen token's log-probability."""
    from kvserve.worker.cache_engine import CacheEngine
    from kvserve.worker.model_runner import ModelRunner
    from tests.model_executor.helpers import ToyAllocator, ToySeq

    cfg = model.config
    ce = CacheEngine(cfg.num_hidden_layers, model.num_kv_heads, model.head_dim, 4, 64, 0, model.dtype, "cpu")
    runner = ModelRunner(model, 4, 64, None, sampler=None)
    seq, alloc, tokens, lps = ToySeq(prompt), ToyAllocator(64), [], []
    chunk = len(prompt)
    for _ in range(n):
        inp = runner.prepare_inputs([seq.metadata(chunk, alloc, 4)])
        with torch.inference_mode():
            h = model(inp.input_ids, inp.positions, ce.gpu_cache, inp.attn)
            logits = model.compute_logits(h[-1:])[0].float()
        tok = int(logits.argmax())
        tokens.append(tok)
        lps.append(float(torch.log_softmax(logits, -1)[tok]))
        seq.data.update_num_computed_tokens(chunk)
        seq.data.append_token_id(tok, 0.0)
        chunk = 1
    return tokens, lps


@pytest.mark.parametrize(
    "family, method",
    [
        pytest.param(f, m, marks=() if (f, m) in QUICK else pytest.mark.slow)
        for f in FAMILIES
        for m in ("int8", "int4")
    ],
)
def test_quantized_family_equals_transformers_on_the_dequantized_weights(saved, family, method):
    path, hf = saved(family)
    model = load_model(path, torch.float32, "cpu", quantization=method)
    qtype = "q8_0" if method == "int8" else "q4_1"
    for layer in model.layers:
        for w in (layer.self_attn.qkv_weight, layer.self_attn.o_weight, layer.mlp.gate_up_weight):
            assert isinstance(w, quant.QuantWeight) and w.qtype == qtype
        assert isinstance(layer.mlp.down_weight, quant.QuantWeight)
    assert isinstance(model.lm_head, quant.QuantWeight)
    ref = dequantized_reference(hf, model)
    # the quantization moved the answers: the check is not float vs float in disguise
    prompts = [[(7 + 31 * i) % VOCAB for i in range(19)], [(5 + 113 * i) % VOCAB for i in range(40)]]
    prompt = prompts[0]
    with torch.no_grad():
        float_logits = hf(torch.tensor([prompt])).logits[0]
    assert not torch.allclose(prefill_logits(model, prompt), float_logits, atol=1e-3)
    for prompt in prompts:
        want_tokens, want_lps = hf_greedy(ref, prompt, MAX_TOKENS)
        tokens, lps = _greedy_with_logprobs(model, prompt, MAX_TOKENS)
        assert tokens == want_tokens
        err = max(abs(a - b) for a, b in zip(lps, want_lps))
        assert err < 1e-4, (err, lps, want_lps)
