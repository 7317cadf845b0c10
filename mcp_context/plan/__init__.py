"""Planner: choose context_parallel_size, hierarchical sizes, cp_comm_type and layout for a model.

``plan(PlanRequest(...))`` enumerates the layouts the engine accepts, takes balance from the
schedule, bytes and attention memory from a dry run of the engine itself (of each layout its host issue
time alone does not rule out), predicts times from a machine profile, and recommends one with its reasons. CLI: ``python -m mcp_context.plan``.
"""
from .candidates import Candidate, enumerate_candidates
from .dryrun import RankShape, RankTraffic, dry_run_rank
from .model import planning_shape
from .planner import Plan, PlanRequest, PlanRow, evaluate, plan
from .profiles import MachineProfile, load_profile, shipped_profiles

__all__ = ["Candidate", "enumerate_candidates", "RankShape", "RankTraffic", "dry_run_rank", "planning_shape", "Plan",
           "PlanRequest", "PlanRow", "evaluate", "plan", "MachineProfile", "load_profile", "shipped_profiles"]
