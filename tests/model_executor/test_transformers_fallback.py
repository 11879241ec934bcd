"""The transformers fallback (``model_impl``): families with no native module run on the paged
KV cache and give transformers' own greedy tokens and logprobs; settings and checkpoints it
cannot run are refused, naming the fallback, the architecture and the feature."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineArgs
from tests.golden import TEST_DEVICE, compare, hf_greedy, hf_greedy_logits

VOCAB = 49152  # the default tokenizer's, saved beside each model
MAX_NEW = 12
ENGINE = dict(device=TEST_DEVICE, dtype="float32")
#: A KV cache small enough to force preemption, with chunked prefill and prefix caching.
TINY_CACHE = dict(
    block_size=4,
    num_gpu_blocks=24,
    num_cpu_blocks=64,
    enable_chunked_prefill=True,
    max_num_batched_tokens=16,
    enable_prefix_caching=True,
)


def _configs():
    from transformers import FalconConfig, GPT2Config, GPTNeoXConfig

    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return {
        "gpt2": GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **common),
        "gpt_neox": GPTNeoXConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=256,
            rotary_pct=0.5,
            **common,
        ),
        # multi-query attention (one KV head), rotary, parallel attention + MLP
        "falcon": FalconConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            alibi=False,
            multi_query=True,
            **common,
        ),
    }


def _save(tmp_path_factory, tokenizer_dir, name, config):
    """A random-weight model of ``config`` with the default tokenizer, as safetensors; its
    output projection scaled so that greedy choices are decisive (few near-ties)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path, model.to(TEST_DEVICE).eval()


@pytest.fixture(scope="module", params=["gpt2", "gpt_neox", "falcon"])
def family(request, tmp_path_factory, default_tokenizer_dir):
    return _save(tmp_path_factory, default_tokenizer_dir, request.param, _configs()[request.param])


@pytest.fixture(scope="module")
def prompts():
    """Prompts of several lengths; the last two share a 16-token prefix (prefix caching)."""
    rng = random.Random(0)
    ps = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 17, 26, 9)]
    ps += [ps[2][:16] + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 11)]
    return ps


def _run(llm, prompts, **params):
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, **params)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def test_family_runs_on_the_fallback_and_matches_transformers(family, prompts):
    """Default settings: greedy tokens equal transformers' ``generate``, and each chosen
    token's logprob equals transformers' log-softmax within 1e-4."""
    from kvserve.model_executor.models.transformers_fallback import TransformersForCausalLM

    path, hf = family
    llm = LLM(model=str(path), **ENGINE)
    assert isinstance(llm.llm_engine.executor.model, TransformersForCausalLM)
    outs = _run(llm, prompts, logprobs=1)
    distinct = set()
    for p, out in zip(prompts, outs):
        tokens, logits = hf_greedy_logits(hf, p, MAX_NEW)
        ours = out.outputs[0]
        assert list(ours.token_ids) == tokens
        distinct.update(tokens)
        for tok, entry, lg in zip(ours.token_ids, ours.logprobs, logits):
            ref = float(torch.log_softmax(lg, -1)[tok])
            assert abs(entry[tok].logprob - ref) < 1e-4, (tok, entry[tok], ref)
    assert len(distinct) > 3  # real, varied generations


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_family_under_scheduling_pressure_matches_transformers(family, prompts, mode):
    """A tiny KV cache with chunked prefill and prefix caching, each preemption mode: the same
    tokens as transformers, after preemptions and prefix-cache hits."""
    path, hf = family
    llm = LLM(model=str(path), **ENGINE, **TINY_CACHE, preemption_mode=mode)
    outs = _run(llm, prompts)
    for p, out in zip(prompts, outs):
        compare(list(out.outputs[0].token_ids), hf_greedy(hf, p, MAX_NEW))
    stats = llm.llm_engine.get_kv_cache_stats()
    assert stats["num_preemptions"] > 0, "the tiny cache must force preemption"
    assert stats["prefix_cache_hits"] > 0


def test_fallback_on_a_native_family_equals_the_native_path(tiny_llama_dir, prompts):
    """``model_impl='transformers'`` on a Llama gives the native path's tokens (and logprobs)."""
    from kvserve.model_executor.models.llama import LlamaForCausalLM
    from kvserve.model_executor.models.transformers_fallback import TransformersForCausalLM

    native = LLM(model=str(tiny_llama_dir), **ENGINE, model_impl="native")
    fallback = LLM(model=str(tiny_llama_dir), **ENGINE, model_impl="transformers")
    assert isinstance(native.llm_engine.executor.model, LlamaForCausalLM)
    assert isinstance(fallback.llm_engine.executor.model, TransformersForCausalLM)
    for a, b in zip(_run(native, prompts, logprobs=1), _run(fallback, prompts, logprobs=1)):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        for tok, ea, eb in zip(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(ea[tok].logprob - eb[tok].logprob) < 1e-4


def test_engine_features_run_on_the_fallback(family, prompts):
    """n > 1, n-gram speculation and a JSON-constrained request run through the engine as for
    a native model (greedy speculation keeps transformers' tokens)."""
    from kvserve import StructuredOutputsParams

    path, hf = family
    llm = LLM(
        model=str(path),
        **ENGINE,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
    )
    for p, out in zip(prompts, _run(llm, prompts)):
        compare(list(out.outputs[0].token_ids), hf_greedy(hf, p, MAX_NEW))
    two = llm.generate(
        [{"prompt_token_ids": prompts[0]}],
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(two[0].outputs) == 2 and all(len(c.token_ids) == 4 for c in two[0].outputs)
    choice = StructuredOutputsParams(choice=["yes", "no"])
    out = llm.generate(["Answer:"], SamplingParams(max_tokens=8, structured_outputs=choice), use_tqdm=False)
    assert out[0].outputs[0].text in ("yes", "no")


# ---------------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, default_tokenizer_dir):
    return _save(tmp_path_factory, default_tokenizer_dir, "gpt2-only", _configs()["gpt2"])[0]


def test_native_refuses_an_architecture_without_a_native_family(gpt2_dir):
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        LLM(model=str(gpt2_dir), **ENGINE, model_impl="native")


def test_model_impl_is_validated():
    """vLLM's ``vllm`` is kvserve's ``native``; any other value is refused, on ``LLM(...)`` and the
    command line alike."""
    from kvserve.entrypoints.cli import add_engine_args

    assert EngineArgs(model_impl="vllm").model_impl == "native"
    with pytest.raises(ValueError, match=r"model_impl must be one of auto\|native\|transformers"):
        EngineArgs(model_impl="terratorch")
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args(["--model-impl", "vllm"]).model_impl == "native"
    assert p.parse_args(["--model-impl", "transformers"]).model_impl == "transformers"


@pytest.mark.parametrize(
    "kw, setting",
    [
        (dict(enable_lora=True), "enable_lora"),
        (dict(tensor_parallel_size=2), "tensor_parallel_size=2"),
        (dict(quantization="int8"), "quantization='int8'"),
        (dict(quantization="int4"), "quantization='int4'"),
        (dict(quantization="gguf"), "quantization='gguf'"),
    ],
)
def test_fallback_refuses_what_it_cannot_run(gpt2_dir, kw, setting):
    """Asked for by name, refused before anything loads; chosen by ``auto`` for an architecture
    with no native family, refused once its config is read."""
    with pytest.raises(ValueError, match=rf"{setting}.*transformers fallback \(model_impl='transformers'\)"):
        EngineArgs(model=str(gpt2_dir), model_impl="transformers", **kw)
    if kw.get("quantization") != "gguf":  # (gguf needs a .gguf file: refused as a path first)
        with pytest.raises(ValueError, match=rf"{setting}.*transformers fallback.*GPT2LMHeadModel"):
            LLM(model=str(gpt2_dir), **ENGINE, **kw)


def test_fused_cpu_decode_step_refuses_the_fallback(gpt2_dir):
    from kvserve.model_executor.model_loader import load_model
    from kvserve.model_executor.models import cpu_decode_step

    model = load_model(gpt2_dir, torch.float32, "cpu", model_impl="auto")
    with pytest.raises(
        ValueError, match="fused CPU decode step is not supported by the transformers fallback"
    ):
        cpu_decode_step.applies(model, [], None, 1)


def test_encoder_only_and_vision_checkpoints_are_refused(tmp_path):
    from transformers import AutoModel, ElectraConfig, ViTConfig

    small = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    for name, cfg in (
        ("ElectraModel", ElectraConfig(vocab_size=64, embedding_size=32, **small)),
        ("ViTModel", ViTConfig(image_size=32, **small)),
    ):
        AutoModel.from_config(cfg).save_pretrained(tmp_path / name)
        with pytest.raises(
            ValueError, match=rf"config\.json: architecture \['{name}'\] has no causal language-model head"
        ):
            LLM(model=str(tmp_path / name), **ENGINE)


@pytest.mark.parametrize(
    "kind, message",
    [
        # a causal-LM mapping entry that is a vision model (Gemma 3's image-text checkpoints)
        ("gemma3", r"Gemma3ForConditionalGeneration is a multimodal model \(vision_config\)"),
        # no position limit (ALiBi, state-space): read before any weight
        ("bloom", r"no max_position_embeddings \(model_type 'bloom'\)"),
        ("mamba", r"no max_position_embeddings \(model_type 'mamba'\)"),
    ],
)
def test_multimodal_and_position_free_configs_are_refused_naming_the_file(tmp_path, kind, message):
    from transformers import BloomConfig, Gemma3Config, MambaConfig

    cfg = {"gemma3": Gemma3Config, "bloom": BloomConfig, "mamba": MambaConfig}[kind]()
    cfg.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: refused from the config
    with pytest.raises(ValueError, match=rf"{tmp_path}/config\.json: {message}"):
        LLM(model=str(tmp_path), **ENGINE)


@pytest.mark.parametrize(
    "make, feature",
    [
        (
            lambda: _configs()["falcon"].__class__(**{**_configs()["falcon"].to_dict(), "alibi": True}),
            "ALiBi",
        ),
        (
            lambda: _configs()["gpt2"].__class__(
                **{**_configs()["gpt2"].to_dict(), "add_cross_attention": True}
            ),
            "cross-attention",
        ),
    ],
)
def test_attention_features_the_fallback_cannot_honour_are_refused(
    tmp_path, default_tokenizer_dir, make, feature
):
    from transformers import AutoModelForCausalLM

    cfg = make()
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"config\.json: \w+ uses {feature}"):
        LLM(model=str(tmp_path), **ENGINE)


def test_beam_search_on_the_fallback_equals_transformers(family, prompts):
    """``LLM.beam_search`` (each beam a one-token request reusing its parent's blocks) gives
    transformers' hypotheses, in order, with its scores."""
    from kvserve import BeamSearchParams
    from tests.entrypoints.test_beam_search import hf_beams

    path, hf = family
    llm = LLM(model=str(path), **ENGINE, enable_prefix_caching=True)
    params = BeamSearchParams(beam_width=2, max_tokens=5)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts[:3]], params)
    for p, out in zip(prompts[:3], outs):
        ref = hf_beams(hf, p, 2, 5, 1.0, False, 2)
        assert [s.output_token_ids for s in out.sequences] == [t for t, _ in ref]
        for s, (_, score) in zip(out.sequences, ref):
            assert s.score == pytest.approx(score, rel=1e-5, abs=1e-4)
