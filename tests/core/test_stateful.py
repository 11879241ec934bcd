"""Hypothesis stateful test: random arrivals, lengths, n, priorities and aborts on tiny caches,
in every mode (chunked prefill on/off x prefix caching on/off x preemption default/recompute/
swap x fcfs/priority x LoRA off / max_loras 1 or 2 with requests for random adapters).
After every step the Harness checks the DESIGN.md invariants (one queue
per live group, token/seq budgets, block conservation on both pools, >= 1 token per prefill,
no position >= max_model_len, <= max_loras adapters per step); at the end every request has ended exactly once, nothing is in
use, and every output equals the no-pressure answer (an oracle computed from the simulator's
sampling function alone), or a prefix of it for aborted/ignored requests."""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvserve.config import LoRAConfig
from kvserve.sampling_params import SamplingParams
from kvserve.sim.executor import SimulatedExecutor, kv_entry
from tests.core.simutil import VOCAB, Harness, configs, lora, prompt_of

L = 32
BASE = prompt_of(999, L)  # shared prefix pool (prefix-cache hits, block-aligned full hits)
_ORACLE = SimulatedExecutor(VOCAB)


def oracle(prompt, n, max_tokens, lora_int_id=0):
    """What any correct schedule must produce: completion i's first token is sample i of the
    prompt, later tokens are the greedy-like hash of everything so far (as K/V of adapter
    ``lora_int_id``)."""
    outs = []
    for i in range(n):
        toks = list(prompt)
        out = []
        for k in range(max_tokens):
            t = _ORACLE._sample([0] + [kv_entry(x, lora_int_id) for x in toks], i if k == 0 else 0)
            out.append(t)
            toks.append(t)
        outs.append(out)
    return outs


def _cdiv(a, b):
    return -(-a // b)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        cp=st.booleans(),
        pc=st.booleans(),
        pm=st.sampled_from([None, "recompute", "swap"]),
        policy=st.sampled_from(["fcfs", "priority", "fair"]),
        BS=st.sampled_from([2, 4]),
        G=st.integers(4, 24),
        C=st.integers(0, 16),
        S=st.integers(1, 6),
        T=st.integers(8, 40),
        partial=st.integers(1, 2),
        max_loras=st.sampled_from([None, 1, 2]),
    )
    def setup(self, cp, pc, pm, policy, BS, G, C, S, T, partial, max_loras):
        cc, sc = configs(
            BS=BS,
            G=G,
            C=C,
            S=S,
            T=T,
            L=L,
            CP=cp,
            PC=pc,
            PM=pm,
            policy=policy,
            max_num_partial_prefills=partial,
        )
        self.h = Harness(cc, sc, lora_config=None if max_loras is None else LoRAConfig(max_loras=max_loras))
        self.reqs = {}
        self.aborted = set()
        self.counter = 0

    @rule(
        plen=st.integers(1, L - 1),
        n=st.integers(1, 3),
        mt=st.integers(1, 12),
        prio=st.integers(0, 2),
        shared=st.booleans(),
        seed=st.integers(0, 50),
        adapter=st.integers(0, 3),
        tenant=st.sampled_from([None, "a", "b"]),
    )
    def add(self, plen, n, mt, prio, shared, seed, adapter, tenant):
        mt = min(mt, L - plen)
        n = min(n, self.h.sc.max_num_seqs)
        prompt = BASE[:plen] if shared else prompt_of(seed, plen)
        rid = f"q{self.counter}"
        self.counter += 1
        params = SamplingParams(
            n=n, max_tokens=mt, temperature=0.0 if n == 1 else 1.0, seed=seed, ignore_eos=True
        )
        if self.h.scheduler.lora_config is None:
            adapter = 0
        self.h.add(rid, prompt, params, priority=prio, lora_request=lora(adapter), tenant=tenant)
        self.reqs[rid] = (prompt, n, mt, adapter)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        if rid not in self.h.engine._groups:
            return
        self.h.engine.abort_request(rid)
        self.aborted.add(rid)

    @rule(k=st.integers(1, 4))
    def step(self, k):
        for _ in range(k):
            self.h.step()

    def teardown(self):
        if not hasattr(self, "h"):
            return
        h = self.h
        h.run(max_steps=3000)
        h.assert_idle()
        pol = h.scheduler.policy
        if pol.tracks_service:  # every group it was told of has ended
            assert not pol._members and not pol._backlog
        cc = h.cc
        bs, G = cc.block_size, cc.num_gpu_blocks
        for rid, (prompt, n, mt, adapter) in self.reqs.items():
            assert h.num_final.get(rid) == 1, (rid, h.num_final.get(rid))
            out = h.outputs[rid]
            ref = oracle(prompt, n, mt, adapter)
            toks = [list(c.token_ids) for c in out.outputs]
            reasons = {c.finish_reason for c in out.outputs}
            if rid in self.aborted and reasons <= {"abort", "length", None}:
                for t, r in zip(toks, ref):
                    assert t == r[: len(t)], rid
                continue
            if out.error:
                p = len(prompt)
                full = p + mt - 1
                footprint = (p // bs) + n * (_cdiv(full, bs) - p // bs)
                legit = p > h.scheduler.prompt_limit or _cdiv(p, bs) > G or footprint > G
                assert legit, (rid, out.error, p, n, mt, footprint, G)
                for t, r in zip(toks, ref):
                    assert t == r[: len(t)], rid
                continue
            assert len(toks) == n, (rid, toks)
            assert toks == ref, (rid, toks, ref)


SchedulerMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSchedulerMachine = SchedulerMachine.TestCase
