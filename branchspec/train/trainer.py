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

from branchspec.config import ModelConfig, tiny_config, v4_mini_config
from branchspec.data.tokenizer import Tokenizer, train_tokenizer
from branchspec.data.workloads import training_text
from branchspec.model.model import Transformer
from branchspec.model.weights import init_weights, save_checkpoint
from branchspec.train.data import BatchSampler, Streams, eval_windows
from branchspec.train.losses import lm_losses

MODEL_PRESETS = {"v4-mini": v4_mini_config, "tiny": tiny_config}


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

    def __post_init__(self):
        if self.model not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {self.model!r}; choose from {sorted(MODEL_PRESETS)}")
        for name in ("steps", "batch_size", "seq_len", "eval_every", "save_every", "eval_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def _tokenizer(cfg: TrainConfig, out: Path) -> Tokenizer:
    if (out / "tokenizer.json").is_file():
        return Tokenizer.from_dir(out)

    def sample():
        for name in cfg.mix:
            chars = 0
            for doc in training_text(name, mbpp_path=cfg.mbpp_path):
                yield doc
                chars += len(doc)
                if chars >= cfg.tokenizer_chars / len(cfg.mix):
                    break
    tok = train_tokenizer(sample(), vocab_size=cfg.vocab_size)
    tok.save(out)
    return tok


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
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train(cfg: TrainConfig, resume: bool = False, export: str | Path | None = None,
          progress: bool = True, stop_after: int | None = None) -> Path | None:
    """Run (or resume) training; returns the exported checkpoint folder.

    `stop_after` ends this run after that many steps (state saved, nothing exported, None
    returned) without changing the schedule, so a long run can be split across sittings."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    t_setup = time.perf_counter()
    tok = _tokenizer(cfg, out)
    model_cfg: ModelConfig = MODEL_PRESETS[cfg.model](vocab_size=tok.vocab_size, bos_token_id=tok.bos_id,
                                                       eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    streams = Streams.build(tok, tuple(cfg.mix), cfg.max_chars, cfg.mbpp_path)
    sampler = BatchSampler(streams.train, cfg.mix, cfg.batch_size, cfg.seq_len, cfg.seed)
    windows = {w: eval_windows(s, cfg.seq_len, cfg.eval_windows) for w, s in streams.eval.items()}
    model = init_weights(Transformer(model_cfg), seed=cfg.seed).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    state_path = out / "state.pt"
    step, history, evals, elapsed = 0, [], [], 0.0
    if resume and state_path.is_file():
        st = torch.load(state_path, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        sampler.set_state(st["sampler"])
        step, history, evals, elapsed = st["step"], st["history"], st["evals"], st["elapsed"]
    (out / "train_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    setup_seconds = time.perf_counter() - t_setup

    def save_state():
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "sampler": sampler.state(),
                    "step": step, "history": history, "evals": evals, "elapsed": elapsed}, state_path)
        plot_losses(history, evals, out / "loss.png")

    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, initial=step, desc="train", unit="step")
    tokens_per_step = cfg.batch_size * cfg.seq_len
    end = cfg.steps if stop_after is None else min(cfg.steps, step + stop_after)
    while step < end:
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        ids = next(sampler)
        main, nxt = lm_losses(model, ids)
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
    if bar is not None:
        bar.close()
    if step < cfg.steps:
        return None

    folder = Path(export) if export is not None else out / "checkpoint"
    info = {
        "model_config": model_cfg.to_dict(), "train_config": dataclasses.asdict(cfg), "steps": step,
        "tokens_seen": step * tokens_per_step, "train_seconds": round(elapsed, 1),
        "setup_seconds": round(setup_seconds, 1), "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "final_train_loss": sum(h["loss"] for h in history[-20:]) / max(1, len(history[-20:])),
        "final_train_mtp_loss": sum(h["mtp_loss"] for h in history[-20:]) / max(1, len(history[-20:])),
        "held_out": evals[-1]["report"] if evals else {},
        "train_tokens_available": {w: int(len(s)) for w, s in streams.train.items()},
    }
    save_checkpoint(model.eval(), folder, dtype="bfloat16", metadata={"training": info})
    tok.save(folder)
    (folder / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    plot_losses(history, evals, folder / "loss.png")
    return folder
