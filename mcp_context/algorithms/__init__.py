"""Algorithms: the ring executor, how shards rotate, and the named communication schemes."""
from .schemes import Scheme, resolve_scheme

__all__ = ["Scheme", "resolve_scheme"]
