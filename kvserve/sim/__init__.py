"""Simulator: the real scheduler and block manager on a cost model and a virtual clock."""

from kvserve.sim.cost_model import CostModel, VirtualClock, fit_cost_model, fit_splitwise_csv
from kvserve.sim.executor import InvalidExecuteRequest, KVCacheCorruption, SimulatedExecutor
from kvserve.sim.step_shape import StepShape, step_shape

__all__ = [
    "CostModel",
    "VirtualClock",
    "fit_cost_model",
    "fit_splitwise_csv",
    "InvalidExecuteRequest",
    "KVCacheCorruption",
    "SimulatedExecutor",
    "StepShape",
    "step_shape",
]
