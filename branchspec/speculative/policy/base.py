"""What a speculation policy is: the `SpecPolicy` protocol the engine steps with."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from branchspec.config import ModelConfig, SpecConfig
from branchspec.speculative.footprint import RoundLimits, check_round_memory
from branchspec.speculative.outcome import RoundResult


@dataclass(frozen=True)
class BatchView:
    """What a policy sees of the running batch before a round."""

    seq_ids: list[int]
    lag: list[int]          # per request, committed positions its drafter has not followed
    remaining: list[int]    # per request, tokens it may still emit
    context: float          # mean committed length (forwards over a longer context cost more)
    # per request, GREEDY or SAMPLED (`calibration`): acceptance is measured apart for
    # each (None: all greedy)
    modes: list[int] | None = None


class SpecPolicy(Protocol):
    """Chooses each round's configuration (a SpecConfig, or None for a plain decode step)
    and learns from its outcome. Made once per spec value by `make_policy`."""

    name: str                      # "fixed" or "auto"
    description: str               # for people: what it runs
    configurations: tuple[SpecConfig | None, ...]   # every configuration it may run
    max_draft_tokens: int          # the most nodes one of its rounds commits (1: plain only)
    uses_drafter: bool             # may run speculative rounds (the drafter must follow)
    # reads the engine's measured acceptance, so its rounds must teach it (a calibrated
    # selection's rounds always do)
    reads_acceptance: bool
    counts: Counter                # rounds run per configuration label
    decide_seconds: float          # time spent choosing and learning from outcomes (not the
                                   # acceptance model's learning of verified rounds, which every
                                   # calibrated round pays alike)

    def check(self, cfg: ModelConfig, has_drafter: bool, limits: RoundLimits | None = None) -> None:
        """ValueError naming what the model lacks to run this policy, or the knob whose
        rounds would not fit the engine's `limits` (batch, lengths, free memory)."""

    def prepare(self, progress: bool = False) -> None:
        """Measure now what the policy would otherwise measure on first use."""

    def defer_drafter(self, batch: BatchView) -> bool:
        """At admission, over the running batch (the newly admitted requests' lag: their
        prompts): leave the prompts' drafter prefill as lag (fed only if a speculative
        round comes) rather than running it with the target's."""

    def choose(self, batch: BatchView) -> SpecConfig | None: ...

    def observe(self, batch: BatchView, result: RoundResult) -> None: ...

    def forget(self, seq_id: int) -> None:
        """The request finished or was preempted."""


def check_speculation(specs: tuple[SpecConfig, ...], cfg: ModelConfig, has_drafter: bool,
                      limits: RoundLimits | None = None) -> None:
    """Can a model speculate with these configurations on an engine of these `limits`?
    ValueError naming what is missing, or the knob that does not fit."""
    if not has_drafter:
        raise ValueError("speculative decoding needs a drafter, and this checkpoint has no MTP "
                         "block (num_mtp_layers=0); decode plainly (spec=None, or --speculative-algorithm NONE)")
    for spec in specs:
        spec.check_model(cfg.vocab_size)
        check_round_memory(spec, cfg, limits)
