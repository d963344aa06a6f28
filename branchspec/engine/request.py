"""A request's state: a few counters and token lists, no mode flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from branchspec.config import SamplingParams
from branchspec.spec.drafter import DraftRoot


class FinishReason(str, Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


@dataclass
class RoundStats:
    """Per-request speculative statistics."""

    num_rounds: int = 0
    num_emitted: int = 0                                   # tokens emitted by verify rounds
    accepted_per_depth: list[int] = field(default_factory=list)   # [depth-1] -> accepted count

    @property
    def accept_length(self) -> float:
        """Mean tokens per verify round, bonus included (1.0 = nothing accepted)."""
        return self.num_emitted / self.num_rounds if self.num_rounds else 0.0


class DrafterLag:
    """Committed positions the drafter has not followed: chunks of (tokens [n], the target's
    hidden state before each [n, d]); len() is the number of positions, kept as a count so
    that reading it each round costs nothing however many chunks plain rounds added."""

    def __init__(self) -> None:
        self.chunks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.length = 0

    def append(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        self.chunks.append((tokens, hidden))
        self.length += len(tokens)

    def clear(self) -> None:
        self.chunks.clear()
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        return iter(self.chunks)


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
    last_hidden: torch.Tensor | None = None                # [d] target hidden at L - 1
    # Positions the target committed while the drafter did not run (under an adaptive
    # policy: the prompt, and plain decode steps), fed to it before its next speculative round.
    drafter_lag: DrafterLag = field(default_factory=DrafterLag)
    # The drafter's output at the next root, computed by the last round's draft extend
    # (`spec.drafter.DraftRoot`, one row), with the committed length it belongs to; a round
    # that finds it current skips the root's own drafter forward.
    draft_root: tuple[int, DraftRoot] | None = None
    generator: torch.Generator | None = None
    finish_reason: FinishReason | None = None
    output_text: str | None = None                         # set when it finishes (a stop string cuts it)
    stats: RoundStats = field(default_factory=RoundStats)
    arrival: int = 0
    # Only when asked for (params.logprobs / prompt_logprobs): one {token_id: logprob} per
    # output token, kept in step with output_ids; and per prompt position (None at 0), set
    # once by the first prefill (a recompute after preemption keeps them).
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def forget_state(self) -> None:
        """Drop everything derived from cached state (preemption, a failed round): the
        request is recomputed from its tokens."""
        self.num_committed, self.last_hidden, self.draft_root = 0, None, None
        self.drafter_lag.clear()

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
