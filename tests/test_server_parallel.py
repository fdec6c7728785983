"""The HTTP server over a tensor-parallel group on the CPU: ``torchrun --nproc-per-node 2 -m fullgraph
serve --tensor-parallel-size 2``; rank 0 serves HTTP and leads, rank 1 follows its engine."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import fullgraph as fg
from fullgraph.models import presets
from test_server import ROOT, TIMEOUT, free_port, wait_until

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

LIMITS = dict(max_num_seqs=4, max_model_len=128, max_num_tokens=64, cudagraph="padded")


def test_two_ranks_serve_what_one_process_generates(tmp_path):
    port, log = free_port(), tmp_path / "server.log"
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "fullgraph",
            "serve", "--preset", "toy", "--port", str(port), "--max-num-seqs", "4", "--max-model-len", "128",
            "--max-num-tokens", "64", "--cudagraph", "padded", "--tensor-parallel-size", "2", "--no-access-log",
            "--log-level", "warning"]
    with open(log, "w") as out:
        server = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            assert server.poll() is None, f"the server exited: {log.read_text()[-3000:]}"
            try:
                return httpx.get(f"{url}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False
        wait_until(ready, 120, "two ranks to load and serve")
        prompts = [[5, 9, 2, 11], [7, 7], [300, 1, 44, 8, 19]]
        body = {"prompt": prompts, "max_tokens": 8, "temperature": 0}
        first = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).json()
        sampled = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT,
                             json={"prompt": prompts[:2], "max_tokens": 8, "temperature": 0.8, "seed": 3}).json()
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).json()   # prefix-cached prompts
    finally:
        server.terminate()
        server.wait(60)
    model = presets.build("toy", dtype=torch.float32, device=torch.device("cpu"), seed=0)
    llm = fg.LLM(model, **LIMITS)
    greedy = [list(o.outputs[0].token_ids)
              for o in llm.generate(prompts, fg.SamplingParams(temperature=0, max_tokens=8))]
    seeded = [list(o.outputs[0].token_ids) for o in
              llm.generate(prompts[:2], fg.SamplingParams(temperature=0.8, seed=3, max_tokens=8))]
    assert [c["token_ids"] for c in first["choices"]] == greedy
    assert [c["token_ids"] for c in again["choices"]] == greedy
    assert [c["token_ids"] for c in sampled["choices"]] == seeded


def test_tensor_parallel_needs_the_engine_process():
    from fullgraph.server import ServerConfig

    with pytest.raises(ValueError, match="tensor_parallel_size > 1 needs engine_process=True"):
        ServerConfig(preset="toy", llm={"tensor_parallel_size": 2}, engine_process=False)
    with pytest.raises(ValueError, match=r"tensor_parallel_size'\]: expected an int >= 1"):
        ServerConfig(preset="toy", llm={"tensor_parallel_size": 0})
