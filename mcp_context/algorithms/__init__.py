"""Algorithms: the ring executor, how shards rotate, and the named communication schemes."""
from .schemes import COMM_ALIASES, COMM_TYPES, Scheme, a2a_degree, resolve_scheme

__all__ = ["COMM_ALIASES", "COMM_TYPES", "Scheme", "a2a_degree", "resolve_scheme"]
