"""Round-time breakdown and accept length on a tiny model trained for seconds on a sparse
Markov chain (the same kind of data the spec tests use). Prints one line per config.

    python scripts/tiny_round_breakdown.py [--threads 1]
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from branchspec import LLM, SamplingParams, SpecConfig
from branchspec.checkpoint import save_checkpoint
from branchspec.config import tiny_config
from branchspec.model.init import random_model
from branchspec.train.losses import train_steps


def markov(vocab: int, num: int, batch: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(3, vocab, (vocab, 3), generator=g)       # three successors per token
    probs = torch.tensor([0.6, 0.3, 0.1])
    for _ in range(num):
        x = torch.zeros(batch, length, dtype=torch.long)
        x[:, 0] = torch.randint(3, vocab, (batch,), generator=g)
        for t in range(1, length):
            x[:, t] = succ[x[:, t - 1], torch.multinomial(probs.expand(batch, 3), 1, generator=g)[:, 0]]
        yield x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = tiny_config()
    model = random_model(cfg, seed=0, std=0.1)
    train_steps(model, markov(cfg.vocab_size, 61, 8, 160), lr=1e-2)
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(model, folder)
        llm = LLM(folder, max_batch_size=8)
        data = next(markov(cfg.vocab_size, 1, 8, 200, seed=5))
        prompts = [data[i, :100].tolist() for i in range(8)]
        params = SamplingParams(max_tokens=64, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=4))     # warm-up
        for b in (1, 8):
            for spec in (None, SpecConfig.chain(6), SpecConfig(3, 2, 6), SpecConfig.chain(8), SpecConfig(4, 2, 8)):
                llm.generate(prompts[:b], params, spec=spec)
                st = llm.last_stats
                ms = {k: round(v * 1e3 / st.num_steps, 2) for k, v in st.phase_seconds.items() if k != "prefill"}
                name = "plain" if spec is None else f"{spec.num_steps}x{spec.topk} D={spec.num_draft_tokens}"
                print(f"batch {b} {name:12} accept {st.accept_length:.2f}  {st.decode_throughput:7.1f} tok/s  "
                      f"ms/round {ms}")


if __name__ == "__main__":
    main()
