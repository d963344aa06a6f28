"""Fine-tune a checkpoint's MTP drafter to its own target, with the target frozen.

During training the MTP block learns the next-next token of the *text*; what speculation
needs is the token the *target* will pick. `distill_drafter` keeps every target weight
(embedding and head included, which the drafter shares) and trains only the MTP block on
the target's own distribution: at drafter slot p, KL(target(. | x_<=p) || drafter(. | h_p-1,
x_p)), both predicting x_{p+1}. The target's greedy outputs cannot change (its weights are
untouched); the drafter's agreement with them is what moves.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from branchspec.checkpoint import load_checkpoint, save_checkpoint
from branchspec.checkpoint.folder import check_new_folder, new_folder
from branchspec.data.tokenizer import Tokenizer
from branchspec.model.metadata import chain_meta
from branchspec.train.data import BatchSampler, Streams, eval_windows
from branchspec.train.trainer import check_mix, evaluate


@dataclass(frozen=True)
class DistillConfig:
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 1e-3
    warmup: int = 20
    # Training text the target reads (the drafter learns where the target will be asked).
    mix: dict[str, float] = field(default_factory=lambda: {"gsm8k": 0.2, "mbpp": 0.1, "pycode": 0.2,
                                                            "sharegpt": 0.5})
    max_chars: dict[str, int] = field(default_factory=lambda: {"sharegpt": 8_000_000})
    mbpp_path: str | None = None
    seed: int = 1
    eval_windows: int = 16

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "warmup", "eval_windows"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < (0 if name == "warmup" else 1):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        check_mix(self.mix)


def _lr(step: int, cfg: DistillConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def drafter_kl(model, ids: torch.Tensor) -> torch.Tensor:
    """ids: [B, T] -> mean KL(target || drafter) over drafter slots 1..T-1 (slot 0 has no
    hidden state before it). Gradients reach only the MTP block."""
    B, T = ids.shape
    with torch.no_grad():
        meta = chain_meta(torch.zeros(B, dtype=torch.long, device=ids.device), T, model.cfg.compressed_kinds)
        out = model(ids, meta)
        prev = torch.cat([torch.zeros_like(out.hidden[:, :1]), out.hidden[:, :-1]], dim=1)
        target_logp = F.log_softmax(out.logits[:, 1:].float(), dim=-1)              # [B, T-1, V]
    mtp = model.mtp_forward(ids, prev, chain_meta(meta.num_committed, T, ()))
    drafter_logp = F.log_softmax(mtp.logits[:, 1:].float(), dim=-1)                 # [B, T-1, V]
    return F.kl_div(drafter_logp.flatten(0, 1), target_logp.flatten(0, 1), log_target=True,
                    reduction="batchmean")


def _stored_dtype(folder: Path) -> torch.dtype:
    from safetensors import safe_open

    path = folder / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not a branchspec checkpoint folder (no model.safetensors)")
    with safe_open(str(path), "pt") as f:
        return f.get_tensor("embed.weight").dtype


def distill_drafter(checkpoint: str | Path, out: str | Path, cfg: DistillConfig = DistillConfig(),
                    progress: bool = True) -> Path:
    """Write `out`: `checkpoint` (a branchspec folder) with its MTP block fine-tuned to
    the target, weights stored in the source's dtype so the target's are bit for bit the
    same; its tokenizer; and training.json extended with a record in `drafter_distillations`
    (settings, loss history, held-out numbers before and after). `out` must not exist or be
    empty; it is written all or nothing."""
    src, out = Path(checkpoint), Path(out)
    check_new_folder(out)            # before minutes of work, not after
    stored = _stored_dtype(src)
    model = load_checkpoint(src, "float32")
    if not model.mtp:
        raise ValueError(f"{src} has no MTP drafter to fine-tune")
    tok = Tokenizer.from_dir(src)
    torch.manual_seed(cfg.seed)
    streams = Streams.build(tok, tuple(cfg.mix), cfg.max_chars, cfg.mbpp_path)
    sampler = BatchSampler(streams.train, cfg.mix, cfg.batch_size, cfg.seq_len, cfg.seed)
    windows = {w: eval_windows(s, cfg.seq_len, cfg.eval_windows) for w, s in streams.eval.items()}

    trained = [p for n, p in model.named_parameters() if n.startswith("mtp.")]
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith("mtp."))
    before = evaluate(model, windows)
    opt = torch.optim.AdamW(trained, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    history, t_start = [], time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, desc="distill drafter", unit="step")
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        loss = drafter_kl(model, next(sampler))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        history.append({"step": step + 1, "kl": loss.item()})
        if bar is not None:
            bar.set_postfix(kl=f"{loss.item():.3f}")
            bar.update(1)
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t_start
    model.eval()
    after = evaluate(model, windows)

    info = json.loads((src / "training.json").read_text()) if (src / "training.json").is_file() else {}
    # Distillations stack (each starts from the last one's drafter): keep every record.
    earlier = info.pop("drafter_distillations", None) or []
    if "drafter_distillation" in info:
        earlier.append(info.pop("drafter_distillation"))
    info["drafter_distillations"] = [*earlier, {
        "config": asdict(cfg), "source": str(src), "seconds": round(seconds, 1),
        "trained_parameters": sum(p.numel() for p in trained), "history": history,
        "held_out_before": before, "held_out_after": after,
    }]
    with new_folder(out) as tmp:     # all or nothing: an interrupted write leaves no half checkpoint
        save_checkpoint(model, tmp, dtype=stored, metadata={"training": info})
        tok.save(tmp)
        (tmp / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    return out
