"""One cell of `branchspec bench` rebuilt from the command line, for the scripts that look
into a single cell (`diverging_draws.py`, `policy_trace.py`): the same prompts, batch and
per-request sampling parameters as the study's."""

from __future__ import annotations

import argparse

from branchspec import LLM, SamplingParams
from branchspec.bench.study import StudyConfig, batch_prompts, load_prompts, request_params


def add_cell_arguments(ap: argparse.ArgumentParser, workload: str, temperature: float) -> None:
    ap.add_argument("--workload", default=workload)
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--temperature", type=float, default=temperature)
    ap.add_argument("--seed", type=int, default=0, help="the study's --seed (request i draws with seed + i)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--mbpp-path", default=None)


def cell(args: argparse.Namespace) -> tuple[LLM, list[list[int]], list[SamplingParams]]:
    """An engine sized for the cell's batch, its prompts and their sampling parameters."""
    B = args.batch_size
    cfg = StudyConfig(workloads=(args.workload,), num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                      temperature=args.temperature, seed=args.seed, batch_sizes=(B,), progress=False,
                      mbpp_path=args.mbpp_path)
    llm = LLM(max_batch_size=B, seed=0)
    return llm, batch_prompts(load_prompts(cfg, llm)[args.workload], B), request_params(cfg, B)
