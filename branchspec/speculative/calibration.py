"""Measured acceptance for the calibrated draft-tree selection.

EAGLE-2 keeps the D - 1 nodes with the highest cumulative *draft* probability: it takes
the drafter's probability p of a child as its chance of being accepted. Whether the
target accepts it is another quantity: a well distilled drafter's first guess is right
far more often than its probability says, and a sibling's probability overstates its
chance. The calibrated selection (`SpecConfig(selection="calibrated")`) values a node by
the product, along its path, of

    q(edge) = min(1, p * c(cell)),    c(cell) = accepted / sum of p, over the cell's tries,

an estimate of P(the child is accepted | its parent was accepted): the drafter's own
probability, corrected by how often children like it were really accepted. A cell is
what is known when drafting: the child's depth, its rank among its siblings (order of
the drafter's probability), a bucket of p, and whether its parent is on the drafter's
main line (every node above it its parent's first proposal). Within a cell p keeps its
resolution, so with no evidence (c = 1) the selection is EAGLE-2's. Greedy and sampled
requests are kept apart (sampling accepts the target's draw, greedy its argmax), counts
decay, and each request's own counts start from the engine-wide ones.

Every verified round is an unbiased sample: at each node of the accepted path that the
drafter expanded, each of its k proposals was a try, and a hit when it is the target's
token there, whether or not the tree kept it. Selection depends on the drafter and past
rounds only, never on this round's target draws, so decoding stays lossless.
"""

from __future__ import annotations

import torch

# The probability buckets' upper edges (the last bucket is (0.9, 1]).
PROB_EDGES = (0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.9)
MAX_DEPTH = 16           # deeper edges share the last depth's estimates
GREEDY, SAMPLED = 0, 1


def bucket_of(prob: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """The probability bucket (by upper edges `edges`) of each drafter probability (same shape)."""
    return torch.bucketize(prob.to(torch.float64).contiguous(), edges.to(prob.device))


def edge_log_values(log_c: torch.Tensor, edges: torch.Tensor, depth: int, parent_main: torch.Tensor,
                    logp: torch.Tensor) -> torch.Tensor:
    """log q of the children of one step's parents: log_c [B, 2, MAX_DEPTH, R, buckets]
    (`AcceptanceModel.log_factors`); edges the buckets' upper edges; depth the children's
    depth (1 = the root's children); parent_main [B, P] bool; logp [B, P, k] the drafter's
    log-probabilities of each parent's top-k children, best first -> [B, P, k], never above
    0. A pure function of tensors (the compiled growth runs it in its graph)."""
    B, P, k = logp.shape
    R = log_c.shape[3]
    d = min(depth, MAX_DEPTH) - 1
    rank = torch.arange(k, device=logp.device).clamp(max=R - 1).expand(B, P, k)
    line = (~parent_main).long()[..., None].expand(B, P, k)
    bucket = bucket_of(logp.exp(), edges)
    table = log_c[:, :, d].to(logp.device)                                # [B, 2, R, buckets]
    b = torch.arange(B, device=logp.device)[:, None, None].expand(B, P, k)
    return (logp + table[b, line, rank, bucket].to(logp.dtype)).clamp(max=0.0)


class AcceptanceModel:
    """Decayed hits and probability mass of tries by (mode, request, main line, depth,
    rank, probability bucket): tables [2 main/off, MAX_DEPTH, ranks, buckets].

    Before any round every cell's factor c is 1 (the drafter taken at its word: the
    calibrated selection starts as EAGLE-2's), with the weight of `prior_observations`
    tries at the bucket's middle probability.
    """

    def __init__(self, max_rank: int = 8, decay: float = 0.9, prior_weight: float = 4.0,
                 prior_observations: float = 4.0, global_memory: int = 100):
        self.R, self.decay, self.prior_weight, self.prior_observations = max_rank, decay, prior_weight, \
            prior_observations
        self.global_memory = global_memory
        edges = torch.tensor((0.0, *PROB_EDGES, 1.0), dtype=torch.float64)
        self.edges = torch.tensor(PROB_EDGES, dtype=torch.float64)
        middle = (edges[:-1] + edges[1:]) / 2                                # [buckets]
        shape = (2, MAX_DEPTH, self.R, len(middle))
        # (hits, mass): accepted tries, and the drafter's probability summed over the tries
        self.prior_hits = middle.expand(shape).clone() * prior_observations
        self.prior_mass = self.prior_hits.clone()
        self.global_counts = [(self.prior_hits.clone(), self.prior_mass.clone()) for _ in (GREEDY, SAMPLED)]
        self.requests: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forget(self, seq_id: int) -> None:
        self.requests.pop(seq_id, None)

    def log_factors(self, seq_ids: list[int], modes: list[int]) -> torch.Tensor:
        """[B, 2, MAX_DEPTH, R, buckets] log c of each request's cells: its own counts
        shrunk towards the engine-wide ratio with `prior_weight` tries' mass."""
        rows = []
        for sid, mode in zip(seq_ids, modes):
            gh, gm = self.global_counts[mode]
            g = (gh + 1e-3 * self.prior_hits) / (gm + 1e-3 * self.prior_mass)   # never 0 / 0, however long unseen
            own = self.requests.get(sid)
            if own is None:
                rows.append(g)
            else:
                w = self.prior_mass * (self.prior_weight / self.prior_observations)   # the mass of prior_weight tries
                rows.append((own[0] + w * g) / (own[1] + w))
        return torch.stack(rows).clamp(min=1e-3).log()

    def bucket(self, prob: torch.Tensor) -> torch.Tensor:
        """The probability bucket of each drafter probability (same shape)."""
        return bucket_of(prob, self.edges)

    def edge_log_values(self, log_c: torch.Tensor, depth: int, parent_main: torch.Tensor,
                        logp: torch.Tensor) -> torch.Tensor:
        """`edge_log_values` with this model's buckets."""
        return edge_log_values(log_c, self.edges, depth, parent_main, logp)

    @torch.no_grad()
    def observe(self, seq_ids: list[int], modes: list[int], children: torch.Tensor, children_logp: torch.Tensor,
                targets: torch.Tensor) -> None:
        """One verified round: children [B, D, k] the drafter's proposals after each
        accepted-path node (-1: not expanded), children_logp [B, D, k] their drafter
        log-probabilities, targets [B, D] the target's token at each path node (-1 past
        the path)."""
        D, k = min(children.shape[1], MAX_DEPTH), min(children.shape[2], self.R)
        ch, p = children[:, :D, :k].cpu(), children_logp[:, :D, :k].cpu().double().exp()
        tg = targets[:, :D, None].cpu()
        valid = (ch >= 0) & (tg >= 0)                                       # [B, D, k]
        hit = valid & (ch == tg)
        main = torch.ones(hit.shape[:2], dtype=torch.bool)                  # path node i on the main line
        main[:, 1:] = torch.cumprod(hit[:, :-1, 0].long(), dim=1).bool()
        bucket = self.bucket(p)                                             # [B, D, k]
        shape = self.prior_hits.shape
        gd = max(self.decay ** (1.0 / len(seq_ids)), 1.0 - 1.0 / self.global_memory)
        line_of = (~main).long()[..., None].expand_as(ch)
        depth = torch.arange(D)[:, None].expand(D, k)
        rank = torch.arange(k)[None].expand(D, k)
        for b, (sid, mode) in enumerate(zip(seq_ids, modes)):
            h, m = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
            idx = (line_of[b], depth, rank, bucket[b])
            m.index_put_(tuple(i[valid[b]] for i in idx), p[b][valid[b]], accumulate=True)
            h.index_put_(tuple(i[hit[b]] for i in idx), torch.ones(int(hit[b].sum()), dtype=torch.float64),
                         accumulate=True)
            own = self.requests.get(sid)
            if own is None:
                self.requests[sid] = (h, m)
            else:
                own[0].mul_(self.decay).add_(h)
                own[1].mul_(self.decay).add_(m)
            # Engine-wide: one decay every batch-size rounds, with a memory of at least
            # `global_memory` rounds.
            gh, gm = self.global_counts[mode]
            gh.mul_(gd).add_(h)
            gm.mul_(gd).add_(m)
