"""The engine on a GPU, as one prepared command: equivalence, then step and round times,
then tokens per second, each phase under the time budget, its results written as JSON as
soon as it ends (a failing or timed-out phase keeps the others; a phase that skipped
configurations for lack of time counts as timed out, its rows kept).

    python scripts/gpu_check.py --device cuda --out gpu_out --budget-s 470
    python scripts/gpu_check.py --device cpu --out cpu_out --quick        # the same code on a CPU

Phases:
1. equivalence: greedy tokens on the device in float64 equal the CPU's (plain, a 4x2 D=8
   tree, a D=8 chain; batch 1 and 4); in float32 speculative decoding equals plain
   decoding (3x2 D=6, 4x2 D=8, a D=6 chain; batch 1, 4, 16) on the CUDA-graph path, and
   the graphs equal eager; seeded sampling gives plain decoding's tokens; bfloat16
   speculative against plain decoding, with every differing request's first differing
   position and plain decoding's top-2 logprob gap there (a tie at bfloat16's resolution
   or not).
2. steps: the mean decode step (plain) or round (speculative) time and tokens per second
   at batch 1, 4, 16, 64 for plain decoding, the 3x2 D=6 and 4x2 D=8 trees and the D=6
   chain, on eager (no graphs), eager + CUDA graphs and compiled + CUDA graphs, with each
   configuration's warm-up time; compiled + graphs' tokens are checked against eager's
   once each configuration is warm (compiling is the slow part, paid once).
3. throughput: per path and batch, the best speculative configuration against plain
   decoding on that path, and every path against compiled + graphs' plain decoding.
4. regime (not in the default phases; run it on its own, `--phases regime`): the paper's
   regime (`branchspec bench --regime`): one plain step and each part of a round at
   DeepSeek-V4-Flash's layer shapes, bfloat16, CUDA graphs, batch 1 to 64, contexts 1k to
   32k, projected to 43 layers; the costs measured so far are written after every batch
   size, regime.md beside the JSON at the end.

Needs nothing but torch, numpy, safetensors, tokenizers and tqdm (no server or data-set
packages). On a CPU the CUDA-graph path runs with `graphs.StaticCalls` standing in for
CUDA graphs (the same buffer logic, nothing recorded): its times say nothing of a GPU.
Exits 0 when every check passed, 2 when one failed, 3 when a phase errored or ran out of
time.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

from branchspec import LLM, SamplingParams, SpecConfig  # noqa: E402

# Held-out prompts of the study's three kinds (arithmetic, code, chat), written here: the
# data-set packages are not needed.
PROMPTS = [
    "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether?\nAnswer:",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Write a short poem about the sea.",
    "Question: A train travels 60 miles in 1.5 hours. What is its average speed in miles per hour?\nAnswer:",
    "def is_palindrome(s):\n",
    "Explain in two sentences why the sky is blue.",
    "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:",
    "Give three tips for writing clear code.",
]
SPECS = {"plain": None, "tree 3x2 D=6": SpecConfig(3, 2, 6), "tree 4x2 D=8": SpecConfig(4, 2, 8),
         "chain D=6": SpecConfig.chain(6)}
PATHS = ("eager", "eager+graphs", "compiled+graphs")


class PhaseTimeout(Exception):
    pass


class Report:
    """The JSON written into --out after every phase (and every timed row)."""

    def __init__(self, out: Path, device: str):
        self.path = out / "gpu_check.json"
        out.mkdir(parents=True, exist_ok=True)
        name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else platform.processor()
        self.data = {"device": device, "device_name": name, "torch": torch.__version__, "phases": {}}
        self.write()

    def phase(self, name: str) -> dict:
        return self.data["phases"].setdefault(name, {"status": "running", "checks": [], "rows": []})

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


@contextmanager
def time_guard(seconds: float):
    """Raise PhaseTimeout in this thread after `seconds` (when control is back in Python)."""
    def expire(signum, frame):
        raise PhaseTimeout(f"out of time after {seconds:.0f} s")

    seconds = max(1, int(seconds))
    before = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


_LLMS: dict[tuple, LLM] = {}


def make_llm(device: str, path: str, dtype: str = "float32", max_batch_size: int = 64) -> LLM:
    """An LLM on `device` running `path` ("eager": no graphs; "eager+graphs",
    "compiled+graphs"; on a CPU the graphs are `StaticCalls`), kept for the other phases:
    its compiled steps and captured graphs are paid for once."""
    key = (device, path, dtype, max_batch_size)
    if key not in _LLMS:
        _LLMS[key] = _new_llm(device, path, dtype, max_batch_size)
    return _LLMS[key]


def _new_llm(device: str, path: str, dtype: str, max_batch_size: int) -> LLM:
    compile_ = path.startswith("compiled")
    graphs = path.endswith("graphs")
    if device.startswith("cuda") or not graphs:
        return LLM(dtype=dtype, device=device, compile=compile_, seed=0, max_batch_size=max_batch_size,
                   cuda_graphs=graphs if device.startswith("cuda") else None)
    from branchspec.checkpoint import load_checkpoint
    from branchspec.engine.engine import Engine
    from branchspec.execution.graphed import GraphExecutor
    from branchspec.execution.graphs import StaticCalls

    llm = LLM(dtype=dtype, device=device, seed=0, max_batch_size=max_batch_size)
    llm.model = load_checkpoint(llm.path, dtype, expert_dispatch="dense")
    llm.engine = Engine(llm.model, llm.engine_config, decode=llm.engine.decode, seed=0,
                        stop_token_ids=tuple(llm.engine.stop_token_ids), draft_vocab=llm.draft_vocab,
                        executor=lambda m, cache: GraphExecutor(m, cache, compiled=compile_, backend=StaticCalls()))
    return llm


def tokens(llm: LLM, batch: int, spec, max_tokens: int = 32, temperature: float = 0.0) -> list[list[int]]:
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature, seed=i)
              for i in range(batch)]
    return [o.token_ids for o in llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(batch)], params, spec=spec)]


def check(phase: dict, name: str, ok: bool, **detail) -> None:
    phase["checks"].append({"name": name, "ok": bool(ok), **detail})
    print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f"  {detail}" if detail else ""), flush=True)


def bf16_ties(llm: LLM, plain: list[list[int]], spec_out: list[list[int]]) -> list[dict]:
    """For each request whose speculative tokens differ from plain decoding's, the first
    differing position and plain decoding's top-2 logit gap there (rerun with logprobs)."""
    found = []
    for i, (a, b) in enumerate(zip(plain, spec_out)):
        if a == b:
            continue
        at = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        out = llm.generate(PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=at + 1, ignore_eos=True, logprobs=2))
        top = sorted(out.logprobs[at].values(), reverse=True)
        found.append({"request": i, "position": at, "top2_logprob_gap": top[0] - top[1] if len(top) > 1 else None})
    return found


def equivalence(device: str, phase: dict, quick: bool) -> None:
    tree8, chain8 = SpecConfig(4, 2, 8), SpecConfig.chain(8)
    cpu64 = LLM(dtype="float64", seed=0, max_batch_size=4)
    dev64 = _new_llm(device, "eager+graphs", "float64", max_batch_size=4)
    for name, spec in (("plain", None), ("tree 4x2 D=8", tree8), ("chain D=8", chain8)):
        for batch in (1,) if quick else (1, 4):
            check(phase, f"float64 {name} batch {batch}: {device} eager+graphs == cpu eager",
                  tokens(dev64, batch, spec) == tokens(cpu64, batch, spec))
    del cpu64, dev64
    batches = (1, 4) if quick else (1, 4, 16)
    most = 4 if quick else 64      # the steps phase's largest batch: its LLMs are these
    graphs = make_llm(device, "eager+graphs", max_batch_size=most)
    eager = make_llm(device, "eager", max_batch_size=most)
    for batch in batches:
        plain = tokens(graphs, batch, None)
        check(phase, f"float32 eager+graphs plain batch {batch}: == eager", plain == tokens(eager, batch, None))
        for name, spec in list(SPECS.items())[1:]:
            check(phase, f"float32 eager+graphs {name} batch {batch}: == plain", tokens(graphs, batch, spec) == plain)
    for batch in (1, 4):
        plain = tokens(graphs, batch, None, temperature=0.8)
        check(phase, f"float32 seeded sampling, tree 3x2 D=6, batch {batch}: == plain",
              tokens(graphs, batch, SPECS["tree 3x2 D=6"], temperature=0.8) == plain)
    if device.startswith("cuda") and torch.cuda.is_bf16_supported():
        bf16 = _new_llm(device, "eager+graphs", "bfloat16", max_batch_size=16)
        plain = tokens(bf16, 16, None)
        for name, spec in list(SPECS.items())[1:]:
            ours = tokens(bf16, 16, spec)
            ties = bf16_ties(bf16, plain, ours)
            check(phase, f"bfloat16 eager+graphs {name} batch 16: == plain but for ties",
                  all(t["top2_logprob_gap"] is not None and t["top2_logprob_gap"] < 0.05 for t in ties),
                  differing=len(ties), first_differences=ties)


def round_times(llm: LLM, batch: int, spec, max_tokens: int, repeats: int) -> dict:
    """The better of `repeats` runs: decode ms per step or round, and decode tokens per second."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    best = None
    for _ in range(repeats):
        sync(str(llm.engine.cache.device))
        llm.generate(prompts, params, spec=spec)
        st = llm.last_stats
        row = {"ms": st.decode_seconds * 1e3 / st.num_steps, "tok_s": st.decode_throughput,
               "accept_length": st.accept_length or 1.0,
               "phases_ms": {k: v * 1e3 / st.num_steps for k, v in st.phase_seconds.items() if k != "prefill"}}
        if best is None or row["tok_s"] > best["tok_s"]:
            best = row
    return best


def steps(device: str, phase: dict, report: Report, quick: bool, deadline: float) -> None:
    batches = (1, 4) if quick else (1, 4, 16, 64)
    specs = {k: SPECS[k] for k in (("plain", "tree 3x2 D=6") if quick else SPECS)}
    paths = ("eager", "eager+graphs") if quick else PATHS
    for path in paths:
        llm = make_llm(device, path, max_batch_size=max(batches))
        for name, spec in specs.items():
            if time.monotonic() > deadline:
                phase.setdefault("skipped", []).append(f"{path} {name}: out of time")
                continue
            t0 = time.perf_counter()
            llm.warmup(spec, progress=False)
            warm = time.perf_counter() - t0
            if path == "compiled+graphs":
                eager = make_llm(device, "eager", max_batch_size=max(batches))
                for batch in (1, 4):
                    check(phase, f"float32 compiled+graphs {name} batch {batch}: == eager",
                          tokens(llm, batch, spec) == tokens(eager, batch, spec))
            for batch in batches:
                row = {"path": path, "config": name, "batch": batch, "warmup_s": warm,
                       **round_times(llm, batch, spec, max_tokens=16 if quick else 32, repeats=2)}
                phase["rows"].append(row)
                report.write()
                print(f"{path:16} {name:13} batch {batch:3d}: {row['ms']:8.2f} ms  {row['tok_s']:9.1f} tok/s  "
                      f"(accept {row['accept_length']:.2f}; warm-up {warm:.0f} s)", flush=True)


def throughput(phase: dict, step_rows: list[dict]) -> None:
    """Ratios side by side from the steps phase's rows."""
    base = {r["batch"]: r["tok_s"] for r in step_rows if r["path"] == "compiled+graphs" and r["config"] == "plain"}
    for path in dict.fromkeys(r["path"] for r in step_rows):
        for batch in dict.fromkeys(r["batch"] for r in step_rows):
            rows = [r for r in step_rows if r["path"] == path and r["batch"] == batch]
            plain = next((r for r in rows if r["config"] == "plain"), None)
            spec = [r for r in rows if r["config"] != "plain"]
            if plain is None or not spec:
                continue
            best = max(spec, key=lambda r: r["tok_s"])
            row = {"path": path, "batch": batch, "plain_ms": plain["ms"], "plain_tok_s": plain["tok_s"],
                   "best": best["config"], "best_tok_s": best["tok_s"],
                   "best_over_plain": best["tok_s"] / plain["tok_s"]}
            if batch in base:      # against the fastest plain configuration
                row["plain_over_compiled_graphs_plain"] = plain["tok_s"] / base[batch]
                row["best_over_compiled_graphs_plain"] = best["tok_s"] / base[batch]
            phase["rows"].append(row)
            print(f"{path:16} batch {batch:3d}: plain {plain['ms']:7.2f} ms, best {best['config']} "
                  f"{row['best_over_plain']:.2f}x plain", flush=True)


def regime(device: str, phase: dict, report: Report, quick: bool, out: Path) -> None:
    """`bench.regime.run` on this device, its preset (quick: fewer batches and contexts):
    the measured costs in the phase's rows as they come, the whole result at the end, and
    regime.json and regime.md beside gpu_check.json."""
    from branchspec.bench.projection import default_studies, study_accept_lengths
    from branchspec.bench.regime import default_plan, run

    def keep(partial: dict) -> None:
        phase["rows"] = partial["depths"]
        report.write()

    studies = {name: study_accept_lengths(path) for name, path in default_studies().items()}
    phase["regime"] = run(default_plan(device, quick, progress=False), out, studies, plots=False, on_result=keep)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json")
    ap.add_argument("--budget-s", type=float, default=470.0, help="wall-time budget for all phases, seconds")
    ap.add_argument("--phases", default="equivalence,steps,throughput")
    ap.add_argument("--quick", action="store_true", help="fewer batches, configurations and paths (a CPU check)")
    args = ap.parse_args()
    t0 = time.monotonic()
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("gpu_check: CUDA is not available here", file=sys.stderr)
            return 1
        torch.backends.cuda.matmul.allow_tf32 = False      # float32 means float32
        torch.backends.cudnn.allow_tf32 = False
    report = Report(args.out, args.device)
    phases = [p for p in args.phases.split(",") if p]
    unknown = set(phases) - {"equivalence", "steps", "throughput", "regime"}
    if unknown:
        ap.error(f"unknown phases {sorted(unknown)}")
    # Shares of what is left when each starts: equivalence is cheap on a GPU, steps take the
    # rest (a CPU's float64 runs take longer: --quick gives equivalence more).
    share = {"equivalence": 0.6 if args.quick else 0.3, "steps": 0.95, "throughput": 1.0, "regime": 1.0}
    status = 0
    for name in phases:
        phase = report.phase(name)
        left = args.budget_s - (time.monotonic() - t0)
        limit = left * share[name]
        start = time.monotonic()
        try:
            if left < 5 and name != "throughput":     # throughput is arithmetic on the rows so far
                raise PhaseTimeout("no time left")
            with time_guard(max(limit, 5)):
                if name == "equivalence":
                    equivalence(args.device, phase, args.quick)
                elif name == "steps":
                    # Stop starting new configurations with a tenth of the phase left.
                    steps(args.device, phase, report, args.quick, deadline=start + 0.9 * limit)
                elif name == "regime":
                    regime(args.device, phase, report, args.quick, args.out)
                else:
                    throughput(phase, report.phase("steps")["rows"])
            if any(not c["ok"] for c in phase["checks"]):
                phase["status"] = "failed"
            elif phase.get("skipped"):       # stopped starting configurations near its deadline
                phase["status"], phase["error"] = "timed out", f"out of time: skipped {len(phase['skipped'])}"
            else:
                phase["status"] = "done"
        except PhaseTimeout as e:
            phase["status"], phase["error"] = "timed out", str(e)
        except Exception as e:   # noqa: BLE001 - a failing phase must not lose the others
            phase["status"], phase["error"] = "error", f"{type(e).__name__}: {e}"
            phase["traceback"] = traceback.format_exc()[-4000:]
            print(phase["traceback"], file=sys.stderr, flush=True)
        phase["seconds"] = time.monotonic() - start
        report.write()
        print(f"== {name}: {phase['status']} in {phase['seconds']:.0f} s", flush=True)
        if phase["status"] == "failed":
            status = max(status, 2)
        elif phase["status"] != "done":
            status = 3
    report.data["seconds"] = time.monotonic() - t0
    report.write()
    print(json.dumps({k: v["status"] for k, v in report.data["phases"].items()}))
    return status


if __name__ == "__main__":
    sys.exit(main())
