"""The simulator: its request checks catch bookkeeping bugs; cost model and virtual clock."""

import os

import pytest

from kvserve.sampling_params import SamplingParams
from kvserve.sequence import ExecuteModelRequest, SequenceData, SequenceGroupMetadata
from kvserve.sim.cost_model import SPLITWISE_CSV, CostModel, VirtualClock, fit_splitwise_csv
from kvserve.sim.executor import InvalidExecuteRequest, KVCacheCorruption, SimulatedExecutor


def meta(rid, data, table, chunk, is_prompt=True, do_sample=True, n=1, sid=0):
    return SequenceGroupMetadata(
        request_id=rid,
        is_prompt=is_prompt,
        seq_data={sid: data},
        sampling_params=SamplingParams(),
        block_tables={sid: table},
        token_chunk_size=chunk,
        do_sample=do_sample,
        num_samples=n,
    )


def test_deterministic_samples_and_n():
    ex = SimulatedExecutor(100, block_size=4, num_gpu_blocks=8)
    d = SequenceData([1, 2, 3, 4, 5])
    out = ex.execute_model(ExecuteModelRequest([meta("a", d, [0, 1], 5, n=3)]))
    toks = [s.output_token for s in out[0].samples]
    assert len(toks) == 3 and len(set(toks)) == 3
    ex2 = SimulatedExecutor(100, block_size=4, num_gpu_blocks=8)
    d2 = SequenceData([1, 2, 3, 4, 5])
    out2 = ex2.execute_model(ExecuteModelRequest([meta("b", d2, [5, 2], 5, n=3)]))
    assert [s.output_token for s in out2[0].samples] == toks  # any blocks, same answer
    assert ex.clock.now() > 0


def test_wrong_block_table_is_caught():
    ex = SimulatedExecutor(100, block_size=4, num_gpu_blocks=8)
    d = SequenceData([1, 2, 3, 4, 5])
    ex.execute_model(ExecuteModelRequest([meta("a", d, [0, 1], 5)]))
    d.update_num_computed_tokens(5)
    d.append_token_id(9)
    with pytest.raises(KVCacheCorruption):  # reads block 2 where block 0 was written
        ex.execute_model(ExecuteModelRequest([meta("a", d, [2, 1], 1, is_prompt=False)]))


def test_request_invariants():
    ex = SimulatedExecutor(100, block_size=4, num_gpu_blocks=8, num_cpu_blocks=4, max_model_len=8)
    d = SequenceData([1, 2, 3])
    with pytest.raises(InvalidExecuteRequest, match="zero-token"):
        ex.execute_model(ExecuteModelRequest([meta("a", d, [0], 0)]))
    with pytest.raises(InvalidExecuteRequest, match="too short"):
        ex.execute_model(ExecuteModelRequest([meta("a", SequenceData(list(range(6))), [0], 6)]))
    with pytest.raises(InvalidExecuteRequest, match="max_model_len"):
        ex.execute_model(ExecuteModelRequest([meta("a", SequenceData(list(range(9))), [0, 1, 2], 9)]))
    with pytest.raises(InvalidExecuteRequest, match="copy-on-write"):
        a, b = SequenceData([1, 2, 3]), SequenceData([1, 2, 4])
        ex.execute_model(ExecuteModelRequest([meta("a", a, [0], 3), meta("b", b, [0], 3, sid=1)]))
    with pytest.raises(InvalidExecuteRequest, match="same step"):
        ex.execute_model(ExecuteModelRequest([], blocks_to_swap_out={0: 1}, blocks_to_swap_in={1: 2}))
    with pytest.raises(InvalidExecuteRequest, match="out of range"):
        ex.execute_model(ExecuteModelRequest([], blocks_to_copy={0: [8]}))


def test_swap_and_copy_move_contents():
    ex = SimulatedExecutor(100, block_size=2, num_gpu_blocks=4, num_cpu_blocks=4)
    d = SequenceData([5, 6, 7])
    first = ex.execute_model(ExecuteModelRequest([meta("a", d, [0, 1], 3)]))[0].samples[0].output_token
    ex.execute_model(ExecuteModelRequest([], blocks_to_swap_out={0: 3, 1: 2}))
    ex.execute_model(ExecuteModelRequest([], blocks_to_swap_in={3: 1, 2: 0}))
    ex.execute_model(ExecuteModelRequest([], blocks_to_copy={1: [2]}))
    # After the moves the sequence lives in blocks [1, 2]; a decode reading through them works.
    d.update_num_computed_tokens(3)
    d.append_token_id(first)
    out = ex.execute_model(ExecuteModelRequest([meta("a", d, [1, 0], 1, is_prompt=False)]))
    assert out[0].samples


@pytest.mark.skipif(not os.path.exists(SPLITWISE_CSV), reason="shared calibration data not present")
def test_cost_model_fit_and_clock():
    cm = CostModel()
    assert cm.step_time(0, 0, 0) == 0.0
    assert cm.step_time(512, 0, 0) > cm.step_time(0, 1, 512) > 0
    fitted = fit_splitwise_csv(SPLITWISE_CSV)
    assert fitted.base_s == pytest.approx(cm.base_s, rel=1e-6)
    assert fitted.prefill_token_s == pytest.approx(cm.prefill_token_s, rel=1e-6)
    with pytest.raises(ValueError):
        fit_splitwise_csv(SPLITWISE_CSV, model="nope")
    c = VirtualClock()
    c.advance(1.5)
    assert c() == c.now() == 1.5
    with pytest.raises(ValueError):
        c.advance(-1)
