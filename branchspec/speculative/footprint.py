"""What one speculative round allocates beyond the model and its page pools, and whether a
configuration's round fits in the memory there is: the check `SpecPolicy.check` runs when
a policy is made for an engine, so that a configuration that cannot run is refused before
any request, naming the knob, instead of failing (or swapping) mid-round.

A round's transient memory is dominated by three things, each counted here at the
engine's largest batch B, in bytes:

* the drafter's candidates (`growth.grow_trees`): after S steps of top-k growth it
  holds C = k + (S - 1) k^2 candidates, each with its ancestor set over the X = 1 + (S - 1) k
  expanded slots ([B, C, X] booleans) and its k proposed children ([B, C, k] ids), and
  every step scores k frontier nodes over the vocabulary ([B, k, V] logits);
* the verify pass over B x D nodes: the target's logits [B, D, V] and, for sampled
  requests, float64 probabilities, their sort and cumulative sums (`sampling`); the tree's
  ancestor matrix [B, D, D]; one layer's attention scores and the indexer's scores over
  every committed C4 entry;
* one layer's activations for those B x D tokens.

The estimate is the larger of the drafting and the verify peaks (their tensors do not
live at once). It is a model of the allocations, not a measurement: within a small factor,
which is what telling 69 GB from 69 MB needs.

The page pools themselves are sized by the user too (max_batch_size requests of
max_model_len tokens): `check_pool_memory` refuses pools that cannot fit before the engine
allocates them, naming the knob and the largest value that fits. Free memory
(`available_memory`) is the least of what the host, the process's cgroup and its address
space limit leave.
"""

from __future__ import annotations

from dataclasses import dataclass

from branchspec.config import ConfigError, ModelConfig, SpecConfig

# The share of the free memory a round may take: the rest is for the allocator's slack,
# the prefill of admitted requests and everything else in the process.
MEMORY_FRACTION = 0.8


@dataclass(frozen=True)
class RoundLimits:
    """What an engine can give a round: its largest batch, its longest request, the size
    of the model's floats and the free memory of its device (None: unknown, not checked)."""

    max_batch_size: int
    max_len: int
    dtype_bytes: int
    available_bytes: int | None
    device: str = "cpu"


def round_bytes(num_steps: int, topk: int, num_draft_tokens: int, cfg: ModelConfig, batch: int, max_len: int,
                dtype_bytes: int) -> dict[str, int]:
    """Bytes of each large transient of one round with these knobs (a SpecConfig's, or
    any others: only arithmetic) at `batch` requests, by part (see the module docstring);
    `peak_bytes` combines them."""
    S, k, D = num_steps, topk, num_draft_tokens
    B, V, e = batch, cfg.vocab_size, dtype_bytes
    C = k + (S - 1) * k * k                      # candidates after the last step
    X = 1 + (S - 1) * k                          # expanded slots (root included)
    heads = cfg.num_heads
    entries4 = max_len // 4 if any(c.ratio == 4 for c in cfg.compressed_kinds) else 0
    visible = cfg.window + D + (cfg.index_topk if entries4 else 0) + max_len // 128
    ffn = max(cfg.ffn_hidden, cfg.moe_hidden * max(cfg.num_experts_per_tok + cfg.num_shared_experts, 1))
    return {
        # drafting
        "draft: candidate ancestor sets": B * C * X + 3 * B * k * k * (X + k),
        "draft: candidate ids, scores and children": B * C * (8 * k + 32),
        "draft: frontier logits": B * k * V * (e + 8),
        "draft: attention": B * heads * k * (cfg.window + X) * 8,
        # verifying
        "verify: logits and sampling": B * D * V * (e + 24),
        "verify: tree plan": B * D * D * 9,
        "verify: attention": B * D * (heads * visible * 8 + cfg.index_num_heads * entries4 * 4),
        "verify: activations": B * D * (cfg.d_model * max(cfg.hc_mult, 1) * 8 + ffn * 3) * e,
    }


def peak_bytes(parts: dict[str, int]) -> int:
    draft = sum(v for n, v in parts.items() if n.startswith("draft"))
    return max(draft, sum(parts.values()) - draft)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


# The knob that shrinks a part, as its name starts.
_KNOB = {"draft": "topk", "verify": "num_draft_tokens"}


def _bytes(spec: SpecConfig, cfg: ModelConfig, limits: RoundLimits, **knobs) -> dict[str, int]:
    k = {"num_steps": spec.num_steps, "topk": spec.topk, "num_draft_tokens": spec.num_draft_tokens, **knobs}
    return round_bytes(k["num_steps"], k["topk"], k["num_draft_tokens"], cfg, limits.max_batch_size, limits.max_len,
                       limits.dtype_bytes)


def check_round_memory(spec: SpecConfig, cfg: ModelConfig, limits: RoundLimits | None) -> None:
    """ConfigError naming the knob when a round of `spec` at the engine's largest batch
    needs more than MEMORY_FRACTION of the free memory, with the largest value of that knob
    that would fit (or the batch that would)."""
    if limits is None or limits.available_bytes is None:
        return
    budget = MEMORY_FRACTION * limits.available_bytes
    parts = _bytes(spec, cfg, limits)
    need = peak_bytes(parts)
    if need <= budget:
        return
    worst = max(parts, key=parts.get)
    knob = _KNOB[worst.split(":")[0]]
    value = getattr(spec, knob)
    low, high = 0, value          # the largest value of the knob that fits, by bisection
    while low < high:
        mid = (low + high + 1) // 2
        if peak_bytes(_bytes(spec, cfg, limits, **{knob: mid})) <= budget:
            low = mid
        else:
            high = mid - 1
    smallest = 2 if knob == "num_draft_tokens" else 1
    if low >= smallest:
        advice = f"use {knob} <= {low} (the other knobs as they are)"
    else:   # the other phase alone is too large as well
        other = "verify" if knob == "topk" else "draft"
        alone = sum(v for n, v in _bytes(spec, cfg, limits, **{knob: smallest}).items() if n.startswith(other))
        advice = (f"even {knob}={smallest} leaves {_gib(alone)} for the {other} phase: use a smaller "
                  f"{_KNOB[other]} too, or a smaller max_batch_size")
    raise ConfigError(
        f"SpecConfig.{knob}={value}: a round of {spec.label} at the engine's batch of {limits.max_batch_size} "
        f"would allocate about {_gib(need)} ({worst.split(': ')[1]}: {_gib(parts[worst])}), more than the "
        f"{_gib(budget)} a round may take of the {_gib(limits.available_bytes)} free on {limits.device}; {advice}")


# -- the page pools ---------------------------------------------------------------------------

def pool_bytes(cfg: ModelConfig, max_seqs: int, max_len: int, page_size: int, dtype_bytes: int,
               num_pages: dict[str, int] | None = None) -> dict[str, int]:
    """Bytes of each kind's page pool (`cache.paged.PagedState`) for these sizes: its
    layers x (its pages + the sink page) x page_size slots x its width. `num_pages` as
    EngineConfig takes it."""
    from branchspec.cache.paged import default_num_pages, kind_specs

    given = dict(num_pages or {})
    return {s.name: len(s.layers) * (given.get(s.name, default_num_pages(s, max_seqs, max_len, page_size)) + 1)
            * page_size * s.width * dtype_bytes for s in kind_specs(cfg, page_size)}


def _largest(fits, high: int) -> int:
    """The largest n in [1, high] with fits(n) (fits is monotone), or 0 if none."""
    low = 0
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def check_pool_memory(cfg: ModelConfig, *, max_batch_size: int, max_len: int, page_size: int, dtype_bytes: int,
                      num_pages: dict[str, int] | None, available_bytes: int | None, device: str = "cpu",
                      max_len_given: bool = True) -> None:
    """ConfigError naming the knob when the page pools for `max_batch_size` requests of
    `max_len` tokens would take more than MEMORY_FRACTION of the free memory, with the
    largest value of it that fits: max_batch_size, else (a single request too large)
    max_model_len, else the num_pages given. `max_len_given`: max_model_len was the user's,
    not the model's max_position (the message says which)."""
    if available_bytes is None:
        return
    budget = MEMORY_FRACTION * available_bytes

    def total(batch: int = max_batch_size, length: int = max_len, pages=num_pages) -> int:
        return sum(pool_bytes(cfg, batch, length, page_size, dtype_bytes, pages).values())

    need = total()
    if need <= budget:
        return
    where = f"more than the {_gib(budget)} they may take of the {_gib(available_bytes)} free on {device}"
    length = f"max_model_len={max_len}" if max_len_given else f"max_model_len={max_len} (the model's max_position)"
    requests = f"{max_batch_size} request{'s' if max_batch_size != 1 else ''}"
    pools = f"the page pools for {requests} of up to {max_len} tokens would take {_gib(need)}"
    batch = _largest(lambda b: total(batch=b) <= budget, max_batch_size)
    if batch >= 1:
        raise ConfigError(f"max_batch_size={max_batch_size}: {pools}, {where}; use max_batch_size <= {batch} "
                          f"(or a smaller max_model_len)")
    length_fits = _largest(lambda n: total(batch=1, length=n) <= budget, max_len)
    if length_fits >= 1:
        raise ConfigError(f"{length}: {pools}, {where}, even one request's; use max_model_len <= {length_fits} "
                          f"(at max_batch_size=1)")
    given = dict(num_pages or {})
    parts = pool_bytes(cfg, 1, 1, page_size, dtype_bytes, given)
    kind = max(given, key=lambda k: parts[k]) if given else max(parts, key=parts.get)
    raise ConfigError(f"num_pages[{kind!r}]={given.get(kind, '?')}: {pools}, {where}; give fewer pages")


# -- free memory -------------------------------------------------------------------------------

def available_memory(device) -> int | None:
    """Free bytes on `device` (a torch.device): CUDA's own count; on the host the least of
    MemAvailable, what the process's cgroup limit leaves and what its address-space limit
    (RLIMIT_AS, `ulimit -v`) leaves; None where none can be read."""
    import torch

    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    known = [n for n in (_host_available(), _cgroup_available(), _address_space_available()) if n is not None]
    return min(known) if known else None


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def _cgroup_available() -> int | None:
    """The cgroup's memory limit less its usage (v2: memory.max; v1: limit_in_bytes)."""
    v1 = "/sys/fs/cgroup/memory/memory."
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         (v1 + "limit_in_bytes", v1 + "usage_in_bytes")):
        try:
            with open(limit) as f:
                text = f.read().strip()
            if text == "max":
                return None
            with open(usage) as f:
                return max(int(text) - int(f.read().strip()), 0)
        except (OSError, ValueError):
            continue
    return None


def _address_space_available() -> int | None:
    """RLIMIT_AS less the process's virtual size: past it every allocation fails, whatever
    the host has free."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return max(limit - int(line.split()[1]) * 1024, 0)
    except (ImportError, OSError, ValueError, IndexError):
        pass
    return None
