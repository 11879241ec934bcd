"""KV-cache pools: sizing, swap out/in and copy round-trips."""

import pytest
import torch

from kvserve.config import CacheConfig
from kvserve.worker.cache_engine import CacheEngine, bytes_per_block


def filled_engine(num_gpu=10, num_cpu=6):
    ce = CacheEngine(
        num_layers=3,
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
        num_gpu_blocks=num_gpu,
        num_cpu_blocks=num_cpu,
        dtype=torch.float32,
        device="cpu",
    )
    torch.manual_seed(0)
    ce.device_cache.copy_(torch.randn_like(ce.device_cache))
    return ce


def block(cache, b):
    return cache[:, :, :, b].clone()


def test_shapes_and_bytes_per_block():
    ce = filled_engine()
    assert ce.device_cache.shape == (3, 2, 2, 10, 4, 8)
    assert ce.cpu_cache.shape == (3, 2, 2, 6, 4, 8)
    assert len(ce.gpu_cache) == 3 and ce.gpu_cache[1].shape == (2, 2, 10, 4, 8)
    assert ce.bytes_per_block == 2 * 3 * 4 * 2 * 8 * 4
    assert bytes_per_block(30, 16, 3, 64, torch.bfloat16) == 2 * 30 * 16 * 3 * 64 * 2


def test_swap_out_then_in_round_trip():
    ce = filled_engine()
    before = {b: block(ce.device_cache, b) for b in (1, 4, 7)}
    untouched = block(ce.device_cache, 0)
    ce.swap_out({1: 0, 4: 5, 7: 2})
    for g, c in ((1, 0), (4, 5), (7, 2)):
        assert torch.equal(ce.cpu_cache[:, :, :, c], before[g])
    ce.device_cache[:, :, :, [1, 4, 7]] = 0
    ce.swap_in({0: 9, 5: 3, 2: 1})
    assert torch.equal(block(ce.device_cache, 9), before[1])
    assert torch.equal(block(ce.device_cache, 3), before[4])
    assert torch.equal(block(ce.device_cache, 1), before[7])
    assert torch.equal(block(ce.device_cache, 0), untouched)
    assert before[1].abs().sum() > 0


def test_copy_one_source_to_many():
    ce = filled_engine()
    src2, src5 = block(ce.device_cache, 2), block(ce.device_cache, 5)
    keep = block(ce.device_cache, 0)
    ce.copy({2: [6, 7], 5: [8]})
    assert torch.equal(block(ce.device_cache, 6), src2)
    assert torch.equal(block(ce.device_cache, 7), src2)
    assert torch.equal(block(ce.device_cache, 8), src5)
    assert torch.equal(block(ce.device_cache, 0), keep)
    # the per-layer views see the copies
    assert torch.equal(ce.gpu_cache[2][:, :, 6], src2[2])


def test_out_of_range_ids_raise():
    ce = filled_engine()
    with pytest.raises(ValueError, match="cpu block"):
        ce.swap_out({1: 6})
    with pytest.raises(ValueError, match="device block"):
        ce.swap_in({0: 10})
    with pytest.raises(ValueError, match="device block"):
        ce.copy({0: [-1]})


def test_determine_num_blocks(tmp_path):
    from kvserve.config import ModelConfig
    from kvserve.worker.worker import Worker
    from tests.model_executor.helpers import llama_config, save_tiny

    save_tiny(tmp_path, llama_config())  # 2 layers, 2 kv heads, head_dim 16
    bpb = 2 * 2 * 16 * 2 * 16 * 4
    w = Worker(
        ModelConfig(model=str(tmp_path), device="cpu"),
        CacheConfig(block_size=16, kv_cache_memory_gib=1.0, swap_space_gib=0.25),
    )
    assert w.bytes_per_block() == bpb
    assert w.determine_num_blocks() == ((1 << 30) // bpb, (1 << 28) // bpb)
    w.cache_config = CacheConfig(block_size=16, num_gpu_blocks=7, num_cpu_blocks=0)
    assert w.determine_num_blocks() == (7, 0)
    w.cache_config = CacheConfig(block_size=16, kv_cache_memory_gib=1e-9)
    with pytest.raises(ValueError, match="kv_cache_memory_gib"):
        w.determine_num_blocks()
    with pytest.raises(RuntimeError, match="init_cache"):
        from kvserve.sequence import ExecuteModelRequest

        w.execute_model(ExecuteModelRequest([]))


@pytest.mark.parametrize(
    "cache, field",
    [
        (dict(kv_cache_memory_gib=100000.0), "kv_cache_memory_gib"),
        (dict(num_gpu_blocks=10**10), "num_gpu_blocks"),
        (dict(num_gpu_blocks=8, swap_space_gib=100000.0), "swap_space_gib"),
        (dict(num_gpu_blocks=8, num_cpu_blocks=10**10), "num_cpu_blocks"),
    ],
)
def test_kv_pools_larger_than_host_memory_are_a_value_error_naming_the_field(tmp_path, cache, field):
    """On CPU both pools live in host memory: more than it has is refused naming the setting
    (was the allocator's RuntimeError, a traceback on the command line)."""
    from kvserve.config import ModelConfig
    from kvserve.worker.worker import Worker
    from tests.model_executor.helpers import llama_config, save_tiny

    save_tiny(tmp_path, llama_config())
    w = Worker(ModelConfig(model=str(tmp_path), device="cpu"), CacheConfig(block_size=16, **cache))
    with pytest.raises(ValueError, match=rf"GiB of host memory.*lower {field}"):
        w.determine_num_blocks()


def test_engine_with_a_kv_pool_beyond_host_memory_is_a_value_error(tmp_path):
    from kvserve import LLM
    from tests.model_executor.helpers import llama_config, save_tiny

    save_tiny(tmp_path, llama_config())
    with pytest.raises(ValueError, match="kv_cache_memory_gib"):
        LLM(model=str(tmp_path), device="cpu", kv_cache_memory_gib=100000.0)


@pytest.mark.parametrize(
    "cache, field",
    [
        (dict(num_gpu_blocks=8, kv_offload_gib=1e12, enable_prefix_caching=True), "kv_offload_gib"),
        (
            dict(num_gpu_blocks=8, num_kv_offload_blocks=10**12, enable_prefix_caching=True),
            "num_kv_offload_blocks",
        ),
    ],
)
def test_a_host_tier_larger_than_host_memory_is_a_value_error_naming_it(tmp_path, cache, field):
    """The prefix cache's host tier is host memory too: more than the machine has is refused
    naming the setting (was the allocator's RuntimeError, a traceback on the command line)."""
    from kvserve.config import ModelConfig
    from kvserve.worker.worker import Worker
    from tests.model_executor.helpers import llama_config, save_tiny

    save_tiny(tmp_path, llama_config())
    w = Worker(ModelConfig(model=str(tmp_path), device="cpu"), CacheConfig(block_size=16, **cache))
    with pytest.raises(ValueError, match=rf"host-tier blocks.*GiB of host memory.*lower {field}"):
        w.determine_num_blocks()
