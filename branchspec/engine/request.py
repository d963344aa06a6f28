"""A request's state: a few counters and token lists, no mode flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from branchspec.config import SamplingParams


class FinishReason(str, Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


@dataclass
class RoundStats:
    """Per-request speculative statistics."""

    num_rounds: int = 0
    num_emitted: int = 0                                   # tokens emitted by verify rounds
    num_drafted: int = 0                                   # draft tokens verified (D - 1 a round)
    accepted_per_depth: list[int] = field(default_factory=list)   # [depth-1] -> accepted count

    def record(self, path_len: int, num_draft_tokens: int) -> None:
        """One verify round that accepted path_len nodes (root included) of a budget of D."""
        self.num_rounds += 1
        self.num_emitted += path_len
        self.num_drafted += num_draft_tokens - 1
        hits = self.accepted_per_depth
        if len(hits) < num_draft_tokens - 1:
            hits.extend([0] * (num_draft_tokens - 1 - len(hits)))
        for d in range(path_len - 1):
            hits[d] += 1

    @property
    def accept_length(self) -> float:
        """Mean tokens per verify round, bonus included (1.0 = nothing accepted)."""
        return self.num_emitted / self.num_rounds if self.num_rounds else 0.0


@dataclass
class Sequence:
    """One request.

    Terms: `num_committed` (L) tokens have their target state in the cache; the *root* is
    token_ids[L], the last emitted token, not yet fed through the target. During decoding
    len(token_ids) == L + 1.
    """

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    num_committed: int = 0
    # What its sampled tokens are drawn from, with their positions (`sampling.target_tokens`):
    # SamplingParams.seed, or one the engine drew at admission.
    seed: int = 0
    finish_reason: FinishReason | None = None
    output_text: str | None = None                         # set when it finishes (a stop string cuts it)
    # The ids that end this request (the engine's EOS and turn end unless ignore_eos, and
    # its own stop_token_ids), and what ended it: the stop string or stop id, None for
    # EOS or a length finish (vLLM's stop_reason).
    stop_ids: frozenset[int] = frozenset()
    stop_reason: str | int | None = None
    stats: RoundStats = field(default_factory=RoundStats)
    arrival: int = 0
    # Only when asked for (params.logprobs / prompt_logprobs): one {token_id: logprob} per
    # output token, kept in step with output_ids; and per prompt position (None at 0), set
    # once by the first prefill (a recompute after preemption keeps them).
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None           # each prompt token's rank (None at 0)

    def forget_state(self) -> None:
        """Drop everything derived from cached state (preemption, a failed round): the
        request is recomputed from its tokens. (The drafter forgets its own state.)"""
        self.num_committed = 0

    def __post_init__(self) -> None:
        if self.logprobs is None and self.params.logprobs is not None:
            self.logprobs = []

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    @property
    def max_len(self) -> int:
        """The most tokens this request can ever hold: its prompt plus max_tokens."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def root_id(self) -> int:
        return self.output_ids[-1]
