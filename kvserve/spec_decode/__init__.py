"""Speculative decoding: proposers (n-gram prompt lookup, draft model), the rejection sampler
and the ``SpecDecodeWorker`` that verifies proposals with one target forward per step.

The scheduler reserves the lookahead slots (``SchedulerConfig.num_lookahead_slots``) and the
engine appends the emitted tokens (``SequenceOutput.spec_tokens``); nothing here knows queues.
"""
