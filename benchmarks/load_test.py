"""Load test of the OpenAI-compatible server: N concurrent streaming clients on loopback.

    python benchmarks/load_test.py --preset llama-1b --requests 256 --concurrency 256 --input-len 512 \\
        --output-len 128 --engine-too --out load.json      # starts the server itself (random weights)
    python benchmarks/load_test.py --url http://127.0.0.1:8000 --api-key KEY ...   # a running server

The workload is ``python -m fullgraph.bench serve``'s, drawn the same way from the same seed
(random token-id prompts, lengths uniform in [L/2, 3L/2] after ``--shared-prefix`` common tokens,
``--output-len`` new tokens each with ``ignore_eos``, all at once or Poisson at ``--rate``), so its
numbers sit beside ``bench serve``'s; with ``--engine-too`` (and ``--preset``) ``bench serve`` runs
next (its CLI, after the server has stopped) and its engine rows are printed below.

Each client holds one keep-alive connection, streams ``/v1/completions`` and reads raw chunks (the
events are parsed after the clock stops, so the client costs little per token). TTFT is from
sending a request to its first chunk, TPOT the mean gap between its tokens after the first.
``client_cpu_s`` says how busy this process was (near ``seconds``: the client, not the server, was
the limit). A server started here gets bench serve's runner sizes and ``--warmup on``. Prints a
table, writes JSON with ``--out``, progress on stderr; never asserts; stops by itself (``--timeout``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fullgraph.bench.serve import workload  # noqa: E402  (bench serve's prompts and arrivals, same seed)


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server (http://host:port)")
    target.add_argument("--model", help="start a server on this checkpoint")
    target.add_argument("--preset", help="start a server on this random-weights preset (token ids only)")
    p.add_argument("--api-key", default=None, help="the server's key")
    p.add_argument("--requests", type=int, default=64, help="number of requests")
    p.add_argument("--concurrency", type=int, default=64, help="most requests in flight (clients)")
    p.add_argument("--input-len", type=int, default=256, help="mean prompt length (uniform in [L/2, 3L/2])")
    p.add_argument("--output-len", type=int, default=64, help="new tokens per request (eos ignored)")
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens of one system prompt every prompt starts with")
    p.add_argument("--rate", type=float, default=0.0, help="requests per second (Poisson); 0: all at once")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")
    p.add_argument("--max-num-seqs", type=int, default=64, help="server started here: most requests running")
    p.add_argument("--max-num-tokens", type=int, default=1024, help="server started here: token budget of a step")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for a server started here")
    p.add_argument("--engine-too", action="store_true", help="with --preset: also run bench serve's in-process engine")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    return p.parse_args(argv)


def _max_model_len(args) -> int:
    longest = args.shared_prefix + args.input_len * 3 // 2 + args.output_len + 16
    return -(-longest // 256) * 256   # as bench serve sizes its runner


def start_server(args) -> tuple[subprocess.Popen, str, Path]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = Path(tempfile.mkstemp(prefix="fullgraph-serve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "fullgraph", "serve", "--port", str(port), "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-tokens", str(args.max_num_tokens), "--max-model-len", str(_max_model_len(args)),
           "--max-capture-size", str(min(args.max_num_tokens, 512)), "--max-logprobs", "0", "--no-structured",
           "--warmup", "on",
           "--seed", str(args.seed), "--no-access-log", "--log-level", "warning",
           *(["--model", args.model] if args.model else ["--preset", args.preset]),
           *(["--api-key", args.api_key] if args.api_key else []), *args.server_arg]
    print(f"starting: {' '.join(cmd)}  (log: {log})", file=sys.stderr, flush=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + args.timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url, log
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the server was not ready after {args.timeout} s (log: {log})")
        time.sleep(0.5)


class Progress:
    def __init__(self, total: int) -> None:
        self.total, self.done, self.start, self._shown = total, 0, time.perf_counter(), 0.0

    def step(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if self.done == self.total or now - self._shown > 0.2:
            self._shown, filled = now, 30 * self.done // self.total
            print(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} requests, "
                  f"{now - self.start:.1f} s", end="\n" if self.done == self.total else "", file=sys.stderr, flush=True)


class Connection:
    """A minimal HTTP/1.1 keep-alive client over asyncio streams: a few microseconds per streamed
    chunk, where httpx's stack costs a few hundred (it was the bottleneck at a few thousand chunks/s)."""

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.host, self.port = host, port
        self.head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": f"{host}:{port}", **headers}.items())
        self.reader = self.writer = None

    async def post(self, path: str, body: dict, result: dict) -> None:
        """POST ``body``; into ``result``: ``sent``, ``first`` / ``last`` (times of the first and last
        body chunks) and ``raw`` (the body), or ``error``."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        result["sent"] = time.perf_counter()
        self.writer.write(f"POST {path} HTTP/1.1\r\n{self.head}Content-Type: application/json\r\n"
                          f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        status = int(head.split(" ", 2)[1])
        chunks = []
        if "transfer-encoding: chunked" in head:
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readline()
                    break
                chunks.append((await self.reader.readexactly(size + 2))[:-2])
                result.setdefault("first", time.perf_counter())
        else:
            length = int(head.split("content-length:", 1)[1].split("\r\n", 1)[0])
            chunks.append(await self.reader.readexactly(length))
            result["first"] = time.perf_counter()
        result["last"] = time.perf_counter()
        if "connection: close" in head:
            self.close()
        if status != 200:
            result["error"] = f"{status}: {b''.join(chunks)[:200]!r}"
        else:
            result["raw"] = b"".join(chunks)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def run_clients(args, url: str, prompts, arrivals, model: str) -> tuple[list[dict], float, float]:
    parsed = urllib.parse.urlsplit(url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    results, progress = [{} for _ in prompts], Progress(len(prompts))
    queue: asyncio.Queue[int] = asyncio.Queue()

    def body(i: int) -> dict:
        return {"model": model, "prompt": prompts[i], "max_tokens": args.output_len, "temperature": args.temperature,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    async def feed(start: float) -> None:
        for i in range(len(prompts)):
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            queue.put_nowait(i)

    async def client() -> None:   # one connection; takes the next request due
        conn = Connection(parsed.hostname, parsed.port or 80, headers)
        try:
            while (i := await queue.get()) >= 0:
                try:
                    await conn.post("/v1/completions", body(i), results[i])
                except (OSError, asyncio.IncompleteReadError, ValueError) as err:
                    results[i]["error"] = f"{type(err).__name__}: {err}"
                    conn.close()
                progress.step()
        finally:
            conn.close()

    warm, conn = {}, Connection(parsed.hostname, parsed.port or 80, headers)  # one untimed request first
    await conn.post("/v1/completions", {**body(0), "max_tokens": 2}, warm)
    conn.close()
    if "error" in warm:
        raise SystemExit(f"the warm-up request failed: {warm['error']}")
    cpu, start = time.process_time(), time.perf_counter()
    clients = [asyncio.create_task(client()) for _ in range(min(args.concurrency, len(prompts)))]
    await asyncio.wait_for(feed(start), args.timeout)
    for _ in clients:
        queue.put_nowait(-1)  # after every request: each client ends when it reaches one
    await asyncio.wait_for(asyncio.gather(*clients), args.timeout)
    return results, time.perf_counter() - start, time.process_time() - cpu


def _tokens(raw: bytes) -> int:
    """Output tokens of one stream: its usage chunk's completion_tokens."""
    for event in reversed(raw.split(b"\n\n")):
        if event.startswith(b"data: {") and b'"usage":{' in event:
            return int(json.loads(event[6:])["usage"]["completion_tokens"])
    return 0


def summarize(name: str, results: list[dict], seconds: float, cpu: float, prompts) -> dict:
    ok = [r for r in results if "raw" in r]
    tokens = [_tokens(r["raw"]) for r in ok]
    ttft = [r["first"] - r["sent"] for r in ok] or [float("nan")]
    tpot = [(r["last"] - r["first"]) / (n - 1) for r, n in zip(ok, tokens) if n > 1] or [float("nan")]
    out = sum(tokens)
    return {"system": name, "requests": len(ok), "errors": len(results) - len(ok), "seconds": seconds,
            "requests_s": len(ok) / seconds, "output_tokens": out, "output_tok_s": out / seconds,
            "total_tok_s": (out + sum(len(p) for p, r in zip(prompts, results) if "raw" in r)) / seconds,
            "ttft_p50_ms": float(np.percentile(ttft, 50)) * 1e3, "ttft_p99_ms": float(np.percentile(ttft, 99)) * 1e3,
            "tpot_p50_ms": float(np.percentile(tpot, 50)) * 1e3, "tpot_p99_ms": float(np.percentile(tpot, 99)) * 1e3,
            "client_cpu_s": cpu, "first_error": next((r["error"] for r in results if "error" in r), "")[:120]}


def engine_rows(args) -> list[dict]:
    """``bench serve``'s in-process engine rows on the same workload (run after the server stopped)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "serve.json"
        cmd = [sys.executable, "-m", "fullgraph.bench", "serve", "--preset", args.preset, "--out", str(out),
               *(f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (
                   "requests", "input_len", "output_len", "rate", "max_num_seqs", "max_num_tokens", "temperature",
                   "seed")), *([f"--shared-prefix={args.shared_prefix}"] if args.shared_prefix else [])]
        print(f"running: {' '.join(cmd)}", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=sys.stderr, timeout=args.timeout)
        rows = json.loads(out.read_text())["rows"]
    return [{**r, "system": f"bench serve: {r['system']}", "errors": 0, "requests_s": r["requests"] / r["seconds"]}
            for r in rows if str(r.get("system", "")).startswith("fullgraph")]


def _table(rows: list[dict]) -> None:
    cols = ["system", "requests", "errors", "seconds", "requests_s", "output_tok_s", "total_tok_s", "ttft_p50_ms",
            "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "client_cpu_s"]
    cell = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(cell(r.get(c, "")).rjust(w) for c, w in zip(cols, widths)))


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.engine_too and not args.preset:
        raise SystemExit("--engine-too needs --preset (the in-process engine runs the same random weights)")
    proc = None
    if args.url is None:
        proc, url, _ = start_server(args)
    else:
        url = args.url.rstrip("/")
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/models", headers=headers), timeout=30) as r:
            card = json.loads(r.read())["data"][0]
        prompts, arrivals = workload(args, card["vocab_size"])
        print(f"load test: {url} ({card['id']}), {args.requests} requests, {args.concurrency} clients, input "
              f"{args.input_len // 2}-{args.input_len * 3 // 2} tokens, {args.output_len} out, "
              f"rate {args.rate or 'all at once'}", file=sys.stderr, flush=True)
        results, seconds, cpu = asyncio.run(run_clients(args, url, prompts, arrivals, card["id"]))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    rows = [summarize("HTTP server (load_test.py)", results, seconds, cpu, prompts)]
    if args.engine_too:
        rows += engine_rows(args)
    _table(rows)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": "load_test", "url": url, "args": vars(args), "rows": rows},
                                             indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
