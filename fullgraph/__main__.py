"""``python -m fullgraph demo``: toy-llama, greedy decoding in eager and in the best mode here."""
from __future__ import annotations

import argparse
import logging
import statistics

import torch

from . import FullGraphRunner, models
from .generate import greedy


def demo(args: argparse.Namespace) -> int:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda and args.bf16 else torch.float32
    model = models.Llama(models.LlamaConfig.toy(), dtype=dtype, device=device, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    lengths = [5, 17, 40, 3][: args.requests] + [9] * max(0, args.requests - 4)
    prompts = [torch.randint(0, model.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    limits = dict(max_num_seqs=8, max_num_tokens=128, max_model_len=256)
    best = "full" if cuda else "padded"
    print(f"toy-llama on {device} ({dtype}), {len(prompts)} requests, prompt lengths {lengths}, "
          f"{args.steps} new tokens each")
    results = {}
    for mode in ("none", best):
        runner = FullGraphRunner(model, cudagraph=mode, attention=args.attention, **limits)
        if mode == "full":
            print(f"  {runner.capture()}")
        results[mode] = greedy(runner, prompts, args.steps)
        r = results[mode]
        print(f"  {mode:>6}: attention={runner.config.attention} decode step median "
              f"{statistics.median(r.decode_seconds) * 1e3:.3f} ms, prefill steps {len(r.prefill_seconds)}; "
              f"{runner.stats_line()}")
    for i, (a, b) in enumerate(zip(results["none"].tokens, results[best].tokens)):
        print(f"  request {i}: {a[:12]}{' ...' if len(a) > 12 else ''} {'==' if a == b else '!='} {best}")
    match = results["none"].tokens == results[best].tokens
    print(f"generated ids {'match' if match else 'DIFFER'} between eager and {best}")
    return 0 if match else 1


def doctor(args: argparse.Namespace) -> int:
    """The same mixed step (decode, chunked prefill with context, a new prompt) in every mode."""
    from . import SeqChunk
    from .debug import compare

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = models.presets.build(args.preset, dtype=dtype, device=device)
    runner = FullGraphRunner(model, max_num_seqs=8, max_num_tokens=128, max_model_len=512, cudagraph="none",
                             attention=args.attention)
    gen = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(0, model.vocab_size - 100, (n,), generator=gen).tolist()
    blocks = [runner.blocks.allocate(8) for _ in range(4)]
    runner.step([SeqChunk(tokens(37), 0, blocks[0]), SeqChunk(tokens(5), 0, blocks[1]),
                 SeqChunk(tokens(70), 0, blocks[2])])
    step = [SeqChunk(tokens(1), 37, blocks[0]), SeqChunk(tokens(1), 5, blocks[1]),
            SeqChunk(tokens(20), 70, blocks[2]), SeqChunk(tokens(9), 0, blocks[3])]
    print(f"doctor: {args.preset} on {device} ({dtype}), attention={runner.config.attention}: one mixed step "
          "(2 decodes, a chunk with 70 cached tokens, a new 9-token prompt) in each mode")
    report = compare(runner, step, modes=args.modes)
    print(report)
    return 0 if report.clean else 1


def load_object(spec: str):
    """``pkg.module:Name`` -> the object (a backend class, a model factory); a plain name is returned as is."""
    import importlib

    if ":" not in spec:
        return spec
    module, _, name = spec.partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError as err:
        raise ValueError(f"{spec}: cannot import module {module!r} ({err})") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{spec}: module {module!r} has no {name!r}")
        obj = getattr(obj, part)
    return obj


def conformance(args: argparse.Namespace) -> int:
    """The regression scenarios for one backend (and model): a table; exit 1 if anything failed."""
    from . import testing

    report = testing.conformance(backend=load_object(args.backend),
                                 model=load_object(args.model) if args.model else None, device=args.device,
                                 modes=args.modes, scenarios=args.scenarios, seed=args.seed)
    print(report.table())
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fullgraph")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="greedy decoding on toy-llama in eager and in the best mode")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--attention", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="bf16 weights on GPU (default float32)")
    d = sub.add_parser("doctor", help="find where eager / padded / graph / compiled outputs diverge")
    d.add_argument("--preset", default="toy", choices=models.presets.names())
    d.add_argument("--attention", default="auto")
    d.add_argument("--modes", nargs="+", default=["none", "padded", "full", "compile"])
    d.add_argument("--bf16", action="store_true")
    c = sub.add_parser("conformance", help="run the regression scenarios against an attention backend (or model)")
    c.add_argument("--backend", default="sdpa", help="a registered backend name or pkg.module:Class (default: sdpa)")
    c.add_argument("--model", default=None, help="pkg.module:factory returning a model (default: toy-llama; "
                                                 "toy Phi-3-Small for a block-sparse backend)")
    c.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="device to run on (default: cuda if present, else cpu)")
    c.add_argument("--modes", nargs="+", default=None, choices=["padded", "full", "compile"],
                   help="modes to test (default: every mode the device has)")
    c.add_argument("--scenarios", nargs="+", type=int, default=None, help="scenario numbers (default: all that apply)")
    c.add_argument("--seed", type=int, default=0, help="random seed of the scenarios' inputs (default: 0)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.command == "doctor" else logging.INFO, format="%(message)s")
    return {"demo": demo, "doctor": doctor, "conformance": conformance}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
