"""`branchspec` command line: generate, serve, bench, train, convert. Flag names follow SGLang."""

from __future__ import annotations

import argparse
import json
import sys

from branchspec.cli_paths import readable_folder, writable_file, writable_folder
from branchspec.config import AutoPolicy, ConfigError, SamplingParams, SpecConfig, fast_path_candidates
from branchspec.speculative.draft_vocab import token_map_arg


POLICY_HELP = ("fixed: one configuration for every round (the --speculative-* flags); auto: pick the "
               "configuration, or none, before every round from live acceptance and measured costs "
               "(SpecConfig.auto; --speculative-num-draft-tokens caps its budget, default 8; with --compile "
               "it chooses among fast_path_candidates, whose graphs compile in minutes, not hours)")


_SPEC_KNOBS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")


def _spec_from_args(args, parser) -> SpecConfig | AutoPolicy | None:
    if args.speculative_algorithm.upper() == "NONE":
        # Flags that shape drafting mean nothing without it: refused, not ignored.
        given = [f"--{f.replace('_', '-')}" for f in _SPEC_KNOBS if getattr(args, f) is not None]
        token_map = getattr(args, "speculative_token_map", None)
        if token_map is not None and token_map.lower() != "none":
            given.append("--speculative-token-map")
        if given:
            parser.error(f"{given[0]} needs speculation; drop --speculative-algorithm NONE (or {given[0]})")
    if getattr(args, "speculative_policy", "fixed") == "auto":
        if args.speculative_algorithm.upper() == "NONE":
            parser.error("--speculative-policy auto needs speculation; drop --speculative-algorithm NONE")
        fixed = [f for f in ("speculative_num_steps", "speculative_eagle_topk") if getattr(args, f) is not None]
        if fixed:
            parser.error(f"--{fixed[0].replace('_', '-')} fixes what --speculative-policy auto chooses; "
                         "drop one of them")
        try:
            top = 8 if args.speculative_num_draft_tokens is None else args.speculative_num_draft_tokens
            if getattr(args, "compile", False):   # every candidate is compiled before the first request
                return SpecConfig.auto(fast_path_candidates(top))
            return SpecConfig.auto(max_draft_tokens=top)
        except ValueError as e:
            parser.error(str(e).replace("SpecConfig.auto.max_draft_tokens", "--speculative-num-draft-tokens")
                         .replace("fast_path_candidates.max_draft_tokens", "--speculative-num-draft-tokens"))
    if args.speculative_algorithm.upper() == "NONE":
        return None
    steps = args.speculative_num_steps if args.speculative_num_steps is not None else 3
    topk = args.speculative_eagle_topk if args.speculative_eagle_topk is not None else 2
    draft = args.speculative_num_draft_tokens
    if draft is None:
        draft = steps + 1 if topk == 1 else 6
    try:
        return SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=draft)
    except ValueError as e:
        parser.error(str(e))


def _add_generate(sub):
    p = sub.add_parser("generate", help="generate text for one prompt and show speculation stats")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded v4-mini-v2)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    p.add_argument("--speculative-algorithm", default="EAGLE", choices=["EAGLE", "NONE", "eagle", "none"],
                   help="EAGLE: MTP draft trees (default); NONE: plain decoding")
    p.add_argument("--speculative-num-steps", type=int, default=None, help="draft depth (default 3)")
    p.add_argument("--speculative-eagle-topk", type=int, default=None, help="branching per step (default 2; 1 = chain)")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="verify budget D per round, root included (default 6; steps+1 for a chain)")
    p.add_argument("--speculative-policy", default="fixed", choices=["fixed", "auto"], help=POLICY_HELP)
    p.add_argument("--speculative-token-map", default=None, metavar="FILE|none", help="a reduced draft vocabulary file (draft_vocab.safetensors), or none for the full vocabulary (default: the checkpoint's own map, if it has one)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--compile", action="store_true", help="run the compiled fast path (compiles first)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--disable-cuda-graph", action="store_true", help=CUDA_GRAPH_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=_generate, parser=p)


CUDA_GRAPH_HELP = ("on a GPU, launch every kernel from Python instead of replaying each step as a CUDA graph "
                   "(slower; for debugging)")


def cuda_graphs_arg(args) -> bool | None:
    """--disable-cuda-graph as LLM's cuda_graphs: False, or None (the device decides)."""
    return False if getattr(args, "disable_cuda_graph", False) else None


def _generate(args) -> int:
    from branchspec.llm import LLM

    if args.model is not None:
        readable_folder("--model", args.model)
    spec = _spec_from_args(args, args.parser)
    if args.max_tokens is not None and args.max_tokens < 1:   # 0 only scores a prompt: nothing to print
        args.parser.error(f"--max-tokens (SamplingParams.max_tokens) must be >= 1, got {args.max_tokens}")
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                                seed=args.seed)
    except ValueError as e:
        args.parser.error(str(e))
    llm = LLM(args.model, dtype=args.dtype, max_batch_size=1, compile=args.compile, device=args.device,
              speculative_token_map=token_map_arg(args.speculative_token_map), cuda_graphs=cuda_graphs_arg(args))
    if args.compile or llm.engine_config.uses_cuda_graphs:
        from branchspec.execution.compiled_step import report_progress

        report_progress()
        # The verify graphs for this one request's decoding (a draw at its temperature alone
        # has graphs of its own; a top-p cut runs the greedy ones).
        mode = "sampled" if params.sampling_temperature > 0 and params.top_p >= 1.0 else "greedy"
        info = llm.warmup(spec, batch_sizes=(1,), sampling=(mode,))
        print(f"fast path ready in {info['seconds']:.1f} s ({info['graphs']} graphs compiled, "
              f"{info['loaded']} loaded from the cache, {info['captured']} CUDA graphs captured)", file=sys.stderr)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, spec=spec)[0]
    else:
        out = llm.generate([args.prompt], params, spec=spec)[0]
    st = llm.last_stats
    phases = {k: round(v * 1e3 / max(st.num_rounds, 1), 3) for k, v in st.phase_seconds.items()}
    auto = st.policy == "auto"
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "accept_length": out.accept_length,
                          "decode_tok_s": st.decode_throughput, "ms_per_round": phases,
                          "spec": "auto" if auto else None if spec is None else vars(spec),
                          **({"rounds_by_configuration": st.spec_choices} if auto else {})}))
        return 0
    print(out.text)
    print("-" * 60)
    if auto:
        what = "adaptive policy (" + ", ".join(f"{k}: {v} rounds" for k, v in
                                               sorted(st.spec_choices.items(), key=lambda kv: -kv[1])) + ")"
    elif spec is None:
        what = "plain decoding"
    else:
        what = f"steps={spec.num_steps} topk={spec.topk} D={spec.num_draft_tokens}"
    print(f"{len(out.token_ids)} tokens, {what}, finish={out.finish_reason}")
    if spec is not None:
        print(f"accept length {out.accept_length:.2f} tokens/round over {out.num_rounds} rounds")
    print(f"decode {st.decode_throughput:.1f} tok/s (prefill {st.prefill_seconds * 1e3:.0f} ms)")
    if st.num_rounds:
        print("ms per round: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if k != "prefill"))
    return 0


def _add_serve(sub):
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with speculative decoding")
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded v4-mini-v2)")
    p.add_argument("--served-model-name", default=None, help="the model id clients name (default: the folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=30000, help="port (default 30000; 0 picks a free one)")
    p.add_argument("--speculative-algorithm", default=None, choices=["EAGLE", "NONE", "eagle", "none"],
                   help="EAGLE: MTP draft trees; NONE: plain decoding (the default unless a "
                        "--speculative-* flag is given)")
    p.add_argument("--speculative-num-steps", type=int, default=None, help="draft depth (default 3)")
    p.add_argument("--speculative-eagle-topk", type=int, default=None, help="branching per step (default 2; 1 = chain)")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="verify budget D per round, root included (default 6; steps+1 for a chain)")
    p.add_argument("--speculative-policy", default="fixed", choices=["fixed", "auto"], help=POLICY_HELP)
    p.add_argument("--speculative-token-map", default=None, metavar="FILE|none", help="a reduced draft vocabulary file (draft_vocab.safetensors), or none for the full vocabulary (default: the checkpoint's own map, if it has one)")
    p.add_argument("--max-running-requests", type=int, default=64,
                   help="requests decoded together at most (the batch; page pools are sized for it)")
    p.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests waiting for the batch at most; more get 503 with Retry-After")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens per request "
                   "(default: the model's max_position)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--seed", type=int, default=None, help="seed the stream unseeded requests draw from")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve beyond this machine (a --host other than loopback) without --api-key; refused "
                        "otherwise")
    p.add_argument("--timeout-request-header", type=float, default=10.0,
                   help="seconds a client has to send a request's headers (default 10); then 408")
    p.add_argument("--timeout-request-body", type=float, default=30.0,
                   help="seconds a client has to send a request's body (default 30); then 408")
    p.add_argument("--timeout-keep-alive", type=float, default=30.0,
                   help="seconds an idle kept-alive connection stays open (default 30)")
    p.add_argument("--limit-concurrency", type=int, default=None,
                   help="connections open at once at most; more get 503 (default: 1024, or room for every "
                        "running and queued request if more)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGINT/SIGTERM, seconds to let requests in flight finish before cancelling them")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads of the engine (default: torch's, one per core); fewer leave "
                        "cores to the HTTP side and to other processes")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--compile", action="store_true",
                   help="run the compiled fast path (compiles every graph before serving)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--disable-cuda-graph", action="store_true", help=CUDA_GRAPH_HELP)
    p.set_defaults(func=_serve, parser=p)


def _serve_spec(args, parser) -> SpecConfig | None:
    """Plain decoding unless speculation is asked for; then `generate`'s defaults."""
    given = [f for f in _SPEC_KNOBS if getattr(args, f) is not None]
    if args.speculative_algorithm is None:
        args.speculative_algorithm = "EAGLE" if given or args.speculative_policy == "auto" else "NONE"
    return _spec_from_args(args, parser)


def _serve(args) -> int:
    import logging

    from branchspec.llm import LLM
    from branchspec.serve.server import run

    parser = args.parser
    if args.model is not None:
        readable_folder("--model", args.model)
    spec = _serve_spec(args, parser)
    for name, low in (("max_running_requests", 1), ("max_queued_requests", 0), ("port", 0), ("num_threads", 1)):
        if getattr(args, name) is not None and getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.port > 65535:
        parser.error(f"--port must be <= 65535, got {args.port}")
    from branchspec.config import check_float
    from branchspec.serve.app import check_api_key
    from branchspec.serve.server import ConnectionLimits, check_host

    try:
        if check_float(None, "--shutdown-timeout", args.shutdown_timeout) < 0:   # nan and inf as the others
            parser.error(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
        check_api_key(args.api_key)
        check_host(args.host, args.api_key, args.allow_unauthenticated)
        need = args.max_running_requests + args.max_queued_requests + 64   # the queue, /health, /metrics
        limits = ConnectionLimits(header_timeout=args.timeout_request_header, body_timeout=args.timeout_request_body,
                                  keep_alive_timeout=args.timeout_keep_alive,
                                  max_connections=(args.limit_concurrency if args.limit_concurrency is not None
                                                   else max(1024, need)))
    except ValueError as e:
        parser.error(str(e).replace("ConnectionLimits.header_timeout", "--timeout-request-header")
                     .replace("ConnectionLimits.body_timeout", "--timeout-request-body")
                     .replace("ConnectionLimits.keep_alive_timeout", "--timeout-keep-alive")
                     .replace("ConnectionLimits.max_connections", "--limit-concurrency"))
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    if args.num_threads is not None:
        import torch

        torch.set_num_threads(args.num_threads)
    try:
        llm = LLM(args.model, dtype=args.dtype, max_batch_size=args.max_running_requests,
                  max_model_len=args.max_model_len, seed=args.seed, compile=args.compile, device=args.device,
                  speculative_token_map=token_map_arg(args.speculative_token_map), cuda_graphs=cuda_graphs_arg(args))
    except ConfigError as e:   # the engine's sizes, named as this command's flags
        parser.error(str(e).replace("max_batch_size", "--max-running-requests")
                     .replace("max_model_len", "--max-model-len"))
    if args.compile or llm.engine_config.uses_cuda_graphs:
        # Before the port opens: no request waits for a compilation or a graph capture.
        info = llm.warmup(spec)
        logging.getLogger("branchspec.serve").info(
            "fast path ready in %.1f s (%d graphs compiled, %d loaded, %d CUDA graphs captured)",
            info["seconds"], info["graphs"], info["loaded"], info["captured"])
    try:
        return run(llm, spec, host=args.host, port=args.port, api_key=args.api_key,
                   max_queued_requests=args.max_queued_requests, model_name=args.served_model_name,
                   shutdown_timeout=args.shutdown_timeout, log_level=args.log_level, limits=limits,
                   allow_unauthenticated=args.allow_unauthenticated)
    except OSError as e:   # the address is taken, or not this machine's
        print(f"branchspec serve: error: {e.strerror or e}", file=sys.stderr)
        return 2


def _add_train(sub):
    from branchspec.train.trainer import TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train", help="train a target model and its MTP drafter on the workloads")
    p.add_argument("--out", default=d.out, help="run folder (tokenizer, state.json and its tensors, the resume "
                                                "pack, loss.png, log)")
    p.add_argument("--model", default=d.model, help="model preset: v4-mini, v4-mini-v2 or tiny")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--mtp-weight", type=float, default=d.mtp_weight)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--mix", default=None, type=_weights_arg,
                   help="training mix as NAME=WEIGHT,... over gsm8k, mbpp, sharegpt and the extra corpus "
                        "pycode (default " + ",".join(f"{k}={v}" for k, v in d.mix.items()) + ")")
    p.add_argument("--max-chars", default=None, type=_weights_arg,
                   help="characters read per source, NAME=N,... (default sharegpt=16000000)")
    p.add_argument("--tokenizer-from", default=None, help="reuse the tokenizer.json of this folder instead of training one")
    p.add_argument("--precision", default=d.precision, choices=("auto", "float32", "bfloat16"),
                   help="training-step precision; auto takes bfloat16 only on CPUs with AMX or AVX512-BF16, "
                        "and only if a timed probe of the model finds it faster")
    p.add_argument("--compile", action="store_true", help="torch.compile the training forward (about 1.3x here)")
    p.add_argument("--mbpp-path", default=None, help="local mbpp.jsonl (default: $BRANCHSPEC_MBPP, else the Hugging Face hub)")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT/state.json (exact), else from OUT's compact pack (resume.safetensors + "
                        "resume.json); a folder with neither is refused")
    p.add_argument("--stop-after", type=int, default=None, help="stop (state saved) after this many steps of this run")
    p.add_argument("--export", default=None, help="checkpoint folder to write at the end (default OUT/checkpoint)")
    p.set_defaults(func=_train, parser=p)


def _weights_arg(text: str) -> dict:
    out = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"expected NAME=VALUE,... got {part!r}")
        try:
            out[name.strip()] = float(value) if "." in value or "e" in value else int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name.strip()}: {value!r} is not a number") from None
    return out


def _train(args) -> int:
    import dataclasses
    from pathlib import Path

    from branchspec.train.trainer import TrainConfig, train

    out = Path(args.out)
    try:
        writable_folder("--out", out)
        if args.export is not None:
            writable_folder("--export", args.export)
        if args.tokenizer_from is not None:
            readable_folder("--tokenizer-from", args.tokenizer_from)
    except (OSError, ValueError) as e:
        args.parser.error(str(e))
    saved = out / "train_config.json"
    if args.resume and saved.is_file():
        # A resumed run keeps the settings it started with (the schedule depends on them);
        # flags that would change them are refused rather than silently ignored.
        try:
            cfg = TrainConfig(**json.loads(saved.read_text(encoding="utf-8")))
        except (ValueError, TypeError) as e:    # not JSON, not an object, unknown or bad fields
            args.parser.error(f"{saved} is not a run's settings ({type(e).__name__}: {e}); restore it, or "
                              "start a new --out")
        fresh = args.parser.parse_args(["--out", args.out])
        # How each step is computed (precision, compile) may change; what it computes may not.
        changed = [f"--{k.replace('_', '-')}" for k, v in vars(args).items()
                   if k not in ("resume", "stop_after", "export", "func", "parser", "precision", "compile")
                   and v != getattr(fresh, k, v)]
        if changed:
            args.parser.error(f"{', '.join(changed)}: a resumed run takes its settings from {saved}; "
                              "drop them (or start a new --out)")
        compute = {k: getattr(args, k) for k in ("precision", "compile") if getattr(args, k) != getattr(fresh, k)}
        cfg = dataclasses.replace(cfg, out=args.out, **compute)
        folder = train(cfg, resume=True, export=args.export, stop_after=args.stop_after)
        print(f"checkpoint written to {folder}" if folder is not None else
              f"stopped before the last step; state saved in {cfg.out} (continue with --resume)")
        return 0
    try:
        cfg = TrainConfig(out=args.out, model=args.model, steps=args.steps, batch_size=args.batch_size,
                          seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, mtp_weight=args.mtp_weight,
                          eval_every=args.eval_every, save_every=args.save_every, vocab_size=args.vocab_size,
                          seed=args.seed, mbpp_path=args.mbpp_path, tokenizer_from=args.tokenizer_from,
                          precision=args.precision, compile=args.compile,
                          **({"mix": args.mix} if args.mix is not None else {}),
                          **({"max_chars": args.max_chars} if args.max_chars is not None else {}))
    except ValueError as e:
        args.parser.error(str(e))
    folder = train(cfg, resume=args.resume, export=args.export, stop_after=args.stop_after)
    if folder is None:
        print(f"stopped before the last step; state saved in {cfg.out} (continue with --resume)")
    else:
        print(f"checkpoint written to {folder}")
    return 0


def _add_distill(sub):
    from branchspec.train.distill import DistillConfig

    d = DistillConfig()
    p = sub.add_parser("distill-drafter",
                       help="fine-tune a checkpoint's MTP drafter to its own target (target weights frozen)")
    p.add_argument("checkpoint", help="branchspec checkpoint folder")
    p.add_argument("--out", required=True, help="folder for the fine-tuned checkpoint (must not exist or be empty)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--mix", default=None, type=_weights_arg,
                   help="text the target reads, NAME=WEIGHT,... (default "
                        + ",".join(f"{k}={v}" for k, v in d.mix.items()) + ")")
    p.add_argument("--mbpp-path", default=None, help="local mbpp.jsonl (as for train)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.set_defaults(func=_distill, parser=p)


def _distill(args) -> int:
    from pathlib import Path

    from branchspec.train.distill import DistillConfig, distill_drafter

    out = Path(args.out)
    try:
        readable_folder("checkpoint", args.checkpoint)
        writable_folder("--out", out, empty=True)
    except (OSError, ValueError) as e:
        args.parser.error(str(e))
    try:
        cfg = DistillConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                            warmup=args.warmup, mbpp_path=args.mbpp_path, seed=args.seed,
                            **({"mix": args.mix} if args.mix is not None else {}))
    except ValueError as e:
        args.parser.error(str(e))
    folder = distill_drafter(args.checkpoint, out, cfg)
    report = json.loads((folder / "training.json").read_text())["drafter_distillations"][-1]
    for w in report["held_out_after"]:
        print(f"{w:9} MTP top-1 agreement {100 * report['held_out_before'][w]['mtp_top1_agreement']:.1f}% -> "
              f"{100 * report['held_out_after'][w]['mtp_top1_agreement']:.1f}%")
    print(f"checkpoint written to {folder}")
    return 0


def _add_draft_vocab(sub):
    p = sub.add_parser("draft-vocab", help="build a reduced draft vocabulary (--speculative-token-map) for a "
                                           "checkpoint from its target's predictions on training text")
    p.add_argument("checkpoint", help="branchspec checkpoint folder (with tokenizer.json)")
    p.add_argument("--size", type=int, default=1024, help="tokens the drafter may propose (default 1024)")
    p.add_argument("--out", default=None,
                   help="file to write (default: CHECKPOINT/draft_vocab.safetensors, which LLM and serve use)")
    p.add_argument("--mbpp-path", default=None, help="local mbpp.jsonl (else $BRANCHSPEC_MBPP, else skipped)")
    p.set_defaults(func=_draft_vocab, parser=p)


def _draft_vocab(args) -> int:
    from pathlib import Path

    from branchspec.checkpoint import load_checkpoint
    from branchspec.data.tokenizer import Tokenizer
    from branchspec.data.workloads import resolve_mbpp_path
    from branchspec.speculative.draft_vocab import DRAFT_VOCAB_FILE
    from branchspec.train.draft_vocab import DEFAULT_CHARS, build_draft_vocab

    folder = readable_folder("checkpoint", args.checkpoint)
    if not (folder / "tokenizer.json").is_file():
        args.parser.error(f"{folder} has no tokenizer.json: the training text cannot be encoded")
    out = writable_file("--out", args.out if args.out is not None else folder / DRAFT_VOCAB_FILE)
    model = load_checkpoint(folder, "float32")
    if not 1 <= args.size <= model.cfg.vocab_size:
        args.parser.error(f"--size must be in [1, {model.cfg.vocab_size}], got {args.size}")
    workloads = [w for w in DEFAULT_CHARS if w != "mbpp"]
    try:   # MBPP only from a local file: a map should not depend on reaching the hub
        if resolve_mbpp_path(args.mbpp_path) is not None:
            workloads.append("mbpp")
    except FileNotFoundError as e:
        args.parser.error(str(e))
    vocab, summary = build_draft_vocab(model, Tokenizer.from_dir(folder), args.size, mbpp_path=args.mbpp_path,
                                       workloads=workloads, progress=True)
    if not out.is_dir():
        out.parent.mkdir(parents=True, exist_ok=True)
    out = vocab.save(out, metadata={k: str(v) for k, v in summary.items()} | {"size": str(vocab.size)})
    print(f"{vocab.size} tokens cover {100 * summary['coverage']:.1f}% of the target's {summary['predictions']} "
          f"predictions on {summary['workloads']}; written to {out}")
    return 0


def _add_bench(sub):
    p = sub.add_parser("bench", help="tree vs chain at matched budgets, batch sizes and workloads")
    try:
        from branchspec.bench.cli import add_arguments, main
    except ImportError:  # the study module is optional at import time
        p.set_defaults(func=lambda args: (print("branchspec bench is not available", file=sys.stderr), 2)[1])
        return
    add_arguments(p)
    p.set_defaults(func=main, parser=p)


def _add_convert(sub):
    p = sub.add_parser("convert", help="write a Hugging Face or DeepSeek checkpoint as a branchspec folder, "
                                       "or a branchspec checkpoint as a Hugging Face one (--to hf)")
    p.add_argument("src", help="checkpoint folder: branchspec, Hugging Face deepseek_v4 or DeepSeek original")
    p.add_argument("out", help="new folder to write (must not exist, or be empty)")
    p.add_argument("--to", default="branchspec", choices=["branchspec", "hf"],
                   help="branchspec (default), or hf: a folder transformers' DeepseekV4ForCausalLM loads "
                        "(the MTP block is kept as mtp.* tensors, which branchspec reads back)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"],
                   help="dtype of the written floating-point weights (default float32)")
    p.set_defaults(func=_convert, parser=p)


def _convert(args) -> int:
    from branchspec.checkpoint import checkpoint_metadata, convert_checkpoint

    readable_folder("source", args.src)
    writable_folder("output", args.out, empty=True)

    if args.to == "hf":
        from branchspec.checkpoint import export_hf_folder

        out = export_hf_folder(args.src, args.out, dtype=args.dtype)
        print(f"exported {args.src} to the Hugging Face deepseek_v4 folder {out} ({args.dtype})")
        return 0
    out = convert_checkpoint(args.src, args.out, dtype=args.dtype)
    fmt = checkpoint_metadata(out).get("converted_from", "?")
    print(f"converted {args.src} ({fmt} format) to the branchspec checkpoint {out} ({args.dtype})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="branchspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_bench(sub)
    _add_train(sub)
    _add_distill(sub)
    _add_draft_vocab(sub)
    _add_convert(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (OSError, ValueError, TypeError) as e:   # OSError: a missing file, a full disk, a refused write
        print(f"branchspec {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
