"""Which drafted nodes a tree keeps: the selection strategies `SpecConfig.selection` names.

A strategy is one object per name, chosen once per round from the configuration
(`selection_of`); the drafter, the round and the cost model ask it what they need instead
of comparing names:

* "eagle2" (the paper's): nodes ranked by their cumulative draft log-probability; its
  rounds teach nothing (a fixed EAGLE-2 tree needs no measured acceptance);
* "calibrated": nodes ranked by the acceptance measured online
  (`calibration.AcceptanceModel.log_factors`, read per request); its rounds teach that
  measurement, since its next trees are valued by it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from branchspec.config import SpecConfig
from branchspec.speculative.calibration import GREEDY, SAMPLED, AcceptanceModel


class TreeSelection(Protocol):
    name: str
    learns: bool      # its rounds teach the measured acceptance

    def log_factors(self, calibration: AcceptanceModel, seq_ids: list[int], temperature: list[float],
                    spec: SpecConfig) -> torch.Tensor | None:
        """What its growth ranks by besides the draft scores (None: the draft scores alone)."""


class Eagle2:
    name, learns = "eagle2", False

    def log_factors(self, calibration, seq_ids, temperature, spec) -> None:
        return None


class Calibrated:
    name, learns = "calibrated", True

    def log_factors(self, calibration: AcceptanceModel, seq_ids: list[int], temperature: list[float],
                    spec: SpecConfig) -> torch.Tensor:
        """The log calibration factors of each request, its greedy and sampled acceptance
        kept apart [B, 2, depths, ranks, buckets]."""
        modes = [SAMPLED if t > 0 else GREEDY for t in temperature]
        return calibration.log_factors(seq_ids, modes, spec.num_steps, spec.topk)


SELECTIONS: dict[str, TreeSelection] = {s.name: s for s in (Eagle2(), Calibrated())}


def selection_of(spec: SpecConfig) -> TreeSelection:
    """The strategy `spec.selection` names."""
    return SELECTIONS[spec.selection]
