"""One configuration for every round: a SpecConfig, or None for plain decoding."""

from __future__ import annotations

from collections import Counter

from branchspec.config import ModelConfig, SpecConfig, spec_label
from branchspec.speculative.footprint import RoundLimits
from branchspec.speculative.policy.base import BatchView, check_speculation
from branchspec.speculative.outcome import RoundResult


class FixedPolicy:
    """Runs `spec` in every round (a `SpecPolicy` that never learns)."""

    name = "fixed"

    def __init__(self, spec: SpecConfig | None):
        self.spec = spec
        self.description = "plain decoding" if spec is None else f"speculative decoding, {spec_label(spec)}"
        self.configurations = (spec,)
        self.max_draft_tokens = spec.num_draft_tokens if spec is not None else 1
        self.uses_drafter = spec is not None
        self.reads_acceptance = False
        self.counts: Counter[str] = Counter()
        self.decide_seconds = 0.0
        self._label = spec_label(spec)

    def check(self, cfg: ModelConfig, has_drafter: bool, limits: RoundLimits | None = None) -> None:
        if self.spec is not None:
            check_speculation((self.spec,), cfg, has_drafter, limits)

    def prepare(self, progress: bool = False) -> None:
        pass

    def defer_drafter(self, batch: BatchView) -> bool:
        return False

    def choose(self, batch: BatchView) -> SpecConfig | None:
        self.counts[self._label] += 1
        return self.spec

    def observe(self, batch: BatchView, result: RoundResult) -> None:
        pass

    def forget(self, seq_id: int) -> None:
        pass
