"""Training: the losses fall on learnable data, the trainer exports a loadable checkpoint,
resuming continues exactly, and the LR schedule has the promised shape."""

import dataclasses
import json
import math

import pytest
import torch

from branchspec.checkpoint import load_checkpoint
from branchspec.config import SamplingParams, SpecConfig, tiny_config
from branchspec.llm import LLM
from branchspec.model.init import random_model
from branchspec.train.losses import lm_losses, train_steps
from branchspec.train.trainer import TrainConfig, lr_at, train
from conftest import markov_batches, write_mbpp


def test_tiny_training_lowers_both_losses():
    cfg = tiny_config()
    model = random_model(cfg, seed=1, std=0.1)
    *batches, probe = markov_batches(cfg.vocab_size, 31, seed=1)   # same chain, unseen sample
    with torch.no_grad():
        before = lm_losses(model, probe)
    train_steps(model, batches, lr=1e-2)
    with torch.no_grad():
        after = lm_losses(model, probe)
    assert after[0] < before[0] - 1.0          # target: next token
    assert after[1] < before[1] - 1.0          # MTP: next-next token


def test_lr_schedule_warms_up_then_decays_to_floor():
    cfg = TrainConfig(steps=100, warmup=10, lr=1e-3, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lr_at(100, cfg) == pytest.approx(1e-4)


@pytest.fixture(scope="module")
def mbpp_path(tmp_path_factory) -> str:
    """An MBPP-shaped file: the trainer only needs MBPP's shape, not the real tasks."""
    return str(write_mbpp(tmp_path_factory.mktemp("mbpp") / "mbpp.jsonl"))


def _small(out, steps, mbpp_path):
    return TrainConfig(out=str(out), model="tiny", steps=steps, batch_size=2, seq_len=160, eval_every=2,
                       save_every=1, vocab_size=300, tokenizer_chars=120_000, eval_windows=1,
                       max_chars={w: 120_000 for w in ("gsm8k", "mbpp", "sharegpt")}, mbpp_path=mbpp_path,
                       precision="float32")   # "auto" times the CPU and may choose differently per run


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, mbpp_path):
    out = tmp_path_factory.mktemp("run")
    folder = train(_small(out, 4, mbpp_path), export=out / "export", progress=False)
    return out, folder


def test_trainer_exports_a_working_checkpoint(trained_run):
    out, folder = trained_run
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "training.json", "loss.png"):
        assert (folder / name).is_file(), name
    info = json.loads((folder / "training.json").read_text())
    assert info["steps"] == 4 and info["tokens_seen"] == 4 * 2 * 160
    assert set(info["held_out"]) == {"gsm8k", "mbpp", "sharegpt"}
    for report in info["held_out"].values():
        assert math.isfinite(report["ppl"]) and 0.0 <= report["mtp_top1_agreement"] <= 1.0
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    llm = LLM(folder)
    a = llm.generate("Question: 1+1?\nAnswer:", SamplingParams(max_tokens=6), spec=SpecConfig(2, 2, 4))[0]
    b = llm.generate("Question: 1+1?\nAnswer:", SamplingParams(max_tokens=6))[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) >= 1


def test_resume_continues_exactly(trained_run, tmp_path, mbpp_path):
    """Two steps, stop, resume to four == four uninterrupted steps (same weights)."""
    _, uninterrupted = trained_run
    assert train(_small(tmp_path, 4, mbpp_path), progress=False, stop_after=2) is None
    folder = train(_small(tmp_path, 4, mbpp_path), resume=True, progress=False)
    a = load_checkpoint(uninterrupted, "float32").state_dict()
    b = load_checkpoint(folder, "float32").state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0, msg=k)


def test_train_config_errors():
    with pytest.raises(ValueError, match="model preset"):
        TrainConfig(model="huge")
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)


def test_resume_from_the_compact_pack(trained_run, tmp_path, mbpp_path):
    """Without the exact state (a fresh clone of a repository that keeps only the pack), a
    run resumes from resume.safetensors + resume.json: the weights and the sampler where
    they were, Adam's moments rebuilt at learning rate 0, and the sittings recorded."""
    from safetensors.torch import load_file

    cfg = _small(tmp_path, 4, mbpp_path)
    assert train(cfg, progress=False, stop_after=2) is None
    saved = load_file(str(tmp_path / "resume.safetensors"))
    record = json.loads((tmp_path / "resume.json").read_text())
    assert record["step"] == 2 and len(record["history"]) == 2
    for p in [tmp_path / "state.json", *tmp_path.glob("state-*.safetensors")]:
        p.unlink()
    folder = train(dataclasses.replace(cfg, reestimate_steps=2), resume=True, progress=False)
    info = json.loads((folder / "training.json").read_text())
    assert info["steps"] == 4 and [s["resumed_from"] for s in info["sittings"]] == [None, "pack"]
    assert info["sittings"][1]["reestimated_steps"] == 2 and info["sittings"][1]["start_step"] == 2
    # The resumed run started from the saved weights, not from a fresh initialisation.
    fresh = TrainConfig(**{**dataclasses.asdict(cfg), "out": str(tmp_path / "other")})
    assert train(fresh, progress=False, stop_after=1) is None
    other = load_file(str(tmp_path / "other" / "resume.safetensors"))
    assert any(not torch.equal(saved[k], other[k]) for k in saved)


def test_train_config_refuses_unknown_sources_and_precisions():
    with pytest.raises(ValueError, match="unknown mix source"):
        TrainConfig(mix={"gsm8k": 1.0, "wikipedia": 1.0})
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="fp8")
    with pytest.raises(ValueError, match="mix weights"):
        TrainConfig(mix={"gsm8k": 0.0})


def test_python_source_corpus_reads_the_standard_library_without_tests(tmp_path):
    from branchspec.train.corpora import corpus_fingerprint, python_source_documents, python_source_files

    (tmp_path / "pkg" / "tests").mkdir(parents=True)
    (tmp_path / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    (tmp_path / "pkg" / "tests" / "test_mod.py").write_text("assert True\n")
    (tmp_path / "bad.py").write_bytes(b"\xff\xfe not utf-8")
    assert [p.name for p in python_source_files(tmp_path)] == ["bad.py", "mod.py"]
    assert list(python_source_documents(tmp_path)) == ["def f():\n    return 1\n"]
    info = corpus_fingerprint("pycode")
    assert info["licence"] == "PSF-2.0" and info["files"] > 100


def test_auto_precision_needs_native_bf16_and_a_faster_probe(monkeypatch):
    """"auto" never probes without native bf16, and with it takes bfloat16 only when the
    timed probe finds it at least 5% faster than float32."""
    from branchspec.train import trainer

    cfg = tiny_config()
    assert trainer.resolve_precision("float32", cfg) == ("float32", {})
    assert trainer.resolve_precision("bfloat16", cfg) == ("bfloat16", {})
    monkeypatch.setattr(trainer, "bf16_is_fast", lambda: False)
    monkeypatch.setattr(trainer, "step_seconds", lambda *a, **k: pytest.fail("probed without native bf16"))
    assert trainer.resolve_precision("auto", cfg) == ("float32", {})
    monkeypatch.setattr(trainer, "bf16_is_fast", lambda: True)
    for bf16_seconds, expected in ((0.5, "bfloat16"), (0.97, "float32"), (1.5, "float32")):
        monkeypatch.setattr(trainer, "step_seconds",
                            lambda c, precision, *a, s=bf16_seconds, **k: s if precision == "bfloat16" else 1.0)
        choice, probe = trainer.resolve_precision("auto", cfg)
        assert (choice, probe) == (expected, {"float32": 1.0, "bfloat16": bf16_seconds})


def test_step_seconds_times_a_real_step():
    from branchspec.train.trainer import step_seconds

    assert 0 < step_seconds(tiny_config(), "float32", batch_size=1, seq_len=16, repeats=1) < 60


def test_cli_resume_takes_the_saved_settings(tmp_path, mbpp_path, capsys):
    """`branchspec train --out DIR --resume` continues with DIR's train_config.json; a flag
    that would change the run is refused."""
    from branchspec.cli import main

    out = tmp_path / "run"
    cfg = _small(out, 3, mbpp_path)
    assert train(cfg, progress=False, stop_after=1) is None
    with pytest.raises(SystemExit):
        main(["train", "--out", str(out), "--resume", "--lr", "0.5"])
    assert "--lr" in capsys.readouterr().err
    assert main(["train", "--out", str(out), "--resume", "--stop-after", "1", "--precision", "float32"]) == 0
    record = json.loads((out / "resume.json").read_text())
    assert record["step"] == 2 and record["sittings"][-1]["precision"] == "float32"


def test_distinct_ngram_ratio_sees_loops():
    from branchspec.train.quality import distinct_ngram_ratio

    assert distinct_ngram_ratio(list(range(10))) == 1.0
    loop = [5, 6, 7] * 10                                  # 27 4-grams, 3 distinct
    assert distinct_ngram_ratio(loop) == pytest.approx(3 / 27)
    assert distinct_ngram_ratio([1, 2, 3]) is None
    assert distinct_ngram_ratio([1, 2, 1, 2], n=2) == pytest.approx(2 / 3)


def test_drafter_distillation_moves_only_the_drafter(trained_run, tmp_path, mbpp_path):
    """distill-drafter trains the MTP block on the target's own distribution: every target
    tensor (the shared embedding and head included) is bit for bit the source's, the
    drafter's KL to the target drops on held-out text, and the target's greedy text, plain
    and speculative, is unchanged."""
    from branchspec.train.distill import DistillConfig, distill_drafter, drafter_kl

    _, src = trained_run
    cfg = DistillConfig(steps=12, batch_size=2, seq_len=160, lr=1e-2, warmup=2, eval_windows=1,
                        mix={"gsm8k": 1.0, "mbpp": 1.0, "sharegpt": 1.0},
                        max_chars={w: 120_000 for w in ("gsm8k", "mbpp", "sharegpt")}, mbpp_path=mbpp_path)
    out = distill_drafter(src, tmp_path / "distilled", cfg, progress=False)
    before, after = load_checkpoint(src), load_checkpoint(out)
    changed = {n for n, t in after.state_dict().items() if not torch.equal(t, before.state_dict()[n])}
    assert changed and all(n.startswith("mtp.") for n in changed), sorted(changed)[:5]
    probe = torch.tensor([LLM(src).tokenizer.encode("Question: Tom has 3 apples and buys 5 more. "
                                                     "How many apples does he have?\nAnswer: 8\n" * 3)])
    with torch.no_grad():
        assert drafter_kl(after, probe) < drafter_kl(before, probe)
    record = json.loads((out / "training.json").read_text())["drafter_distillations"][-1]
    assert len(record["history"]) == 12 and set(record["held_out_after"]) == {"gsm8k", "mbpp", "sharegpt"}
    # A second distillation keeps the first one's record.
    again = distill_drafter(out, tmp_path / "again", dataclasses.replace(cfg, steps=1), progress=False)
    records = json.loads((again / "training.json").read_text())["drafter_distillations"]
    assert [len(r["history"]) for r in records] == [12, 1]
    prompt, params = "Question: 1+1?\nAnswer:", SamplingParams(max_tokens=8, ignore_eos=True)
    want = LLM(src).generate(prompt, params)[0].token_ids
    distilled = LLM(out)
    assert distilled.generate(prompt, params)[0].token_ids == want
    assert distilled.generate(prompt, params, spec=SpecConfig(2, 2, 4))[0].token_ids == want


def test_distill_config_errors():
    from branchspec.train.distill import DistillConfig

    with pytest.raises(ValueError, match="steps"):
        DistillConfig(steps=0)
    with pytest.raises(ValueError, match="wikipedia"):
        DistillConfig(mix={"wikipedia": 1.0})
    with pytest.raises(ValueError, match="lr"):
        DistillConfig(lr=float("nan"))


def test_cli_distill_refuses_a_used_out_folder(trained_run, tmp_path, capsys):
    from branchspec.cli import main

    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("x")
    with pytest.raises(SystemExit) as e:
        main(["distill-drafter", str(trained_run[1]), "--out", str(tmp_path / "used")])
    assert e.value.code == 2 and "not an empty folder" in capsys.readouterr().err
    assert (tmp_path / "used" / "keep.txt").read_text() == "x"
