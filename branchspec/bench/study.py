"""Running the tree-vs-chain study: `run_study(StudyConfig) -> StudyResult`.

For every workload and batch size the baseline (no speculation) runs first, then the
chain and every tree shape at each budget D, back to back in one process, so the ratios
the report draws (speedup, tree/chain) compare runs made under the same machine load.
Each cell is one `LLM.generate` call on ``batch_size`` prompts with
``ignore_eos=True``: every request generates exactly ``max_tokens`` tokens, so the batch
stays full until the last rounds.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from branchspec.bench.analysis import SELECTION_FINALIST_ROLES
from branchspec.bench.grid import DEFAULT_MAX_SHAPES, TreeShape, calibrated_specs_at_budget, shape_label, specs_at_budget
from branchspec.bench.metrics import FIXED_KINDS, CellResult, measure_cell
from branchspec.config import SamplingParams, SpecConfig, check_device, check_float, fast_path_candidates, spec_label
from branchspec.config.sampling_params import MAX_SEED
from branchspec.speculative.draft_vocab import token_map_arg
from branchspec.data.workloads import MBPP_ENV_VAR, MBPP_HUB_NAME, WORKLOADS, MbppUnavailable, load_workload
from branchspec.llm import DEFAULT_CHECKPOINT, LLM

DEFAULT_WORKLOADS = ("gsm8k", "mbpp", "sharegpt")
DEFAULT_BUDGETS = (5, 6, 7, 8)
DEFAULT_BATCH_SIZES = (1, 4, 16, 64)
# How many of each side the calibrated selection's side-by-side reruns (`recheck_selection`).
SELECTION_FINALISTS = len(SELECTION_FINALIST_ROLES["other"])
DTYPES = ("float32", "float64", "bfloat16", "float16")


@dataclass(frozen=True)
class StudyConfig:
    """What to sweep. Invalid values raise ValueError at construction, before any work.

    model: a checkpoint folder, or None for the embedded default checkpoint.
    tree_shapes: explicit (num_steps x topk) shapes, each valid at every budget; None picks
    up to ``max_tree_shapes`` valid shapes per budget (`grid.default_tree_shapes`).
    num_prompts: eval prompts per workload; a batch larger than this cycles through them.
    max_prompt_tokens: eval prompts longer than this (after encoding) are skipped, in
    order, so a few very long ShareGPT openings do not dominate prefill and context cost.
    prompts_override: workload name -> token-id prompts, used instead of loading the
    named workloads (for checkpoints without a tokenizer, e.g. in tests); ``workloads``
    must then name keys of it.
    mbpp_optional: when MBPP has no source (no local file, hub unreachable), drop it from
    ``workloads`` and say so in ``notes`` rather than raise. The CLI sets it when the
    workloads are the preset's, not ones the user named with ``--workloads``.
    notes: set at construction; lines for the user and report.md (the MBPP skip line).
    """

    model: str | Path | None = None
    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    budgets: tuple[int, ...] = DEFAULT_BUDGETS
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    tree_shapes: tuple[TreeShape, ...] | None = None
    max_tree_shapes: int = DEFAULT_MAX_SHAPES
    max_tokens: int = 128
    num_prompts: int = 64
    max_prompt_tokens: int = 512
    temperature: float = 0.0
    out_dir: str | Path = "bench_out"
    mbpp_path: str | Path | None = None
    dtype: str = "float32"
    compile: bool = False
    device: str = "cpu"               # "cpu", "cuda" or "cuda:N"
    cuda_graphs: bool | None = None   # LLM's: None replays CUDA graphs on a GPU
    # The drafter's vocabulary: None the checkpoint's own reduced map (if any), "none" the
    # full vocabulary, else a map file (`LLM(speculative_token_map=...)`).
    token_map: str | None = None
    threads: int | None = None
    prompts_override: dict[str, list[list[int]]] | None = None
    progress: bool = True
    warmup: bool = True
    plots: bool = True
    mbpp_optional: bool = False
    # "fixed": the chain and tree grid; "auto": the adaptive policy (SpecConfig.auto over
    # the budgets' range) as one more cell per (workload, batch size). The baseline always runs.
    policies: tuple[str, ...] = ("fixed",)
    # With both policies: after each (workload, batch size), plain decoding, the best fixed
    # configuration there and the policy run again, this many times in turn (0: not), and
    # the policy is judged on the medians (one run of the best of many configurations is
    # that configuration's luckiest run). With both selections, the same for the best
    # calibrated tree against the best of the chain and the EAGLE-2 trees at each D.
    policy_repeats: int = 3
    # Which node selections the fixed grid's trees run: "eagle2" (the paper's, by cumulative
    # draft probability) and/or "calibrated" (by measured acceptance, over the same shapes
    # and the deep (D-1)x2 and (D-1)x3; cells of kind "calibrated").
    selections: tuple[str, ...] = ("eagle2",)
    # Sampled requests: request i of a batch draws with seed `seed + i` (mod 2**64). A seeded draw
    # depends on nothing but its seed and position, so every configuration of a cell (plain
    # decoding included) emits the same tokens: configurations are compared on the same
    # text, and sampled outputs are checked against plain decoding's as greedy ones are.
    # None: draws from the engine's stream, so every run samples other text.
    seed: int | None = 0
    notes: tuple[str, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        # Tuples (CLI and callers may pass lists), duplicates dropped, order kept.
        for name in ("workloads", "budgets", "batch_sizes"):
            object.__setattr__(self, name, tuple(dict.fromkeys(getattr(self, name))))
        if self.tree_shapes is not None:
            object.__setattr__(self, "tree_shapes", tuple(self.tree_shapes))
        if not self.workloads:
            raise ValueError("no workloads given")
        if self.prompts_override is not None:
            missing = [w for w in self.workloads if w not in self.prompts_override]
            if missing:
                raise ValueError(f"workloads {missing} have no prompts in prompts_override "
                                 f"(keys: {sorted(self.prompts_override)})")
            for w in self.workloads:
                prompts = self.prompts_override[w]
                if not prompts or any(not p or not all(isinstance(t, int) for t in p) for p in prompts):
                    raise ValueError(f"prompts_override[{w!r}] must be a non-empty list of non-empty token-id lists")
        else:
            unknown = [w for w in self.workloads if w not in WORKLOADS]
            if unknown:
                raise ValueError(f"unknown workload(s) {unknown}; valid workloads: {', '.join(WORKLOADS)}")
        object.__setattr__(self, "policies", tuple(dict.fromkeys(self.policies)))
        object.__setattr__(self, "selections", tuple(dict.fromkeys(self.selections)))
        bad = [s for s in self.selections if s not in ("eagle2", "calibrated")]
        if bad or "eagle2" not in self.selections:
            raise ValueError(f"selections must name eagle2, and may add calibrated, got {list(self.selections)}")
        bad = [p for p in self.policies if p not in ("fixed", "auto")]
        if bad or not self.policies:
            raise ValueError(f"policies must name fixed and/or auto, got {list(self.policies)}")
        if not self.budgets:
            raise ValueError("no budgets D given")
        for d in self.budgets:
            if not isinstance(d, int) or isinstance(d, bool) or d < 2:
                raise ValueError(f"budget D={d!r} is invalid: D counts verified tokens per round, root "
                                 "included, so it must be an integer >= 2")
        if not self.batch_sizes:
            raise ValueError("no batch sizes given")
        for b in self.batch_sizes:
            if not isinstance(b, int) or isinstance(b, bool) or b < 1:
                raise ValueError(f"batch size {b!r} is invalid: it must be an integer >= 1")
        if not isinstance(self.policy_repeats, int) or isinstance(self.policy_repeats, bool) \
                or self.policy_repeats < 0:
            raise ValueError(f"policy_repeats must be an integer >= 0, got {self.policy_repeats!r}")
        if self.max_tree_shapes < 1:
            raise ValueError(f"max_tree_shapes must be >= 1, got {self.max_tree_shapes}")
        for d in self.budgets:
            # Every explicit shape must work at every budget: raises naming shape and D.
            specs_at_budget(d, list(self.tree_shapes) if self.tree_shapes is not None else None,
                            self.max_tree_shapes)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.num_prompts, int) or self.num_prompts < 1:
            raise ValueError(f"num_prompts must be an integer >= 1, got {self.num_prompts!r}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        check_float("StudyConfig", "temperature", self.temperature)   # inf would fail only mid-run
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        check_device("StudyConfig", self.device)
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        folder = Path(self.model) if self.model is not None else DEFAULT_CHECKPOINT
        if not (folder / "config.json").is_file():
            which = "the embedded default checkpoint" if self.model is None else "checkpoint"
            raise ValueError(f"{which} folder {folder} has no config.json; pass --model PATH / model=...")
        # Last, as it may read a file or ask the hub: a mistyped flag should not wait for that.
        if self.prompts_override is None and "mbpp" in self.workloads:
            self._resolve_mbpp()

    def _resolve_mbpp(self) -> None:
        """Load MBPP now (a local file, else the Hugging Face hub), so a missing source is
        found before any cell runs rather than after the other workloads; the loaded rows
        stay cached for ``load_prompts``."""
        try:
            load_workload("mbpp", "eval", mbpp_path=self.mbpp_path)
        except MbppUnavailable as e:
            if not self.mbpp_optional or self.workloads == ("mbpp",):
                raise ValueError(f"workload 'mbpp': {e}") from e
            object.__setattr__(self, "workloads", tuple(w for w in self.workloads if w != "mbpp"))
            object.__setattr__(self, "notes", (
                f"MBPP skipped: no local mbpp.jsonl, and the Hugging Face hub failed ({e.reason}); to add it, "
                f"pass --mbpp-path FILE, set ${MBPP_ENV_VAR}=FILE, or go online so that {MBPP_HUB_NAME} "
                f"downloads from the hub",
            ))

    def specs_at(self, num_draft_tokens: int) -> list[SpecConfig]:
        """Chain first, then the tree shapes, at budget D (then, with the calibrated
        selection, its trees)."""
        shapes = list(self.tree_shapes) if self.tree_shapes is not None else None
        specs = specs_at_budget(num_draft_tokens, shapes, self.max_tree_shapes)
        if "calibrated" in self.selections:
            specs += calibrated_specs_at_budget(num_draft_tokens, shapes, self.max_tree_shapes)
        return specs

    def auto_policy(self):
        """The adaptive policy the study runs: every default candidate up to the largest D;
        on the fast path the compact set whose graphs compile in minutes."""
        if self.compile:
            return SpecConfig.auto(fast_path_candidates(max(self.budgets)))
        return SpecConfig.auto(max_draft_tokens=max(self.budgets))

    def group(self) -> list:
        """The configurations one (workload, batch size) runs, baseline first."""
        out: list = [None]
        if "fixed" in self.policies:
            out += [s for d in self.budgets for s in self.specs_at(d)]
        if "auto" in self.policies:
            out.append(self.auto_policy())
        return out

    @property
    def rechecks(self) -> int:
        """The policy's side-by-side repeats after each (workload, batch size): see `policy_repeats`."""
        return self.policy_repeats if {"fixed", "auto"} <= set(self.policies) else 0

    @property
    def selection_rechecks(self) -> int:
        """The calibrated selection's side-by-side repeats at each (workload, batch size, D)."""
        return self.policy_repeats if "fixed" in self.policies and "calibrated" in self.selections else 0

    def num_cells(self) -> int:
        """Generate calls the study makes (at most: a recheck whose best fixed
        configuration is plain decoding runs two roles, not three)."""
        per_batch = (len(self.group()) + 3 * self.rechecks
                     + 2 * SELECTION_FINALISTS * len(self.budgets) * self.selection_rechecks)
        return len(self.workloads) * len(self.batch_sizes) * per_batch

    def describe(self) -> dict:
        """The configuration as JSON-ready values (prompts_override summarised)."""
        return {
            "model": str(self.model) if self.model is not None else "default",
            "workloads": list(self.workloads), "budgets": list(self.budgets),
            "batch_sizes": list(self.batch_sizes),
            "tree_shapes": {d: [s.label for s in self.specs_at(d)[1:]] for d in self.budgets},
            "selections": list(self.selections),
            "max_tokens": self.max_tokens, "num_prompts": self.num_prompts,
            "max_prompt_tokens": self.max_prompt_tokens, "temperature": self.temperature,
            "seed": self.seed,
            "dtype": self.dtype, "compile": self.compile, "device": self.device, "cuda_graphs": self.cuda_graphs,
            "token_map": self.token_map or "checkpoint's",
            "threads": self.threads or torch.get_num_threads(),
            "prompts": "override" if self.prompts_override is not None else "eval split",
            "policies": list(self.policies),
            "notes": list(self.notes),
        }


@dataclass
class StudyResult:
    """Every cell, the derived comparisons, and where the outputs were written."""

    config: StudyConfig
    cells: list[CellResult]
    comparisons: list  # list[analysis.Comparison]
    summary: dict
    out_dir: Path
    files: dict[str, Path] = field(default_factory=dict)
    wall_seconds: float = 0.0


def load_prompts(cfg: StudyConfig, llm) -> dict[str, list[list[int]]]:
    """Token-id prompts per workload: the first ``num_prompts`` eval prompts that fit
    ``max_prompt_tokens`` (chat prompts rendered with the chat template), or the override."""
    if cfg.prompts_override is not None:
        V = llm.config.vocab_size
        out = {}
        for w in cfg.workloads:
            prompts = [list(p) for p in cfg.prompts_override[w][: cfg.num_prompts]]
            bad = [t for p in prompts for t in p if not 0 <= t < V]
            if bad:
                raise ValueError(f"prompts_override[{w!r}] has token ids outside the vocabulary [0, {V}): {bad[:5]}")
            out[w] = prompts
        return out
    if llm.tokenizer is None:
        raise ValueError(f"checkpoint {llm.path} has no tokenizer.json, so text workloads cannot be "
                         "encoded; use a checkpoint with a tokenizer or pass prompts_override")
    out = {}
    for w in cfg.workloads:
        prompts: list[list[int]] = []
        for example in load_workload(w, "eval", mbpp_path=cfg.mbpp_path):
            ids = llm.encode(example.prompt_text())
            if len(ids) <= cfg.max_prompt_tokens:
                prompts.append(ids)
                if len(prompts) == cfg.num_prompts:
                    break
        if not prompts:
            raise ValueError(f"workload {w!r} has no eval prompt of at most {cfg.max_prompt_tokens} tokens")
        out[w] = prompts
    return out


def batch_prompts(pool: list[list[int]], batch_size: int) -> list[list[int]]:
    """``batch_size`` prompts, cycling through the pool when it is smaller."""
    return [pool[i % len(pool)] for i in range(batch_size)]


def request_params(cfg: StudyConfig, batch_size: int, max_tokens: int | None = None) -> list[SamplingParams]:
    """Each request's sampling parameters for a batch of ``batch_size``: the study's
    temperature and length, and when sampled with a seed, request i's own `cfg.seed + i`."""
    seeded = cfg.temperature > 0 and cfg.seed is not None
    return [SamplingParams(temperature=cfg.temperature, max_tokens=max_tokens or cfg.max_tokens, ignore_eos=True,
                           seed=(cfg.seed + i) % (MAX_SEED + 1) if seeded else None) for i in range(batch_size)]


def checks_outputs(cfg: StudyConfig) -> bool:
    """Whether every configuration must emit plain decoding's tokens: greedy, or sampled
    with seeds (`StudyConfig.seed`)."""
    return cfg.temperature == 0.0 or cfg.seed is not None


def run_study(cfg: StudyConfig) -> StudyResult:
    """Run every cell, write results.jsonl, report.md and the plots into ``cfg.out_dir``."""
    t_start = time.perf_counter()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    llm = LLM(cfg.model, dtype=cfg.dtype, max_batch_size=1, max_model_len=64)   # tokenizer and checks
    if llm.model.mtp is None:
        raise ValueError(f"checkpoint {llm.path} has no MTP block, so it cannot draft; the study needs one")
    prompts = load_prompts(cfg, llm)
    longest = max(len(p) for pool in prompts.values() for p in pool)
    # Cache pools sized for the longest request plus one round of slack, not the model's
    # full max_position: smaller pools, same behaviour.
    max_len = min(llm.config.max_position, longest + cfg.max_tokens + max(cfg.budgets))
    if longest + cfg.max_tokens > max_len:
        raise ValueError(f"a prompt of {longest} tokens + max_tokens {cfg.max_tokens} exceeds the model's "
                         f"max_position {llm.config.max_position}; lower max_tokens or max_prompt_tokens")
    # One engine for the whole study, its pools sized for the largest batch of the longest
    # request plus one round of slack (not the model's full max_position); seeded, so
    # sampled studies repeat run to run.
    llm = LLM(cfg.model, dtype=cfg.dtype, max_batch_size=max(cfg.batch_sizes), max_model_len=max_len,
              seed=0, compile=cfg.compile, device=cfg.device, speculative_token_map=token_map_arg(cfg.token_map),
              cuda_graphs=cfg.cuda_graphs)
    compile_seconds = 0.0
    if cfg.compile or llm.engine_config.uses_cuda_graphs:
        # Compile (and capture) every graph the grid needs before anything is timed: compiled
        # steps have batch 1 and any larger batch apart, CUDA graphs every bucket.
        sizes = None if llm.engine_config.uses_cuda_graphs else tuple(sorted({min(b, 2) for b in cfg.batch_sizes}))
        mode = ("sampled",) if cfg.temperature > 0 else ("greedy",)     # only the graphs the study's requests run
        for spec in cfg.group():
            compile_seconds += llm.warmup(spec, batch_sizes=sizes, sampling=mode, progress=cfg.progress)["seconds"]
    elif "auto" in cfg.policies:
        llm.engine.policy(cfg.auto_policy(), progress=True)   # the round-cost calibration, untimed

    if cfg.warmup:
        # One short untimed run of each path, so one-time costs (allocator growth, lazy
        # initialisation) do not land in the first measured cell.
        first = next(iter(prompts.values()))[:1]
        warm = request_params(cfg, 1, max_tokens=min(4, cfg.max_tokens))
        llm.generate(first, warm)
        llm.generate(first, warm, spec=cfg.specs_at(cfg.budgets[0])[-1])

    cells: list[CellResult] = []
    results_path = out_dir / "results.jsonl"
    bar = _progress(cfg)
    with results_path.open("w") as f:
        for workload in cfg.workloads:
            for b in cfg.batch_sizes:
                batch = batch_prompts(prompts[workload], b)
                params = request_params(cfg, b)
                group = cfg.group()
                baseline: CellResult | None = None
                baseline_ids: list[list[int]] = []
                for spec in group:
                    if bar is not None:
                        bar.set_postfix_str(f"{workload} bs={b} {_cell_name(spec)}")
                    t0 = time.perf_counter()
                    outs = llm.generate(batch, params, spec=spec)
                    wall = time.perf_counter() - t0
                    cell = measure_cell(workload, spec, outs, llm.last_stats, wall_seconds=wall,
                                        max_tokens=cfg.max_tokens, temperature=cfg.temperature)
                    if spec is None:
                        baseline, baseline_ids = cell, [o.token_ids for o in outs]
                        cell.speedup = 1.0
                    else:
                        assert baseline is not None
                        base_tp = baseline.throughput_tok_s
                        cell.speedup = cell.throughput_tok_s / base_tp if base_tp > 0 else None
                        if checks_outputs(cfg):
                            cell.matches_baseline = [o.token_ids for o in outs] == baseline_ids
                    cells.append(cell)
                    f.write(json.dumps(cell.to_dict()) + "\n")
                    f.flush()  # a long sweep that is interrupted keeps what it measured
                    if bar is not None:
                        bar.update(1)
                reference = baseline_ids if checks_outputs(cfg) else None
                rechecked = recheck_selection(llm, cfg, workload, batch, params, cells, bar, reference)
                rechecked += recheck_policy(llm, cfg, workload, batch, params, cells, bar, reference)
                for cell in rechecked:
                    cells.append(cell)
                    f.write(json.dumps(cell.to_dict()) + "\n")
                    f.flush()
    if bar is not None:
        bar.close()

    wall_seconds = time.perf_counter() - t_start
    config = {**cfg.describe(), "compile_seconds": round(compile_seconds, 1)}
    comparisons, summary, files = write_outputs(out_dir, cells, config, wall_seconds, cfg.plots)
    return StudyResult(config=cfg, cells=cells, comparisons=comparisons, summary=summary,
                       out_dir=out_dir, files=files, wall_seconds=wall_seconds)


def spec_of(cell: CellResult) -> SpecConfig:
    """The fixed configuration a chain, tree or calibrated cell ran."""
    return SpecConfig(num_steps=cell.num_steps, topk=cell.topk, num_draft_tokens=cell.D,
                      selection="calibrated" if cell.kind == "calibrated" else "eagle2")


def run_side_by_side(llm, cfg: StudyConfig, workload: str, batch: list[list[int]], params: list[SamplingParams],
                     roles: dict[str, SpecConfig | None], label: str, bar=None,
                     reference: list[list[int]] | None = None, **extra) -> list[CellResult]:
    """Run `roles` (role -> configuration) in turn, `cfg.policy_repeats` times: cells of
    kind "recheck" with their role, repeat, the kind they rechecked and `extra` in `extra`,
    each checked against `reference` (plain decoding's tokens) where given.
    The best of many configurations by one run each is partly the luckiest; measured side
    by side, in turn, the comparison is fair."""
    out = []
    for repeat in range(cfg.policy_repeats):
        for role, spec in roles.items():
            if bar is not None:
                bar.set_postfix_str(f"{workload} bs={len(batch)} {label}: {role}")
            t0 = time.perf_counter()
            outs = llm.generate(batch, params, spec=spec)
            cell = measure_cell(workload, spec, outs, llm.last_stats, wall_seconds=time.perf_counter() - t0,
                                max_tokens=cfg.max_tokens, temperature=cfg.temperature)
            cell.extra = {**cell.extra, **extra, "role": role, "repeat": repeat, "of": cell.kind}
            if reference is not None:
                cell.matches_baseline = [o.token_ids for o in outs] == reference
            cell.kind = "recheck"
            out.append(cell)
            if bar is not None:
                bar.update(1)
    return out


def recheck_selection(llm, cfg: StudyConfig, workload: str, batch: list[list[int]], params: list[SamplingParams],
                      cells: list[CellResult], bar=None, reference: list[list[int]] | None = None
                      ) -> list[CellResult]:
    """At each D of this (workload, batch size): the `SELECTION_FINALISTS` fastest calibrated
    trees and the as many fastest of the chain and the EAGLE-2 trees (by their sweep runs),
    run again in turn `cfg.selection_rechecks` times (roles `analysis.SELECTION_FINALIST_ROLES`,
    D in `extra`). Two a side, since one sweep run picks the luckiest configuration as often
    as the fastest."""
    if not cfg.selection_rechecks:
        return []
    b, out = len(batch), []
    for D in cfg.budgets:
        same = [c for c in cells if c.workload == workload and c.batch_size == b and c.D == D]
        finalists = {side: sorted((c for c in same if c.kind in kinds), key=lambda c: c.throughput_tok_s,
                                  reverse=True)[:SELECTION_FINALISTS]
                     for side, kinds in (("other", ("chain", "tree")), ("calibrated", ("calibrated",)))}
        if not finalists["other"] or not finalists["calibrated"]:
            continue
        roles = {}      # in turn: the fastest of each side, then the second fastest
        for i in range(SELECTION_FINALISTS):
            for side in ("other", "calibrated"):
                if i < len(finalists[side]):
                    roles[SELECTION_FINALIST_ROLES[side][i]] = spec_of(finalists[side][i])
        out += run_side_by_side(llm, cfg, workload, batch, params, roles, f"D={D} side by side", bar, reference,
                                D=D)
    return out


def recheck_policy(llm, cfg: StudyConfig, workload: str, batch: list[list[int]], params: list[SamplingParams],
                   cells: list[CellResult], bar=None, reference: list[list[int]] | None = None) -> list[CellResult]:
    """Plain decoding, the best fixed configuration of this (workload, batch size) (any
    chain, EAGLE-2 or calibrated tree, or plain decoding) and the policy, run again in turn
    `cfg.rechecks` times: roles "baseline", "best_fixed" and "auto"."""
    if not cfg.rechecks:
        return []
    b = len(batch)
    fixed = [c for c in cells if c.workload == workload and c.batch_size == b
             and c.kind in FIXED_KINDS]
    best = max(fixed, key=lambda c: c.throughput_tok_s)
    roles: dict[str, SpecConfig | None] = {"baseline": None}
    if best.kind != "baseline":
        roles["best_fixed"] = spec_of(best)
    roles["auto"] = cfg.auto_policy()
    if bar is not None and len(roles) < 3:
        bar.total -= cfg.rechecks
        bar.refresh()
    return run_side_by_side(llm, cfg, workload, batch, params, roles, "side by side", bar, reference)


def write_outputs(out_dir: Path, cells: list[CellResult], config: dict, wall_seconds: float,
                  with_plots: bool = True) -> tuple[list, dict, dict[str, Path]]:
    """Comparisons, summary, report.md and plots from measured cells."""
    from branchspec.bench import analysis, plots, report

    comparisons = analysis.compare(cells)
    summary = analysis.summary(cells, comparisons, config, wall_seconds)
    files: dict[str, Path] = {"results": out_dir / "results.jsonl"}
    plot_files = plots.write_plots(out_dir, cells, comparisons) if with_plots else {}
    files.update(plot_files)
    files["report"] = report.write_report(out_dir / "report.md", cells, comparisons, summary, plot_files)
    summary["files"] = {k: str(v) for k, v in files.items()}
    return comparisons, summary, files


def report_from_results(out_dir: str | Path) -> tuple[list[CellResult], list, dict]:
    """Rebuild report.md and the plots from results.jsonl, e.g. of an interrupted sweep
    (every finished cell is flushed to it as it completes)."""
    out_dir = Path(out_dir)
    path = out_dir / "results.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no results.jsonl in {out_dir}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); is it a results.jsonl?") from None
    cells = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            cells.append(CellResult.from_dict(json.loads(line)))
        except (ValueError, KeyError, TypeError, AttributeError) as e:   # not JSON, or not a cell's fields
            raise ValueError(f"{path}, line {number}: not a cell of a results file ({type(e).__name__}: "
                             f"{str(e)[:200]}); remove or repair that line and run --report-only again") from None
    if not cells:
        raise ValueError(f"{path} has no cells")
    wall = sum(c.wall_seconds for c in cells)
    comparisons, summary, _ = write_outputs(out_dir, cells, {"rebuilt_from": str(path)}, wall)
    return cells, comparisons, summary


def _cell_name(spec) -> str:
    """A cell's configuration, named as everywhere (`spec_label`), plain decoding as the baseline."""
    label = spec_label(spec)
    return "baseline" if label == "none" else label


def _progress(cfg: StudyConfig):
    """A tqdm bar over cells (its ETA is the remaining-time estimate), or None."""
    if not cfg.progress:
        return None
    from tqdm import tqdm
    return tqdm(total=cfg.num_cells(), desc="bench", unit="cell", dynamic_ncols=True)
