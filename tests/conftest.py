import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from branchspec.config import tiny_config  # noqa: E402
from branchspec.model.weights import random_model, save_checkpoint  # noqa: E402
from branchspec.train.losses import train_steps  # noqa: E402


@pytest.fixture(scope="session")
def tiny64():
    """A random float64 tiny model with weights large enough for peaked, tie-free scores."""
    torch.set_grad_enabled(True)
    return random_model(tiny_config(), seed=3, dtype="float64", std=0.3)


def markov_batches(vocab: int, num: int, batch: int = 8, length: int = 160, seed: int = 0):
    """Sequences from a sparse random Markov chain (3 successors per token): learnable, so
    a briefly trained target and drafter agree often but not always."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(3, vocab, (vocab, 3), generator=g)
    probs = torch.tensor([0.6, 0.3, 0.1])
    for _ in range(num):
        x = torch.zeros(batch, length, dtype=torch.long)
        x[:, 0] = torch.randint(3, vocab, (batch,), generator=g)
        for t in range(1, length):
            c = torch.multinomial(probs.expand(batch, 3), 1, generator=g).squeeze(1)
            x[:, t] = succ[x[:, t - 1], c]
        yield x


@pytest.fixture(scope="session")
def trained_ckpt(tmp_path_factory):
    """A tiny model trained for a few seconds on a Markov chain, saved as a checkpoint
    folder (float64), so that drafts are accepted often enough to exercise every path."""
    cfg = tiny_config()
    model = random_model(cfg, seed=0, std=0.1)
    train_steps(model, markov_batches(cfg.vocab_size, 60), lr=1e-2)
    folder = tmp_path_factory.mktemp("trained")
    save_checkpoint(model.double(), folder)
    return folder
