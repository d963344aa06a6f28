"""`branchspec bench`: flags, presets, and the printed table + JSON line.

The top-level CLI calls ``add_arguments(subparser)`` and ``main(args)``;
``python -m branchspec.bench`` does the same on its own parser.

Presets: without ``--quick`` the defaults are the full sweep (3 workloads x D 5-8 x batch
1/4/16/64 x chain + up to 4 tree shapes, 128 tokens). ``--quick`` shrinks it to D = 6,
batch 1 and 4, chain + 2 trees, 32 tokens, 4 prompts per workload. Flags given
explicitly override the preset either way.

MBPP: the presets' workloads include it, but when it has no source (no local file, the
Hugging Face hub unreachable) the study runs the others and says so in one line on
stderr and in report.md. Workloads named with ``--workloads`` must all have a source, or
the command fails before any work.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from branchspec.bench.grid import DEFAULT_MAX_SHAPES, parse_tree_shapes
from branchspec.cli_paths import readable_folder, writable_folder
from branchspec.bench.study import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_BUDGETS,
    DEFAULT_WORKLOADS,
    DTYPES,
    StudyConfig,
    report_from_results,
    run_study,
)


@dataclass(frozen=True)
class Preset:
    workloads: tuple[str, ...]
    budgets: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    max_tree_shapes: int
    max_tokens: int
    num_prompts: int


FULL = Preset(DEFAULT_WORKLOADS, DEFAULT_BUDGETS, DEFAULT_BATCH_SIZES, DEFAULT_MAX_SHAPES,
              max_tokens=128, num_prompts=64)
QUICK = Preset(DEFAULT_WORKLOADS, (6,), (1, 4), 2, max_tokens=32, num_prompts=4)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    return values


def _seed(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed or none, got {text!r}") from None


def _name_list(text: str) -> tuple[str, ...]:
    values = tuple(t.strip() for t in text.split(",") if t.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return values


def _named_paths(text: str) -> dict[str, str]:
    if text.strip().lower() == "none":
        return {}
    out = {}
    for item in _name_list(text):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise argparse.ArgumentTypeError(f"expected NAME=FILE (e.g. greedy=results.jsonl), got {item!r}")
        out[name.strip()] = path.strip()
    return out


def _shapes(text: str):
    try:
        return tuple(parse_tree_shapes(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench flags. List defaults are None so a preset can tell 'not given' apart."""
    p = parser
    p.add_argument("--quick", action="store_true",
                   help="small preset: D=6, batch 1,4, chain + 2 trees, 32 tokens, 4 prompts per workload")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="checkpoint folder (default: the embedded default checkpoint)")
    p.add_argument("--workloads", type=_name_list, default=None, metavar="W[,W..]",
                   help=f"eval workloads (default: {','.join(FULL.workloads)})")
    p.add_argument("--budgets", type=_int_list, default=None, metavar="D[,D..]",
                   help="verify budgets D, root included (default: 5,6,7,8)")
    p.add_argument("--batch-sizes", type=_int_list, default=None, metavar="B[,B..]",
                   help="batch sizes (default: 1,4,16,64)")
    p.add_argument("--tree-shapes", type=_shapes, default=None, metavar="SxK[,SxK..]",
                   help="tree shapes num_steps x topk, each valid at every D (default: a grid per D)")
    p.add_argument("--max-tree-shapes", type=int, default=None, metavar="N",
                   help=f"shapes per D in the default grid (default: {FULL.max_tree_shapes})")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens generated per request (default: 128)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="eval prompts per workload; larger batches cycle through them (default: 64)")
    p.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="skip eval prompts longer than this many tokens (default: 512)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=_seed, default=0, metavar="N|none",
                   help="sampled request i of a batch draws with seed N + i, so every configuration emits the "
                        "same tokens and is checked against plain decoding (default 0); none: unseeded, each "
                        "run samples other text")
    p.add_argument("--out", default="bench_out", help="output folder (default: bench_out)")
    p.add_argument("--mbpp-path", default=None,
                   help="local mbpp.jsonl (default: $BRANCHSPEC_MBPP, else google-research-datasets/mbpp "
                        "from the Hugging Face hub; without --workloads, MBPP "
                        "is skipped with a note when none of these works)")
    p.add_argument("--policies", type=_name_list, default=None, metavar="P[,P..]",
                   help="fixed (the chain and tree grid) and/or auto (the adaptive policy, SpecConfig.auto); "
                        "default: fixed")
    p.add_argument("--policy-repeats", type=int, default=3, metavar="N",
                   help="with fixed,auto: after each (workload, batch size), run plain decoding, the best fixed "
                        "configuration and the policy again in turn N times and judge the policy on the medians; "
                        "with eagle2,calibrated, the same at each D for the best calibrated tree and the best of "
                        "the others (default: 3; 0: judge on the sweep's single runs)")
    p.add_argument("--selections", type=_name_list, default=None, metavar="S[,S..]",
                   help="eagle2 (the paper's node selection, by cumulative draft probability) and optionally "
                        "calibrated (by measured acceptance: the same shapes plus (D-1)x2 and (D-1)x3); "
                        "default: eagle2")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="float32 for the study (default); with --regime, bfloat16 where the device has native "
                        "bf16 products, else float32")
    p.add_argument("--compile", action="store_true",
                   help="run the compiled fast path (compiles every graph the grid needs first; eager is the default)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="on a GPU, launch every kernel from Python instead of replaying each step as a CUDA graph")
    p.add_argument("--speculative-token-map", default=None, metavar="FILE|none",
                   help="a reduced draft vocabulary file (draft_vocab.safetensors), or none for the full vocabulary (default: the checkpoint's own map, if it has one)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG figures")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("the paper's regime (--regime)")
    g.add_argument("--regime", action="store_true",
                   help="instead of the study: time one plain step and each part of a speculative round at "
                        "DeepSeek-V4-Flash's layer shapes (random weights, two reduced depths), project them to its "
                        "43 layers, and project throughput from accept lengths; writes regime.json, regime.md and "
                        "regime.png into --out (--quick: a few minutes on 2 CPU cores)")
    g.add_argument("--contexts", type=_int_list, default=None, metavar="N[,N..]",
                   help="committed tokens per request (default: 1024,8192 with --quick on a CPU, else "
                        "1024,8192,32768)")
    g.add_argument("--regime-pairs", type=_int_list, default=None, metavar="P0,P1",
                   help="the two depths measured, in (C4, C128) layer pairs after the first three layers "
                        "(default: 0,2 on a CPU, 1,3 on a GPU)")
    g.add_argument("--regime-repeats", type=int, default=None, metavar="N",
                   help="timed calls per cost, medians taken (default: 3 with --quick on a CPU, else 5)")
    g.add_argument("--accept-lengths", type=_named_paths, default=None, metavar="NAME=FILE[,..]|none",
                   help="a study's results.jsonl per name, whose accept lengths the projection uses beside the "
                        "paper's (default: this checkout's docs/results greedy and sampled studies, where present)")
    p.add_argument("--report-only", metavar="DIR", default=None,
                   help="rebuild report.md and the plots from DIR/results.jsonl (e.g. of an interrupted "
                        "sweep) without running anything")


def config_from_args(args: argparse.Namespace) -> StudyConfig:
    """Apply the preset under explicit flags; ValueError for values that cannot work."""
    preset = QUICK if args.quick else FULL
    pick = lambda given, default: default if given is None else given  # noqa: E731
    return StudyConfig(
        model=args.model,
        workloads=pick(args.workloads, preset.workloads),
        budgets=pick(args.budgets, preset.budgets),
        batch_sizes=pick(args.batch_sizes, preset.batch_sizes),
        tree_shapes=args.tree_shapes,
        max_tree_shapes=pick(args.max_tree_shapes, preset.max_tree_shapes),
        max_tokens=pick(args.max_tokens, preset.max_tokens),
        num_prompts=pick(args.num_prompts, preset.num_prompts),
        max_prompt_tokens=args.max_prompt_tokens,
        temperature=args.temperature,
        seed=args.seed,
        out_dir=args.out,
        mbpp_path=args.mbpp_path,
        # Workloads the user named must all run; the preset's may drop MBPP when it has no source.
        mbpp_optional=args.workloads is None,
        dtype=args.dtype or "float32",
        compile=args.compile,
        device=args.device,
        cuda_graphs=False if args.disable_cuda_graph else None,
        token_map=args.speculative_token_map,
        threads=args.threads,
        progress=not args.no_progress,
        plots=not args.no_plots,
        policies=tuple(args.policies) if args.policies else ("fixed",),
        policy_repeats=args.policy_repeats,
        selections=tuple(args.selections) if args.selections else ("eagle2",),
    )


def main(args: argparse.Namespace) -> int:
    """Run the study; print the tables, then one line of JSON. Returns the exit status
    (2 with an argparse-style message for a configuration that cannot work)."""
    from branchspec.bench.report import console_tables

    if getattr(args, "regime", False):
        return regime_main(args)
    if getattr(args, "report_only", None):
        try:
            cells, comparisons, summary = report_from_results(args.report_only)
        except (ValueError, FileNotFoundError) as e:
            print(f"branchspec bench: error: {e}", file=sys.stderr)
            return 2
        print(console_tables(cells, comparisons))
        print(json.dumps(summary))
        return 0
    stray = _given(args, REGIME_ONLY)
    if stray:
        print(f"branchspec bench: error: {', '.join(stray)} need --regime", file=sys.stderr)
        return 2
    try:
        if args.model is not None:      # before any work, as the study's first write
            readable_folder("--model", args.model)
        writable_folder("--out", args.out)
        cfg = config_from_args(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"branchspec bench: error: {e}", file=sys.stderr)
        return 2
    for note in cfg.notes:
        print(note, file=sys.stderr)   # the same line heads report.md
    if cfg.compile and cfg.progress:
        from branchspec.execution.compiled_step import report_progress

        report_progress()
    result = run_study(cfg)
    print(console_tables(result.cells, result.comparisons))
    print(f"\nwrote {', '.join(str(p) for p in result.files.values())}")
    print(json.dumps(result.summary))
    return 0


# Study flags the regime run does not use: given with --regime, they are refused, not ignored.
STUDY_ONLY = ("model", "workloads", "tree_shapes", "max_tree_shapes", "max_tokens", "num_prompts",
              "max_prompt_tokens", "temperature", "seed", "mbpp_path", "policies", "policy_repeats", "selections",
              "speculative_token_map", "report_only")
REGIME_ONLY = ("contexts", "regime_pairs", "regime_repeats", "accept_lengths")


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    defaults = build_parser().parse_args([])
    return ["--" + n.replace("_", "-") for n in names if getattr(args, n, None) != getattr(defaults, n)]


def regime_plan_from_args(args: argparse.Namespace):
    """The regime's plan: the device's preset under the flags given; ValueError for flags
    that do not apply or values that cannot work."""
    from branchspec.bench.regime import default_plan

    stray = _given(args, STUDY_ONLY)
    if stray:
        raise ValueError(f"{', '.join(stray)} {'does' if len(stray) == 1 else 'do'} not apply to --regime, which "
                         "measures random weights of V4-Flash's shapes, not workloads")
    if args.regime_pairs is not None and len(args.regime_pairs) != 2:
        raise ValueError(f"--regime-pairs takes two depths, got {args.regime_pairs}")
    gpu = args.device.startswith("cuda")
    path = ("eager" if args.disable_cuda_graph and not args.compile else "compiled" if args.disable_cuda_graph
            else "graphs") if gpu else ("compiled" if args.compile else "eager")
    if args.disable_cuda_graph and not gpu:
        raise ValueError("--disable-cuda-graph applies to a GPU (--device cuda); on a CPU nothing is captured")
    return default_plan(args.device, args.quick, batch_sizes=args.batch_sizes, contexts=args.contexts,
                        nodes=args.budgets, pairs=tuple(args.regime_pairs) if args.regime_pairs else None,
                        repeats=args.regime_repeats, dtype=args.dtype or "auto", path=path,
                        progress=not args.no_progress)


def regime_main(args: argparse.Namespace) -> int:
    """`branchspec bench --regime`: measure, project, print regime.md, then one JSON line."""
    from branchspec.bench.projection import default_studies, study_accept_lengths
    from branchspec.bench.regime import run

    try:
        writable_folder("--out", args.out)
        plan = regime_plan_from_args(args)
        named = default_studies() if args.accept_lengths is None else args.accept_lengths
        studies = {}
        for name, path in named.items():
            try:
                studies[name] = study_accept_lengths(path)
            except (OSError, ValueError, KeyError) as e:
                raise ValueError(f"--accept-lengths {name}={path}: not a study's results.jsonl ({e})") from None
    except (ValueError, FileNotFoundError) as e:
        print(f"branchspec bench: error: {e}", file=sys.stderr)
        return 2
    if args.threads is not None:
        import torch
        torch.set_num_threads(args.threads)
    payload = run(plan, args.out, studies, plots=not args.no_plots)
    out = Path(args.out)
    print((out / "regime.md").read_text())
    print(f"wrote {', '.join(str(out / n) for n in ('regime.json', 'regime.md', 'regime.png') if (out / n).exists())}")
    print(json.dumps({"regime": payload["environment"], "wall_seconds": round(payload["wall_seconds"], 1)}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="branchspec bench",
                                     description="tree vs chain speculative decoding at matched budget D")
    add_arguments(parser)
    return parser
