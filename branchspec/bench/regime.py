"""The paper's regime, measured: what one plain step and each part of a speculative round
cost at DeepSeek-V4-Flash's layer shapes (`config.model.v4_flash_slice_config`), at long
committed contexts, on whatever device this runs on.

The embedded model is too small to say whether the paper's regularities follow from the
costs (on a CPU its verify rows are compute-bound at once, on a GPU it is all launches).
Here every call a round makes (`speculative.profiling.RoundCalls`) is timed on random
weights of V4-Flash's widths at two reduced depths, so that the cost of one (C4, C128)
layer pair separates from the rest (embedding, LM head, the first layers) and the full
43-layer model's costs follow by arithmetic (`bench.projection`).

Committed state is written straight into the pools (random values, lengths set): prefill
of 32k tokens at batch 64 would take hours on a CPU, and a call's cost does not depend on
the values it reads, only on how many there are. Every measured cost is written to
`regime.json` as the run goes, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from branchspec.atomic import write_text
from branchspec.config import SpecConfig, check_device
from branchspec.config.model import v4_flash_slice_config

NODES = (1, 2, 3, 4, 5, 6, 7, 8)            # D, root included; 1 is the plain decode step
# The target's calls scale with depth; the drafter's (one MTP block and the LM head, over a
# window of 128 positions) do not, and are measured once per batch size (first depth, first
# context).
TARGET_CALLS = ("plain", "verify_chain", "verify_tree")
DRAFTER_CALLS = ("draft_chain", "draft_tree", "extend")


def tree_spec(D: int) -> SpecConfig:
    """The tree measured at budget D: top-2 per step, three steps at most (the paper's best
    case, 3 x 2 at D = 6); below D = 3 a tree is a chain."""
    return SpecConfig(num_steps=min(3, D - 1), topk=2, num_draft_tokens=D)


def tree_parents(D: int) -> list[int]:
    """A tree of D nodes for the verify pass: node i's parent is (i - 1) // 2 (a binary
    tree, each parent before its children), the same for every request."""
    return [(i - 1) // 2 if i else -1 for i in range(D)]


@dataclass(frozen=True)
class RegimePlan:
    """What to measure: batch sizes, committed contexts, budgets D (1 always: the plain
    step), the two depths (in (C4, C128) pairs between the first three layers and the last),
    and how: device, dtype, execution path, timed repeats per call."""

    batch_sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    nodes: tuple[int, ...] = NODES
    pairs: tuple[int, int] = (0, 2)
    device: str = "cpu"
    dtype: str = "auto"
    # eager | compiled | graphs | auto (graphs on a GPU, eager on a CPU); graphs on a CPU run
    # the same buffer logic with nothing recorded (`graphs.StaticCalls`), for tests
    path: str = "auto"
    repeats: int = 2
    progress: bool = True
    seed: int = 0
    config_overrides: dict = field(default_factory=dict)   # tests: a tiny slice

    def __post_init__(self):
        check_device("RegimePlan", self.device)
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be positive, got {self.batch_sizes}")
        if not self.contexts or min(self.contexts) < 1:
            raise ValueError(f"contexts must be positive token counts, got {self.contexts}")
        if not self.nodes or min(self.nodes) < 1:
            raise ValueError(f"budgets D must be at least 1, got {self.nodes}")
        if len(self.pairs) != 2 or not 0 <= self.pairs[0] < self.pairs[1]:
            raise ValueError(f"pairs must be two increasing depths >= 0 (in (4, 128) layer pairs), got {self.pairs}")
        if self.path not in ("auto", "eager", "compiled", "graphs"):
            raise ValueError(f"path must be auto, eager, compiled or graphs, got {self.path!r}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {self.repeats}")
        most = max(self.contexts) + max(self.nodes) + 2
        limit = v4_flash_slice_config(0, **self.config_overrides).max_position
        if most > limit:
            raise ValueError(f"a context of {max(self.contexts)} tokens plus D = {max(self.nodes)} needs "
                             f"{most} positions; the regime model has {limit}")

    @property
    def budgets(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.nodes) | {1}))


CPU_QUICK = dict(batch_sizes=(1, 4), contexts=(1024, 8192), repeats=3)
CPU_FULL = dict(batch_sizes=(1, 4, 16), contexts=(1024, 8192, 32768), repeats=5)
GPU_FULL = dict(batch_sizes=(1, 4, 16, 64), contexts=(1024, 8192, 32768), repeats=5, pairs=(1, 3))


def default_plan(device: str, quick: bool, **given) -> RegimePlan:
    """The preset for this device (a CPU's quick one fits a few minutes of 2 cores; its
    full one leaves out batch 64, whose rounds take tens of seconds each there), under the
    values given explicitly (None: the preset's)."""
    gpu = torch.device(check_device("RegimePlan", device)).type == "cuda"
    preset = dict(GPU_FULL if gpu else CPU_QUICK if quick else CPU_FULL)
    if gpu and quick:
        preset.update(batch_sizes=(1, 4, 64), contexts=(1024, 8192), repeats=3)
    preset.update({k: v for k, v in given.items() if v is not None})
    return RegimePlan(device=device, **preset)


def native_bf16(device: torch.device) -> bool:
    """Whether bfloat16 matrix products run natively here: any CUDA device torch supports
    bf16 on, or a CPU with AVX512-BF16 or AMX (elsewhere a CPU emulates them, far slower
    than float32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_regime_dtype(dtype: str, device: torch.device) -> str:
    if dtype != "auto":
        return dtype
    return "bfloat16" if native_bf16(device) else "float32"


def resolve_path(path: str, device: torch.device) -> str:
    """auto: CUDA graphs on a GPU (one replay per call, where eager would launch thousands
    of kernels); eager on a CPU, where matrix products are 92% of a plain step's time at
    these widths (torch's profiler, 3 layers, batch 1) and compiling could save at most
    the rest, at minutes of compiling per shape."""
    if path != "auto":
        return path
    return "graphs" if device.type == "cuda" else "eager"


@dataclass
class RegimeCosts:
    """What a run measured: each depth's calls, and one routed expert over m tokens."""

    depths: list["DepthCosts"]
    expert_seconds: dict[int, float] = field(default_factory=dict)


@dataclass
class DepthCosts:
    """Seconds of each call at one depth: costs[call][batch][context][D] (as strings in
    JSON). The drafter's calls are measured at the first depth only."""

    pairs: int
    num_layers: int
    costs: dict[str, dict[int, dict[int, dict[int, float]]]] = field(default_factory=dict)

    def put(self, call: str, batch: int, context: int, D: int, seconds: float) -> None:
        self.costs.setdefault(call, {}).setdefault(batch, {}).setdefault(context, {})[D] = seconds


def _calls_at(plan: RegimePlan, calls, with_drafter: bool) -> list[tuple[str, int, object]]:
    """(call, D, run) of every call measured at one (batch, context)."""
    # the plain step as the runner takes it, and the verify pass over the root alone: the
    # same one-token step by another route (the faster is plain decoding's baseline)
    out = [("plain", 1, calls.of("target", 1)), ("verify_chain", 1, calls.verify([-1]))]
    budgets = [D for D in plan.budgets if D > 1]
    for D in budgets:
        out.append(("verify_chain", D, calls.verify(list(range(-1, D - 1)))))
        out.append(("verify_tree", D, calls.verify(tree_parents(D))))
    for D in budgets if with_drafter else ():
        out.append(("draft_chain", D, calls.draft(SpecConfig.chain(D))))
        if D >= 3:
            out.append(("draft_tree", D, calls.draft(tree_spec(D))))
        out.append(("extend", D, calls.of("extend", D + 1)))
    return out


def _fill_committed(cache, ids: list[int], context: int, most: int, gen: torch.Generator) -> None:
    """Admit the requests with room for `context` + `most` tokens and write random values
    into every pool (the committed state's contents do not change what a call costs)."""
    for sid in ids:
        cache.add(sid)
        cache.reserve(sid, context + most)
    for storage in cache.storage.values():
        storage.normal_(0.0, 1.0, generator=gen)


@torch.no_grad()
def measure(plan: RegimePlan, on_result=None) -> RegimeCosts:
    """Time every call of `plan` at both depths, and one routed expert over the token
    counts its calls run; `on_result(costs)` after each batch size, so a caller can write
    what is measured so far.

    Both depths' models are held at once and, at each (batch, context), the calls of both
    are timed in turn (`median_seconds`): the cost of a layer pair is their difference, a
    fraction of either, and a slow spell of a shared machine must fall on both alike."""
    from branchspec.execution import expert_dispatch
    from branchspec.model.init import allocated_random_model
    from branchspec.speculative.profiling import median_seconds

    device = torch.device(plan.device)
    dtype = resolve_regime_dtype(plan.dtype, device)
    dense = resolve_path(plan.path, device) in ("compiled", "graphs")

    models = [allocated_random_model(v4_flash_slice_config(pairs, **plan.config_overrides), dtype, device,
                                     seed=plan.seed, expert_dispatch=expert_dispatch(dense, device))
              for pairs in plan.pairs]
    results = [DepthCosts(pairs=pairs, num_layers=m.cfg.num_layers) for pairs, m in zip(plan.pairs, models)]
    measured = RegimeCosts(results, time_expert(models[0], expert_token_counts(plan), plan.repeats, device))
    bar = None
    if plan.progress:
        from tqdm import tqdm
        bar = tqdm(total=len(plan.batch_sizes) * len(plan.contexts), desc="regime (batch, context)", unit="cell")
    for B in plan.batch_sizes:
        gen = torch.Generator(device=device).manual_seed(plan.seed)
        for k, context in enumerate(plan.contexts):
            cells = []        # each run holds its calls, and through them their paged state
            for i, model in enumerate(models):
                calls = _round_calls(plan, model, B, context, gen)
                cells += [(i, call, D, run) for call, D, run in _calls_at(plan, calls, with_drafter=i == 0 and k == 0)]
            seconds = median_seconds([run for *_, run in cells], plan.repeats, device)
            for (i, call, D, _), s in zip(cells, seconds):
                results[i].put(call, B, context, D, s)
            del cells
            if bar is not None:
                bar.update(1)
        if on_result is not None:
            on_result(measured)
    if bar is not None:
        bar.close()
    del models
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return measured


def expert_token_counts(plan: RegimePlan) -> tuple[int, ...]:
    """Tokens one routed expert is timed over: powers of two up to every token a call
    of the plan runs (largest batch x largest D)."""
    most, out, m = max(plan.batch_sizes) * max(plan.budgets), [], 1
    while m < most:
        out.append(m)
        m *= 2
    return tuple(out + [most])


@torch.no_grad()
def time_expert(model, counts: tuple[int, ...], repeats: int, device: torch.device) -> dict[int, float]:
    """Seconds of one routed expert of `model` (its SwiGLU, as the grouped dispatch runs
    it) over m tokens, for each m of `counts`: what V4-Flash's other 250 experts would add
    (`projection.expert_correction`)."""
    from branchspec.model.layers import Experts, swiglu
    from branchspec.speculative.profiling import median_seconds

    experts = next(m for m in model.modules() if isinstance(m, Experts))
    w1, w2, w3 = experts.w1[0], experts.w2[0], experts.w3[0]
    gen = torch.Generator(device=device).manual_seed(0)
    xs = [torch.randn(m, model.cfg.d_model, generator=gen, device=device, dtype=w1.dtype) for m in counts]
    runs = [lambda x=x: swiglu(x, w1, w2, w3, experts.limit) for x in xs]
    return dict(zip(counts, median_seconds(runs, repeats, device)))


def _round_calls(plan: RegimePlan, model, B: int, context: int, gen: torch.Generator):
    """The calls of a round over B requests of `context` committed tokens of `model`, on a
    paged state of their own."""
    from branchspec.cache.paged import PagedState
    from branchspec.execution import make_executor
    from branchspec.speculative.drafter import DrafterState, MTPDrafter
    from branchspec.speculative.profiling import RoundCalls

    device, cfg = torch.device(plan.device), model.cfg
    path = resolve_path(plan.path, device)
    most, ids = max(plan.budgets) + 2, list(range(B))
    # A paged state as long as this context needs: a captured graph addresses every entry
    # max_model_len allows (`cache.paged`), so a longer one would cost more.
    cache = PagedState(cfg, max_seqs=B, max_len=context + most, page_size=16, dtype=model.embed.weight.dtype,
                       device=device)
    _fill_committed(cache, ids, context, most, gen)
    if path == "graphs" and device.type != "cuda":
        from branchspec.execution.graphed import GraphExecutor
        from branchspec.execution.graphs import StaticCalls
        ex = GraphExecutor(model, cache, backend=StaticCalls())
    else:
        ex = make_executor(model, cache, compile=path == "compiled", cuda_graphs=path == "graphs")
    drafter = MTPDrafter(model, cache, ex)
    L = torch.full((B,), context, dtype=torch.long, device=device)
    hidden = torch.randn(B, 1, max(1, cfg.hc_mult) * cfg.d_model, generator=gen, device=device,
                         dtype=model.embed.weight.dtype)                    # [B, 1, n*d] the target's last
    for b, sid in enumerate(ids):
        drafter.states[sid] = DrafterState(last_hidden=hidden[b, 0])
    return RoundCalls(ex, drafter, hidden, ids, L, torch.Generator().manual_seed(plan.seed))


def environment(plan: RegimePlan) -> dict:
    """What the numbers were measured on: device and its name, dtype and path as resolved,
    the torch build, threads."""
    from branchspec.machine import cpu_model_name

    device = torch.device(plan.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model_name()
    return {"device": str(device), "device_name": name, "dtype": resolve_regime_dtype(plan.dtype, device),
            "path": resolve_path(plan.path, device), "torch": torch.__version__, "threads": torch.get_num_threads()}


def to_json(plan: RegimePlan, measured: RegimeCosts, projection: dict | None, seconds: float) -> dict:
    def keyed(d):
        return {str(k): keyed(v) for k, v in d.items()} if isinstance(d, dict) else d

    plan_dict = {k: v for k, v in asdict(plan).items() if k != "progress"}
    return {"plan": plan_dict, "environment": environment(plan), "wall_seconds": seconds,
            "depths": [{"pairs": d.pairs, "num_layers": d.num_layers, "costs": keyed(d.costs)}
                       for d in measured.depths],
            "expert_seconds": keyed(measured.expert_seconds), "projection": projection}


def write_json(path: Path, payload: dict) -> None:
    write_text(path, json.dumps(payload, indent=1) + "\n")


def run(plan: RegimePlan, out_dir: str | Path, studies: dict[str, dict] | None = None, plots: bool = True,
        on_result=None) -> dict:
    """Measure, project (under the paper's accept lengths and each of `studies`, see
    `projection.project`), and write regime.json (after every batch size too), regime.md
    and the plot into `out_dir`; returns the JSON written. `on_result(partial JSON)`
    after every batch size as well."""
    from branchspec.bench.projection import project
    from branchspec.bench.regime_report import regime_markdown, regime_plot

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    path = out / "regime.json"
    def keep(measured: RegimeCosts) -> None:
        partial = to_json(plan, measured, None, time.perf_counter() - start)
        write_json(path, partial)
        if on_result is not None:
            on_result(partial)

    measured = measure(plan, on_result=keep)
    projection = project(measured, studies)
    # through JSON and back: the report reads what the file holds (string keys throughout)
    payload = json.loads(json.dumps(to_json(plan, measured, projection, time.perf_counter() - start)))
    write_json(path, payload)
    (out / "regime.md").write_text(regime_markdown(payload))
    if plots:
        regime_plot(payload, out / "regime.png")
    return payload
