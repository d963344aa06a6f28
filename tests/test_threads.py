"""MKL on one thread for single-row steps (`execution/threads.py`): the switch is scoped
to its block and its thread, applies to one-row CPU steps only, and decoding gives the
same tokens with it as without."""

from __future__ import annotations

import threading

import pytest
import torch

from branchspec import LLM, SamplingParams
from branchspec.checkpoint import save_checkpoint
from branchspec.config import tiny_config
from branchspec.execution import threads
from branchspec.execution.threads import mkl_local_threads_available, mkl_max_threads, one_row_products
from branchspec.model.init import random_model

needs_mkl = pytest.mark.skipif(not mkl_local_threads_available(), reason="torch without MKL's thread-local setting")


@pytest.fixture(autouse=True)
def two_threads():
    """torch, and with it this thread's MKL, on two threads; restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


@needs_mkl
def test_one_row_runs_mkl_on_one_thread_and_restores():
    before = mkl_max_threads()
    assert before == 2
    with one_row_products(1):
        assert mkl_max_threads() == 1
    assert mkl_max_threads() == before


@needs_mkl
def test_restored_after_an_error():
    with pytest.raises(ValueError):
        with one_row_products(1):
            raise ValueError("a failed step")
    assert mkl_max_threads() == 2


@needs_mkl
@pytest.mark.parametrize("rows, device", [(2, "cpu"), (64, "cpu"), (1, "cuda")])
def test_other_steps_keep_every_thread(rows, device):
    with one_row_products(rows, device):
        assert mkl_max_threads() == 2


@needs_mkl
def test_switched_off(monkeypatch):
    """Negative control: with the bound at 0 a one-row step keeps every thread."""
    monkeypatch.setattr(threads, "ONE_THREAD_MAX_ROWS", 0)
    with one_row_products(1):
        assert mkl_max_threads() == 2


@needs_mkl
def test_other_threads_unaffected():
    """The setting is the calling thread's: a server's other threads keep theirs."""
    seen = []
    inside, done = threading.Event(), threading.Event()

    def other():
        inside.wait()
        seen.append(mkl_max_threads())
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with one_row_products(1):
        inside.set()
        done.wait()
    t.join()
    assert seen == [2]


def test_decoding_the_same_either_way(monkeypatch, tmp_path):
    """Plain decoding at batch 1 (MKL on one thread) and at batch 2 (every thread), and
    batch 1 with the switch off, give the same greedy tokens."""
    llm = LLM(save_checkpoint(random_model(tiny_config(), seed=0, std=0.3), tmp_path), seed=0)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [[0] + [3 + (7 * j) % 60 for j in range(20)], [0] + [5 + (3 * j) % 50 for j in range(31)]]
    one = [llm.generate([p], params)[0].token_ids for p in prompts]
    both = [o.token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setattr(threads, "ONE_THREAD_MAX_ROWS", 0)
    off = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert one == both == off
