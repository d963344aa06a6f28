"""regime.md and regime.png from a regime run's JSON (`bench.regime.run`)."""

from __future__ import annotations

from pathlib import Path


def _k(d: dict) -> dict:
    """JSON's string keys back to integers, one level."""
    return {int(k): v for k, v in d.items()}


def _ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}" if ms < 10_000 else f"{ms:.0f}"


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def _context_name(ctx: int) -> str:
    return f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)


def regime_markdown(payload: dict) -> str:
    env, plan, proj = payload["environment"], payload["plan"], payload["projection"]
    depths = payload["depths"]
    lines = ["# The paper's regime: round costs at DeepSeek-V4-Flash's layer shapes", "",
             f"Measured on {env['device_name']} ({env['device']}, {env['threads']} threads), {env['dtype']}, "
             f"{env['path']} path, torch {env['torch']}; depths of "
             f"{' and '.join(str(d['num_layers']) for d in depths)} layers, projected to {proj['layers']}; "
             f"medians of {plan['repeats']} timed calls each, the calls of a cell (both depths) taken in turn; "
             f"{payload['wall_seconds']:.0f} s in all.", ""]
    experts = {int(m): s for m, s in payload.get("expert_seconds", {}).items()}
    if experts:
        lines += ["One routed expert (its SwiGLU, as the grouped dispatch runs it) over m tokens: " +
                  ", ".join(f"{m}: {_ms(s)} ms" for m, s in sorted(experts.items())) + ".", ""]
    for name, variant in proj["variants"].items():
        lines += [f"## Costs with {name}", ""]
        noise = variant.get("noise")
        if noise:
            lines += [f"Noise: the chain's and the tree's verify passes of the same D (the same work but for "
                      f"their plans) differ by {noise['median'] * 100:.0f}% in the median, at most "
                      f"{noise['max'] * 100:.0f}%, once projected; read single cells with that in mind.", ""]
        lines += _variant_tables(variant)
        lines += _gain_tables(variant)
        lines += _regularity_lines(variant.get("regularities", {}))
        lines.append("")
    costs = _costs(next(iter(proj["variants"].values())))
    batches = sorted(costs["plain"])
    contexts = sorted(int(c) for c in costs["plain"][batches[0]])
    budgets = sorted(int(D) for D in costs["verify_chain"][batches[0]][str(contexts[0])])
    lines += _measured_depths(depths, batches, contexts, budgets)
    return "\n".join(lines) + "\n"


def _costs(variant: dict) -> dict:
    return {call: _k(v) for call, v in variant["costs"].items()}


def _variant_tables(variant: dict) -> list[str]:
    costs = _costs(variant)
    baseline = _k(variant["plain_baseline"])
    batches = sorted(costs["plain"])
    contexts = sorted(int(c) for c in costs["plain"][batches[0]])
    budgets = sorted(int(D) for D in costs["verify_chain"][batches[0]][str(contexts[0])] if int(D) > 1)

    def cost(call, B, ctx, D):
        return costs[call][B][str(ctx)][str(D)]

    lines = ["### Verify cost of D nodes over one plain step (43 layers, projected)", "",
             "Plain step: the faster of the runner's decode step and the verify pass over the root alone.", "",
             "| batch | context | " + " | ".join(f"D={D}" for D in budgets)
             + " | decode step ms | root-only verify ms |",
             "|---|---|" + "---|" * (len(budgets) + 2)]
    for B in batches:
        for ctx in contexts:
            plain = baseline[B][str(ctx)]
            row = [f"{cost('verify_chain', B, ctx, D) / plain:.2f}" for D in budgets]
            root = costs["verify_chain"][B][str(ctx)].get("1")
            lines.append(f"| {B} | {_context_name(ctx)} | " + " | ".join(row) +
                         f" | {_ms(cost('plain', B, ctx, 1))} | {_ms(root) if root is not None else '-'} |")
    top = max(budgets)
    lines += ["", f"### Where a round's time goes at D = {top} (43 layers, projected; ms)", "",
              "| batch | context | plain step | chain: draft / verify / extend | tree: draft / verify / extend |",
              "|---|---|---|---|---|"]
    for B in batches:
        for ctx in contexts:
            parts = {k: " / ".join(_ms(cost(f"{c}_{k}" if c != "extend" else "extend", B, ctx, top))
                                   for c in ("draft", "verify", "extend"))
                     for k in ("chain", "tree")}
            lines.append(f"| {B} | {_context_name(ctx)} | {_ms(baseline[B][str(ctx)])} | {parts['chain']} | "
                         f"{parts['tree']} |")
    return lines


def _measured_depths(depths: list[dict], batches, contexts, budgets) -> list[str]:
    lines = ["## As measured (ms): plain step and chain verify at the smallest and largest D, per depth", "",
             "| layers | batch | context | plain | verify, smallest D | verify, largest D |",
             "|---|---|---|---|---|---|"]
    lo, hi = min(D for D in budgets if D > 1), max(budgets)
    for d in depths:
        c = d["costs"]
        for B in batches:
            for ctx in contexts:
                get = lambda call, D: c[call][str(B)][str(ctx)][str(D)]  # noqa: E731
                lines.append(f"| {d['num_layers']} | {B} | {_context_name(ctx)} | {_ms(get('plain', 1))} | "
                             f"{_ms(get('verify_chain', lo))} | {_ms(get('verify_chain', hi))} |")
    return lines


def _gain_tables(variant: dict) -> list[str]:
    lines = []
    for source, by_B in variant["gains"].items():
        by_B = _k(by_B)
        batches = sorted(by_B)
        contexts = sorted(int(c) for c in by_B[batches[0]])
        Ds = sorted(int(D) for D in by_B[batches[0]][str(contexts[0])])
        lines += ["", f"### Projected gains, accept lengths: {source}", "",
                  "Tree over chain at the same D (throughput), and each over plain decoding (x).", "",
                  "| batch | context | " + " | ".join(f"D={D} tree/chain | chain x | tree x" for D in Ds) + " |",
                  "|---|---|" + "---|---|---|" * len(Ds)]
        for B in batches:
            for ctx in contexts:
                cells = []
                for D in Ds:
                    g = by_B[B][str(ctx)][str(D)]
                    cells.append(f"{_pct(g['tree_vs_chain'])} | {g['chain_vs_plain']:.2f} | {g['tree_vs_plain']:.2f}")
                lines.append(f"| {B} | {_context_name(ctx)} | " + " | ".join(cells) + " |")
    return lines


def _regularity_lines(reg: dict) -> list[str]:
    """Each regularity under each source of accept lengths, as the numbers say it."""
    ctx = _context_name(reg["context"])
    lines = ["", f"### The paper's regularities, from these costs (context {ctx})", ""]
    for source, r in reg["R2"].items():
        for B, gains in _k(r["tree_vs_chain"]).items():
            trend = ", ".join(f"D={D}: {_pct(g)}" for D, g in zip(r["D"], gains))
            verdict = "grows" if r["grows"][str(B)] else "does not grow"
            lines.append(f"- R2 (the tree's gain grows with D), {source}, batch {B}: {trend}; it {verdict} "
                         f"from D={r['D'][0]} to D={r['D'][-1]}.")
    for source, r in reg["R4"].items():
        by = ", ".join(f"batch {B}: {_pct(g)}" for B, g in _k(r["tree_vs_chain"]).items())
        where = "between the smallest and the largest batch" if r["interior"] else "at an end of the batches measured"
        lines.append(f"- R4 (largest at small-to-medium batch), {source}, D={r['D']}: {by}; largest at batch "
                     f"{r['best_batch']}, {where}.")
    for source, r in reg["R5"].items():
        for B, v in _k(r["by_batch"]).items():
            lines.append(f"- R5 (throughput plateaus past D=6), {source}, batch {B}: from D={r['from']} to "
                         f"D={r['to']} the tree's accept length rises {_pct(v['accept_rise'])} and its throughput "
                         f"over plain {_pct(v['throughput_rise'])}: "
                         f"{'decoupled' if v['decoupled'] else 'still following the accept length'}.")
    if not reg["R2"]:
        lines.append("- no accept lengths at several D were given: R2 and R5 cannot be judged.")
    return lines


def regime_plot(payload: dict, path: Path) -> None:
    """Per cost variant (6 experts as measured; 256 with uniform routing), two panels:
    verify cost over one plain step against D per batch (43 layers, the middle context),
    and the tree's projected gain over the chain against D per batch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = payload["projection"]["variants"]
    fig, axes = plt.subplots(len(variants), 2, figsize=(11, 4 * len(variants)), squeeze=False)
    for (name, variant), (a, b) in zip(variants.items(), axes):
        costs = _costs(variant)
        batches = sorted(costs["plain"])
        contexts = sorted(int(c) for c in costs["plain"][batches[0]])
        ctx = contexts[len(contexts) // 2]
        baseline = _k(variant["plain_baseline"])
        for B in batches:
            by_D = {int(D): t for D, t in costs["verify_chain"][B][str(ctx)].items()}
            plain = baseline[B][str(ctx)]
            Ds = sorted(by_D)
            a.plot(Ds, [by_D[D] / plain for D in Ds], marker="o", label=f"batch {B}")
        a.set_xticks(Ds)
        a.set(xlabel="D (nodes per request)", ylabel="verify / plain step",
              title=f"verify cost, 43 layers, {_context_name(ctx)}: {name}")
        a.axhline(1.0, color="grey", lw=0.5)
        a.legend()
        gains = variant["gains"]
        several = [s for s, g in gains.items() if len(next(iter(g.values()))[str(ctx)]) > 1]
        source = several[-1] if several else next(iter(gains), None)
        if source is not None:
            g = _k(gains[source])
            for B in batches:
                rows = {int(D): v for D, v in g[B][str(ctx)].items()}
                Ds = sorted(rows)
                b.plot(Ds, [rows[D]["tree_vs_chain"] * 100 for D in Ds], marker="o", label=f"batch {B}")
            b.set_xticks(Ds)
            b.set(xlabel="D", ylabel="tree over chain, %", title=f"projected gain ({source})")
            b.axhline(0.0, color="grey", lw=0.5)
            b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
