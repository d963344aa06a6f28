"""What one cell of the study measured, computed from `LLM.generate` outputs and stats.

A *cell* is one (workload, batch size, configuration) run: ``batch_size`` prompts
generated together, either plainly (the baseline) or with one SpecConfig. Metric names
follow DESIGN.md section 5.

A *step* here is one batch-level decode iteration: a plain decode step for the baseline,
a speculative round otherwise. Phase timers sum per step over the whole batch, so per-step
times are phase seconds / number of steps. Every request of a cell is admitted at once
and has the same token budget, so the number of steps is the longest request's count.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from branchspec.config import SpecConfig
from branchspec.speculative.outcome import ROUND_PHASES
from branchspec.llm import GenerateStats, RequestOutput
from branchspec.bench.grid import shape_label

KINDS = ("baseline", "chain", "tree", "auto")
# A cell of one of these ran one fixed configuration (or plain decoding), for the whole cell.
FIXED_KINDS = ("baseline", "chain", "tree", "calibrated")


@dataclass
class CellResult:
    """One line of results.jsonl. ``D``, ``num_steps``, ``topk`` are None for the baseline.

    accept_length: tokens emitted per round per request, bonus included (1.0 baseline).
    accept_rate_per_depth[d]: fraction of rounds whose accepted path reached draft depth d+1.
    throughput_tok_s: generated tokens / decode wall time (prefill excluded).
    speedup: throughput / the baseline's throughput in the same workload and batch size.
    ms_per_round: per phase (ROUND_PHASES), plus "other" (scheduling, glue) and "total".
    num_rounds: batch-level steps; request_rounds: rounds summed over requests.
    matches_baseline: greedy, or sampled with seeds, whether every output equals the
    plain-decoding output (speculation is lossless and a seeded draw depends only on its
    seed and position, so False points at a bug or a numerical tie); None where unchecked.
    """

    workload: str
    batch_size: int
    kind: str
    shape: str
    D: int | None
    num_steps: int | None
    topk: int | None
    accept_length: float
    accept_rate_per_depth: list[float]
    throughput_tok_s: float
    speedup: float | None
    ms_per_round: dict[str, float]
    num_rounds: int
    request_rounds: int
    tokens: int
    decode_seconds: float
    prefill_seconds: float
    wall_seconds: float
    max_tokens: int
    temperature: float
    mean_prompt_tokens: float
    matches_baseline: bool | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CellResult":
        return cls(**d)


def measure_cell(workload: str, spec: SpecConfig | None, outputs: list[RequestOutput], stats: GenerateStats,
                 *, wall_seconds: float, max_tokens: int, temperature: float) -> CellResult:
    """Turn one generate() call into a CellResult (speedup and matches_baseline filled later)."""
    steps = stats.num_steps
    if stats.policy == "auto":
        ms = ms_per_round(stats, steps)
        cell = CellResult(
            workload=workload, batch_size=len(outputs), kind="auto", shape="auto", D=None, num_steps=None,
            topk=None, accept_length=stats.accept_length if stats.num_rounds else 1.0, accept_rate_per_depth=[],
            throughput_tok_s=stats.decode_throughput, speedup=None, ms_per_round=ms, num_rounds=steps,
            request_rounds=stats.num_rounds, tokens=stats.num_generated, decode_seconds=stats.decode_seconds,
            prefill_seconds=stats.prefill_seconds, wall_seconds=wall_seconds, max_tokens=max_tokens,
            temperature=temperature,
            mean_prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs) / len(outputs))
        cell.extra = {"choices": dict(sorted(stats.spec_choices.items(), key=lambda kv: -kv[1])),
                      "policy_ms_per_round": 1e3 * stats.policy_seconds / steps if steps else 0.0}
        return cell
    if spec is None:
        accept_length, rates = 1.0, []
        kind, D, num_steps, topk = "baseline", None, None, None
    else:
        accept_length = stats.accept_length
        depth_hits = [0] * (spec.num_draft_tokens - 1)
        for o in outputs:
            for d, hits in enumerate(o.accepted_per_depth):
                depth_hits[d] += hits
        rates = [h / stats.num_rounds if stats.num_rounds else 0.0 for h in depth_hits]
        kind = "chain" if spec.is_chain else ("calibrated" if spec.selection == "calibrated" else "tree")
        D, num_steps, topk = spec.num_draft_tokens, spec.num_steps, spec.topk
    ms = ms_per_round(stats, steps)
    return CellResult(
        workload=workload, batch_size=len(outputs), kind=kind, shape=shape_label(spec), D=D,
        num_steps=num_steps, topk=topk, accept_length=accept_length, accept_rate_per_depth=rates,
        throughput_tok_s=stats.decode_throughput, speedup=None, ms_per_round=ms, num_rounds=steps,
        request_rounds=stats.num_rounds if spec is not None else steps * len(outputs),
        tokens=stats.num_generated, decode_seconds=stats.decode_seconds,
        prefill_seconds=stats.prefill_seconds, wall_seconds=wall_seconds, max_tokens=max_tokens,
        temperature=temperature,
        mean_prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs) / len(outputs),
    )


def ms_per_round(stats: GenerateStats, steps: int) -> dict[str, float]:
    """Milliseconds per batch step for every round phase, "other" and "total"."""
    if steps <= 0:
        return {p: 0.0 for p in (*ROUND_PHASES, "other", "total")}
    out = {p: 1e3 * stats.phase_seconds.get(p, 0.0) / steps for p in ROUND_PHASES}
    total = 1e3 * stats.decode_seconds / steps
    # Decode wall time not inside any phase timer: admission, scheduling, appending tokens.
    out["other"] = max(total - sum(out.values()), 0.0)
    out["total"] = total
    return out
