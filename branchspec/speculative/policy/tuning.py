"""Every tuned constant of the adaptive policy, in one place, each with what it trades off.

The values are the ones the policy sweeps (docs/policy.md) were measured with; change one
and measure again side by side.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tuning:
    # -- reading the measured acceptance (calibration.AcceptanceModel, whose own prior and
    # memory the calibrated selection shares) -------------------------------------------------
    # Per plain round, the engine-wide statistics drift this much back towards the prior,
    # so a few unlucky rounds do not rule speculation out for good (higher: retried sooner).
    relax_rate: float = 0.01
    # Estimated acceptance is never below this, so every path keeps a finite log-value.
    acceptance_floor: float = 1e-4

    # -- accept calibration (adaptive.py) ----------------------------------------------------
    # Pseudo-tokens each kind's (chain, tree) observed/predicted ratio starts with: more
    # makes a kind harder to condemn after unlucky rounds, and slower to correct.
    calibration_prior: float = 16.0
    # A candidate's own ratio is shrunk towards its kind's with this many predicted tokens.
    label_weight: float = 8.0
    # Per speculative round, what did not run fades by this (kinds back towards level):
    # the rounds that run are the ones whose estimates were high, so what they measure is
    # biased low, and a shape set low that way would otherwise never be measured again.
    calibration_fade: float = 0.98
    # Per plain round, every calibration drifts this much of the way back towards level.
    plain_fade: float = 0.97
    # How much of a candidate's accept evidence one of its rounds keeps.
    calibration_keep: float = 0.9

    # -- decisions (adaptive.py) ---------------------------------------------------------------
    # Estimates are recomputed every this many rounds while the batch stays the same, or
    # every batch / redecide_per_requests rounds if that is more: a large batch's estimate
    # moves slowly and costs more to recompute. Fewer rounds react faster and cost more.
    redecide_every: int = 4
    redecide_per_requests: int = 8
    # A better estimate must beat the standing choice by this much: near-ties are noise,
    # and every switch costs a catch-up or a warm-up.
    switch_margin: float = 0.03
    # Speculation must beat plain decoding's estimate by this much: a speculative estimate
    # has more ways to be wrong, and losing to plain decoding is the outcome to prevent.
    plain_margin: float = 0.08
    # A choice leading every other by this factor is judged `clear_lead_period` times less often.
    clear_lead: float = 1.15
    clear_lead_period: int = 4
    # After a switch between plain decoding and speculation the choice is judged again
    # this soon: a switch made on a wrong estimate costs this many rounds.
    probe_rounds: int = 2

    # -- round costs (costs.py) ------------------------------------------------------------------
    # Measured overheads (measured - predicted round time) kept per (candidate, batch
    # bucket): more is steadier, fewer follows a change sooner.
    overhead_history: int = 8
    # A measured overhead is clamped to [low, high] x the predicted time, so one round
    # slowed by something else cannot swing a candidate's price.
    overhead_low: float = -0.5
    overhead_high: float = 3.0
    # The load (how much slower than at calibration the machine runs now, which prices a
    # candidate with nothing of its kind measured at a batch size) is the median of
    # measured / predicted over this many recent rounds of any candidate: fewer follows a
    # server's load sooner, more is steadier.
    load_history: int = 8
    # Plain decoding's overhead is this quantile of its history (a few slow rounds after a
    # large prefill would otherwise price it high and pick speculation where it loses).
    plain_overhead_quantile: float = 0.25
    # Predictions are kept per context rounded to this many tokens.
    context_step: int = 32


TUNING = Tuning()
