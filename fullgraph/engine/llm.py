"""LLM: the one-line front of the engine (vLLM's ``LLM(...).generate(prompts, SamplingParams(...))``)."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from ..models import from_pretrained
from ..runner import FullGraphRunner
from .engine import Engine
from .params import RequestOutput, RequestOutputKind, SamplingParams

logger = logging.getLogger("fullgraph")


def load_tokenizer(path: str | Path):
    """The checkpoint's own tokenizer (transformers, an optional extra): from the directory, or
    from the GGUF file's embedded vocabulary."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(f"{path}: a tokenizer needs transformers (pip install 'fullgraph[hf]'); "
                         "or pass tokenizer=None to work in token ids") from None
    path = Path(path)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # transformers would otherwise guess a tokenizer class from config.json and ask for sentencepiece
    # or tiktoken, which would not help: say what is missing
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
             "vocab.txt", "tokenizer.tiktoken")
    if path.is_dir() and not any((path / f).is_file() for f in files) and not any(path.glob("*.tiktoken")):
        raise ValueError(f"{path}: the checkpoint directory has no tokenizer (none of {', '.join(files)}); copy the "
                         "model's tokenizer files into it, pass tokenizer=<a transformers tokenizer>, or pass "
                         "tokenizer=None to work in token ids")
    return AutoTokenizer.from_pretrained(path)


class LLM:
    """A model, a sampling runner and an engine, from a checkpoint path or a model.

    ``LLM("dir-or.gguf", max_num_seqs=64, max_model_len=4096)``; ``LLM(model, tokenizer=tok)`` for a
    model object (ours or a transformers one). The tokenizer defaults to the checkpoint's own
    (``tokenizer=None`` for a model object: token ids in and out). Device: CUDA when present
    (bfloat16), else the CPU (float32); CUDA graphs on CUDA, the padded buffers elsewhere.
    ``max_model_len`` defaults to the model's, capped at 4096. Every step the engine runs has its
    graph: the runner captures its default schedule up to ``max_num_tokens`` (pass
    ``max_capture_size`` to cap it; larger steps then run eagerly over the padded buffers, 1.3-3.9x
    slower for llama-1b steps of 512-2,048 tokens on the H200). Other keyword arguments go to the
    ``FullGraphRunner``. ``llm.engine`` is the ``Engine``, ``llm.runner`` its runner.
    ``structured=True``: requests may carry ``SamplingParams(structured=fg.Structured(...))``.
    ``enable_prefix_caching`` (on by default, as in vLLM V1): requests share the KV pages of equal
    prompt prefixes and skip their prefill (``Engine``); False computes every prompt in full.
    ``tensor_parallel_size`` N > 1: one of N processes started by ``torchrun --nproc-per-node N``
    (``fullgraph.parallel``); every rank runs the same ``LLM`` calls on its shard of the model and
    gets the same tokens. From a safetensors checkpoint each rank reads only its shard.
    """

    def __init__(self, model: str | Path | nn.Module, *, tokenizer="auto", dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None, max_num_seqs: int = 64, max_model_len: int | None = None,
                 max_num_tokens: int = 1024, max_logprobs: int = 0, seed: int = 0, eos_token_ids=None,
                 structured: bool = False, enable_prefix_caching: bool = True, tensor_parallel_size: int = 1,
                 **runner_kwargs) -> None:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        eos = set(eos_token_ids or [])
        tp = None
        if tensor_parallel_size != 1:
            from ..parallel import tensor_parallel_of_size

            tp = tensor_parallel_of_size(tensor_parallel_size)
        if isinstance(model, (str, Path)):   # each rank reads its shard of the checkpoint
            path = Path(model)
            model = from_pretrained(path, dtype=dtype, device=device, tensor_parallel=tp)
            tokenizer = load_tokenizer(path) if tokenizer == "auto" else tokenizer
        else:
            if tp is not None:
                from ..parallel import shard_model

                model = shard_model(model, tp)
            if tokenizer == "auto":
                tokenizer = None
        if eos_token_ids is None:
            eos |= set(getattr(model, "eos_token_ids", ()))
        if tokenizer is not None and eos_token_ids is None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        max_model_len = max_model_len or min(int(getattr(model, "max_model_len", 4096)), 4096)
        max_num_seqs = min(max_num_seqs, max_num_tokens)
        self.runner = FullGraphRunner(model, sampling=True, max_logprobs=max_logprobs, structured=structured,
                                      max_num_seqs=max_num_seqs,
                                      max_model_len=max_model_len, max_num_tokens=max_num_tokens, **runner_kwargs)
        self.engine = Engine(self.runner, tokenizer, eos_token_ids=eos, seed=seed,
                             enable_prefix_caching=enable_prefix_caching)
        self.tokenizer = tokenizer
        self._next_id = 0

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (text, or token ids); ``params``: one for all, or one per
        prompt. Returns the finished outputs in the order of the prompts."""
        prompts = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else list(prompts)
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} SamplingParams for {len(prompts)} prompts (give one, or one each)")
        # one output per request, when it finishes (no per-step copies of a growing output); a
        # params object shared by the prompts is copied once (anything else add_request refuses)
        final = {id(p): dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                 for p in params if isinstance(p, SamplingParams)}
        final[id(None)] = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)
        params = [final.get(id(p), p) for p in params]
        ids = [str(self._next_id + i) for i in range(len(prompts))]
        self._next_id += len(prompts)
        queued = []  # every request is validated; one refused takes the others back out
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(rid, prompt, p)
                queued.append(rid)
        except ValueError:
            for rid in queued:
                self.engine.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        while self.engine.has_unfinished() and not self.engine._requests:
            self.engine.step()  # drain the overlapped step's surplus
        return [final[rid] for rid in ids]

    def chat(self, messages, params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or several,
        formatted by the tokenizer's chat template."""
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer with a chat template (this LLM has none)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [list(self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)) for c in conversations]
        return self.generate(prompts, params)
