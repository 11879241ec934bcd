"""Tensor-parallel process groups (``parallel_state``) and the collectives the model calls."""
