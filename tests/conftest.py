import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# No test reaches the network. huggingface_hub reads this once, when it is first imported
# (lazily, by the MBPP loader), and subprocesses inherit it; tests of the download path
# replace the downloader instead.
os.environ["HF_HUB_OFFLINE"] = "1"

# Under pytest-xdist (pyproject's addopts) the workers share the machine's cores: each takes
# its share for torch's threads, and the processes its tests start inherit it (OpenMP
# threads oversubscribed spin against each other). Tests of thread settings set their own.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _SHARE = max(1, torch.get_num_threads() // _WORKERS)
    torch.set_num_threads(_SHARE)
    os.environ.setdefault("OMP_NUM_THREADS", str(_SHARE))

from branchspec.config import tiny_config, tiny_v4_config  # noqa: E402
from branchspec.checkpoint import save_checkpoint  # noqa: E402
from branchspec.data.workloads import MBPP_ENV_VAR  # noqa: E402
from branchspec.model.init import random_model  # noqa: E402
from branchspec.train.losses import train_steps  # noqa: E402

# The real MBPP, for the tests that read it: library code has no default location, so this
# project's copy (../shared/data/mbpp.jsonl beside the checkout, found from this file, not
# the working directory) is named through the environment when it exists. Without it
# those tests skip, and the rest use MBPP-shaped files of their own.
SHARED_MBPP = Path(__file__).resolve().parents[2] / "shared" / "data" / "mbpp.jsonl"
if SHARED_MBPP.is_file():
    os.environ.setdefault(MBPP_ENV_VAR, str(SHARED_MBPP))


def pytest_collection_modifyitems(items):
    """The order pytest-xdist hands test files to its workers (`--dist loadfile
    --no-loadscope-reorder`): the modules marked `compiles` first, since compiling their
    steps from scratch is the longest thing the suite does and the wall time is at least
    when it started plus that; then the rest by their number of tests, most first
    (xdist's own heuristic), so that short files fill the end. Each file's tests stay
    together, in their order."""
    counts = Counter(item.path for item in items)
    items.sort(key=lambda item: (item.get_closest_marker("compiles") is None, -counts[item.path]))


# The two model families every equivalence test runs on: the plain model (one residual
# stream, dense FFN, one RoPE) and the real V4 architecture (YaRN on compressed layers,
# grouped output, 2 hyper-connection streams, MoE with a hash layer). Eight indexer heads
# keep exact ReLU ties in the index scores out of the way.
ARCHS = {"plain": lambda: tiny_config(), "v4": lambda: tiny_v4_config(index_num_heads=8)}


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module (tiny matmuls gain nothing from a second one, and
    shared cores lose a lot to contention); restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session", params=sorted(ARCHS))
def tiny64(request):
    """A random float64 tiny model with weights large enough for peaked, tie-free scores."""
    torch.set_grad_enabled(True)
    return random_model(ARCHS[request.param](), seed=3, dtype="float64", std=0.3)


def mbpp_rows(task_ids=range(1, 975)) -> list[dict]:
    """MBPP-shaped rows (the fields of mbpp.jsonl and of the hub's parquet files), one small
    distinct task per id, so no test needs the real data set."""
    return [
        {"task_id": t, "text": f"Write a function that multiplies a number by {t}.",
         "code": f"def times_{t}(x):\r\n    return x * {t}",
         "test_list": [f"assert times_{t}(2) == {2 * t}", f"assert times_{t}(0) == 0"],
         "test_setup_code": "", "challenge_test_list": []}
        for t in task_ids
    ]


def write_mbpp(path: Path, task_ids=range(1, 975)) -> Path:
    """An MBPP-shaped mbpp.jsonl at ``path`` (the standard 974 tasks by default)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in mbpp_rows(task_ids)))
    return path


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


@pytest.fixture(scope="session", params=sorted(ARCHS))
def trained_ckpt(request, tmp_path_factory):
    """A tiny model trained for a few seconds on a Markov chain, saved as a checkpoint
    folder (float64), so that drafts are accepted often enough to exercise every path."""
    cfg = ARCHS[request.param]()
    model = random_model(cfg, seed=0, std=0.1)
    train_steps(model, markov_batches(cfg.vocab_size, 60), lr=1e-2)
    folder = tmp_path_factory.mktemp("trained")
    save_checkpoint(model.double(), folder)
    return folder

