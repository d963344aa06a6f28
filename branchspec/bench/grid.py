"""Which speculative configurations the study runs at each verify budget D.

At a budget D (verified tokens per round, root included) the study compares the chain
(topk = 1, num_steps = D - 1) with a few tree shapes (num_steps, topk). The paper reports
the best tree at each D, so the grid holds several shapes and the analysis picks the best.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from branchspec.config import SpecConfig

# Shapes tried in this order, first valid ones kept. Mixing depth-leaning (x2) and
# width-leaning (2xk) shapes early means a capped grid still spans both directions; 3x2
# comes first because it is the paper's best case (ShareGPT, D = 6, batch 4).
SHAPE_PREFERENCE: tuple[tuple[int, int], ...] = (
    (3, 2), (2, 3), (4, 2), (3, 3), (2, 4), (2, 2), (4, 3), (3, 4), (4, 4),
)
DEFAULT_MAX_SHAPES = 4

_SHAPE_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


@dataclass(frozen=True)
class TreeShape:
    """A tree's draft depth and branching; the budget D comes from the sweep."""

    num_steps: int
    topk: int

    def __str__(self) -> str:
        return f"{self.num_steps}x{self.topk}"

    def spec(self, num_draft_tokens: int) -> SpecConfig:
        """The SpecConfig at budget D; ValueError (naming shape and D) if it cannot work."""
        try:
            return SpecConfig(num_steps=self.num_steps, topk=self.topk, num_draft_tokens=num_draft_tokens)
        except ValueError as e:
            raise ValueError(f"tree shape {self} (num_steps x topk) is invalid at D={num_draft_tokens}: {e}") from None


def parse_tree_shapes(text: str) -> list[TreeShape]:
    """Parse ``"3x2,2x3"`` (num_steps x topk) into shapes; ValueError on a bad item.

    topk must be >= 2: topk 1 is the chain, which the study always runs anyway.
    """
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"--tree-shapes {text!r} names no shape; use e.g. 3x2,2x3 (num_steps x topk)")
    shapes: list[TreeShape] = []
    for item in items:
        m = _SHAPE_RE.match(item)
        if m is None:
            raise ValueError(f"bad tree shape {item.strip()!r} in {text!r}: expected STEPSxTOPK, e.g. 3x2")
        steps, topk = int(m.group(1)), int(m.group(2))
        if steps < 1:
            raise ValueError(f"bad tree shape {item.strip()!r}: num_steps must be >= 1")
        if topk < 2:
            raise ValueError(f"bad tree shape {item.strip()!r}: topk must be >= 2 (topk 1 is the chain, "
                             "which is always run)")
        shape = TreeShape(steps, topk)
        if shape not in shapes:
            shapes.append(shape)
    return shapes


def default_tree_shapes(num_draft_tokens: int, max_shapes: int = DEFAULT_MAX_SHAPES) -> list[TreeShape]:
    """Up to ``max_shapes`` valid tree shapes at budget D, in ``SHAPE_PREFERENCE`` order."""
    out: list[TreeShape] = []
    for steps, topk in SHAPE_PREFERENCE:
        if len(out) == max_shapes:
            break
        shape = TreeShape(steps, topk)
        try:
            shape.spec(num_draft_tokens)
        except ValueError:
            continue
        out.append(shape)
    return out


def specs_at_budget(num_draft_tokens: int, shapes: list[TreeShape] | None = None,
                    max_shapes: int = DEFAULT_MAX_SHAPES) -> list[SpecConfig]:
    """The chain first, then the trees at budget D.

    Explicit ``shapes`` must all be valid at D (ValueError names the first that is not);
    None picks ``default_tree_shapes``.
    """
    chain = SpecConfig.chain(num_draft_tokens)
    if shapes is None:
        shapes = default_tree_shapes(num_draft_tokens, max_shapes)
    return [chain] + [s.spec(num_draft_tokens) for s in shapes]


def calibrated_specs_at_budget(num_draft_tokens: int, shapes: list[TreeShape] | None = None,
                               max_shapes: int = DEFAULT_MAX_SHAPES) -> list[SpecConfig]:
    """The trees at budget D with the calibrated selection: the EAGLE-2 grid's shapes, and
    the deep ones it makes worth trying, (D-1)x2 and (D-1)x3 (the calibrated selection
    keeps the chain where the chain is the better bet, and adds siblings only where they
    earn their slot)."""
    grid = [(s.num_steps, s.topk) for s in (shapes if shapes is not None else default_tree_shapes(num_draft_tokens,
                                                                                                   max_shapes))]
    out = []
    for steps, topk in dict.fromkeys(grid + [(num_draft_tokens - 1, 2), (num_draft_tokens - 1, 3)]):
        try:
            out.append(SpecConfig(steps, topk, num_draft_tokens, selection="calibrated"))
        except ValueError:
            pass
    return out


def shape_label(spec: SpecConfig | None) -> str:
    """A short name for a cell's configuration: ``baseline``, ``chain``, ``3x2``."""
    if spec is None:
        return "baseline"
    return "chain" if spec.is_chain else f"{spec.num_steps}x{spec.topk}"
