"""The `appliance` command: serve | generate | bench | eval | selftest | quantize | model-files.

Errors a user can fix (bad flags, a broken model directory) end in one line on
stderr and a non-zero exit, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from appliance.cli.args import (MODEL_HELP, add_engine_arguments, engine_settings, int_list, load_engine,
                                positive_int)
from appliance.errors import ApplianceError
from appliance.options import WEIGHT_FORMATS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine steps")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    g = sub.add_parser("generate", help="generate text from a prompt or a chat message")
    add_engine_arguments(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw completion prompt")
    src.add_argument("--chat", help="a user message, rendered with the model's chat template")
    g.add_argument("--system", help="system message for --chat")
    g.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image for --chat, placed before the text (repeatable; a vision model such as Qwen3-VL)")
    g.add_argument("--max-tokens", type=positive_int, default=128, metavar="N",
                   help="tokens to generate at most (default 128)")
    from_model = " (default: the model's generation_config.json, else %s)"
    g.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="0 is greedy" + from_model % "1.0")
    g.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus sampling" + from_model % "1.0")
    g.add_argument("--top-k", type=int, default=None, metavar="K", help="0 is off" + from_model % "0")
    g.add_argument("--min-p", type=float, default=None, metavar="P", help=from_model.strip() % "0.0")
    g.add_argument("--repetition-penalty", type=float, default=None, metavar="R", help=from_model.strip() % "1.0")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="prefill and decode speed per context length")
    add_engine_arguments(b)
    b.add_argument("--context", type=int_list, default=[128, 1024, 4096],
                   help="prompt lengths to measure (default 128,1024,4096)")
    b.add_argument("--gen", type=positive_int, default=32, help="tokens decoded per context (default 32)")
    b.add_argument("--repeat", type=positive_int, default=1, help="prefill repetitions, median (default 1)")
    b.add_argument("--compare-exact", action="store_true",
                   help="with --sparse-attn: run exact attention too and print both side by side")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench)

    s = sub.add_parser("selftest", help="check the compiled kernels against the portable reference, "
                                         "and the weight cache of the model served")
    s.add_argument("--model", default=None, help="also verify this model's quantized weight cache")
    s.add_argument("--weights", choices=WEIGHT_FORMATS, default=None,
                   help="the cache format to verify (default: the model family's)")
    s.add_argument("--config", metavar="FILE", default=None,
                   help="take --model and --weights from this settings file (the server's)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_selftest)

    q = sub.add_parser("quantize", help="build the quantized weight cache of a model ahead of time")
    q.add_argument("--model", default=None, help=MODEL_HELP)
    q.add_argument("--weights", choices=[f for f in WEIGHT_FORMATS if f != "f32"], default="q8",
                   help="format to quantize to (default q8)")
    q.set_defaults(func=cmd_quantize)

    m = sub.add_parser("model-files", help="list every file the engine reads from a checkpoint, with "
                                           "sizes and SHA-256 (the fleet role's appliance_model_files)")
    m.add_argument("model_dir", help="checkpoint directory")
    m.add_argument("--json", action="store_true", help="JSON instead of the role's YAML")
    m.set_defaults(func=cmd_model_files)

    from appliance.cli.evaluate import add_eval_parser
    add_eval_parser(sub)

    try:
        from appliance.server.gunicorn import add_serve_arguments, run_serve
    except ImportError:
        add_serve_arguments = run_serve = None
    if add_serve_arguments is not None:
        v = sub.add_parser("serve", help="serve the OpenAI API, dashboard and metrics")
        add_serve_arguments(v)
        v.set_defaults(func=lambda args: run_serve(args))
    return parser


def cmd_generate(args) -> int:
    engine = load_engine(args)
    if args.image and args.chat is None:
        raise ValueError("--image needs --chat (the question about the image)")
    images = [Path(f).read_bytes() for f in args.image]
    if args.chat is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        content = ([{"type": "image"} for _ in images] + [{"type": "text", "text": args.chat}]
                   if images else args.chat)
        prompt = messages + [{"role": "user", "content": content}]
    else:
        prompt = args.prompt
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                    seed=args.seed, stop=args.stop)
    prompt_ids = engine.encode_prompt(prompt)
    if args.json:
        result = engine.generate(prompt_ids, stream=False, images=images, **sampling)
        result["prompt_token_ids"] = prompt_ids
        result["prefill_tokens_per_s"] = result["prompt_tokens"] / result["prefill_s"] if result["prefill_s"] else None
        print(json.dumps(result))
        return 0
    for event in engine.generate(prompt_ids, images=images, **sampling):
        sys.stdout.write(event.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_bench(args) -> int:
    from appliance.cli.bench import format_comparison, format_table, run_bench
    if args.max_context is None:
        args.max_context = max(args.context) + args.gen + 1
    sparse = engine_settings(args).sparse_attn
    runs = {}
    if args.compare_exact or not sparse:
        engine = load_engine(args, sparse=None)
        runs["exact"] = (engine, run_bench(engine, args.context, args.gen, repeat=args.repeat))
        del engine
    if sparse:
        engine = load_engine(args)
        runs["sparse"] = (engine, run_bench(engine, args.context, args.gen, repeat=args.repeat))
    if args.json:
        print(json.dumps({name: {"engine": e.info(), "rows": rows} for name, (e, rows) in runs.items()}))
    elif len(runs) == 2:
        print(format_comparison(runs["exact"], runs["sparse"]))
    else:
        (engine, rows), = runs.values()
        print(format_table(engine, rows))
    return 0


def cmd_selftest(args) -> int:
    from appliance.kernels.selftest import run_selftest
    model, weights = args.model, args.weights
    if args.config:
        from appliance.config import load_settings
        settings = load_settings(args.config, environ={})
        model, weights = model or settings.model, weights or settings.weights
    extra = {"weight_cache": weight_cache_verdict(model, weights)} if model or args.config else None
    return run_selftest(as_json=args.json, extra=extra)


def weight_cache_verdict(model, weights) -> dict:
    """The quantized cache a load of this model would map: intact, absent, or refused (and why)."""
    from appliance.engine.engine import DEMO_MODEL_DIR
    from appliance.models import read_family
    from appliance.weights.loader import verify_cache
    model_dir = Path(model).expanduser() if model else DEMO_MODEL_DIR
    try:
        family, cfg, _ = read_family(model_dir)
        fmt = weights or getattr(family, "DEFAULT_WEIGHTS", "q8")
        if fmt == "f32":
            return {"ok": True, "path": None, "detail": "f32 weights are read from the checkpoint, no cache"}
        return verify_cache(model_dir, fmt, family.tensor_plan(cfg))
    except ApplianceError as e:
        return {"ok": False, "path": None, "problem": str(e)}


def cmd_quantize(args) -> int:
    from appliance.engine.engine import Engine
    engine = Engine.load(args.model, weights=args.weights)
    print(f"{engine.model_dir}: {args.weights} weights ready ({engine.weight_bytes / 2**20:.1f} MiB)")
    return 0


def cmd_model_files(args) -> int:
    from appliance.weights.manifest import checkpoint_files
    model_dir = Path(args.model_dir).expanduser()
    if not model_dir.is_dir():
        raise ValueError(f"{model_dir}: not a directory")
    files = checkpoint_files(model_dir)
    if args.json:
        print(json.dumps([vars(f) for f in files], indent=2))
        return 0
    # YAML for a host or group vars file; names are JSON-quoted, which YAML reads as the same string.
    print(f"# {len(files)} files, {sum(f.size for f in files) / 2**20:.1f} MiB: "
          f"`appliance model-files {model_dir}`")
    print(f"appliance_model_name: {json.dumps(model_dir.name)}")
    print("appliance_model_files:")
    for f in files:
        print(f"  - {{name: {json.dumps(f.name)}, sha256: {json.dumps(f.sha256)}, size: {f.size}}}")
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s", stream=sys.stderr)
    from appliance.engine.stats import profiling_enabled
    if profiling_enabled():
        logging.getLogger("appliance.profile").setLevel(logging.INFO)
    try:
        return args.func(args) or 0
    except (ApplianceError, ValueError, OSError) as e:
        print(f"appliance {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
