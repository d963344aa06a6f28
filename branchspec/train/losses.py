"""Training objectives: next-token loss for the target, next-next-token loss for the MTP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from branchspec.model.model import Transformer


def lm_losses(model: Transformer, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids: [B, T] -> (target loss, MTP loss).

    The target at p predicts x_{p+1}. The MTP at p sees x_p and the target's hidden state
    at p - 1 and predicts x_{p+1}: one token further than that hidden state's own
    prediction, as DeepSeek trains its MTP module.
    """
    out, mtp = model.full_forward(ids, with_mtp=bool(model.mtp))
    V = model.cfg.vocab_size
    main = F.cross_entropy(out.logits[:, :-1].reshape(-1, V).float(), ids[:, 1:].reshape(-1))
    if mtp is None:
        return main, None
    # Position 0 has no hidden state before it; train the MTP from position 1 on.
    nxt = F.cross_entropy(mtp.logits[:, 1:-1].reshape(-1, V).float(), ids[:, 2:].reshape(-1))
    return main, nxt


def train_steps(model: Transformer, batches, lr: float = 3e-3, mtp_weight: float = 0.5,
                weight_decay: float = 0.0) -> list[float]:
    """A plain AdamW loop over an iterable of [B, T] id tensors; returns the total losses."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    history = []
    for ids in batches:
        main, nxt = lm_losses(model, ids)
        loss = main + mtp_weight * nxt if nxt is not None else main
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history.append(loss.item())
    model.eval()
    return history
