"""What a request's own rules do to the target's logits at a node, before a token is drawn.

Three rules, in vLLM v1's order: `logit_bias` is added; while fewer than `min_tokens`
tokens precede the node's token, the request's stop ids (EOS, the turn end, its
stop_token_ids) are banned; then the repetition, frequency and presence penalties. Greedy
takes the argmax of the result, sampling goes on to `sampling.sampling_probs`.

The rules depend on the output before the token being drawn. At a node of a speculative
round that output is the request's committed output plus the node's own path in the
draft tree (its ancestors below the root, and itself), never a sibling's: so each node's
distribution is exactly the one plain decoding would use after that same prefix, and the
round stays lossless. `NodePaths` says where every node sits; a plain decode step and the
first token after a prefill are one node at depth 0.

Logprobs are never taken from these logits: they stay vLLM's raw logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NodePaths:
    """Where each node of a step sits below its request's last emitted token (the root).

    The token drawn at node n of request b is output token num_output[b] + depth[b, n].
    """

    depth: torch.Tensor                  # [B, N] long, root (or a single node) = 0
    tokens: torch.Tensor | None = None   # [B, N] the nodes' own tokens (None: no node below a root)
    ancestor: torch.Tensor | None = None  # [B, N, N] bool, ancestor[b, n, m]: m is n or an ancestor of n

    @staticmethod
    def single(batch_size: int, device: torch.device | str = "cpu") -> "NodePaths":
        """One node per request at depth 0: a decode step, or the first token of a prefill."""
        return NodePaths(torch.zeros(batch_size, 1, dtype=torch.long, device=device))

    @staticmethod
    def tree(tokens: torch.Tensor, ancestor: torch.Tensor) -> "NodePaths":
        """The nodes of draft trees (node 0 the root): tokens [B, D], ancestor [B, D, D]."""
        return NodePaths(ancestor.sum(-1) - 1, tokens, ancestor)


@dataclass(frozen=True)
class LogitsRules:
    """The rules of a batch's requests, as tensors (`LogitsRules.build` from lists).

    Only the parts some request uses are set; the others are None.
    """

    num_output: torch.Tensor                         # [B] long, tokens emitted so far
    bias: torch.Tensor | None = None                 # [B, V] float64 added to the logits
    min_tokens: torch.Tensor | None = None           # [B] long
    stop_mask: torch.Tensor | None = None            # [B, V] bool, the ids min_tokens bans
    presence: torch.Tensor | None = None             # [B] float64
    frequency: torch.Tensor | None = None            # [B] float64
    repetition: torch.Tensor | None = None           # [B] float64
    output_counts: torch.Tensor | None = None        # [B, V] float64, times each id was emitted
    prompt_mask: torch.Tensor | None = None          # [B, V] bool, ids in the prompt

    @staticmethod
    def build(vocab_size: int, num_output: list[int], logit_bias: list[tuple[tuple[int, float], ...]],
              min_tokens: list[int], stop_ids: list[frozenset[int]], penalties: list[tuple[float, float, float]],
              output_ids: list[list[int]], prompt_ids: list[list[int]]) -> "LogitsRules | None":
        """From each request's settings (per request b: its tokens emitted so far, logit bias
        pairs, min_tokens and stop ids, (presence, frequency, repetition) penalties, output
        and prompt ids). None when no request has a rule that can act."""
        B, V = len(num_output), vocab_size
        biased = [b for b in range(B) if logit_bias[b]]
        banning = [b for b in range(B) if num_output[b] < min_tokens[b] and stop_ids[b]]
        penalised = [b for b in range(B) if penalties[b] != (0.0, 0.0, 1.0)]
        if not (biased or banning or penalised):
            return None
        rules: dict = {"num_output": torch.tensor(num_output, dtype=torch.long)}
        if biased:
            bias = torch.zeros(B, V, dtype=torch.float64)
            for b in biased:
                ids, values = zip(*logit_bias[b])
                bias[b, list(ids)] = torch.tensor(values, dtype=torch.float64)
            rules["bias"] = bias
        if banning:
            mask = torch.zeros(B, V, dtype=torch.bool)
            for b in banning:
                mask[b, sorted(stop_ids[b])] = True
            rules["min_tokens"] = torch.tensor(min_tokens, dtype=torch.long)
            rules["stop_mask"] = mask
        if penalised:
            p = torch.tensor(penalties, dtype=torch.float64)                             # [B, 3]
            rules["presence"], rules["frequency"], rules["repetition"] = p[:, 0], p[:, 1], p[:, 2]
            counts = torch.zeros(B, V, dtype=torch.float64)
            prompt = torch.zeros(B, V, dtype=torch.bool)
            for b in penalised:
                if output_ids[b]:
                    counts[b].index_add_(0, torch.tensor(output_ids[b]), torch.ones(len(output_ids[b]),
                                                                                     dtype=torch.float64))
                prompt[b, prompt_ids[b]] = True
            rules["output_counts"], rules["prompt_mask"] = counts, prompt
        return LogitsRules(**rules)

    def rows(self, index: list[int]) -> "LogitsRules":
        """The same for the requests at `index`."""
        return LogitsRules(**{name: None if t is None else t[index] for name, t in vars(self).items()})


def process_logits(logits: torch.Tensor, rules: LogitsRules | None, paths: NodePaths) -> torch.Tensor:
    """The logits tokens are drawn from: logits [B, N, V] -> [B, N, V] (float64 where a
    rule acted, else `logits` itself). Each node's row depends on its own prefix only."""
    if rules is None:
        return logits
    device = logits.device
    out = logits.double()
    if rules.bias is not None:
        out = out + rules.bias.to(device)[:, None, :]
    if rules.stop_mask is not None:
        index = rules.num_output.to(device)[:, None] + paths.depth.to(device)                   # [B, N]
        early = index < rules.min_tokens.to(device)[:, None]                                    # [B, N]
        out = out.masked_fill(early[..., None] & rules.stop_mask.to(device)[:, None, :], float("-inf"))
    if rules.output_counts is not None:
        out = _penalise(out, rules, paths)
    return out


def _penalise(logits: torch.Tensor, rules: LogitsRules, paths: NodePaths) -> torch.Tensor:
    """vLLM's `apply_penalties` at every node: logits [B, N, V] float64."""
    device = logits.device
    B, N, V = logits.shape
    counts = rules.output_counts.to(device)[:, None, :].expand(B, N, V)                   # [B, N, V]
    if paths.tokens is not None and N > 1:
        # The node's own path below the root: its ancestors-or-self at depth >= 1.
        below_root = paths.ancestor.to(device) & (paths.depth.to(device) > 0)[:, None, :]   # [B, N, N]
        onehot = torch.nn.functional.one_hot(paths.tokens.to(device), V).double()          # [B, N, V]
        counts = counts + torch.bmm(below_root.double(), onehot)
    seen = counts > 0                                                                     # [B, N, V]
    repetition = rules.repetition.to(device)[:, None, None]
    factor = torch.where(seen | rules.prompt_mask.to(device)[:, None, :], repetition, torch.ones_like(repetition))
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    logits = logits - rules.frequency.to(device)[:, None, None] * counts
    return logits - rules.presence.to(device)[:, None, None] * seen.double()
