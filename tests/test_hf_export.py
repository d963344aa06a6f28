"""branchspec -> Hugging Face export, checked against transformers' own loader.

A random branchspec model (every weight random, biases, sinks and APE included, so a
misplaced tensor shows), exported with `export_hf`, must load in transformers'
`DeepseekV4ForCausalLM.from_pretrained` with nothing missing, and give branchspec's logits:
to 1e-10 with transformers' float32 islands lifted to float64, to 1e-5 as it ships. This
at the tiny test shape and at v4-mini-v2's (the next default model's) shape. The exported
folder also reloads in branchspec, MTP drafter included, bit for bit.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch
from safetensors import safe_open

transformers = pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")

from branchspec import LLM, SamplingParams, SpecConfig  # noqa: E402
from branchspec.checkpoint import (  # noqa: E402
    ExportError, detect_format, export_hf, export_hf_folder, load_checkpoint, save_checkpoint,
)
from branchspec.checkpoint.export import hf_config_from_branchspec, hf_equivalent_config  # noqa: E402
from branchspec.checkpoint.folder import FORMAT_HF  # noqa: E402
from branchspec.checkpoint.hf_config import hf_config_to_branchspec  # noqa: E402
from branchspec.config import ModelConfig, tiny_config, tiny_v4_config, v4_mini_v2_config  # noqa: E402
from branchspec.data.tokenizer import train_tokenizer  # noqa: E402
from branchspec.model.init import random_model  # noqa: E402
from branchspec.model.layers import rope_tables  # noqa: E402
from helpers import lifted_float32_islands  # noqa: E402

# v4-mini-v2's shape with a smaller vocabulary (the embedding, head and hash table scale
# with it; nothing else does).
MINI_V2 = dict(vocab_size=512)


def fully_random(model, seed: int, std: float):
    """Every weight random: branchspec's init zeros sinks, APE, mHC biases and routing
    biases, which would hide a tensor written under the wrong name. Norm weights and mHC
    scales are centred on 1; the hash table stays as init_weights drew it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 1.0 if name.endswith(("norm.weight", "_scale")) else 0.0
            spread = std if p.dim() > 1 else 0.1
            p.copy_(centre + torch.randn(p.shape, generator=g, dtype=torch.float64) * spread)
    return model


def random_v4(cfg: ModelConfig, seed: int = 0, std: float = 0.1):
    return fully_random(random_model(cfg, seed=seed, dtype="float64"), seed + 1, std)


def load_in_transformers(folder):
    """transformers' model from the folder (eager attention and experts, float64) and its
    loading report."""
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        folder, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True)
    return model.eval(), info


def ids_of(length: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@contextmanager
def index_ties_by_entry():
    """transformers' lightning indexer with branchspec's tie rule.

    Index scores are sums of ReLUs, so an entry every indexer head scores <= 0 gets
    exactly 0, and with 2 or 4 heads (tiny, v4-mini-v2) several entries tie at the top-k
    boundary. branchspec keeps the lowest entry numbers (a stable sort); transformers'
    ``Tensor.topk``, which in its model only the indexer calls, leaves the order of ties
    unspecified. Neither is wrong, but they attend to different entries; so transformers'
    ``topk`` becomes a stable sort here (the same set whenever there is no tie).
    test_hf_equivalence avoids the ties instead, with 32 indexer heads.
    """
    def stable_topk(self, k, dim=-1, largest=True, sorted=True):
        order = torch.sort(self, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "topk", stable_topk)
        yield


@torch.no_grad()
def both_logits(model, hf_model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(branchspec's, transformers') full-forward logits [T, V] over ids."""
    ours = model.full_forward(torch.tensor([ids]))[0].logits[0]
    with index_ties_by_entry():
        theirs = hf_model(torch.tensor([ids])).logits[0]
    return ours, theirs


# -- config -----------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [tiny_v4_config, v4_mini_v2_config])
def test_config_round_trip(make):
    """The HF config reads back as the same model; only fields that mean nothing for it
    (the dense FFN width beside experts) take the reader's value."""
    cfg = make()
    d = json.loads(json.dumps(hf_config_from_branchspec(cfg, dtype=torch.bfloat16)))
    back = ModelConfig(**hf_config_to_branchspec(d))
    assert back == hf_equivalent_config(cfg)
    assert back.ffn_hidden == cfg.moe_hidden and hf_equivalent_config(back) == back
    assert d["model_type"] == "deepseek_v4" and d["architectures"] == ["DeepseekV4ForCausalLM"]
    assert d["dtype"] == "bfloat16" and d["tie_word_embeddings"] is False
    hf = transformers.DeepseekV4Config.from_dict(d)      # transformers reads it as written
    assert hf.layer_types == d["layer_types"] and hf.mlp_layer_types[0] == "hash_moe"
    assert hf.qk_rope_head_dim == cfg.rope_dim
    assert hf.rope_parameters["compress"]["rope_type"] == "yarn"
    assert hf.rope_parameters["compress"]["attention_factor"] == 1.0


def test_config_round_trip_without_yarn_and_with_an_eos_list():
    cfg = tiny_v4_config(yarn_factor=1.0, compress_rope_theta=None, num_mtp_layers=0, num_hash_layers=0)
    d = hf_config_from_branchspec(cfg, extra_stop_ids=[7, cfg.eos_token_id, 9])
    assert d["eos_token_id"] == [cfg.eos_token_id, 7, 9]
    assert d["rope_parameters"]["compress"] == {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                                "partial_rotary_factor": 0.5}
    assert ModelConfig(**hf_config_to_branchspec(d)) == hf_equivalent_config(cfg)


@pytest.mark.parametrize("overrides, field", [
    (dict(num_experts=0, num_experts_per_tok=0, moe_hidden=0, num_hash_layers=0), "num_experts"),
    (dict(num_shared_experts=0), "num_shared_experts"),
    (dict(hc_mult=0), "hc_mult"),
    (dict(o_groups=0), "o_groups"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(swiglu_limit=0.0), "swiglu_limit"),
])
def test_refuses_what_transformers_cannot_express(overrides, field):
    with pytest.raises(ExportError, match=field):
        hf_config_from_branchspec(tiny_v4_config(**overrides))


def test_refusal_names_every_field_and_writes_nothing(tmp_path):
    model = random_model(tiny_config())      # the plain model: dense FFN, no mHC, one W_o
    with pytest.raises(ExportError) as e:
        export_hf(model, tmp_path / "out")
    assert all(f in str(e.value) for f in ("num_experts", "hc_mult", "o_groups"))
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


# -- tiny shape: against transformers ---------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return random_v4(tiny_v4_config(), seed=0)


@pytest.fixture(scope="module")
def tiny_folder(tiny, tmp_path_factory):
    return export_hf(tiny, tmp_path_factory.mktemp("export") / "tiny")


@pytest.fixture(scope="module")
def tiny_hf(tiny_folder):
    return load_in_transformers(tiny_folder)


def test_transformers_loads_every_tensor(tiny_folder, tiny_hf):
    hf, info = tiny_hf
    assert detect_format(tiny_folder) == FORMAT_HF
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info.get("error_msgs")
    # The MTP block is in the file, in transformers' spelling; transformers has no MTP
    # module and skips it.
    with safe_open(str(tiny_folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"mtp.0.self_attn.q_a_proj.weight", "mtp.0.mlp.experts.gate_up_proj", "mtp.0.e_proj.weight"} <= names
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"])
    assert hf.config.num_nextn_predict_layers == 1 and hf.dtype == torch.float64
    assert hf.model.layers[0].mlp.gate.tid2eid.dtype == torch.long


def test_tiny_logits_equal_transformers_exactly(tiny, tiny_hf):
    hf = tiny_hf[0]
    ids = ids_of(300, tiny.cfg.vocab_size, seed=1)
    with lifted_float32_islands(hf, rope_tables(tiny.cfg)):
        ours, ref = both_logits(tiny, hf, ids)
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=0)


def test_tiny_logits_equal_transformers_as_shipped(tiny, tiny_hf):
    ours, ref = both_logits(tiny, tiny_hf[0], ids_of(300, tiny.cfg.vocab_size, seed=2))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


# -- v4-mini-v2 shape -------------------------------------------------------------------------

def test_v4_mini_v2_shape_equals_transformers(tmp_path):
    """The next default model's shape: 6 layers of all three kinds, window 64, indexer
    top-32, 4 experts of 256, mHC with 4 Sinkhorn iterations, YaRN from 128."""
    model = random_v4(v4_mini_v2_config(**MINI_V2), seed=3, std=0.02)
    hf, info = load_in_transformers(export_hf(model, tmp_path / "mini"))
    assert not info["missing_keys"] and not info["mismatched_keys"]
    ids = ids_of(300, model.cfg.vocab_size, seed=4)   # > 128: C128 entries and indexer pruning
    with lifted_float32_islands(hf, rope_tables(model.cfg)):
        ours, ref = both_logits(model, hf, ids)
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=0)
    ours, ref = both_logits(model, hf, ids)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_default_checkpoint_equals_transformers(tmp_path):
    """The shipped default model, trained weights and all, exported: transformers gives its
    logits on real text long enough to fill C128 blocks and prune the indexer's choice."""
    from branchspec.llm import DEFAULT_CHECKPOINT

    llm = LLM(DEFAULT_CHECKPOINT, dtype="float64")
    hf, info = load_in_transformers(export_hf_folder(DEFAULT_CHECKPOINT, tmp_path / "default"))
    assert not info["missing_keys"] and not info["mismatched_keys"]
    text = ("Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many "
            "clips in May. How many clips did Natalia sell altogether in April and May?\nAnswer: ") * 10
    ids = llm.tokenizer.encode(text)[:300]
    assert len(ids) == 300
    with lifted_float32_islands(hf, rope_tables(llm.model.cfg)):
        ours, ref = both_logits(llm.model, hf, ids)
    torch.testing.assert_close(ours, ref, atol=1e-9, rtol=0)


# -- back into branchspec ---------------------------------------------------------------------

def test_exported_folder_reloads_bit_for_bit_with_its_drafter(tiny, tiny_folder):
    back = load_checkpoint(tiny_folder, "float64")
    assert back.cfg == hf_equivalent_config(tiny.cfg) and back.cfg.num_mtp_layers == 1
    original = tiny.state_dict()
    assert back.state_dict().keys() == original.keys()
    for name, t in back.state_dict().items():
        assert torch.equal(t, original[name]), name


def test_exported_folder_generates_the_same_tokens(tiny, tiny_folder, tmp_path):
    """LLM(exported) decodes as LLM(branchspec checkpoint) does, plainly and with MTP
    speculation (greedy: the same tokens either way)."""
    save_checkpoint(tiny, tmp_path / "bs")
    kw = dict(dtype="float64", max_batch_size=2, page_size=4, max_model_len=256)
    ours, exported = LLM(tmp_path / "bs", **kw), LLM(tiny_folder, **kw)
    assert exported.model.cfg.num_mtp_layers == 1
    prompts = [ids_of(n, tiny.cfg.vocab_size, seed=10 + n) for n in (5, 40)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in ours.generate(prompts, params)]
    assert [o.token_ids for o in exported.generate(prompts, params)] == want
    assert [o.token_ids for o in exported.generate(prompts, params, spec=SpecConfig(3, 2, 6))] == want
    assert exported.last_stats.num_rounds > 0          # the drafter ran


def test_export_folder_carries_the_tokenizer_and_stop_ids(tmp_path):
    tok = train_tokenizer(["the quick brown fox jumps over the lazy dog"] * 20, vocab_size=300)
    cfg = tiny_v4_config(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                         pad_token_id=tok.pad_id)
    src = save_checkpoint(random_v4(cfg, seed=5), tmp_path / "src")
    tok.save(src)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_id, 5]}))
    out = export_hf_folder(src, tmp_path / "out", dtype="float64")
    assert {p.name for p in out.iterdir()} == {"config.json", "generation_config.json", "model.safetensors",
                                               "tokenizer.json", "tokenizer_config.json"}
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == [tok.eos_id, 5]
    kw = dict(dtype="float64", max_batch_size=1, max_model_len=128)
    a, b = LLM(src, **kw), LLM(out, **kw)
    assert {tok.eos_id, 5} <= b.engine.stop_token_ids
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    assert a.generate("the quick", params)[0].text == b.generate("the quick", params)[0].text


def test_export_refuses_a_non_empty_folder(tiny, tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not an empty folder"):
        export_hf(tiny, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_cli_convert_to_hf(tiny, tmp_path, capsys):
    from branchspec.cli import main

    src = save_checkpoint(tiny, tmp_path / "src")
    assert main(["convert", str(src), str(tmp_path / "hf"), "--to", "hf", "--dtype", "float64"]) == 0
    assert "Hugging Face" in capsys.readouterr().out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v4" and config["architectures"] == ["DeepseekV4ForCausalLM"]
    plain = main(["convert", str(src), str(tmp_path / "hf"), "--to", "hf"])
    assert plain == 2 and "not an empty folder" in capsys.readouterr().err
