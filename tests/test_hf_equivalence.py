"""branchspec against an implementation written elsewhere: transformers'
`DeepseekV4ForCausalLM` (5.23.0), on a random tiny config with all three layer kinds,
YaRN, grouped output, 2 hyper-connection streams and MoE with a hash layer, in float64.

transformers computes norms, RoPE tables, softmaxes and the mHC in float32 even in a
float64 model, so its logits carry float32 rounding: the checks against it as it ships
use 1e-5. With those float32 islands lifted to float64 (`exact_transformers`) the two
implementations agree to 1e-12, which is what lets every execution path of branchspec
(chunked prefill, token-by-token decode, each root-to-node path of a verified tree) be
compared with transformers' plain full forward over the same tokens.
"""

from __future__ import annotations


import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")

from branchspec import LLM, SamplingParams, SpecConfig  # noqa: E402
from branchspec.model.layers import rope_tables  # noqa: E402
from branchspec.model.metadata import tree_meta  # noqa: E402
from helpers import feed, lifted_float32_islands, new_cache  # noqa: E402

V = 64
LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
               "compressed_sparse_attention"]


def hf_config(**overrides):
    kw = dict(vocab_size=V, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, head_dim=16,
              partial_rotary_factor=0.5, q_lora_rank=16, sliding_window=8, index_n_heads=32, index_head_dim=8,
              index_topk=3, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
              n_shared_experts=1, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
              mlp_layer_types=["hash_moe", "moe", "moe", "moe"], swiglu_limit=10.0, o_groups=2, o_lora_rank=8,
              hc_mult=2, rope_theta=10000.0, compress_rope_theta=160000.0,
              rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                               "beta_fast": 32, "beta_slow": 1},
              layer_types=LAYER_TYPES, max_position_embeddings=1024, rms_norm_eps=1e-6,
              bos_token_id=0, eos_token_id=1, pad_token_id=2)
    kw.update(overrides)
    cfg = transformers.DeepseekV4Config(**kw)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def random_hf_model(cfg, seed: int = 0, std: float = 0.15):
    """transformers' model with every weight random (its own init leaves sinks, biases,
    APE and the hash table at zero, which would hide mistakes)."""
    model = transformers.DeepseekV4ForCausalLM(cfg).double().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 1.0 if name.endswith(("norm.weight", "scale")) else 0.0
            p.copy_(centre + torch.randn(p.shape, generator=g, dtype=torch.float64) * (std if p.dim() > 1 else 0.1))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.rand(b.shape[0], cfg.n_routed_experts, generator=g).argsort(-1)[:, : b.shape[1]])
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g, dtype=torch.float64) * 0.1)
    return model


@pytest.fixture(scope="module")
def hf_model():
    return random_hf_model(hf_config())


@pytest.fixture(scope="module")
def hf_folder(hf_model, tmp_path_factory):
    """A folder written by save_pretrained, sharded (model.safetensors.index.json)."""
    folder = tmp_path_factory.mktemp("hf_v4")
    hf_model.save_pretrained(folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


@pytest.fixture(scope="module")
def llm(hf_folder):
    return LLM(hf_folder, dtype="float64", max_batch_size=4, page_size=4, max_model_len=512)


@pytest.fixture
def exact_transformers(hf_model, llm):
    """Lift transformers' float32 islands to float64 for this test (see
    `helpers.lifted_float32_islands`)."""
    with lifted_float32_islands(hf_model, rope_tables(llm.model.cfg)):
        yield


def ids_of(length: int, seed: int) -> list[int]:
    return torch.randint(3, V, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0]                      # [T, V]


# -- loading ----------------------------------------------------------------------------------

def test_hf_folder_loads_with_its_config(llm, hf_model):
    cfg = llm.model.cfg
    assert cfg.compress_ratios == (0, 4, 128, 4) and cfg.hc_mult == 2 and cfg.num_experts == 4
    assert cfg.num_hash_layers == 1 and cfg.o_groups == 2 and cfg.yarn_factor == 16.0
    assert cfg.num_mtp_layers == 0, "transformers' save_pretrained drops the MTP block"


def test_prompt_logprobs_equal_transformers(llm, hf_model):
    """The issue's acceptance check: a save_pretrained folder, loaded by LLM(), gives the
    prompt logprobs transformers gives, to 1e-5 (transformers as it ships)."""
    ids = ids_of(300, seed=1)
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    ref = torch.log_softmax(hf_logits(hf_model, ids), dim=-1)
    assert out.prompt_logprobs[0] is None
    for p in range(1, len(ids)):
        got = out.prompt_logprobs[p]
        assert ids[p] in got
        for token, value in got.items():
            assert abs(value - ref[p - 1, token].item()) < 1e-5, (p, token)


def test_full_forward_logits(llm, hf_model, exact_transformers):
    ids = ids_of(300, seed=2)
    with torch.no_grad():
        ours = llm.model.full_forward(torch.tensor([ids]))[0].logits[0]
    torch.testing.assert_close(ours, hf_logits(hf_model, ids), atol=1e-12, rtol=0)


def test_full_forward_logits_against_float32_islands(llm, hf_model):
    ids = ids_of(300, seed=3)
    with torch.no_grad():
        ours = llm.model.full_forward(torch.tensor([ids]))[0].logits[0]
    torch.testing.assert_close(ours, hf_logits(hf_model, ids), atol=1e-5, rtol=0)


# -- every execution path against transformers' full forward ----------------------------------

@pytest.mark.parametrize("chunk", [1, 5, 64, 300])
def test_chunked_prefill_and_decode(llm, hf_model, exact_transformers, chunk):
    """chunk 1 is token-by-token decode; 300 the whole prompt in one chunk."""
    ids = ids_of(300, seed=4)
    model = llm.model
    cache = new_cache(model, max_seqs=1)
    cache.add(0)
    ours = feed(model, cache, 0, ids, 0, chunk=chunk)
    torch.testing.assert_close(ours, hf_logits(hf_model, ids), atol=1e-12, rtol=0)


def _path(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


# Committed lengths that put C4 completions at every depth and a C128 block boundary at
# the root and just after it.
@pytest.mark.parametrize("L", [3, 5, 6, 8, 125, 126, 127, 128])
def test_tree_paths(llm, hf_model, exact_transformers, L):
    model = llm.model
    g = torch.Generator().manual_seed(L)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 6, 8]          # depth up to 5, branching at 0, 1 and 3
    tokens = torch.randint(3, V, (len(parents),), generator=g).tolist()
    prefix = ids_of(L, seed=100 + L)
    cache = new_cache(model, max_seqs=1)
    cache.add(0)
    feed(model, cache, 0, prefix, 0, chunk=64)
    meta = tree_meta(torch.tensor([parents]), torch.tensor([L]), model.cfg.compressed_kinds)
    cache.reserve(0, L + len(parents))
    with torch.no_grad():
        out = model(torch.tensor([tokens]), meta, cache.gather([0], torch.tensor([L])))
    for node in range(len(parents)):
        path_ids = prefix + [tokens[i] for i in _path(parents, node)]
        torch.testing.assert_close(out.logits[0, node], hf_logits(hf_model, path_ids)[-1], atol=1e-12, rtol=0,
                                   msg=lambda m: f"node {node}, L={L}: {m}")


# -- generation -------------------------------------------------------------------------------

def test_greedy_generation_equals_transformers(llm, hf_model, exact_transformers):
    prompts = [ids_of(n, seed=10 + n) for n in (5, 40, 126)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                    eos_token_id=None, pad_token_id=2)[0, len(prompt):].tolist()
        assert out.token_ids == ref


def test_checkpoint_without_mtp_decodes_plainly_and_names_the_missing_drafter(llm):
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    with pytest.raises(ValueError, match="MTP"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), spec=SpecConfig(3, 2, 6))
    free = llm.engine.cache.num_free_pages()
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids
    assert llm.engine.cache.num_free_pages() == free


def test_every_eos_of_an_hf_eos_list_stops(hf_model, tmp_path):
    hf_model.config.eos_token_id = [1, 5]
    try:
        hf_model.save_pretrained(tmp_path)
    finally:
        hf_model.config.eos_token_id = 1
    llm = LLM(tmp_path, dtype="float64", max_batch_size=1, max_model_len=64)
    assert {1, 5} <= llm.engine.stop_token_ids


def test_hf_tokenizer_smaller_than_the_padded_vocabulary(hf_model, tmp_path):
    """Real V4 checkpoints pad the embedding past the tokenizer; generated ids in the
    padding have no text and must not break decoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf_model.save_pretrained(tmp_path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(
        vocab_size=V, special_tokens=["<s>", "</s>", "<pad>"], initial_alphabet=[]))
    assert tok.get_vocab_size() < V
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    llm = LLM(tmp_path, dtype="float64", max_batch_size=1, max_model_len=64)
    out = llm.generate("hello", SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert len(out.token_ids) == 12
    assert out.text == llm.tokenizer.decode([i for i in out.token_ids if i < tok.get_vocab_size()])
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("scoring_func", ["sigmoid"])
def test_other_router_scores(scoring_func, tmp_path):
    """The default config routes by sqrtsoftplus; sigmoid too. (transformers 5.23.0 cannot
    build a softmax-scored V4: its activation table has no "softmax"; see
    test_softmax_gate_follows_its_definition.)"""
    hf = random_hf_model(hf_config(scoring_func=scoring_func), seed=5)
    hf.save_pretrained(tmp_path)
    llm = LLM(tmp_path, dtype="float64", max_batch_size=1, max_model_len=512)
    assert llm.model.cfg.scoring_func == scoring_func
    ids = ids_of(200, seed=6)
    with torch.no_grad():
        ours = llm.model.full_forward(torch.tensor([ids]))[0].logits[0]
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=1e-5, rtol=0)


def test_softmax_gate_follows_its_definition():
    """DeepSeek's softmax scoring: softmax over experts, top-k of score + bias, weights the
    chosen scores (not renormalised when norm_topk_prob is off, as DeepSeek's gate does)."""
    from branchspec.config import tiny_v4_config
    from branchspec.model.layers import Gate

    cfg = tiny_v4_config(scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=2.0)
    gate = Gate(cfg, hashed=False).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g, dtype=torch.float64))
        gate.bias.copy_(torch.randn(gate.bias.shape, generator=g, dtype=torch.float64))
    x = torch.randn(7, cfg.d_model, generator=g, dtype=torch.float64)
    weights, indices = gate(x, torch.zeros(7, dtype=torch.long))
    scores = torch.softmax(x @ gate.weight.T, dim=-1)
    expected = (scores + gate.bias).topk(cfg.num_experts_per_tok, dim=-1).indices
    assert torch.equal(indices, expected)
    torch.testing.assert_close(weights, 2.0 * scores.gather(1, expected), atol=1e-15, rtol=0)
