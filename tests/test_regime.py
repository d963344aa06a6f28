"""The paper's regime benchmark (`branchspec bench --regime`): its V4-Flash-shaped config,
the model it builds without a float64 copy, that its measured calls compute what the
reference forward does (at a tiny size), the projection's arithmetic by hand, and that a
run writes its files. No speed checks: speed is measured by the benchmark itself."""

import json
import math

import pytest
import torch

from branchspec.bench import cli
from branchspec.bench.projection import (
    MEASURED,
    ROUTED,
    at_depth,
    expert_correction,
    experts_touched,
    full_depth_costs,
    per_pair,
    project,
    regularities,
    round_seconds,
    speedup,
    study_accept_lengths,
    tree_gain,
)
from branchspec.bench.regime import DepthCosts, RegimePlan, expert_token_counts, run, tree_parents, tree_spec
from branchspec.cache.paged import PagedState
from branchspec.config.model import V4_FLASH_LAYERS, tiny_v4_config, v4_flash_slice_config
from branchspec.execution.eager import EagerExecutor
from branchspec.model.init import allocated_random_model, random_model
from branchspec.model.metadata import chain_meta
from branchspec.model.model import Transformer
from branchspec.speculative.profiling import RoundCalls

# V4-Flash's widths scaled down, everything else the slice's own (the layer pattern, MoE
# with every expert chosen, 4 -> 2 mHC streams, grouped output, the indexer pruning).
TINY_SLICE = dict(vocab_size=64, d_model=32, num_heads=2, head_dim=16, rope_dim=8, q_lora_rank=16, window=8,
                  index_num_heads=2, index_head_dim=8, index_topk=3, o_groups=2, o_lora_rank=8, hc_mult=2,
                  num_experts=2, num_experts_per_tok=2, moe_hidden=16, ffn_hidden=32, max_position=1024,
                  yarn_original_max_position=64)


def test_the_slice_has_v4_flash_layer_shapes():
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV4Config()
    cfg = v4_flash_slice_config(pairs=2)
    pairs = {"d_model": "hidden_size", "num_heads": "num_attention_heads", "head_dim": "head_dim",
             "rope_dim": "qk_rope_head_dim", "q_lora_rank": "q_lora_rank", "o_lora_rank": "o_lora_rank",
             "o_groups": "o_groups", "window": "sliding_window", "index_num_heads": "index_n_heads",
             "index_head_dim": "index_head_dim", "index_topk": "index_topk", "moe_hidden": "moe_intermediate_size",
             "num_experts_per_tok": "num_experts_per_tok", "hc_mult": "hc_mult", "vocab_size": "vocab_size",
             "num_shared_experts": "n_shared_experts", "num_mtp_layers": "num_nextn_predict_layers"}
    assert {ours: getattr(cfg, ours) for ours in pairs} == {ours: getattr(hf, theirs) for ours, theirs in pairs.items()}
    assert cfg.compress_ratios == (0, 0, 4, 128, 4, 128, 4) and cfg.num_layers == 7
    # every token runs as many routed experts as a V4-Flash token chooses
    assert cfg.num_experts == cfg.num_experts_per_tok == 6
    assert v4_flash_slice_config(20).num_layers == V4_FLASH_LAYERS == hf.num_hidden_layers
    # a layer pair's parameters, counted without allocating them (about 591M: C4 + C128)
    with torch.device("meta"):
        small, large = Transformer(v4_flash_slice_config(0)), Transformer(v4_flash_slice_config(1))
    pair = sum(p.numel() for p in large.parameters()) - sum(p.numel() for p in small.parameters())
    assert 5.5e8 < pair < 6.5e8
    with pytest.raises(ValueError, match="pairs .* must be an integer >= 0, got -1"):
        v4_flash_slice_config(-1)


def test_a_model_allocated_in_place_computes_what_random_model_does():
    cfg = tiny_v4_config()
    ref = random_model(cfg, dtype="float64")
    built = allocated_random_model(cfg, "float64", "cpu")
    assert built.embed.weight.dtype == torch.float64 and all(p.device.type == "cpu" for p in built.parameters())
    built.load_state_dict(ref.state_dict())
    ids = torch.randint(3, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    meta = chain_meta(torch.zeros(2, dtype=torch.long), 40, cfg.compressed_kinds)
    with torch.no_grad():
        want = ref(ids, meta).logits
        assert torch.equal(built(ids, meta).logits, want)
        # negative control: the RoPE tables it computes outside the meta device matter
        built.rope = {name: torch.zeros_like(t) for name, t in built.rope.items()}
        assert not torch.allclose(built(ids, meta).logits, want)


@pytest.mark.parametrize("D", [1, 5, 8])
def test_the_measured_verify_pass_equals_the_reference_forward(D):
    """Over a committed prompt, every node of the regime's verify tree gets the logits a
    full forward of the prompt and its ancestors gives (float64, the tiny slice)."""
    cfg = v4_flash_slice_config(1, **TINY_SLICE)
    model = allocated_random_model(cfg, "float64", "cpu", seed=3)
    B, P = 2, 37
    cache = PagedState(cfg, max_seqs=B, max_len=P + D + 2, dtype=torch.float64)
    ex = EagerExecutor(model, cache)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, cfg.vocab_size, (B, P), generator=gen)
    ids, L = [0, 1], torch.zeros(B, dtype=torch.long)
    for sid in ids:
        cache.add(sid)
        cache.reserve(sid, P + D + 1)
    with torch.no_grad():
        meta = chain_meta(L, P, cfg.compressed_kinds)
        out = ex.prefill(prompt, meta, ids, L)
        cache.commit(ids, meta, out.scratch, meta.valid)
        L = L + P
        tokens = torch.randint(3, cfg.vocab_size, (B, D), generator=gen)
        parents = tree_parents(D)
        calls = RoundCalls(ex, None, out.hidden[:, -1:], ids, L, gen)
        logits = calls.verify(parents, tokens)().out.logits                     # [B, D, V]

        def reference(parents_of):
            rows = []
            for j in range(D):
                path, k = [], j
                while k >= 0:
                    path.append(k)
                    k = parents_of[k]
                seq = torch.cat([prompt, tokens[:, path[::-1]]], dim=1)
                full = model(seq, chain_meta(torch.zeros(B, dtype=torch.long), seq.shape[1], cfg.compressed_kinds))
                rows.append(full.logits[:, -1])
            return torch.stack(rows, dim=1)

        torch.testing.assert_close(logits, reference(parents), rtol=1e-9, atol=1e-9)
        if D > 2:   # negative control: the same nodes read as a chain give other logits
            assert not torch.allclose(logits, reference(list(range(-1, D - 1))), atol=1e-6)


def test_projection_arithmetic_by_hand():
    # 3 layers: 10 ms; 5 layers (one more C4 + C128 pair): 14 ms -> 4 ms per pair
    base, pair = per_pair(0.010, 0.014, 0, 1)
    assert (base, pair) == pytest.approx((0.010, 0.004))
    assert at_depth(base, pair) == pytest.approx(0.010 + 20 * 0.004)          # 43 layers
    assert per_pair(0.014, 0.022, 1, 3) == pytest.approx((0.010, 0.004))
    assert at_depth(0.010, -0.001) == pytest.approx(0.010)                   # noise below zero: free
    assert speedup(3.0, 0.1, 0.2) == pytest.approx(1.5)                       # 3 tokens / 0.2 s vs 1 / 0.1 s
    assert tree_gain(3.0, 0.25, 2.5, 0.2) == pytest.approx((3.0 / 0.25) / (2.5 / 0.2) - 1)
    assert tree_gain(2.0, 0.2, 2.0, 0.2) == 0.0


def _depths(plain: float, verify: float, draft: float, extend: float) -> list[DepthCosts]:
    """Two depths (0 and 1 pairs) whose target calls cost twice as much at the larger."""
    out = []
    for pairs, scale in ((0, 1.0), (1, 2.0)):
        d = DepthCosts(pairs=pairs, num_layers=3 + 2 * pairs)
        for B in (1, 4):
            for ctx in (100, 200, 300):
                d.put("plain", B, ctx, 1, scale * plain * B)
                for D in (2, 6, 8):
                    d.put("verify_chain", B, ctx, D, scale * verify * B * D)
                    d.put("verify_tree", B, ctx, D, scale * verify * B * D)
                    if pairs == 0 and ctx == 100:
                        d.put("draft_chain", B, ctx, D, draft * (D - 1))
                        d.put("draft_tree", B, ctx, D, draft * 3)
                        d.put("extend", B, ctx, D, extend)
        out.append(d)
    return out


def test_expert_correction_by_hand():
    assert experts_touched(1) == pytest.approx(6.0)
    assert experts_touched(8) == pytest.approx(256 * (1 - (250 / 256) ** 8))       # about 44
    assert experts_touched(10**6) == pytest.approx(256.0)
    linear = {1: 1.0, 2: 2.0, 64: 64.0}                   # one expert costs its token count (any unit)
    assert expert_correction(1, linear) == pytest.approx(0.0)             # 6 experts either way
    assert expert_correction(8, linear) == pytest.approx(0.0)             # the same tokens x experts work
    flat = {1: 1.0, 512: 1.0}                             # every expert costs its weights' read
    assert expert_correction(8, flat) == pytest.approx(43 * (experts_touched(8) - 6))
    assert expert_token_counts(RegimePlan(batch_sizes=(1, 4), contexts=(64,), nodes=(1, 6))) == (1, 2, 4, 8, 16, 24)


def test_full_depth_costs_and_round_composition():
    depths = _depths(plain=0.01, verify=0.002, draft=0.001, extend=0.003)
    costs = full_depth_costs(depths)
    # base = the 0-pair time, pair = the same again: 43 layers = 21 x the 3-layer time
    assert costs["plain"][4][200][1] == pytest.approx(21 * 0.01 * 4)
    assert costs["verify_chain"][1][300][6] == pytest.approx(21 * 0.002 * 6)
    # the drafter's calls, measured once, hold at every context
    assert costs["draft_chain"][1][300][8] == pytest.approx(0.007)
    chain = round_seconds(costs, "chain", 1, 200, 8)
    assert chain == pytest.approx(0.007 + 21 * 0.016 + 0.003)
    assert round_seconds(costs, "tree", 1, 200, 8) == pytest.approx(0.003 + 21 * 0.016 + 0.003)
    assert round_seconds(costs, "tree", 1, 200, 2) == round_seconds(costs, "chain", 1, 200, 2)   # below D=3


def test_the_plain_baseline_is_the_faster_one_token_step():
    from branchspec.bench.projection import plain_baseline

    costs = {"plain": {1: {64: {1: 0.30}}, 4: {64: {1: 0.20}}},
             "verify_chain": {1: {64: {1: 0.25, 2: 0.3}}, 4: {64: {2: 0.4}}}}
    assert plain_baseline(costs) == {1: {64: 0.25}, 4: {64: 0.20}}     # no root-only verify at batch 4


def test_regularities_read_the_numbers():
    def cell(gain, accept, speed):
        return {"tree_vs_chain": gain, "tree_vs_plain": speed, "chain_vs_plain": 1.0,
                "accept": {"tree": accept, "chain": 1.0}}

    gains = {"s": {B: {8192: {6: cell(0.05 * B, 3.0, 2.0), 8: cell(0.06 * B if B < 16 else 0.01, 3.3, 2.02)}}
                   for B in (1, 4, 16)}}
    reg = regularities(gains, [1, 4, 16], [8192])
    assert reg["R2"]["s"]["grows"] == {1: True, 4: True, 16: False}
    assert reg["R4"]["s"]["best_batch"] == 16 and not reg["R4"]["s"]["interior"]      # D=6: 0.8 at 16
    r5 = reg["R5"]["s"]["by_batch"][1]
    assert r5["accept_rise"] == pytest.approx(0.1) and r5["throughput_rise"] == pytest.approx(0.01)
    assert r5["decoupled"]


def test_study_accept_lengths(tmp_path):
    rows = [dict(workload=w, batch_size=b, kind=k, shape=s, D=D, accept_length=a)
            for w, b, k, s, D, a in [("g", 1, "chain", "chain", 8, 3.0), ("g", 4, "chain", "chain", 8, 2.0),
                                     ("g", 1, "tree", "3x2", 8, 3.5), ("g", 4, "tree", "3x2", 8, 3.5),
                                     ("g", 1, "tree", "2x3", 8, 2.0), ("g", 4, "tree", "2x3", 8, 5.1),
                                     ("m", 1, "chain", "chain", 8, 2.0), ("m", 1, "tree", "3x2", 8, 4.0),
                                     ("g", 1, "baseline", "baseline", None, 1.0)]]
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    acc = study_accept_lengths(path)
    assert acc["g"][8] == {"chain": 2.5, "tree": pytest.approx(3.55)}          # the best shape's mean
    assert acc["mean"][8] == {"chain": 2.25, "tree": pytest.approx((3.55 + 4.0) / 2)}


def test_a_tiny_regime_run_writes_its_files(tmp_path):
    plan = RegimePlan(batch_sizes=(1, 2), contexts=(40, 90), nodes=(1, 2, 3, 8), repeats=1, progress=False,
                      dtype="float32", config_overrides=TINY_SLICE)
    study = {"study x": {"mean": {8: {"chain": 2.0, "tree": 2.5}, 3: {"chain": 1.5, "tree": 1.6}}}}
    payload = run(plan, tmp_path, study)
    assert json.loads((tmp_path / "regime.json").read_text()) == payload
    assert (tmp_path / "regime.png").read_bytes()[:4] == b"\x89PNG"
    md = (tmp_path / "regime.md").read_text()
    assert "Verify cost of D nodes over one plain step" in md and "study x" in md and "paper low" in md
    measured = payload["depths"]
    assert [d["num_layers"] for d in measured] == [3, 7]
    for d in measured:
        for call, by_B in d["costs"].items():
            for by_ctx in by_B.values():
                for by_D in by_ctx.values():
                    assert all(math.isfinite(s) and s > 0 for s in by_D.values())
    assert "Noise: the chain's and the tree's verify passes" in md
    assert set(measured[0]["costs"]) == {"plain", "verify_chain", "verify_tree", "draft_chain", "draft_tree",
                                         "extend"}
    assert set(measured[1]["costs"]) == {"plain", "verify_chain", "verify_tree"}       # drafter: once
    assert set(payload["expert_seconds"]) == {"1", "2", "4", "8", "16"}       # up to batch 2 x D 8
    variants = payload["projection"]["variants"]
    assert set(variants) == {MEASURED, ROUTED}
    gains = variants[MEASURED]["gains"]
    assert set(gains) == {"paper low (ShareGPT)", "paper high", "study x"}
    assert set(gains["study x"]["2"]["90"]) == {"3", "8"}
    # the routed variant only adds to the target's calls, and never at one token
    measured, routed = variants[MEASURED]["costs"], variants[ROUTED]["costs"]
    assert routed["plain"]["1"]["40"]["1"] == measured["plain"]["1"]["40"]["1"]
    assert routed["draft_chain"] == measured["draft_chain"]


def test_the_graphs_path_measures_every_call(tmp_path):
    """The path a GPU takes (captured graphs, batch padded to its bucket, every entry up
    to max_model_len addressed), with nothing recorded on a CPU: every call runs."""
    from branchspec.bench.regime import measure

    plan = RegimePlan(batch_sizes=(3,), contexts=(40,), nodes=(1, 4), repeats=1, progress=False, dtype="float32",
                      path="graphs", config_overrides=TINY_SLICE)
    measured = measure(plan)
    calls = measured.depths[0].costs
    assert set(calls) == {"plain", "verify_chain", "verify_tree", "draft_chain", "draft_tree", "extend"}
    assert all(s > 0 for by_ctx in calls["verify_tree"].values() for by_D in by_ctx.values() for s in by_D.values())


def test_tree_spec_and_parents():
    assert (tree_spec(6).num_steps, tree_spec(6).topk, tree_spec(6).num_draft_tokens) == (3, 2, 6)
    assert tree_spec(3).num_steps == 2 and tree_parents(5) == [-1, 0, 0, 1, 1]


def test_regime_flags_are_checked(capsys, tmp_path):
    parser = cli.build_parser()
    for argv, message in [(["--regime", "--workloads", "gsm8k"], "--workloads does not apply to --regime"),
                          (["--regime", "--temperature", "0.7"], "--temperature does not apply"),
                          (["--contexts", "1024"], "--contexts need --regime"),
                          (["--regime", "--regime-pairs", "1"], "two depths"),
                          (["--regime", "--regime-pairs", "2,1"], "two increasing depths"),
                          (["--regime", "--contexts", "70000"], "the regime model has 65536"),
                          (["--regime", "--disable-cuda-graph"], "applies to a GPU"),
                          (["--regime", "--device", "tpu"], "device='tpu' is not a device name"),
                          (["--regime", "--regime-repeats", "0"], "repeats must be at least 1"),
                          *([(["--regime", "--device", "cuda"], "CUDA is not available")]
                            if not torch.cuda.is_available() else [])]:
        args = parser.parse_args(argv + ["--out", str(tmp_path / "out")])
        assert cli.main(args) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--regime", "--accept-lengths", "nameless"])
    plan = cli.regime_plan_from_args(parser.parse_args(["--regime", "--quick"]))
    assert plan.batch_sizes == (1, 4) and plan.contexts == (1024, 8192) and plan.path == "eager"
    assert plan.budgets == tuple(range(1, 9)) and plan.pairs == (0, 2)
