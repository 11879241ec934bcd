"""Small drivers for executor tests: tiny HF models on disk, a toy block allocator, metadata."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch

from kvserve.config import CacheConfig, ModelConfig
from kvserve.sampling_params import SamplingParams
from kvserve.sequence import SequenceData, SequenceGroupMetadata
from tests.golden import TEST_DEVICE

VOCAB = 256


def save_tiny(path, config, seed: int = 0):
    """Random-weight HF model for ``config`` saved (safetensors) into ``path``; returns it in eval,
    on ``TEST_DEVICE``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases so their loading is actually tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    model.save_pretrained(path)
    return model.to(TEST_DEVICE).eval()


def llama_config(**kw):
    from transformers import LlamaConfig

    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(kw)
    return LlamaConfig(**base)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """float32 logits ``[len(ids), vocab]`` of a HF model on one unpadded sequence (on the
    model's device)."""
    with torch.no_grad():
        return model(torch.tensor([ids], device=model.device)).logits[0].float()


class ToyAllocator:
    """Hands out shuffled block ids so block tables are never contiguous."""

    def __init__(self, num_blocks: int, seed: int = 0):
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def grow(self, table: list[int], num_tokens: int, block_size: int) -> None:
        while len(table) * block_size < num_tokens:
            table.append(self.free.pop())


class ToySeq:
    """One sequence with its own block table, fed by ``metadata(chunk)``."""

    _next_id = 0

    def __init__(self, prompt: list[int]):
        self.seq_id = ToySeq._next_id
        ToySeq._next_id += 1
        self.data = SequenceData(prompt)
        self.table: list[int] = []

    def metadata(
        self,
        chunk: int,
        alloc: ToyAllocator,
        block_size: int,
        do_sample: bool = True,
        params: SamplingParams | None = None,
    ) -> SequenceGroupMetadata:
        c = self.data.get_num_computed_tokens()
        alloc.grow(self.table, c + chunk, block_size)
        return SequenceGroupMetadata(
            request_id=str(self.seq_id),
            is_prompt=c < self.data.get_prompt_len(),
            seq_data={self.seq_id: self.data},
            sampling_params=params or SamplingParams(temperature=0.0),
            block_tables={self.seq_id: list(self.table)},
            token_chunk_size=chunk,
            do_sample=do_sample,
        )


def replace_weight(module, name: str, value) -> None:
    """``module.<name> = value`` for a model's linear weight: one still an ``nn.Parameter``
    (float32 left plain by ``prepack_weight`` without AVX-512F) or already a plain attribute
    (packed or quantized) alike."""
    module._parameters.pop(name, None)
    setattr(module, name, value)


@contextlib.contextmanager
def panels_everywhere() -> Iterator[None]:
    """Float weights loaded inside go to kvserve's panel GEMM wherever its kernels built
    (``gemm.beats_onednn`` answers ``gemm.available()``), so that tests of the panels and of the
    one-call decode step (which needs them) run on AVX2 hosts too, where ``prepack_weight``
    leaves float32 and bfloat16 weights to oneDNN."""
    import pytest

    from kvserve.ops import gemm

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gemm, "beats_onednn", gemm.available)
        yield


def make_worker(
    model_dir,
    block_size: int = 4,
    num_gpu_blocks: int = 64,
    num_cpu_blocks: int = 16,
    sliding_window: int | None = None,
    native: bool | None = None,
    dtype: str = "float32",
    panels: bool = False,
    kv_cache_dtype: str = "auto",
):
    """A worker (``dtype``, float32 by default) on ``model_dir`` on ``TEST_DEVICE``; ``native`` forces the
    decode-attention path (``None``: the default choice; ``True`` skips the test off CPU);
    ``panels`` loads the weights as under ``panels_everywhere`` (else as on this host);
    ``kv_cache_dtype``: ``CacheConfig.cache_dtype``."""
    from kvserve.worker.worker import Worker

    if native and TEST_DEVICE != "cpu":
        import pytest

        pytest.skip("the native decode kernel is CPU-only")
    with panels_everywhere() if panels else contextlib.nullcontext():
        w = Worker(
            ModelConfig(model=str(model_dir), dtype=dtype, device=TEST_DEVICE),
            CacheConfig(
                block_size=block_size,
                num_gpu_blocks=num_gpu_blocks,
                num_cpu_blocks=num_cpu_blocks,
                sliding_window=sliding_window,
                cache_dtype=kv_cache_dtype,
            ),
        )
    g, c = w.determine_num_blocks()
    w.init_cache(g, c)
    if native is not None:
        from kvserve.ops import attention as paged_attention

        if native and not paged_attention.available():
            import pytest

            pytest.skip(f"native kernel unavailable: {paged_attention.failure_reason()}")
        w.runner.use_native = native
    return w


def step_logits(worker, metadata: list[SequenceGroupMetadata]) -> torch.Tensor:
    """Run one step through the worker's runner and return the sampled rows' logits."""
    return worker.runner.compute_logits(metadata, worker.cache_engine.gpu_cache)


def all_logits(worker, metadata: list[SequenceGroupMetadata]) -> dict[int, torch.Tensor]:
    """Logits of *every* fed token, per seq id (rows in position order), for one step."""
    r = worker.runner
    inp = r.prepare_inputs(metadata)
    with torch.inference_mode():
        hidden = r.model(inp.input_ids, inp.positions, worker.cache_engine.gpu_cache, inp.attn)
        logits = r.model.compute_logits(hidden)
    return {sid: logits[a:b] for sid, (a, b) in inp.seq_rows.items()}


def advance(metadata: list[SequenceGroupMetadata]) -> None:
    """What the engine does after a step: mark the chunk computed."""
    for md in metadata:
        for d in md.seq_data.values():
            d.update_num_computed_tokens(md.token_chunk_size)
