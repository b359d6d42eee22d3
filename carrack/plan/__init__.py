"""Plans: a model compiled once for every input shape (see `carrack.plan.plan`)."""

from carrack.plan.plan import Bound, Plan, build_plan, prepare_kernels

__all__ = ["Bound", "Plan", "build_plan", "prepare_kernels"]
