"""The tree-vs-chain study on a tiny random checkpoint: every output file is written with
every field and column, and bad arguments fail clearly before any work. No speed checks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from branchspec.bench import cli
from branchspec.bench.grid import TreeShape, default_tree_shapes, parse_tree_shapes, specs_at_budget
from branchspec.bench.metrics import CellResult
from branchspec.bench.report import (
    ACCEPT_HEADERS,
    BREAKDOWN_HEADERS,
    CELL_HEADERS,
    COMPARISON_HEADERS,
    THROUGHPUT_HEADERS_LEAD,
)
from branchspec.bench.study import StudyConfig, run_study
from branchspec.checkpoint import save_checkpoint
from branchspec.config import tiny_config
from branchspec.data import workloads as wl
from branchspec.data.workloads import mbpp as mbpp_source
from branchspec.speculative.outcome import ROUND_PHASES
from branchspec.model.init import random_model

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CELL_FIELDS = {f for f in CellResult.__dataclass_fields__}


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench_ckpt")
    save_checkpoint(random_model(tiny_config(), seed=1, dtype="float64", std=0.3), folder)
    return folder


@pytest.fixture(scope="module")
def study(tiny_ckpt, tmp_path_factory):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    # Two synthetic "workloads" of token-id prompts (tiny models have no tokenizer).
    prompts = {w: [torch.randint(3, 64, (n,), generator=g).tolist() for n in (7, 12, 5)]
               for w in ("alpha", "beta")}
    cfg = StudyConfig(model=tiny_ckpt, workloads=("alpha", "beta"), budgets=(5,), batch_sizes=(1, 2),
                      tree_shapes=(TreeShape(3, 2),), max_tokens=6, num_prompts=3, dtype="float64",
                      threads=1, out_dir=tmp_path_factory.mktemp("bench_out"), prompts_override=prompts,
                      progress=False)
    return run_study(cfg)


def _table_headers(markdown: str) -> list[tuple[str, ...]]:
    """Header rows of every markdown table: a `| .. |` line followed by a `|---|` line."""
    lines = markdown.splitlines()
    return [tuple(c.strip() for c in line.strip("|").split("|"))
            for line, nxt in zip(lines, lines[1:]) if line.startswith("| ") and nxt.startswith("|---")]


def test_results_jsonl_has_one_full_line_per_cell(study):
    lines = (study.out_dir / "results.jsonl").read_text().splitlines()
    assert len(lines) == study.config.num_cells() == 2 * 2 * 3   # workloads x batches x (base, chain, tree)
    records = [json.loads(line) for line in lines]
    for r in records:
        assert set(r) == CELL_FIELDS
        assert r["kind"] in ("baseline", "chain", "tree")
        assert r["tokens"] == r["batch_size"] * 6            # ignore_eos: every request runs to max_tokens
        assert set(r["ms_per_round"]) == {*ROUND_PHASES, "other", "total"}
        assert r["throughput_tok_s"] > 0 and r["num_rounds"] > 0
        if r["kind"] == "baseline":
            assert r["D"] is None and r["accept_length"] == 1.0 and r["speedup"] == 1.0
        else:
            assert r["D"] == 5 and len(r["accept_rate_per_depth"]) == 4
            assert 1.0 <= r["accept_length"] <= 5.0
            assert all(0.0 <= a <= 1.0 for a in r["accept_rate_per_depth"])
            assert r["speedup"] > 0
            assert r["matches_baseline"] is True           # greedy speculation is lossless
    assert [(r["workload"], r["batch_size"], r["shape"]) for r in records][:3] == [
        ("alpha", 1, "baseline"), ("alpha", 1, "chain"), ("alpha", 1, "3x2")]


def test_report_has_every_table_column(study):
    text = (study.out_dir / "report.md").read_text()
    headers = _table_headers(text)
    for expected in (ACCEPT_HEADERS, COMPARISON_HEADERS, BREAKDOWN_HEADERS, CELL_HEADERS,
                     (*THROUGHPUT_HEADERS_LEAD, "D=5")):
        assert tuple(expected) in headers, f"missing table with columns {expected}"
    assert len(study.comparisons) == 2 * 2                # workloads x batch sizes at D=5
    for name in ("accept_length.png", "throughput_ratio.png", "round_breakdown.png"):
        assert f"]({name})" in text


def test_plots_are_png_files(study):
    for name in ("accept_length", "throughput_ratio", "round_breakdown"):
        path = study.files[name]
        assert path.is_file() and path.read_bytes()[:8] == PNG_SIGNATURE


@pytest.fixture
def no_mbpp(monkeypatch, tmp_path):
    """No MBPP source at all: no env var, and a Hugging Face cache without it (offline, so
    the hub is not asked). The working directory is a fresh folder."""
    monkeypatch.delenv(wl.MBPP_ENV_VAR, raising=False)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")

    def not_cached(*, local_files_only):
        raise FileNotFoundError("MBPP is not in the Hugging Face cache")

    monkeypatch.setattr(mbpp_source, "_download_mbpp", not_cached)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    mbpp_source._mbpp_from_hub.cache_clear()
    yield
    mbpp_source._mbpp_from_hub.cache_clear()


def test_cli_prints_tables_then_one_json_line(study, tiny_ckpt, monkeypatch, capsys, no_mbpp):
    configs = []
    monkeypatch.setattr(cli, "run_study", lambda cfg: configs.append(cfg) or study)
    args = cli.build_parser().parse_args(["--quick", "--no-progress", "--model", str(tiny_ckpt)])
    assert cli.main(args) == 0
    captured = capsys.readouterr()
    out = captured.out.strip().splitlines()
    summary = json.loads(out[-1])
    assert summary["num_cells"] == 12 and "5" in summary["mean_throughput_gain_by_D"]
    assert any("throughput gain" in line for line in out[:-1])
    # The preset's workloads run without MBPP, and one line on stderr says so.
    assert configs[0].workloads == ("gsm8k", "sharegpt")
    assert captured.err.splitlines() == list(configs[0].notes) and configs[0].notes[0].startswith("MBPP skipped")


def test_quick_preset_and_explicit_flags(tiny_ckpt):
    parser = cli.build_parser()
    model = ["--model", str(tiny_ckpt)]
    quick = cli.config_from_args(parser.parse_args(["--quick", "--workloads", "gsm8k", *model]))
    assert (quick.budgets, quick.batch_sizes, quick.max_tokens, quick.num_prompts) == ((6,), (1, 4), 32, 4)
    assert [s.topk for s in quick.specs_at(6)] == [1, 2, 3]   # chain + 2 trees
    full = cli.config_from_args(parser.parse_args(["--workloads", "gsm8k", "--max-tokens", "16", *model]))
    assert full.budgets == (5, 6, 7, 8) and full.batch_sizes == (1, 4, 16, 64) and full.max_tokens == 16
    assert full.policy_repeats == 3 and full.rechecks == 0          # fixed only: nothing to recheck
    both = cli.config_from_args(parser.parse_args(["--workloads", "gsm8k", "--policies", "fixed,auto",
                                                   "--policy-repeats", "1", *model]))
    assert both.rechecks == 1
    assert quick.seed == 0
    assert cli.config_from_args(parser.parse_args(["--workloads", "gsm8k", "--seed", "none", *model])).seed is None


@pytest.mark.parametrize("argv, message", [
    (["--workloads", "gsm8k,nope"], "unknown workload"),
    (["--budgets", "1,6"], "D=1"),
    (["--batch-sizes", "4,0"], "batch size 0"),
    (["--tree-shapes", "5x2", "--budgets", "5,6"], "tree shape 5x2 (num_steps x topk) is invalid at D=5"),
    (["--tree-shapes", "1x2", "--budgets", "6"], "invalid at D=6"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--policies", "fixed,auto", "--policy-repeats", "-1"], "policy_repeats"),
    (["--seed", "-1"], "seed must be None or an integer in [0, 2**64)"),
    (["--model", "/nonexistent/ckpt"], "--model /nonexistent/ckpt does not exist"),
])
def test_invalid_values_fail_before_any_work(argv, message, tmp_path, capsys):
    out = tmp_path / "never"
    extra = [] if "--workloads" in argv else ["--workloads", "gsm8k"]
    args = cli.build_parser().parse_args([*argv, *extra, "--out", str(out)])
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("argv, messages", [
    (["--workloads", "gsm8k,mbpp"], ["workload 'mbpp': no MBPP source", "--mbpp-path", wl.MBPP_ENV_VAR,
                                     "going online"]),
    (["--mbpp-path", "nope.jsonl"], ["MBPP file not found: nope.jsonl"]),
])
def test_mbpp_asked_for_but_missing_fails_before_any_work(argv, messages, tiny_ckpt, tmp_path, capsys, no_mbpp):
    """MBPP named with --workloads, or a --mbpp-path, is not skipped when missing: exit 2."""
    out = tmp_path / "never"
    args = cli.build_parser().parse_args([*argv, "--model", str(tiny_ckpt), "--out", str(out)])
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert all(m in err for m in messages), err
    assert not out.exists()


def test_readme_quick_command_runs_without_mbpp(tmp_path):
    """The README's main command, `branchspec bench --quick` (shrunk), on a machine without
    MBPP: no $BRANCHSPEC_MBPP, offline, an empty cache. It runs the other workloads, says so
    in one line on stderr and the same line in report.md, and exits 0."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != wl.MBPP_ENV_VAR}
    repo = str(Path(__file__).resolve().parents[1])
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"),   # an empty Hugging Face cache
               PYTHONPATH=os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")])))
    argv = ["--quick", "--num-prompts", "1", "--max-tokens", "4", "--batch-sizes", "1", "--no-plots",
            "--no-progress", "--threads", "1", "--out", "out"]
    proc = subprocess.run([sys.executable, "-m", "branchspec", "bench", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("MBPP skipped") and "HF_HUB_OFFLINE" in line
    assert all(way in line for way in ("--mbpp-path", wl.MBPP_ENV_VAR, "go online"))
    assert line in (cwd / "out" / "report.md").read_text().splitlines()
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["config"]["workloads"] == ["gsm8k", "sharegpt"] and summary["num_cells"] == 2 * 4


@pytest.mark.parametrize("argv, message", [
    (["--tree-shapes", "3by2"], "bad tree shape '3by2'"),
    (["--tree-shapes", "3x1"], "topk must be >= 2"),
    (["--budgets", "5,six"], "comma-separated integers"),
    (["--seed", "x"], "expected an integer seed or none"),
])
def test_malformed_flags_are_parser_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_grid_and_study_config_checks():
    for d in (5, 6, 7, 8):
        shapes = default_tree_shapes(d)
        assert 1 <= len(shapes) <= 4
        specs = specs_at_budget(d)
        assert specs[0].is_chain and specs[0].num_draft_tokens == d
        assert all(not s.is_chain and s.num_draft_tokens == d for s in specs[1:])
    assert parse_tree_shapes("3x2, 2X3,3x2") == [TreeShape(3, 2), TreeShape(2, 3)]
    with pytest.raises(ValueError, match="no prompts in prompts_override"):
        StudyConfig(workloads=("alpha",), prompts_override={"beta": [[3, 4]]})
    with pytest.raises(ValueError, match="budget D=1"):
        StudyConfig(workloads=("alpha",), budgets=(1,), prompts_override={"alpha": [[3, 4]]})


def test_report_can_be_rebuilt_from_results(study, tmp_path):
    """An interrupted sweep keeps its flushed cells; --report-only rebuilds the report."""
    from branchspec.bench.study import report_from_results

    with pytest.raises(FileNotFoundError, match="results.jsonl"):
        report_from_results(tmp_path)
    lines = (study.out_dir / "results.jsonl").read_text().splitlines()
    (tmp_path / "results.jsonl").write_text("\n".join(lines[:6]) + "\n")   # one workload's cells
    cells, comparisons, summary = report_from_results(tmp_path)
    assert len(cells) == 6 and summary["num_cells"] == 6
    assert comparisons and all(c.workload == cells[0].workload for c in comparisons)
    assert (tmp_path / "report.md").is_file()
    assert (tmp_path / "accept_length.png").read_bytes()[:4] == b"\x89PNG"


def test_the_report_says_when_speculation_changed_an_output(study):
    """Greedy speculation matched plain decoding everywhere, and the report says nothing;
    a summary counting mismatched cells puts them at the report's head."""
    from branchspec.bench.report import render_report

    assert study.summary["output_mismatches"] == 0
    clean = render_report(study.cells, study.comparisons, study.summary)
    assert "emitted other tokens" not in clean
    flagged = render_report(study.cells, study.comparisons, {**study.summary, "output_mismatches": 2})
    head = flagged.split("## Accept length")[0]
    assert "**2 speculative cells emitted other tokens than plain decoding**" in head


def test_policy_row_joins_the_study(tiny_ckpt, tmp_path, monkeypatch):
    """--policies fixed,auto: one auto cell per (workload, batch size), compared in the
    report with the best fixed configuration and with no speculation; greedy and lossless."""
    from branchspec.bench.report import POLICY_HEADERS

    monkeypatch.setenv("BRANCHSPEC_CACHE", str(tmp_path / "cache"))
    g = torch.Generator().manual_seed(1)
    prompts = {"alpha": [torch.randint(3, 64, (n,), generator=g).tolist() for n in (7, 12)]}
    cfg = StudyConfig(model=tiny_ckpt, workloads=("alpha",), budgets=(4,), batch_sizes=(1, 2),
                      tree_shapes=(TreeShape(2, 2),), max_tokens=6, num_prompts=2, dtype="float64", threads=1,
                      out_dir=tmp_path / "out", prompts_override=prompts, progress=False,
                      policies=("fixed", "auto"), policy_repeats=2)
    result = run_study(cfg)
    auto = [c for c in result.cells if c.kind == "auto"]
    assert len(auto) == 2
    for cell in auto:
        assert cell.matches_baseline is True and cell.tokens == cell.batch_size * 6
        assert sum(cell.extra["choices"].values()) == cell.num_rounds
    # Side by side: plain decoding, the best fixed configuration (unless that is plain
    # decoding) and the policy, twice each in turn; the goals are judged on their medians.
    from branchspec.bench.analysis import policy_table
    rows = {r.batch_size: r for r in policy_table(result.cells)}
    for b in (1, 2):
        same = [c for c in result.cells if c.batch_size == b]
        fixed = [c for c in same if c.kind in ("chain", "tree", "calibrated", "baseline")]
        best = max(fixed, key=lambda c: c.throughput_tok_s)
        side = [c for c in same if c.kind == "recheck"]
        roles = [c.extra["role"] for c in side]
        expected = ["baseline", "auto"] if best.kind == "baseline" else ["baseline", "best_fixed", "auto"]
        assert roles == expected * 2 and [c.extra["repeat"] for c in side] == sorted([0, 1] * len(expected))
        if best.kind != "baseline":
            assert all((c.D, c.topk) == (best.D, best.topk) for c in side if c.extra["role"] == "best_fixed")
        runs = {role: sorted(c.throughput_tok_s for c in side if c.extra["role"] == role) for role in expected}
        other = runs.get("best_fixed", runs["baseline"])
        assert rows[b].vs_best_fixed == pytest.approx(sum(runs["auto"]) / sum(other))     # medians of two
        assert rows[b].sweep_vs_best_fixed == pytest.approx(rows[b].auto.throughput_tok_s / best.throughput_tok_s)
    assert len(result.cells) <= cfg.num_cells() == 2 * (4 + 3 * 2)
    text = (result.out_dir / "report.md").read_text()
    assert tuple(POLICY_HEADERS) in _table_headers(text)
    assert result.summary["policy"]["cells"] == 2 and result.summary["policy"]["judged"] == "side by side"
    with pytest.raises(ValueError, match="policy_repeats"):
        StudyConfig(model=tiny_ckpt, policies=("fixed", "auto"), policy_repeats=-1)
    with pytest.raises(ValueError, match="policies"):
        StudyConfig(model=tiny_ckpt, policies=("best",))


def test_calibrated_trees_join_the_study(tiny_ckpt, tmp_path):
    """--selections eagle2,calibrated: calibrated trees over the grid's shapes and the deep
    (D-1)x2 and (D-1)x3 run beside the chain and the EAGLE-2 trees, greedy output equal to
    plain decoding's, and the report compares the three per (workload, batch size, D)."""
    from branchspec.bench.analysis import selection_table
    from branchspec.bench.report import SELECTION_HEADERS

    g = torch.Generator().manual_seed(2)
    prompts = {"alpha": [torch.randint(3, 64, (n,), generator=g).tolist() for n in (7, 12)]}
    cfg = StudyConfig(model=tiny_ckpt, workloads=("alpha",), budgets=(5,), batch_sizes=(1, 2),
                      tree_shapes=(TreeShape(2, 2),), max_tokens=8, num_prompts=2, dtype="float64", threads=1,
                      out_dir=tmp_path / "out", prompts_override=prompts, progress=False, plots=False,
                      selections=("eagle2", "calibrated"), policy_repeats=2)
    assert [(s.num_steps, s.topk, s.selection) for s in cfg.specs_at(5)] == [
        (4, 1, "eagle2"), (2, 2, "eagle2"), (2, 2, "calibrated"), (4, 2, "calibrated"), (4, 3, "calibrated")]
    result = run_study(cfg)
    assert len(result.cells) == cfg.num_cells() == 2 * (6 + 2 * 2 * 2)
    calibrated = [c for c in result.cells if c.kind == "calibrated"]
    assert sorted({c.shape for c in calibrated}) == ["2x2", "4x2", "4x3"] and len(calibrated) == 2 * 3
    assert all(c.matches_baseline is True for c in calibrated)
    rows = selection_table(result.cells)
    assert [(r.batch_size, r.D) for r in rows] == [(1, 5), (2, 5)]
    for r in rows:
        same = [c for c in result.cells if c.batch_size == r.batch_size]
        best = max(c.accept_length for c in calibrated if c.batch_size == r.batch_size)
        assert r.accept_gain("chain") == pytest.approx(best / r.chain.accept_length - 1)
        # The two fastest calibrated trees and the two fastest of the others (the chain and
        # the one EAGLE-2 tree), run again in turn twice; each side is judged by its faster
        # one's median (of two: the mean).
        finalists = {kinds: sorted((c for c in same if c.kind in kinds), key=lambda c: c.throughput_tok_s,
                                   reverse=True)[:2]
                     for kinds in (("calibrated",), ("chain", "tree"))}
        ran = {"best_calibrated": finalists[("calibrated",)][0], "calibrated_2": finalists[("calibrated",)][1],
               "best_other": finalists[("chain", "tree")][0], "other_2": finalists[("chain", "tree")][1]}
        side = [c for c in same if c.kind == "recheck"]
        assert [c.extra["role"] for c in side] == ["best_other", "best_calibrated", "other_2", "calibrated_2"] * 2
        for c in side:
            cell = ran[c.extra["role"]]
            assert (c.D, c.topk, c.shape, c.extra["of"], c.extra["D"]) == (cell.D, cell.topk, cell.shape, cell.kind, 5)
            assert c.matches_baseline is True and c.tokens == r.batch_size * 8
            assert r.side_shapes[c.extra["role"]] == cell.shape
        runs = {role: sum(c.throughput_tok_s for c in side if c.extra["role"] == role) / 2 for role in ran}
        assert r.throughput_ratio() == pytest.approx(max(runs["best_calibrated"], runs["calibrated_2"])
                                                     / max(runs["best_other"], runs["other_2"]))
        assert r.sweep_throughput_ratio() == pytest.approx(
            finalists[("calibrated",)][0].throughput_tok_s / finalists[("chain", "tree")][0].throughput_tok_s)
    assert tuple(SELECTION_HEADERS) in _table_headers((result.out_dir / "report.md").read_text())
    assert result.summary["calibrated"]["cells"] == 2
    assert result.summary["calibrated"]["throughput_judged"] == "side by side"
    with pytest.raises(ValueError, match="selections"):
        StudyConfig(model=tiny_ckpt, selections=("calibrated",))


def _cell(kind: str, tok_s: float, D: int | None = 6, shape: str = "3x2", **extra) -> CellResult:
    return CellResult(workload="alpha", batch_size=1, kind=kind, shape=shape, D=D, num_steps=3, topk=2,
                      accept_length=2.0, accept_rate_per_depth=[], throughput_tok_s=tok_s, speedup=None,
                      ms_per_round={}, num_rounds=1, request_rounds=1, tokens=8, decode_seconds=1.0,
                      prefill_seconds=0.0, wall_seconds=1.0, max_tokens=8, temperature=0.0,
                      mean_prompt_tokens=5.0, extra=dict(extra))


def test_sampled_studies_draw_the_same_tokens_in_every_configuration(tiny_ckpt, tmp_path):
    """Sampled, request i of a batch draws with seed `seed` + i, so plain decoding, chains,
    trees of both selections and their side-by-side reruns all emit the same tokens, and the
    study checks every one of them against plain decoding's. The seeds matter (another seed
    samples other text), and unseeded studies leave the check out."""
    from branchspec import LLM
    from branchspec.bench.study import request_params

    g = torch.Generator().manual_seed(3)
    prompts = {"alpha": [torch.randint(3, 64, (n,), generator=g).tolist() for n in (9, 6)]}
    common = dict(model=tiny_ckpt, workloads=("alpha",), budgets=(5,), batch_sizes=(2,),
                  tree_shapes=(TreeShape(3, 2),), max_tokens=8, num_prompts=2, dtype="float64", threads=1,
                  prompts_override=prompts, progress=False, plots=False, temperature=1.0)
    cfg = StudyConfig(**common, out_dir=tmp_path / "seeded", selections=("eagle2", "calibrated"), policy_repeats=1)
    assert [p.seed for p in request_params(cfg, 3)] == [0, 1, 2]
    result = run_study(cfg)
    checked = [c for c in result.cells if c.kind != "baseline"]
    assert {c.kind for c in checked} == {"chain", "tree", "calibrated", "recheck"}
    assert all(c.matches_baseline is True for c in checked)
    assert result.summary["output_mismatches"] == 0 and result.summary["config"]["seed"] == 0
    assert "every configuration of a cell emits the same tokens" in (result.out_dir / "report.md").read_text()

    llm = LLM(tiny_ckpt, dtype="float64", max_batch_size=2, seed=0)
    texts = {seed: [o.token_ids for o in llm.generate(prompts["alpha"], request_params(
        StudyConfig(**common, seed=seed, out_dir=tmp_path / "unused"), 2))] for seed in (0, 1)}
    assert texts[0] != texts[1]

    unseeded = run_study(StudyConfig(**common, out_dir=tmp_path / "unseeded", seed=None))
    assert all(c.matches_baseline is None for c in unseeded.cells)
    assert "unseeded" in (unseeded.out_dir / "report.md").read_text()
    with pytest.raises(ValueError, match="seed must be None or an integer"):
        StudyConfig(**common, seed=-1, out_dir=tmp_path / "never")


def test_the_policy_is_judged_against_calibrated_trees_too():
    """A calibrated tree is a fixed configuration a user may pick: when it is the fastest,
    it is the policy's best fixed configuration; the selection's side-by-side runs do not
    count as the policy's."""
    from branchspec.bench.analysis import policy_table
    from branchspec.bench.report import fixed_label

    cells = [_cell("baseline", 100.0, D=None, shape="baseline"), _cell("chain", 140.0, shape="chain"),
             _cell("tree", 150.0), _cell("calibrated", 160.0), _cell("auto", 150.0, D=None, shape="auto"),
             _cell("recheck", 999.0, role="best_calibrated", D=6, repeat=0, of="calibrated"),
             _cell("recheck", 155.0, role="best_fixed", repeat=0, of="calibrated"),
             _cell("recheck", 152.0, role="auto", repeat=0, of="auto")]
    (row,) = policy_table(cells)
    assert row.best_fixed.kind == "calibrated" and fixed_label(row.best_fixed) == "3x2 D=6 calibrated"
    assert row.side_by_side == {"best_fixed": [155.0], "auto": [152.0]}
    assert row.vs_best_fixed == pytest.approx(152.0 / 155.0)


def test_each_side_is_judged_by_its_faster_finalist_side_by_side():
    """The sweep's fastest of a side can be its luckiest: side by side, the finalist with the
    higher median speaks for its side, and the report names it; without side-by-side runs
    the sweep's ratio stands."""
    from branchspec.bench.analysis import selection_table
    from branchspec.bench.report import side_pair

    sweep = [_cell("chain", 100.0, shape="chain"), _cell("tree", 90.0, shape="3x2"),
             _cell("calibrated", 120.0, shape="5x3"), _cell("calibrated", 95.0, shape="2x3")]
    side = [_cell("recheck", tok_s, shape=shape, role=role, repeat=rep, of=of)
            for rep in range(3)
            for role, shape, of, tok_s in (("best_other", "chain", "chain", 100.0 + rep),
                                           ("other_2", "3x2", "tree", 92.0),
                                           ("best_calibrated", "5x3", "calibrated", 80.0 + rep),
                                           ("calibrated_2", "2x3", "calibrated", 104.0 - rep))]
    for c in side:
        c.extra["D"] = 6      # as `study.run_side_by_side` records it
    (row,) = selection_table(sweep + side)
    assert row.sweep_throughput_ratio() == pytest.approx(120.0 / 100.0)
    assert (row.side_winner("calibrated"), row.side_winner("other")) == ("calibrated_2", "best_other")
    assert row.throughput_ratio() == pytest.approx(103.0 / 101.0)
    assert side_pair(row) == "2x3 103.0 / chain 101.0"
    (bare,) = selection_table(sweep)
    assert bare.throughput_ratio() == pytest.approx(1.2) and side_pair(bare) == "-"
