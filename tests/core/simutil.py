"""Helpers for the core tests: build an engine on the simulator and check the DESIGN.md
invariants after every step."""

from __future__ import annotations

from kvserve.config import CacheConfig, ModelConfig, PreemptionMode, SchedulerConfig
from kvserve.core.scheduler import Scheduler, SchedulerOutputs
from kvserve.sampling_params import SamplingParams
from kvserve.sequence import Sequence, SequenceGroup, SequenceStatus, next_seq_id
from kvserve.sim.executor import SimulatedExecutor

VOCAB = 1000


def configs(
    BS=4,
    G=64,
    C=0,
    S=8,
    T=64,
    L=64,
    CP=False,
    PC=False,
    PM=None,
    WM=0.0,
    TIER=None,
    policy="fcfs",
    sliding_window=None,
    max_num_partial_prefills=1,
    long_prefill_token_threshold=None,
    lookahead=0,
    **scheduler_kw,
):
    """Scenario-README abbreviations -> (CacheConfig, SchedulerConfig)."""
    if isinstance(PM, str):
        PM = PreemptionMode[PM.upper()]
    cc = CacheConfig(
        block_size=BS,
        num_gpu_blocks=G,
        num_cpu_blocks=C,
        enable_prefix_caching=PC,
        num_kv_offload_blocks=TIER,
        watermark=WM,
        sliding_window=sliding_window,
    )
    sc = SchedulerConfig(
        max_num_batched_tokens=T,
        max_num_seqs=S,
        max_model_len=L,
        chunked_prefill_enabled=CP,
        preemption_mode=PM,
        policy=policy,
        max_num_partial_prefills=max_num_partial_prefills,
        long_prefill_token_threshold=long_prefill_token_threshold,
        num_lookahead_slots=lookahead,
        **scheduler_kw,
    )
    return cc, sc


def make_group(
    request_id: str,
    prompt: list[int],
    block_size: int = 4,
    n: int = 1,
    max_tokens: int = 16,
    arrival_time: float = 0.0,
    priority: int = 0,
    lora_request=None,
    **kw,
) -> SequenceGroup:
    """A SequenceGroup as the engine would build it (one prompt sequence), with
    ``lora_request`` (a ``LoRARequest`` or None)."""
    params = SamplingParams(
        n=n, max_tokens=max_tokens, temperature=0.0 if n == 1 else 1.0, ignore_eos=True, **kw
    )
    seq = Sequence(next_seq_id(), prompt, block_size)
    return SequenceGroup(
        request_id, [seq], params, arrival_time=arrival_time, priority=priority, lora_request=lora_request
    )


def lora(i: int):
    """LoRA adapter ``i`` as a ``LoRARequest`` (None for 0: the base model)."""
    from kvserve.lora_request import LoRARequest

    return LoRARequest(f"adapter{i}", i, f"/adapters/{i}") if i else None


def prompt_of(i: int, length: int) -> list[int]:
    """A distinct, deterministic prompt for request ``i``."""
    return [(i * 7919 + j * 31 + 1) % VOCAB for j in range(length)]


class Harness:
    """An LLMEngine on a SimulatedExecutor that checks invariants around every step.

    ``history`` keeps, per step, (SchedulerOutputs, {request_id: queue name before the step}).
    """

    def __init__(
        self,
        cc: CacheConfig,
        sc: SchedulerConfig,
        check_kv: bool = True,
        lora_config=None,
        preemption_cost=None,
    ):
        from kvserve.engine.llm_engine import LLMEngine

        self.cc, self.sc = cc, sc
        self.executor = SimulatedExecutor(
            VOCAB, cache_config=cc, max_model_len=sc.max_model_len, check_kv=check_kv
        )
        self.engine = LLMEngine(
            ModelConfig(max_model_len=sc.max_model_len, device="cpu"),
            cc,
            sc,
            executor=self.executor,
            clock=self.executor.clock,
            lora_config=lora_config,
            preemption_cost=preemption_cost,
        )
        # These tests drive the scheduler's own handling of groups that outgrow the pool
        # (preempt, recompute, length-cap): the engine's admission, which refuses such requests
        # up front, is left out here (tests/engine/test_kv_capacity_admission.py covers it).
        self.engine.kv_capacity = lambda: None  # type: ignore[method-assign]
        self.scheduler: Scheduler = self.engine.scheduler
        self.history: list[SchedulerOutputs] = []
        self.outputs: dict[str, object] = {}
        self.finished_order: list[str] = []
        self.num_final: dict[str, int] = {}
        self.admitted_while_swapped = 0
        self.lora_steps: list[set[int]] = []  # per step: the adapter ids it held (LoRA on)
        # The engine turns an executor exception into a "failed" request (fault isolation);
        # here that would hide a bookkeeping bug the simulator caught, so it fails the test
        # unless a test injects faults on purpose.
        self.allow_failed = False
        self._wrap()

    def _wrap(self):
        sched = self.scheduler
        orig = sched.schedule

        def schedule():
            before = {g.request_id: "waiting" for g in sched.waiting}
            swapped_before = bool(sched.swapped)
            metas, out = orig()
            self.history.append(out)
            self.check_step(out, metas, before, swapped_before)
            return metas, out

        sched.schedule = schedule

    def add(self, request_id, prompt, params, priority=0, arrival_time=None, lora_request=None, tenant=None):
        self.engine.add_request(
            request_id,
            prompt,
            params,
            arrival_time=arrival_time,
            priority=priority,
            lora_request=lora_request,
            tenant=tenant,
        )

    # ------------------------------------------------------------------ checks
    def check_queues(self):
        s = self.scheduler
        seen: dict[str, str] = {}
        for name in ("waiting", "running", "swapped"):
            for g in getattr(s, name):
                assert g.request_id not in seen, f"{g.request_id} in {seen[g.request_id]} and {name}"
                seen[g.request_id] = name
                assert not g.is_finished(), f"finished group {g.request_id} still in {name}"
                if name == "waiting":
                    # A waiting group never has more than its live seqs waiting; they are all WAITING.
                    for seq in g.get_unfinished_seqs():
                        assert seq.status == SequenceStatus.WAITING, (g, seq)
                if name == "swapped":
                    for seq in g.get_unfinished_seqs():
                        assert seq.status == SequenceStatus.SWAPPED, (g, seq)
        return seen

    def check_step(self, out: SchedulerOutputs, metas, before, swapped_before):
        sc = self.sc
        assert out.num_batched_tokens <= sc.max_num_batched_tokens
        num_seqs = sum(len(m.seq_data) for m in metas)
        assert num_seqs <= sc.max_num_seqs, (num_seqs, sc.max_num_seqs)
        total = 0
        for ssg, m in zip(out.scheduled_seq_groups, metas):
            assert ssg.token_chunk_size >= 1
            assert m.request_id == ssg.seq_group.request_id
            total += (ssg.token_chunk_size + ssg.num_lookahead_slots) * len(m.seq_data)
            for d in m.seq_data.values():
                assert d.get_num_computed_tokens() + ssg.token_chunk_size <= sc.max_model_len
        assert total == out.num_batched_tokens, (total, out.num_batched_tokens)
        if swapped_before and not self.scheduler.policy.preempts_by_rank:
            newly = [
                ssg for ssg in out.scheduled_seq_groups if before.get(ssg.seq_group.request_id) == "waiting"
            ]
            self.admitted_while_swapped += len(newly)
        self.check_queues()
        self.check_loras(out, metas)
        bm = self.scheduler.block_manager
        bm.check_invariants()
        assert bm.get_num_free_cpu_blocks() <= self.cc.num_host_blocks()
        self.check_tier_moves(out)

    def check_tier_moves(self, out: SchedulerOutputs):
        """Block moves (host-tier ones merged in) are well formed: no two sources share a
        destination, and no host block is both written and read in the step."""
        assert len(set(out.blocks_to_swap_in.values())) == len(out.blocks_to_swap_in)
        assert len(set(out.blocks_to_swap_out.values())) == len(out.blocks_to_swap_out)
        assert not set(out.blocks_to_swap_out.values()) & set(out.blocks_to_swap_in)

    def check_loras(self, out: SchedulerOutputs, metas):
        """The step's adapters are its groups' (metadata included) and, like the adapters of
        everything in ``running``, at most ``max_loras``."""
        step = {ssg.seq_group.lora_request for ssg in out.scheduled_seq_groups} - {None}
        assert out.lora_requests == step, (out.lora_requests, step)
        assert [m.lora_request for m in metas] == [
            ssg.seq_group.lora_request for ssg in out.scheduled_seq_groups
        ]
        lc = self.scheduler.lora_config
        if lc is None:
            assert not step
            return
        assert len(step) <= lc.max_loras, step
        running = {g.lora_int_id for g in self.scheduler.running} - {0}
        assert len(running) <= lc.max_loras, running
        self.lora_steps.append({r.lora_int_id for r in step})

    # ------------------------------------------------------------------ driving
    def step(self):
        outs = self.engine.step()
        for o in outs:
            assert self.allow_failed or o.outcome != "failed", o.error
            self.outputs[o.request_id] = o
            if o.finished:
                self.num_final[o.request_id] = self.num_final.get(o.request_id, 0) + 1
                self.finished_order.append(o.request_id)
        self.scheduler.block_manager.check_invariants()
        self.check_queues()
        return outs

    def run(self, max_steps: int = 5000, on_step=None):
        steps = 0
        while self.engine.has_unfinished_requests():
            self.step()
            steps += 1
            if on_step is not None:
                on_step(self, steps)
            assert steps < max_steps, "engine did not drain (hang / livelock)"
        return steps

    def assert_idle(self):
        bm = self.scheduler.block_manager
        assert not self.scheduler.has_unfinished_seqs()
        assert bm.get_num_free_gpu_blocks() == self.cc.num_gpu_blocks
        assert bm.get_num_free_cpu_blocks() == self.cc.num_host_blocks()
        assert bm.gpu.get_num_in_use() == 0 and bm.cpu.get_num_in_use() == 0
        assert not bm.block_tables
        assert not self.engine._groups and not self.engine._max_tokens

    def tokens(self, request_id) -> list[list[int]]:
        return [list(c.token_ids) for c in self.outputs[request_id].outputs]
