"""Which configuration each round runs: a fixed one (`FixedPolicy`), or one chosen per
round by expected throughput (`AdaptivePolicy`, `SpecConfig.auto()`). Both are
`SpecPolicy`s, made from what a user passes as `spec` by `make_policy`, the one place
that asks which kind it is."""

from __future__ import annotations

from typing import Callable

from branchspec.config import AutoPolicy, SpecConfig
from branchspec.speculative.calibration import AcceptanceModel
from branchspec.speculative.policy.base import BatchView, SpecPolicy
from branchspec.speculative.policy.costs import CostModel
from branchspec.speculative.policy.fixed import FixedPolicy

__all__ = ["BatchView", "SpecPolicy", "FixedPolicy", "make_policy"]


def make_policy(spec: SpecConfig | AutoPolicy | None, costs: Callable[..., CostModel],
                acceptance: AcceptanceModel | None = None) -> SpecPolicy:
    """The policy `spec` asks for. costs(auto_policy, progress=False): the round-cost model
    an adaptive policy prices its candidates with, called on its first need (see
    `profiling.load_or_calibrate`); acceptance: the engine's measured acceptance, which its
    rounds teach and an adaptive policy reads (its drafter's)."""
    if spec is None or isinstance(spec, SpecConfig):
        return FixedPolicy(spec)
    if isinstance(spec, AutoPolicy):
        from branchspec.speculative.policy.adaptive import AdaptivePolicy
        return AdaptivePolicy(spec, costs, acceptance=acceptance)
    raise TypeError(f"spec must be a SpecConfig, SpecConfig.auto(...) or None, got {type(spec).__name__}")
