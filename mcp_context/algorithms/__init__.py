"""Algorithms: the ring executor, how shards rotate, and the named communication schemes."""
from .schemes import COMM_ALIASES, COMM_TYPES, a2a_degree, context_parallel_forward

__all__ = ["COMM_ALIASES", "COMM_TYPES", "a2a_degree", "context_parallel_forward"]
