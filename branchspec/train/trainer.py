"""`branchspec train`: joint training of the target and its MTP drafter on the workloads.

Next-token loss for the target plus a weighted next-next-token loss for the MTP block,
AdamW with linear warm-up and cosine decay, periodic held-out evaluation (perplexity per
workload and the drafter's top-1 agreement with the target), resumable state, a loss-curve
PNG, and an exported checkpoint folder (config.json, model.safetensors, tokenizer).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from branchspec.atomic import write_atomically, write_text
from branchspec.checkpoint import save_checkpoint
from branchspec.config import ModelConfig, check_float, tiny_config, v4_mini_config, v4_mini_v2_config
from branchspec.machine import cpu_model_name
from branchspec.data.tokenizer import Tokenizer, train_tokenizer
from branchspec.model.init import init_weights
from branchspec.model.model import Transformer
from branchspec.train.corpora import CORPORA, corpus_fingerprint
from branchspec.train.data import BatchSampler, Streams, documents, eval_windows
from branchspec.train import state
from branchspec.train.losses import lm_losses

MODEL_PRESETS = {"v4-mini": v4_mini_config, "v4-mini-v2": v4_mini_v2_config, "tiny": tiny_config}
PRECISIONS = ("auto", "float32", "bfloat16")
TRAINABLE = ("gsm8k", "mbpp", "sharegpt", *CORPORA)


def check_mix(mix: dict[str, float]) -> None:
    """ValueError unless `mix` names known sources with non-negative weights of positive sum."""
    unknown = set(mix) - set(TRAINABLE)
    if unknown:
        raise ValueError(f"unknown mix source(s) {sorted(unknown)}; choose from {list(TRAINABLE)}")
    if not mix or any(not (w >= 0) for w in mix.values()) or sum(mix.values()) <= 0:
        raise ValueError(f"mix weights must be non-negative with a positive sum, got {mix}")


@dataclass
class TrainConfig:
    out: str = "runs/v4-mini"
    model: str = "v4-mini"
    steps: int = 600
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 40
    weight_decay: float = 0.1
    mtp_weight: float = 0.3
    eval_every: int = 100
    eval_windows: int = 8
    save_every: int = 50
    seed: int = 0
    vocab_size: int = 8192
    mix: dict = field(default_factory=lambda: {"gsm8k": 0.3, "mbpp": 0.25, "sharegpt": 0.45})
    # ShareGPT is far larger than the budget can read; cap the characters tokenized.
    max_chars: dict = field(default_factory=lambda: {"sharegpt": 16_000_000})
    tokenizer_chars: int = 8_000_000
    mbpp_path: str | None = None
    # A folder whose tokenizer.json to reuse (keeps per-token perplexity comparable).
    tokenizer_from: str | None = None
    # Autocast precision of the training step; "auto" takes bfloat16 only where the CPU
    # multiplies it natively (AMX or AVX512-BF16) and a timed probe of the model itself
    # finds it faster, see `resolve_precision`. Evaluation is float32.
    precision: str = "auto"
    # After a resume from the compact pack (weights only), Adam's moments are rebuilt over
    # this many batches at learning rate 0 before training goes on.
    reestimate_steps: int = 20
    # torch.compile the model's forward for training (inductor; compiled, the MoE runs every
    # expert on every token, weighted by its routing). Evaluation and the exported weights
    # are unaffected.
    compile: bool = False

    def __post_init__(self):
        if self.model not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {self.model!r}; choose from {sorted(MODEL_PRESETS)}")
        for name in ("steps", "batch_size", "seq_len", "eval_every", "save_every", "eval_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose from {PRECISIONS}")
        check_mix(self.mix)
        for name in ("lr", "min_lr_ratio", "weight_decay", "mtp_weight"):   # NaN would train on silently
            check_float(None, name, getattr(self, name))
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.mtp_weight < 0:
            raise ValueError(f"mtp_weight must be >= 0 (0: the drafter is not trained), got {self.mtp_weight}")


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def _tokenizer(cfg: TrainConfig, out: Path) -> Tokenizer:
    if (out / "tokenizer.json").is_file():
        return Tokenizer.from_dir(out)
    if cfg.tokenizer_from is not None:
        tok = Tokenizer.from_dir(cfg.tokenizer_from)
        tok.save(out)
        return tok

    def sample():
        for name in cfg.mix:
            chars = 0
            for doc in documents(name, cfg.mbpp_path):
                yield doc
                chars += len(doc)
                if chars >= cfg.tokenizer_chars / len(cfg.mix):
                    break
    tok = train_tokenizer(sample(), vocab_size=cfg.vocab_size)
    tok.save(out)
    return tok


def bf16_is_fast() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX or AVX512-BF16). Without either,
    oneDNN emulates bf16 and a matmul runs far slower than in float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags for f in ("amx_bf16", "avx512_bf16"))


def step_seconds(model_cfg: ModelConfig, precision: str, batch_size: int, seq_len: int,
                 repeats: int = 2) -> float:
    """Median seconds of one training step (forward, backward, AdamW) of a fresh model of
    `model_cfg` in `precision`, eager, on random tokens; the first step is not timed."""
    model = init_weights(Transformer(model_cfg), seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(0)
    times = []
    for i in range(repeats + 1):
        ids = torch.randint(3, model_cfg.vocab_size, (batch_size, seq_len), generator=g)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
            main, nxt = lm_losses(model, ids)
        loss = main if nxt is None else main + nxt
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def resolve_precision(precision: str, model_cfg: ModelConfig | None = None, batch_size: int = 2,
                      seq_len: int = 512) -> tuple[str, dict[str, float]]:
    """The autocast precision to train in, and the probe timings behind an "auto" choice.

    "auto" is float32 unless the CPU multiplies bf16 natively; where it does, the flag is
    not enough (bf16 autocast adds casts that can cost more than the faster matmuls save
    on a small model), so both precisions time a few steps of the model itself and
    bfloat16 is taken only if it is at least 5% faster."""
    if precision != "auto":
        return precision, {}
    if not bf16_is_fast() or model_cfg is None:
        return "float32", {}
    probe = {p: step_seconds(model_cfg, p, batch_size, seq_len) for p in ("float32", "bfloat16")}
    return ("bfloat16" if probe["bfloat16"] < 0.95 * probe["float32"] else "float32"), probe


@torch.no_grad()
def evaluate(model: Transformer, windows: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """Held-out next-token loss / perplexity, MTP loss and the drafter's top-1 agreement with
    the target's greedy token, per workload."""
    model.eval()
    V = model.cfg.vocab_size
    report = {}
    for name, ids in windows.items():
        losses, mtp_losses, agree, total = [], [], 0, 0
        for row in ids.split(4):
            out, mtp = model.full_forward(row, with_mtp=True)
            losses.append(F.cross_entropy(out.logits[:, :-1].reshape(-1, V), row[:, 1:].reshape(-1)).item())
            mtp_losses.append(F.cross_entropy(mtp.logits[:, 1:-1].reshape(-1, V), row[:, 2:].reshape(-1)).item())
            # Drafter slot p and target position p both predict x_{p+1}.
            agree += (mtp.logits[:, 1:].argmax(-1) == out.logits[:, 1:].argmax(-1)).sum().item()
            total += row[:, 1:].numel()
        loss = sum(losses) / len(losses)
        report[name] = {"loss": loss, "ppl": math.exp(loss), "mtp_loss": sum(mtp_losses) / len(mtp_losses),
                        "mtp_top1_agreement": agree / total}
    model.train()
    return report


def plot_losses(history: list[dict], evals: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["loss"] for h in history], label="train: target", lw=0.8)
    ax.plot(steps, [h["mtp_loss"] for h in history], label="train: MTP", lw=0.8, alpha=0.7)
    for name in (evals[0]["report"] if evals else {}):
        ax.plot([e["step"] for e in evals], [e["report"][name]["loss"] for e in evals], "o-",
                label=f"held-out {name}", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title("v4-mini training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")   # `path` may be a temporary name
    plt.close(fig)


def train(cfg: TrainConfig, resume: bool = False, export: str | Path | None = None,
          progress: bool = True, stop_after: int | None = None) -> Path | None:
    """Run (or resume) training; returns the exported checkpoint folder.

    `resume` continues from OUT/state.json (exact: weights, Adam moments, sampler), else
    from OUT's compact pack (weights and sampler; moments rebuilt); see `train.state`. A
    folder with neither, or only an older version's pickled state.pt, is refused
    (ResumeError naming the file), as is an OUT that is a file. `stop_after` ends this run
    after that many steps (state saved, nothing exported, None returned) without changing
    the schedule, so a long run can be split across sittings and machines."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"the run folder {out} is a file; give --out a folder (new or a run's)")
    source = state.resume_source(out) if resume else None
    if source is not None:
        state.check_resumable(out, source, cfg.steps)     # before any work
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    t_setup = time.perf_counter()
    tok = _tokenizer(cfg, out)
    model_cfg: ModelConfig = MODEL_PRESETS[cfg.model](vocab_size=tok.vocab_size, bos_token_id=tok.bos_id,
                                                       eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    streams = Streams.build(tok, tuple(cfg.mix), cfg.max_chars, cfg.mbpp_path)
    sampler = BatchSampler(streams.train, cfg.mix, cfg.batch_size, cfg.seq_len, cfg.seed)
    windows = {w: eval_windows(s, cfg.seq_len, cfg.eval_windows) for w, s in streams.eval.items()}
    # Compiled, the MoE runs every expert on every token (no shape follows the routing).
    dispatch = "dense" if cfg.compile else "grouped"
    model = init_weights(Transformer(model_cfg, expert_dispatch=dispatch), seed=cfg.seed).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    precision, precision_probe = resolve_precision(cfg.precision, model_cfg, seq_len=cfg.seq_len)
    if cfg.compile:
        model.forward = torch.compile(model.forward)
    step, history, evals, elapsed, sittings = 0, [], [], 0.0, []
    reestimate = 0
    if source is not None:
        if source == "state":
            st, where = state.load_state(out, model, opt, cfg.steps), out / state.STATE_FILE
        else:
            st, where = state.load_pack(out, model, cfg.steps), out / state.PACK_STATE
            reestimate = cfg.reestimate_steps
        try:
            sampler.set_state(st["sampler"])
        except (KeyError, TypeError, ValueError) as e:
            raise state.ResumeError(f"{where}: field 'sampler' is not a batch sampler's state ({e})") from None
        step, history, evals, elapsed = st["step"], st["history"], st["evals"], st["elapsed"]
        sittings = st.get("sittings", [])
    state.remove_leftovers(out)                  # what interrupted saves left behind
    write_text(out / "train_config.json", json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    setup_seconds = time.perf_counter() - t_setup
    sitting = {"start_step": step, "precision": precision, "compile": cfg.compile, "threads": torch.get_num_threads(),
               "cpu": cpu_model_name(), "torch": torch.__version__, "precision_probe_seconds": precision_probe,
               "resumed_from": {"state": state.STATE_FILE, "pack": "pack", None: None}[source]}
    sittings.append(sitting)

    def record() -> dict:
        return {"step": step, "sampler": sampler.state(), "history": history, "evals": evals,
                "elapsed": elapsed, "sittings": sittings}

    def save_state():
        sitting.update(end_step=step)
        state.save_state(out, model.state_dict(), opt.state_dict(), record())
        state.save_pack(out, model, record())
        write_atomically(out / "loss.png", lambda tmp: plot_losses(history, evals, tmp))

    def losses(ids):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
            main, nxt = lm_losses(model, ids)
        return main, nxt

    if reestimate:
        # Rebuild Adam's moments at learning rate 0 on batches from a side stream, so the
        # weights and the training sampler's stream stay where the pack left them.
        side = BatchSampler(streams.train, cfg.mix, cfg.batch_size, cfg.seq_len, cfg.seed + 1_000_003 + step)
        for group in opt.param_groups:
            group["lr"] = 0.0
        for _ in range(reestimate):
            main, nxt = losses(next(side))
            opt.zero_grad(set_to_none=True)
            (main + cfg.mtp_weight * nxt).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        sitting["reestimated_steps"] = reestimate

    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, initial=step, desc="train", unit="step")
    tokens_per_step = cfg.batch_size * cfg.seq_len
    end = cfg.steps if stop_after is None else min(cfg.steps, step + stop_after)

    with _stop_on_sigterm() as stop_requested:
        while step < end and not stop_requested():
            t0 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            main, nxt = losses(next(sampler))
            loss = main + cfg.mtp_weight * nxt
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
            opt.step()
            dt = time.perf_counter() - t0
            elapsed += dt
            step += 1
            history.append({"step": step, "loss": main.item(), "mtp_loss": nxt.item(), "lr": lr_at(step - 1, cfg),
                            "grad_norm": grad_norm, "tok_per_s": tokens_per_step / dt})
            if bar is not None:
                bar.set_postfix(loss=f"{main.item():.3f}", mtp=f"{nxt.item():.3f}", tok_s=f"{tokens_per_step / dt:.0f}")
                bar.update(1)
            if step % cfg.eval_every == 0 or step == cfg.steps:
                evals.append({"step": step, "report": evaluate(model, windows)})
                with open(out / "train_log.jsonl", "a") as f:
                    f.write(json.dumps(evals[-1]) + "\n")
            if step % cfg.save_every == 0 or step == end:
                save_state()
        if step % cfg.save_every != 0 and step != end:
            save_state()    # stopped by SIGTERM between saves
    if bar is not None:
        bar.close()
    if step < cfg.steps:
        return None

    folder = Path(export) if export is not None else out / "checkpoint"
    recent = history[-20:]
    info = {
        "model_config": model_cfg.to_dict(), "train_config": dataclasses.asdict(cfg), "steps": step,
        "tokens_seen": step * tokens_per_step, "train_seconds": round(elapsed, 1),
        "setup_seconds": round(setup_seconds, 1), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "precision": precision, "sittings": sittings,
        "final_train_loss": sum(h["loss"] for h in recent) / max(1, len(recent)),
        "final_train_mtp_loss": sum(h["mtp_loss"] for h in recent) / max(1, len(recent)),
        "held_out": evals[-1]["report"] if evals else {},
        "train_tokens_available": {w: int(len(s)) for w, s in streams.train.items()},
        "corpora": {w: corpus_fingerprint(w) for w in streams.train if w in CORPORA},
    }
    save_checkpoint(model.eval(), folder, dtype="bfloat16", metadata={"training": info})
    tok.save(folder)
    write_text(folder / "training.json", json.dumps(info, indent=2) + "\n")
    write_atomically(folder / "loss.png", lambda tmp: plot_losses(history, evals, tmp))
    return folder


class _stop_on_sigterm:
    """Within the block, SIGTERM asks the loop to stop after the current step (state is
    then saved) instead of killing the process mid-write. Main thread only."""

    def __enter__(self):
        import signal
        import threading

        self.flag, self.previous = False, None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._handle)
        return lambda: self.flag

    def _handle(self, signum, frame):
        self.flag = True

    def __exit__(self, *exc):
        import signal

        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
        return False
