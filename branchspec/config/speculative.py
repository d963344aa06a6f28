"""Speculative decoding settings: `SpecConfig` (SGLang's three knobs) and `AutoPolicy`
(`SpecConfig.auto()`: a configuration chosen per round among candidates)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from branchspec.config.checks import ConfigError, ConfigTypeError, check_int


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding knobs, named as in SGLang.

    num_steps: draft depth; topk: branching per step (1 = chain);
    num_draft_tokens: verify budget D per sequence, the root included.
    selection: which D - 1 drafted nodes a tree keeps (and which topk each step expands):
    "eagle2" (the paper's method) the highest cumulative draft probability; "calibrated"
    the highest measured acceptance (`speculative/calibration.py`), learnt online from
    verified rounds, so a tree keeps the chain wherever the chain is the better bet.
    """

    num_steps: int = 3
    topk: int = 2
    num_draft_tokens: int = 6
    selection: str = "eagle2"

    SELECTIONS: ClassVar[tuple[str, ...]] = ("eagle2", "calibrated")

    def __post_init__(self) -> None:
        for name in ("num_steps", "topk", "num_draft_tokens"):
            object.__setattr__(self, name, check_int("SpecConfig", name, getattr(self, name), minimum=1))
        if not isinstance(self.selection, str):
            raise ConfigTypeError(f"SpecConfig.selection must be a string, got {type(self.selection).__name__}")
        if self.selection not in self.SELECTIONS:
            raise ConfigError(f"SpecConfig.selection={self.selection!r} is not one of {self.SELECTIONS}")
        s, k, d = self.num_steps, self.topk, self.num_draft_tokens
        if d < 2:
            raise ConfigError(f"SpecConfig.num_draft_tokens={d} leaves no draft token (the root counts as "
                             "one); use >= 2")
        # EAGLE-2 growth yields topk candidates at step 1 and topk^2 at every later step;
        # the best D-1 of them are kept, so there must be at least that many.
        max_candidates = k + (s - 1) * k * k
        if max_candidates < d - 1:
            need = 1 + -(-(d - 1 - k) // (k * k)) if d - 1 > k else 1
            raise ConfigError(
                f"SpecConfig: num_steps={s}, topk={k} draft at most {max_candidates} candidates, fewer "
                f"than num_draft_tokens-1={d - 1}; use num_steps >= {need} or a larger topk")
        # Kept nodes are at most D-1 deep, so deeper steps would be drafted and thrown away.
        if s > d - 1:
            raise ConfigError(f"SpecConfig.num_steps={s} exceeds num_draft_tokens-1={d - 1}, the deepest "
                             f"a kept node can be; use num_steps <= {d - 1}")
        # A child of rank r is kept only with its r - 1 better siblings (they score at least
        # as high and come first), so no tree of D-1 nodes holds a child ranked past D-1:
        # a larger topk drafts the same tree at topk^2 times the cost per step.
        if k > d - 1:
            raise ConfigError(f"SpecConfig.topk={k} exceeds num_draft_tokens-1={d - 1}: a tree of {d - 1} drafted "
                             f"nodes never keeps a child ranked past {d - 1}; use topk <= {d - 1}")

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def label(self) -> str:
        """``chain D=5`` or ``tree 3x2 D=6`` (see `spec_label`)."""
        if self.is_chain:
            return f"chain D={self.num_draft_tokens}"
        tail = " calibrated" if self.selection == "calibrated" else ""
        return f"tree {self.num_steps}x{self.topk} D={self.num_draft_tokens}{tail}"

    def check_model(self, vocab_size: int) -> None:
        """What only a model can tell: each step takes topk distinct tokens of the vocabulary."""
        if self.topk > vocab_size:
            raise ConfigError(f"SpecConfig.topk={self.topk} exceeds the model's vocabulary of {vocab_size} "
                             f"tokens; use topk <= {vocab_size}")

    @classmethod
    def chain(cls, num_draft_tokens: int) -> "SpecConfig":
        d = check_int("SpecConfig", "num_draft_tokens", num_draft_tokens)
        if d < 2:
            raise ConfigError(f"a chain needs num_draft_tokens >= 2 (the root plus at least one draft), "
                             f"got {num_draft_tokens!r}")
        return cls(num_steps=d - 1, topk=1, num_draft_tokens=d)


    @classmethod
    def auto(cls, candidates=None, *, max_draft_tokens: int | None = None,
             selection: str | None = None) -> "AutoPolicy":
        """Adaptive speculation: before each round the engine picks, from `candidates`
        (a list of SpecConfigs and None for plain decoding), the one with the most expected
        emitted tokens per second for the running batch, by the engine's measured acceptance
        (the one the calibrated selection learns). None takes `default_candidates`, up to
        `max_draft_tokens` (default 8), whose trees keep their nodes by `selection` (default
        "calibrated"). Those two shape the default candidates only: given beside
        `candidates` they would be ignored, so they are refused."""
        if candidates is None:
            return AutoPolicy(candidates=default_candidates(8 if max_draft_tokens is None else max_draft_tokens,
                                                            "calibrated" if selection is None else selection))
        for name, value in (("max_draft_tokens", max_draft_tokens), ("selection", selection)):
            if value is not None:
                raise ConfigError(f"SpecConfig.auto: {name}={value!r} shapes the default candidates only, and "
                                  f"candidates are given; drop {name} (or pass no candidates)")
        if isinstance(candidates, (SpecConfig, str, bytes)) or not isinstance(candidates, Iterable):
            hint = "; wrap a single configuration in a list: [spec]" if isinstance(candidates, SpecConfig) else ""
            raise ConfigTypeError(f"SpecConfig.auto: candidates must be a list of SpecConfig or None (None: plain "
                                  f"decoding), got {type(candidates).__name__} {candidates!r}{hint}")
        return AutoPolicy(candidates=tuple(candidates))


# Tree shapes (num_steps, topk) the default candidate set holds at each budget D >= 4: the
# study's default grid (bench/grid.py), so the policy can pick whatever a fixed run could,
# and, for calibrated trees, the deep (D-1)x2 (a chain that widens where it earns it).
AUTO_TREE_SHAPES = ((3, 2), (2, 3), (4, 2), (3, 3))


def default_candidates(max_draft_tokens: int = 8, selection: str = "calibrated") -> tuple["SpecConfig | None", ...]:
    """No speculation, chains with D = 2..max_draft_tokens, and the trees of
    `AUTO_TREE_SHAPES` at every D from 4 up (those valid at that D), selecting their nodes
    by `selection`; calibrated ones add (D-1)x2 from D = 6 up (11x2 from D = 13 up: a
    twelfth step would give the policy 8,190 nodes to weigh, past `AutoPolicy.MAX_PATHS`).
    Every budget the knob allows (2..16) gives candidates the policy can weigh.

    Calibrated trees by default: the policy prices a tree by the best D-1 nodes under the
    measured acceptance, which is what the calibrated selection keeps (EAGLE-2's keeps the
    most probable drafts instead, so its trees accept less than that price, which only a
    per-kind correction learnt from its rounds could say)."""
    top = check_int("SpecConfig.auto", "max_draft_tokens", max_draft_tokens, minimum=2, maximum=16)
    if selection not in SpecConfig.SELECTIONS:
        raise ConfigError(f"SpecConfig.auto: selection={selection!r} is not one of {SpecConfig.SELECTIONS}")
    out: list[SpecConfig | None] = [None] + [SpecConfig.chain(d) for d in range(2, top + 1)]
    for d in range(4, top + 1):
        shapes = list(AUTO_TREE_SHAPES)
        if selection == "calibrated" and d >= 6:
            # No deeper than the policy can weigh (AutoPolicy.MAX_PATHS): 11 steps, from D = 13 on.
            shapes.append((min(d - 1, deepest_weighable(2)), 2))
        for steps, topk in shapes:
            try:
                out.append(SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=d, selection=selection))
            except ValueError:      # not a valid shape at this D
                pass
    return tuple(out)


def fast_path_candidates(max_draft_tokens: int = 8, selection: str = "calibrated"
                         ) -> tuple["SpecConfig | None", ...]:
    """A compact candidate set for compiled steps (`compile=True`), whose engine compiles
    every candidate's graphs before it can choose: `default_candidates` (about 45
    configurations) is about 90 graphs per batch class, most of an hour on two cores, and
    this set about a dozen. Plain decoding (the fastest there from batch 4 up, in
    docs/fast-path.md), chains at D = 4 and 6, the 3x2 tree at D = 6 and the 4x2 at D = 8
    (the fastest at batch 1), and at D = 6 the deep 5x2 a calibrated selection widens
    where it pays (2x3 for EAGLE-2's selection, whose default candidates have no deep
    shape either).
    Under `max_draft_tokens` the D = 6 shapes take that budget (from 4 up) and the D = 8
    tree is left out below 7."""
    top = check_int("fast_path_candidates", "max_draft_tokens", max_draft_tokens, minimum=2, maximum=16)
    if selection not in SpecConfig.SELECTIONS:
        raise ConfigError(f"fast_path_candidates: selection={selection!r} is not one of {SpecConfig.SELECTIONS}")
    out: list[SpecConfig | None] = [None]
    for d in sorted({min(4, top), min(6, top)}):
        out.append(SpecConfig.chain(d))
    d6 = min(6, top)
    trees = [((3, 2), d6), ((d6 - 1, 2) if selection == "calibrated" else (2, 3), d6)] if top >= 4 else []
    if top >= 7:
        trees.append(((4, 2), min(8, top)))
    for (steps, topk), d in trees:
        try:
            spec = SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=d, selection=selection)
        except ValueError:      # not a valid shape at this D
            continue
        if spec not in out:
            out.append(spec)
    return tuple(out)


def deepest_weighable(topk: int) -> int:
    """The most steps a candidate of this topk may draft for the policy to weigh it: its
    possible nodes (topk + topk^2 + ... + topk^steps) within `AutoPolicy.MAX_PATHS`, and
    its depth within `AutoPolicy.MAX_DEPTH`."""
    steps, nodes = 0, 0
    while steps < AutoPolicy.MAX_DEPTH and nodes + topk ** (steps + 1) <= AutoPolicy.MAX_PATHS:
        steps += 1
        nodes += topk ** steps
    return steps


def spec_label(spec: "SpecConfig | AutoPolicy | None") -> str:
    """A short, stable name: ``none``, ``chain D=5``, ``tree 3x2 D=6``, ``auto``."""
    return "none" if spec is None else spec.label


@dataclass(frozen=True)
class AutoPolicy:
    """Speculation chosen per round (`SpecConfig.auto`). See `speculative/policy/`.

    candidates: SpecConfigs, and None for a plain decode step. How fast the measured
    acceptance forgets is the engine's (`calibration.AcceptanceModel`), shared with the
    calibrated selection.
    """

    candidates: tuple[SpecConfig | None, ...]

    # The measured acceptance goes this deep (a bound on a candidate's steps) and tells this
    # many sibling ranks apart (lower ranks share the last one's estimates); the expected
    # accept length enumerates every node a candidate could verify (a bound on its paths).
    MAX_DEPTH: ClassVar[int] = 16
    MAX_RANK: ClassVar[int] = 8
    MAX_PATHS: ClassVar[int] = 4096

    def __post_init__(self) -> None:
        own = "SpecConfig.auto"
        if not isinstance(self.candidates, tuple) or not self.candidates:
            raise ConfigError(f"{own}: candidates must be a non-empty list of SpecConfig or None")
        for i, c in enumerate(self.candidates):
            if c is not None and not isinstance(c, SpecConfig):
                raise ConfigTypeError(f"{own}: candidates[{i}] must be a SpecConfig or None, got {type(c).__name__}")
            if c is None:
                continue
            if c.num_steps > self.MAX_DEPTH:
                raise ConfigError(f"{own}: candidates[{i}] ({spec_label(c)}) drafts {c.num_steps} steps deep; the "
                                 f"policy's statistics go {self.MAX_DEPTH} deep: use num_steps <= {self.MAX_DEPTH}")
            paths = sum(c.topk ** d for d in range(1, c.num_steps + 1))
            if paths > self.MAX_PATHS:
                raise ConfigError(f"{own}: candidates[{i}] ({spec_label(c)}) could verify {paths} distinct nodes "
                                 f"(topk ** depth summed over its steps), more than the {self.MAX_PATHS} the "
                                 f"policy can weigh; use fewer steps or a smaller topk")
        if len(set(self.candidates)) != len(self.candidates):
            raise ConfigError(f"{own}: candidates hold duplicates")

    label: ClassVar[str] = "auto"

    @property
    def speculative(self) -> tuple[SpecConfig, ...]:
        return tuple(c for c in self.candidates if c is not None)

    @property
    def max_draft_tokens(self) -> int:
        """The largest verify budget among the candidates (1: plain decoding only)."""
        return max((c.num_draft_tokens for c in self.speculative), default=1)

    def check_model(self, vocab_size: int) -> None:
        for c in self.speculative:
            c.check_model(vocab_size)
