"""ServerConfig (what ``python -m fullgraph serve`` takes) and loading the model it serves."""
from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("fullgraph.server")


@dataclass(frozen=True)
class ServerConfig:
    """One server: a checkpoint (``model``: a directory or .gguf) or a random-weights ``preset``
    (token ids only), where it listens, and the ``fg.LLM`` options (``llm``: max_num_seqs,
    max_model_len, max_num_tokens, cudagraph, attention, ...).

    ``served_model_names``: the names clients put in ``model`` (default: the file or preset name).
    ``api_key``: required as ``Authorization: Bearer KEY`` on everything but ``/health``.
    ``max_logprobs``: the most top logprobs a request may ask for (0: logprobs off).
    ``structured``: constrained output (None: on when llguidance is installed).
    ``warmup``: run every step shape before serving (None: when the runner captures graphs or
    compiles, which the first step would otherwise do while a client waits).
    ``max_body_bytes``: larger request bodies are refused with 413.
    ``engine_process``: run the engine in a process of its own (``server/engine_process.py``), so
    its host work never waits for the HTTP side's turn on the interpreter lock; False: a thread
    of the server's process.
    """

    model: str | None = None
    preset: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ()
    max_logprobs: int = 20
    structured: bool | None = None
    warmup: bool | None = None
    max_body_bytes: int = 8 * 2**20
    engine_process: bool = True
    llm: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.model is None) == (self.preset is None):
            raise ValueError(f"ServerConfig: give exactly one of model (a checkpoint) or preset (random weights), "
                             f"got model={self.model!r}, preset={self.preset!r}")
        if self.model is not None and not Path(self.model).exists():
            raise ValueError(f"ServerConfig.model: {self.model} does not exist (a checkpoint directory or .gguf file)")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"ServerConfig.port: expected an int in [0, 65536), got {self.port!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("ServerConfig.api_key: empty; give a key or None (no key)")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"ServerConfig.max_logprobs: expected an int >= 0, got {self.max_logprobs!r}")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ValueError(f"ServerConfig.max_body_bytes: expected an int >= 1024, got {self.max_body_bytes!r}")
        names = tuple(self.served_model_names) or (self.default_name(),)
        if any(not isinstance(n, str) or not n for n in names):
            raise ValueError(f"ServerConfig.served_model_names: expected non-empty strings, got {names!r}")
        object.__setattr__(self, "served_model_names", names)
        object.__setattr__(self, "llm", dict(self.llm))
        size = self.llm.get("tensor_parallel_size", 1)
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"ServerConfig.llm['tensor_parallel_size']: expected an int >= 1, got {size!r}")
        if size > 1 and not self.engine_process:
            raise ValueError("ServerConfig: tensor_parallel_size > 1 needs engine_process=True (rank 0's engine "
                             "process leads the ranks that follow it)")

    def default_name(self) -> str:
        if self.preset is not None:
            return self.preset
        path = Path(self.model)
        return path.stem if path.suffix == ".gguf" else path.resolve().name

    @property
    def structured_on(self) -> bool:
        if self.structured is not None:
            return self.structured
        return importlib.util.find_spec("llguidance") is not None


def _tokenizer(path: Path):
    """The checkpoint's tokenizer, or None (token ids only) when it has none: the server then
    says so at startup and refuses text prompts with a 400."""
    from ..engine import load_tokenizer

    try:
        return load_tokenizer(path)
    except ValueError as err:
        logger.warning("fullgraph: serving token ids only: %s", err)
        return None


def load_server_tokenizer(config: ServerConfig):
    """The tokenizer the server process tokenizes with (None for a preset: token ids only)."""
    return None if config.preset is not None else _tokenizer(Path(config.model))


def load_llm(config: ServerConfig):
    """The ``fg.LLM`` the server runs (warmed up where the first step would otherwise compile or capture)."""
    from ..engine import LLM
    from ..models import from_pretrained, presets

    kw = dict(config.llm)
    size, tp = kw.pop("tensor_parallel_size", 1), None
    if size != 1:   # this process's rank of the group torchrun started ("cuda" is then cuda:LOCAL_RANK)
        from ..parallel import tensor_parallel_of_size

        tp = tensor_parallel_of_size(size)
    device = torch.device(kw.pop("device", None) or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = kw.pop("dtype", None) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if config.preset is not None:
        model, tokenizer = presets.build(config.preset, dtype=dtype, device=device, seed=0), None
        if tp is not None:
            from ..parallel import shard_model

            model = shard_model(model, tp)
    else:   # each rank reads only its shard of a safetensors checkpoint
        path = Path(config.model)
        model, tokenizer = from_pretrained(path, dtype=dtype, device=device, tensor_parallel=tp), _tokenizer(path)
    llm = LLM(model, tokenizer=tokenizer, dtype=dtype, device=device, max_logprobs=config.max_logprobs,
              structured=config.structured_on, **kw)
    cfg = llm.runner.config
    if config.warmup or (config.warmup is None and (cfg.cudagraph == "full" or cfg.compile)):
        logger.info("fullgraph: warming up (%s%s) ...", cfg.cudagraph, " + compile" if cfg.compile else "")
        llm.runner.warmup()
    return llm
