"""What one step of the engine produced (`RoundResult`), and where a round's time goes
(`ROUND_PHASES`): the types the round, the runner, the engine, the policies and the
benchmarks share, kept apart so that a policy depends on no execution code."""

from __future__ import annotations

from dataclasses import dataclass, field

from branchspec.config import SpecConfig

# Where a round's time goes: drafting, the verify pass with the round's accept and commit,
# the draft extend (with any catch-up), learning.
ROUND_PHASES = ("draft", "verify", "draft_extend", "learn")


@dataclass
class RoundResult:
    """What one step (a plain decode step or a speculative round) produced."""

    spec: SpecConfig | None      # the configuration that ran (None: a plain decode step)
    emitted: list[list[int]]     # per request, the tokens this step adds to its output
    path_len: list[int]          # per request, accepted nodes incl. the root (= tokens committed)
    # per request, one {token_id: logprob} per emitted token, or None where not asked for
    logprobs: list[list[dict[int, float]] | None] | None = None
    # Whether the round taught the engine's measured acceptance (what an adaptive policy
    # reads); a fixed EAGLE-2 configuration's rounds teach nothing.
    learnt: bool = False
    phase_seconds: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0             # the step's own wall time, catch-up excluded
    catch_up_seconds: float = 0.0    # feeding the drafter what it had not followed
