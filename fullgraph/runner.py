"""FullGraphRunner: plan -> static buffers -> eager / padded / CUDA-graph step."""
from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from . import _compat, padding, sampling
from .attention import AttentionBackend, AttentionMetadata, BackendLimits
from .attention.backends import resolve_backends
from .block_ids import BlockIdCache
from .buffers import StaticBuffers
from .chunks import _who, check_prev_rows
from .compile import CompiledStep
from .config import RunnerConfig, resolve_mode
from .fields import SAMPLING_FIELDS, StepPlan, structured_fields
from .graphs import CaptureReport, GraphKey, GraphSet
from .kernels import compile_ahead, linear_choice
from .kv_cache import BlockAllocator, KVCacheSpec, allocate_kv_caches
from .models import from_hf
from .models.base import check_model
from .models.layers import refresh_norms_on_load
from .plan import SeqChunk, Target, capture_plan, plan_with_cache
from .validate import StepValidator, check_token_ids

logger = logging.getLogger("fullgraph")


@dataclass(frozen=True)
class StepOutput:
    """What a step returns (device tensors of the caller's own: later steps never overwrite them)."""

    logits: torch.Tensor | None    # (num_chunks, vocab) float32 of each chunk's last token; None when sampling
    mode: str                      # how the step ran: "none" | "padded" | "full"
    num_tokens: int
    num_tokens_padded: int         # the bucket it ran in (== num_tokens when unpadded)
    token_ids: torch.Tensor | None = None   # (num_chunks,) int64 sampled ids, when sampling
    logprobs: torch.Tensor | None = None    # (num_chunks, 1 + max_logprobs) float32: the sample's, then the top ones
    top_ids: torch.Tensor | None = None     # (num_chunks, max_logprobs) int64 ids of the top logprobs


class FullGraphRunner:
    """Runs steps of ``model`` (see ``fullgraph.models.base`` for the protocol; a transformers
    model of a supported architecture is converted once by ``models.from_hf``, sharing its weights).

    ``FullGraphRunner(model, config=None, **overrides)``: ``config`` is a ``RunnerConfig``;
    keyword overrides replace its fields (or build one from defaults). Device and dtype come from
    the model's parameters.

    Attributes:
        config: the resolved config (``num_blocks``, ``cudagraph`` and ``attention`` filled in).
        kv_caches: one tensor per attention layer, ``(2, num_blocks, block_size, num_kv_heads,
            head_dim)`` in the model's dtype; see ``fullgraph.kv_cache``. Block 0 is the null block.
        blocks: the ``BlockAllocator`` of those pages (never hands out block 0).
        policy: the composed padding policy of every backend the model uses.
        fields: the step fields each step's plan holds (``policy.table``).
    """

    def __init__(self, model: nn.Module, config: RunnerConfig | None = None, **overrides) -> None:
        config = (config or RunnerConfig()).replace(**overrides)
        if type(model).__module__.startswith("transformers."):  # a PreTrainedModel: ours, sharing its weights
            model = from_hf(model)
        layers = check_model(model)
        param = next(model.parameters())
        self.model, self.device, self.dtype = model, param.device, param.dtype
        self.vocab_size = int(model.vocab_size)
        config = resolve_mode(config, self.device.type == "cuda")
        if config.max_model_len > model.max_model_len:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's max_model_len "
                             f"{model.max_model_len} (its position table / the length it was built for)")
        num_blocks = config.num_blocks or config.max_num_seqs * config.max_blocks_per_seq + 1
        limits = BackendLimits(config.max_num_seqs, config.max_num_tokens, config.max_model_len,
                               config.block_size, num_blocks, self.device, self.dtype)
        self.backends, dense_cls = resolve_backends(config.attention, layers, limits)
        dense = dense_cls.name if isinstance(config.attention, str) else config.attention
        self.config = config.replace(num_blocks=num_blocks, attention=dense)
        unique = list({id(b): b for b in self.backends.values()}.values())
        self.policy = padding.compose(*(b.policy for b in unique))
        self.fields = self.policy.table.extended((SAMPLING_FIELDS if config.sampling else ())
                                                 + (structured_fields(self.vocab_size) if config.structured else ()))
        # only backends that plan on the host are asked, every step
        self._preparers = [b for b in unique if type(b).prepare is not AttentionBackend.prepare]
        self.kv_caches = allocate_kv_caches([KVCacheSpec(l.num_kv_heads, l.head_dim) for l in layers],
                                            num_blocks, config.block_size, self.dtype, self.device)
        self.blocks = BlockAllocator(num_blocks)
        self.buffers = StaticBuffers(self.config, self.fields, self._output_specs(), self.device)
        for backend in unique:
            self.buffers.add_workspaces(backend.name, backend.workspaces())
        self._graphs = GraphSet(self.device) if self.config.cudagraph == "full" else None
        self._capture_report: CaptureReport | None = None
        # the plain function, the runner passed in: a bound method kept here would be a reference cycle
        self._compiled = CompiledStep(type(self)._model_forward, strict=config.validate) if config.compile else None
        self._validator = StepValidator(self.buffers, self.kv_caches, config.block_size) if config.validate else None
        self._host_fields = [n for n, f in self.fields.items() if f.source == "host"]
        self._warm = False
        self._block_ids = BlockIdCache()  # the last step's block ids, reused while a request's list is unchanged
        self._stats = {"steps": 0, "tokens": 0, "padded_tokens": 0, "graph_hits": Counter(),
                       "eager_fallbacks": Counter()}

    def _output_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The step's outputs: logits, or (sampling) ids and, when asked for, logprobs."""
        cfg = self.config
        if not cfg.sampling:
            return {"logits": ((self.vocab_size,), torch.float32)}
        out = {"token_ids": ((), torch.int64)}
        if cfg.max_logprobs:
            out.update(logprobs=((1 + cfg.max_logprobs,), torch.float32), top_ids=((cfg.max_logprobs,), torch.int64))
        return out

    def reset(self) -> None:
        """Forget every request (all KV pages free and zeroed); graphs, compiled code and statistics stay."""
        self.blocks = BlockAllocator(self.config.num_blocks)
        for cache in self.kv_caches:
            cache.zero_()
        self._block_ids = BlockIdCache()

    # ---- running a step -------------------------------------------------------------------
    def step(self, chunks: Sequence[SeqChunk], token_ids: torch.Tensor | None = None,
             values: Mapping[str, Sequence] | None = None, copy_outputs: bool = True) -> StepOutput:
        """Run one step; returns the logits of each chunk's last token (or, with ``sampling``, a
        token sampled from them).

        The step is queued on the device and this returns without waiting for it (the logits are
        a device tensor). ``token_ids``: optionally, every token id of the step as one
        ``(num_tokens,)`` int64 (or int32) tensor on the runner's device, the chunks' ids
        concatenated in chunk order; it replaces the values of ``chunks[i].token_ids``, which then
        only give each chunk's length (any ids in range will do). Step N+1 can so be planned and
        launched while step N still runs, its ids being step N's samples that never visit the host
        (``generate.greedy(..., overlap=True)``). These ids are range-checked only with
        ``validate=True``, which waits for the device; otherwise an id outside the vocabulary is
        clamped into it (a wrong token, never a read outside the embedding table).

        Checked on the host before anything is sent, each a ``ValueError`` naming the chunk and
        field: types (ints only, no bool/float/str; ``SeqChunk``s in a list), sizes and limits,
        token ids, page ids (in range, never the null block, none in two chunks unless cached, every
        page allocated by ``runner.blocks``), that every position a chunk attends to was written
        by an earlier step, and that no chunk writes a shared page (cached by ``runner.blocks.seal``,
        or with several owners). Not checked: which request a page belongs to (a chunk naming another
        live request's pages in a later step overwrites them): the engine owns pages and never
        does that; callers of the runner must not.

        ``values``: the real rows of the step fields a caller fills (``Field.source == "caller"``),
        field name -> one value per chunk (per token for token fields); with ``sampling`` these are
        the sampling parameters (``fields.SAMPLING_FIELDS``) and ``prev_token_row``: a token whose
        id is the previous step's sample of row j says j, and the graph reads that id itself.

        ``copy_outputs=False``: the outputs are views of the runner's buffers, not copies (7.8 us
        less for 32 rows of logits, H100), for work queued on this stream before the next ``step``.
        """
        with _compat.inference_mode():
            return self._step(chunks, token_ids, values, copy_outputs)

    def _step(self, chunks: Sequence[SeqChunk], token_ids: torch.Tensor | None = None,
              values: Mapping[str, Sequence] | None = None, copy_outputs: bool = True) -> StepOutput:
        cfg = self.config
        pad = cfg.cudagraph != "none"
        if not self._warm and (self._compiled is not None or self._graphs is not None):
            self.warmup()  # compile / capture first: they run their own plans through the staging area
        # padded: planned straight into the staging area. A step refused below leaves it unsent (on
        # CPU it is the buffers themselves, but every step rewrites all of its own bucket).
        if cfg.structured and values and values.get("token_bitmask") is None and any(values.get("constrained", ())):
            raise ValueError("values['constrained'] marks constrained rows but values['token_bitmask'] is missing "
                             "(the masks of earlier steps are not kept)")
        if cfg.sampling and values and values.get("prev_token_row") is not None:
            check_prev_rows(values["prev_token_row"], cfg.max_num_seqs)
        target = Target(self.fields, self.policy, values, self.buffers.staging() if pad else None)
        plan = plan_with_cache(chunks, cfg, target, pad, cfg.num_blocks, self.vocab_size, self._block_ids,
                               self.blocks.shared_pages())  # cached pages may be named by several chunks
        self.blocks.check(plan, lambda i: _who(chunks, i),  # pages owned, context written, no shared page written
                          self._block_ids.basis() if plan.decode_only else None)
        for backend in self._preparers:
            reason = backend.prepare(plan)
            if reason:
                raise ValueError(f"attention backend {backend.name!r} cannot run this step: {reason}")
        if token_ids is not None:
            check_token_ids(token_ids, plan.num_tokens, self.device, self.vocab_size, cfg.validate)
        if cfg.validate and pad:
            padding.check(plan, self.policy)
        if not pad:
            outputs, mode = self._run_unpadded(plan, token_ids), "none"
        else:
            side = {n: plan.num_reqs_padded for n in self._host_fields if values and n in values}
            outputs, mode = self._run_padded(plan, token_ids, side, copy_outputs)
        self.blocks.record_writes(plan.slot_mapping[: plan.num_tokens], cfg.block_size)
        self._count(plan, mode)
        return StepOutput(outputs.get("logits"), mode, plan.num_tokens, plan.num_tokens_padded,
                          outputs.get("token_ids"), outputs.get("logprobs"), outputs.get("top_ids"))

    def _run_padded(self, plan: StepPlan, token_ids: torch.Tensor | None = None,
                    side: dict[str, int] | None = None, copy_outputs: bool = True) -> tuple[dict[str, torch.Tensor], str]:
        key = plan.key
        graph = self._graphs is not None and self._graph_for(key, plan)
        self.buffers.upload(token_ids, self.vocab_size, side)
        if self._validator is not None:
            if graph:
                self._graphs.check_addresses(self._addresses())
            self._validator.before(plan)
        if graph:
            self._graphs.replay(key)
        else:
            self._run_static(key, plan.num_reqs_padded)
        outputs = ({name: self.buffers.output_copy(name, plan.num_reqs) for name in self.buffers.outputs} if copy_outputs
                   else self.buffers.output_views(plan.num_reqs))
        if self._validator is not None:
            self._validator.after(plan, outputs)
        return outputs, "full" if graph else "padded"

    def _graph_for(self, key: GraphKey, plan: StepPlan) -> bool:
        if key in self._graphs:
            return True
        if plan.num_tokens_padded > self.config.buckets[-1]:
            reason = f"{plan.num_tokens} tokens: above the largest captured size {self.config.buckets[-1]}"
        else:
            reason = f"backends {self.policy.name!r} do not allow {'decode' if key[1] else 'mixed'} steps in a graph"
        if reason not in self._stats["eager_fallbacks"]:
            logger.warning("fullgraph: running eagerly (padded): %s", reason)
        self._stats["eager_fallbacks"][reason] += 1
        return False

    def _run_static(self, key: GraphKey, num_reqs: int) -> None:
        """The staging area in, then the model over the static buffers of one bucket; what a graph captures."""
        num_tokens, decode_only = key
        self.buffers.stage()
        self._write_outputs(self._forward(self._inputs(self.buffers.views(num_tokens, num_reqs)), decode_only),
                            num_reqs)
        self.buffers.join()

    def _inputs(self, fields: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.config.sampling:  # the previous step's samples, which tokens with prev_token_row take
            fields["feedback"] = self.buffers.feedback
        return fields

    def _write_outputs(self, outputs: Mapping[str, torch.Tensor], num_reqs: int) -> None:
        for name, dst in self.buffers.output_views(num_reqs).items():
            dst.copy_(outputs[name])
        if self.config.sampling:
            self.buffers.feedback[:num_reqs].copy_(outputs["token_ids"])

    def _run_unpadded(self, plan: StepPlan, token_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        inputs = {name: torch.from_numpy(a).to(self.device) for name, a in plan.arrays.items()}
        if token_ids is not None:  # ids outside the vocabulary are clamped into it, never read out of bounds
            inputs["input_ids"] = token_ids.to(torch.int64).clamp(0, self.vocab_size - 1)
        outputs = self._forward(self._inputs(inputs), plan.decode_only)
        if self.config.sampling:
            self._write_outputs(outputs, plan.num_reqs)
        return {name: t.clone() for name, t in outputs.items()}

    def _forward(self, inputs: Mapping[str, torch.Tensor], decode_only: bool) -> dict[str, torch.Tensor]:
        """The step's function, compiled with ``compile=True``."""
        return self._compiled(self, inputs, decode_only) if self._compiled else self._model_forward(inputs, decode_only)

    def _model_forward(self, inputs: Mapping[str, torch.Tensor], decode_only: bool) -> dict[str, torch.Tensor]:
        """Model + logits (+ sampling) for one step: the function ``compile=True`` compiles.
        ``inputs``: one tensor per step field (``self.fields``); returns the step's outputs by name."""
        metadata = AttentionMetadata.from_step(inputs, self.fields.metadata, self.policy.reads, decode_only,
                                               self.backends)
        input_ids = inputs["input_ids"]
        if self.config.sampling:  # ids sampled by the previous step, read where they lie on the device
            input_ids = sampling.fed_back_ids(input_ids, inputs["prev_token_row"], inputs["feedback"])
        hidden = self.model(input_ids, inputs["positions"], self.kv_caches, metadata)             # (T, hidden)
        # (R, vocab) float32; a decode step's rows are its tokens (T == R, one each): no gather launch
        logits = self.model.compute_logits(hidden if decode_only else hidden[inputs["logits_indices"]])
        if not self.config.sampling:
            return {"logits": logits}
        return self._sample(logits, inputs)

    def _sample(self, logits: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raw = logits
        if self.config.structured:  # grammar masks first: the filters and the sample see allowed tokens only
            logits = sampling.apply_token_bitmask(logits, inputs["token_bitmask"], inputs["constrained"])
        ids = sampling.sample(logits, inputs["temperature"], inputs["top_k"], inputs["top_p"], inputs["min_p"],
                              inputs["seed"], inputs["sample_offset"])                            # (R,) int64
        out = {"token_ids": ids}
        if self.config.max_logprobs:
            chosen, top, top_ids = sampling.token_logprobs(raw, ids, self.config.max_logprobs)
            out.update(logprobs=torch.cat((chosen[:, None], top), dim=1), top_ids=top_ids)
        return out

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run every step shape once on dummy plans (reading the null block, writing nothing), so
        Triton JIT and, with ``compile=True``, every compilation happen now, not mid-serving."""
        cfg = self.config
        if cfg.cudagraph == "full":
            self.capture()
            return
        refresh_norms_on_load(self.model)  # what the fused kernels derive from the weights, before any compile
        target = Target(self.fields, self.policy, None, None)
        if cfg.cudagraph == "padded":
            def run(key: GraphKey) -> None:
                self.buffers.copy_in(capture_plan(cfg, target, cfg.num_blocks, *key))
                self._run_static(key, cfg.padded_num_reqs(key[0]))

            keys = sorted(self.graph_keys(), reverse=True)
            compile_ahead.compile_runs((lambda k=k: run(k)) for k in keys)  # every key's Triton kernels, in parallel
            for key in keys:
                run(key)
        else:  # unpadded: one request / several requests, decode / mixed (sizes 1 specialise)
            for tokens, reqs, decode in ((3, 2, False), (2, 1, False), (2, 2, True), (1, 1, True)):
                if reqs <= cfg.max_num_seqs and tokens <= cfg.max_num_tokens:
                    self._run_unpadded(capture_plan(cfg, target, cfg.num_blocks, tokens, decode, num_reqs=reqs))
        self._finish_warmup()

    def _finish_warmup(self) -> None:
        self._warm = True
        if self._compiled is not None:
            self._compiled.mark_warm()
            logger.info("fullgraph: compiled %d graphs in %.1f s", self._compiled.stats.graphs,
                        self._compiled.stats.seconds)

    # ---- capture -------------------------------------------------------------------------
    def graph_keys(self) -> list[GraphKey]:
        """Every (bucket, decode-only) pair a step can land in and the backends allow in a graph."""
        keys = []
        for size in self.config.buckets:
            if size <= self.config.max_num_seqs and self.policy.allows_graph(True):
                keys.append((size, True))
            if size > 1 and self.policy.allows_graph(False):
                keys.append((size, False))
        return keys

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        """Capture a CUDA graph for every key (largest first, one pool); returns a report."""
        if self._graphs is None:
            if self.device.type != "cuda":
                raise ValueError(f"capture() records CUDA graphs, this runner's model is on {self.device}: nothing to "
                                 "capture here (cudagraph='padded' runs the static buffers eagerly)")
            raise ValueError(f'capture() needs cudagraph="full" (this runner is {self.config.cudagraph!r})')
        cfg = self.config
        target = Target(self.fields, self.policy, None, None)
        refresh_norms_on_load(self.model)  # what the fused kernels derive from the weights, before recording

        def prepare(key: GraphKey, context: int = 0) -> None:  # context: the step the linear forms are timed on
            plan = capture_plan(cfg, target, cfg.num_blocks, *key, context=context)
            if context and any(backend.prepare(plan) for backend in self._preparers):
                plan = capture_plan(cfg, target, cfg.num_blocks, *key)  # a backend reading no cache: none
            self.buffers.copy_in(plan)

        def run(key: GraphKey) -> None:
            self._run_static(key, cfg.padded_num_reqs(key[0]))

        forms = functools.partial(linear_choice.capture_forms, dtype=self.dtype, kept=self._graphs.forms)
        logger.info("fullgraph: capturing %d CUDA graphs ...", len(self.graph_keys()))
        self._capture_report = self._graphs.capture(self.graph_keys(), prepare, run, self._addresses, variants=forms,
                                                    timing=functools.partial(prepare, context=linear_choice.CONTEXT))
        logger.info("fullgraph: %s", self._capture_report)
        self._finish_warmup()
        return self._capture_report

    def _addresses(self) -> dict[str, int]:
        return {**self.buffers.addresses(), **{f"kv_caches[{i}]": t.data_ptr() for i, t in enumerate(self.kv_caches)}}

    # ---- statistics ----------------------------------------------------------------------
    def _count(self, plan: StepPlan, mode: str) -> None:
        s = self._stats
        s["steps"] += 1
        s["tokens"] += plan.num_tokens
        s["padded_tokens"] += plan.num_tokens_padded - plan.num_tokens
        if mode == "full":
            s["graph_hits"][plan.key] += 1

    def stats(self) -> dict:
        """Steps, graph hits per key, eager fallbacks with reasons, padding waste, capture cost, forms."""
        s = self._stats
        total = s["tokens"] + s["padded_tokens"]
        report = self._capture_report
        return {"steps": s["steps"], "tokens": s["tokens"], "padded_tokens": s["padded_tokens"],
                "padding_waste": s["padded_tokens"] / total if total else 0.0,
                "graph_hits": dict(s["graph_hits"]), "eager_fallbacks": dict(s["eager_fallbacks"]),
                "graphs": report.num_graphs if report else 0, "capture_seconds": report.seconds if report else 0.0,
                "graph_bytes": report.graph_bytes if report else 0,
                "forms": dict(self._graphs.forms) if self._graphs is not None else {},  # linear form per key
                "form_ms": {key: times for key, _, times in report.chosen} if report else {},  # where timed
                "compiled_graphs": self._compiled.stats.graphs if self._compiled else 0,
                "compile_seconds": self._compiled.stats.seconds if self._compiled else 0.0,
                "recompiles_after_warmup": self._compiled.stats.recompiles_after_warmup if self._compiled else 0}

    def stats_line(self) -> str:
        s = self.stats()
        return (f"steps={s['steps']} tokens={s['tokens']} padding={s['padding_waste']:.1%} "
                f"graph_hits={sum(s['graph_hits'].values())} fallbacks={sum(s['eager_fallbacks'].values())} "
                f"graphs={s['graphs']} capture={s['capture_seconds']:.2f}s/{s['graph_bytes'] / 2**20:.1f}MiB")

