"""Scheduling and paged KV-cache bookkeeping (pure Python, no tensors)."""

from kvserve.core.block_manager import AllocStatus, BlockSpaceManager
from kvserve.core.policy import FCFS, Policy, PolicyFactory, PriorityPolicy
from kvserve.core.scheduler import (
    ScheduledSequenceGroup,
    Scheduler,
    SchedulerOutputs,
    SchedulerPrefillOutputs,
    SchedulerRunningOutputs,
    SchedulerSwappedInOutputs,
    SchedulingBudget,
)

__all__ = [
    "AllocStatus",
    "BlockSpaceManager",
    "FCFS",
    "Policy",
    "PolicyFactory",
    "PriorityPolicy",
    "ScheduledSequenceGroup",
    "Scheduler",
    "SchedulerOutputs",
    "SchedulerPrefillOutputs",
    "SchedulerRunningOutputs",
    "SchedulerSwappedInOutputs",
    "SchedulingBudget",
]
