"""A reduced draft vocabulary (--speculative-token-map): the drafter proposes only the
map's tokens, decoding stays lossless (greedy equal to plain, sampled following the
target's distribution), and bad maps are refused naming the file."""

import shutil

import numpy as np
import pytest
import torch

from branchspec.checkpoint import save_checkpoint
from branchspec.checkpoint import load_checkpoint
from branchspec.config import SamplingParams, SpecConfig, tiny_config
from branchspec.llm import LLM
from branchspec.model.init import random_model
from branchspec.speculative.draft_vocab import DRAFT_VOCAB_FILE, DraftVocab, DraftVocabError
from branchspec.train.draft_vocab import count_predictions
from conftest import markov_batches
from helpers import chi2_p_value, second_and_third_token_counts

SPECS = [SpecConfig.chain(6), SpecConfig(3, 2, 6), SpecConfig(2, 4, 7)]


@pytest.fixture(scope="module")
def mapped_ckpt(trained_ckpt, tmp_path_factory):
    """The trained tiny checkpoint with a 32-token map (half its vocabulary) of its
    target's most frequent predictions on its own kind of text."""
    folder = tmp_path_factory.mktemp("mapped")
    for f in trained_ckpt.iterdir():
        shutil.copy(f, folder / f.name)
    model = load_checkpoint(trained_ckpt, "float64")
    text = next(markov_batches(64, 1, batch=4, length=256, seed=11)).flatten().numpy()
    counts = count_predictions(model, text, seq_len=128, batch_size=4)
    assert int(counts.sum()) == (len(text) // 128) * 128        # one prediction per position
    DraftVocab.most_frequent(counts.double(), 32).save(folder)
    return folder


@pytest.fixture(scope="module")
def prompts():
    data = next(markov_batches(64, 1, batch=5, length=200, seed=5))
    return [data[i, :n].tolist() for i, n in enumerate((5, 126, 40, 3, 190))]


def test_the_checkpoints_map_is_used_and_drafts_only_its_tokens(mapped_ckpt, prompts, monkeypatch):
    llm = LLM(mapped_ckpt, dtype="float64", max_batch_size=8)
    vocab = DraftVocab.of_folder(mapped_ckpt, llm.config.vocab_size)
    assert llm.engine.drafter.vocab_size == 32 and vocab.size == 32
    allowed = set(vocab.token_ids.tolist())
    drafted = []
    propose = llm.engine.drafter.propose

    def recording(*args, **kwargs):
        tree = propose(*args, **kwargs)
        drafted.extend(tree.tokens[:, 1:].flatten().tolist())
        return tree

    monkeypatch.setattr(llm.engine.drafter, "propose", recording)
    llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True), spec=SpecConfig(3, 2, 6))
    assert drafted and set(drafted) <= allowed
    full = LLM(mapped_ckpt, dtype="float64", max_batch_size=8, speculative_token_map=False)
    assert full.engine.drafter.vocab_size == full.config.vocab_size


@pytest.mark.parametrize("spec", SPECS, ids=["chain6", "tree3x2", "tree2x4"])
def test_greedy_with_a_map_equals_plain(mapped_ckpt, prompts, spec):
    llm = LLM(mapped_ckpt, dtype="float64", max_batch_size=8)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (20, 37, 5, 60, 11)]
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    outs = llm.generate(prompts, params, spec=spec)
    assert [o.token_ids for o in outs] == plain
    assert llm.last_stats.accept_length > 1.15, "drafts were hardly accepted: the test would prove little"


def test_sampled_with_a_map_follows_the_target_distribution(tmp_path):
    """The chi-square test of test_spec_decode, the drafter limited to 4 of the 8 tokens:
    the target's tokens outside the map still come out as often as the target says."""
    cfg = tiny_config(vocab_size=8, compress_ratios=(0, 4, 0, 4), index_topk=2)
    model = random_model(cfg, seed=4, dtype="float64", std=0.25)
    save_checkpoint(model, tmp_path)
    DraftVocab(torch.tensor([3, 5, 6, 0])).save(tmp_path)
    llm = LLM(tmp_path, dtype="float64", max_batch_size=64)
    prompt = [3, 5, 7, 6, 4, 5, 3]
    n = 1500
    params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=3000 + i) for i in range(n)]
    outs = llm.generate([prompt] * n, params, spec=SpecConfig(2, 2, 4))
    assert sum(o.num_rounds for o in outs) < 2 * n, "no round accepted a draft"
    counts, expected = second_and_third_token_counts(model, prompt, outs)
    assert chi2_p_value(counts, expected) > 1e-3
    # Tokens the drafter can never propose are still emitted (as bonus tokens).
    assert counts[[1, 2, 4, 7]].sum() > 0


def test_a_topk_wider_than_the_map_is_refused(mapped_ckpt, prompts):
    llm = LLM(mapped_ckpt, dtype="float64", max_batch_size=8)
    with pytest.raises(ValueError, match="drafter's vocabulary of 32"):
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), spec=SpecConfig(2, 33, 40))
    assert llm.generate(prompts[:1], SamplingParams(max_tokens=4), spec=SpecConfig(3, 2, 6))[0].token_ids


@pytest.mark.parametrize("tensors, message", [
    ({"token_ids": torch.tensor([1, 2, 64])}, "outside the model's vocabulary"),
    ({"token_ids": torch.tensor([1, 2, 2])}, "more than once"),
    ({"token_ids": torch.zeros(0, dtype=torch.int64)}, "empty"),
    ({"ids": torch.tensor([1, 2])}, "'token_ids'"),
    ({"token_ids": torch.tensor([1.0, 2.0])}, "'token_ids'"),
])
def test_bad_maps_are_refused_naming_the_file(tmp_path, tensors, message):
    from safetensors.torch import save_file

    path = tmp_path / DRAFT_VOCAB_FILE
    save_file(tensors, str(path))
    with pytest.raises(DraftVocabError, match=message) as info:
        DraftVocab.load(path, 64)
    assert str(path) in str(info.value)


def test_unreadable_or_missing_maps_name_the_file(tmp_path, trained_ckpt):
    path = tmp_path / "map.safetensors"
    path.write_bytes(b"not safetensors")
    with pytest.raises(DraftVocabError, match="not a readable safetensors file"):
        DraftVocab.load(path, 64)
    with pytest.raises(DraftVocabError, match="no such draft vocabulary file"):
        LLM(trained_ckpt, speculative_token_map=tmp_path / "missing.safetensors")
    with pytest.raises(TypeError, match="speculative_token_map"):
        LLM(trained_ckpt, speculative_token_map=16)


def test_most_frequent_keeps_the_highest_counts_in_order():
    counts = torch.tensor([5.0, 0.0, 9.0, 5.0, 1.0])
    assert DraftVocab.most_frequent(counts, 3).token_ids.tolist() == [2, 0, 3]
    with pytest.raises(ValueError, match="size"):
        DraftVocab.most_frequent(counts, 6)
    assert np.array_equal(DraftVocab.most_frequent(counts, 5).token_ids.sort().values.numpy(), np.arange(5))
