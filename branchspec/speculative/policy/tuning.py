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
    # While plain rounds run, acceptance goes unmeasured and the text moves on: the tokens a
    # request's speculative round would accept are taken to walk at random from what was
    # last measured, one step of this standard deviation per plain round. That widens
    # what exploring a speculative round could reveal (not the noise a lead must pass), so
    # exploring retries speculation once it could have caught up: with nothing to catch
    # up, within about 60 plain rounds after a narrow loss (0.9x) and 125 after a wide one
    # (0.6x); a drafter catch-up to pay puts it off further. A retried round measures
    # only part of that walk (as much as its own noise allows), so a noisy sampled round
    # is followed by another while exploring is still worth it. Higher retries sooner;
    # every retry that finds the text unchanged pays a catch-up and a losing round.
    drift_noise: float = 0.03
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
    # How much of a candidate's accept evidence one of its rounds keeps.
    calibration_keep: float = 0.9
    # The same for each kind's long-run ratio, which plain rounds bring its calibration
    # back to, by `plain_fade` a round: the rounds just before plain decoding took over are
    # biased low (their bad luck is why it took over), and the long run is not. Higher
    # remembers further back; lower follows a change of workload sooner.
    long_keep: float = 0.99
    # Per plain round, each kind's calibration drifts this much of the way back towards
    # its long-run ratio, and each shape's own evidence fades by as much.
    plain_fade: float = 0.97
    # How far (log) a shape's accept calibration may lie from its kind's before its own
    # rounds say: higher makes untried shapes more worth exploring, and a shape's own
    # rounds count sooner.
    accept_spread: float = 0.10

    # -- decisions (adaptive.py) ---------------------------------------------------------------
    # Estimates are recomputed every this many rounds while the batch stays the same, or
    # every batch / redecide_per_requests rounds if that is more: a large batch's estimate
    # moves slowly and costs more to recompute. Fewer rounds react faster and cost more
    # bookkeeping; at most one exploring round per period, so this also bounds exploration.
    redecide_every: int = 4
    redecide_per_requests: int = 8
    # A decision that keeps the standing choice doubles the period, up to this many rounds
    # (one exploring round at most in each, so exploring thins out too); a switch brings
    # it back.
    # Higher costs less bookkeeping once settled and explores less often, but notices a
    # change in acceptance (a new topic within a request) that many rounds later. A
    # request that joins the batch is decided for at once (at its admission), and unless
    # plain decoding holds, the period starts over at redecide_every x B / newcomers
    # (rounded down to a doubling; never longer than it was): what the newcomers' rounds
    # measure moves the batch's estimate by their share of it.
    redecide_most: int = 16
    # The same while the standing choice is plain decoding. Plain rounds teach nothing of
    # acceptance (the estimates only widen, `drift_noise`, and follow the growing
    # context), so deciding as often only costs: a decision is 0.3-0.8 ms, 6-15%
    # of a compiled plain step at batch 4, and each exploring round it may ask for pays
    # the drafter's whole catch-up. Higher is cheaper where plain decoding wins, and
    # slower back to speculation where a change of text makes it win.
    redecide_most_plain: int = 64
    # A challenger replaces the standing choice once its estimated lead exceeds this many
    # standard deviations of the difference (the choice is the largest of many noisy
    # estimates, so its own is biased high). Lower switches sooner on real gains and more
    # often on noise; plain decoding is judged the same way, with no margin of its own.
    lead_noise: float = 1.0
    # Exploring a candidate is worth it when what one more round of it could gain, over the
    # rounds the information can still be used (the batch's rounds left, at most this
    # many), exceeds what that round loses. More explores more, and finds a winner sooner
    # on long generations; fewer settles faster on short ones.
    explore_horizon: int = 48

    # -- round prices (costs.py) ----------------------------------------------------------------
    # A served round is read against the plain steps served within this many rounds before
    # it (the median of the latest `pair_steps` of them; same batch bucket and sampling),
    # which ran at the machine's speed of that moment and on the same engine state. More
    # pairs a round with plain steps more often, but with ones run further from it (a
    # slow spell of the machine lasts seconds: hundreds of rounds at batch 1); without
    # any, a round is read against its own target forward and that forward's calibrated
    # price, which misses what the served forward costs beyond the calibrated one.
    pair_rounds: int = 32
    # More plain steps in that median are steadier and reach further back.
    pair_steps: int = 8
    # Measured corrections (log of a round's plain steps over its forwards' ratio) kept per
    # (candidate, batch bucket): more is steadier, fewer follows a change sooner.
    ratio_history: int = 16
    # A correction is clamped to +-this (log: 4.5x), so one round slowed by something else (a
    # prefill in a server, a page fault) cannot swing a candidate's price.
    ratio_clamp: float = 1.5
    # Rounds' worth of weight the kind's correction has in a candidate's own: more trusts a
    # shape's own rounds later (an unlucky round moves it less), fewer sooner.
    ratio_prior_rounds: float = 2.0
    # The spread of one round's correction assumed before rounds measure it (log, ~5%):
    # lower makes the policy commit sooner, higher explore longer.
    ratio_noise: float = 0.05
    # How far (log) a shape's correction may lie from its kind's before it is measured:
    # shapes differ in what their forwards miss (tree metadata, wider acceptance). Higher
    # makes untried shapes more worth exploring.
    shape_spread: float = 0.10
    # Predictions are kept per context rounded to this many tokens.
    context_step: int = 32


TUNING = Tuning()
