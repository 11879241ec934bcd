"""Queue-ordering policies for the scheduler.

A policy ranks sequence groups: ``get_priority(now, group)`` returns a comparable key where a
*larger* key is served first, and ``sort_by_priority`` orders a queue from highest to lowest.
The scheduler keeps its ``waiting``/``running``/``swapped`` deques in policy order, admits from
the head and preempts from the tail (the lowest-ranked group).

Policies:
- ``fcfs``: first come, first served (key: time waited since arrival, in seconds).
- ``priority``: lower ``SequenceGroup.priority`` value first, ties by arrival (key:
  ``(-priority, time waited)``).

New policies register with ``PolicyFactory.register(name, cls)``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from kvserve.sequence import SequenceGroup

PriorityKey = float | tuple[float, ...]


class Policy:
    """Base class. Subclasses implement ``get_priority``."""

    #: True when the policy ranks by something other than arrival order; the scheduler then
    #: lets a waiting group that strictly outranks running ones preempt them.
    preempts_by_rank: bool = False

    def get_priority(self, now: float, seq_group: SequenceGroup) -> PriorityKey:
        """A comparable key; larger is served first."""
        raise NotImplementedError

    def sort_by_priority(self, now: float, seq_groups: Iterable[SequenceGroup]) -> deque[SequenceGroup]:
        """A new deque from highest to lowest priority (stable for equal keys)."""
        return deque(sorted(seq_groups, key=lambda g: self.get_priority(now, g), reverse=True))

    def outranks(self, now: float, a: SequenceGroup, b: SequenceGroup) -> bool:
        """True when ``a`` must be served strictly before ``b`` by rank (used for
        priority preemption; arrival-order ties never preempt)."""
        return False


class FCFS(Policy):
    """First come, first served: the longest-waiting group first."""

    def get_priority(self, now: float, seq_group: SequenceGroup) -> float:
        return now - seq_group.metrics.arrival_time

    def sort_by_priority(self, now: float, seq_groups: Iterable[SequenceGroup]) -> deque[SequenceGroup]:
        # Same order as sorting by ``now - arrival`` descending, without the lambda per item.
        return deque(sorted(seq_groups, key=_arrival))


def _arrival(g: SequenceGroup) -> float:
    return g.metrics.arrival_time


def _prio_arrival(g: SequenceGroup) -> tuple[int, float]:
    return (g.priority, g.metrics.arrival_time)


class PriorityPolicy(Policy):
    """Lower ``priority`` value first; equal priorities in arrival order."""

    preempts_by_rank = True

    def get_priority(self, now: float, seq_group: SequenceGroup) -> tuple[float, float]:
        return (-seq_group.priority, now - seq_group.metrics.arrival_time)

    def sort_by_priority(self, now: float, seq_groups: Iterable[SequenceGroup]) -> deque[SequenceGroup]:
        return deque(sorted(seq_groups, key=_prio_arrival))

    def outranks(self, now: float, a: SequenceGroup, b: SequenceGroup) -> bool:
        return a.priority < b.priority


class PolicyFactory:
    """Registry of policies by name."""

    _POLICY_REGISTRY: dict[str, type[Policy]] = {"fcfs": FCFS, "priority": PriorityPolicy}

    @classmethod
    def get_policy(cls, policy_name: str, **kwargs) -> Policy:
        """Instantiate a policy. Raises ValueError naming the known policies."""
        try:
            return cls._POLICY_REGISTRY[policy_name](**kwargs)
        except KeyError:
            raise ValueError(
                f"policy must be one of {sorted(cls._POLICY_REGISTRY)}, got {policy_name!r}."
            ) from None

    @classmethod
    def register(cls, name: str, policy_cls: type[Policy]) -> None:
        cls._POLICY_REGISTRY[name] = policy_cls
