"""Phi-3-Small (random weights) with block-sparse attention: chunked prefill of a prompt longer
than the local window, then greedy decoding, each step one captured CUDA graph.

GPU: the full 8K shape in bf16, ``cudagraph="full"``. CPU: the toy config, ``cudagraph="padded"``.
"""
import time

import torch

import fullgraph as fg

cuda = torch.cuda.is_available()
config = fg.models.Phi3SmallConfig.phi3_small_8k() if cuda else fg.models.Phi3SmallConfig.toy()
model = fg.models.Phi3Small(config, dtype=torch.bfloat16 if cuda else torch.float32,
                            device="cuda" if cuda else "cpu", seed=0)
chunk, new_tokens = (1024, 32) if cuda else (64, 16)
prompt_len = 4 * chunk          # the local window is 1024 tokens (toy: 64), so the prompt is sparse
runner = fg.FullGraphRunner(model, max_num_seqs=1, max_num_tokens=chunk, max_model_len=prompt_len + new_tokens,
                            capture_sizes=(1, chunk), cudagraph="full" if cuda else "padded")
blocks = runner.blocks.allocate(-(-(prompt_len + new_tokens) // runner.config.block_size))
prompt = torch.randint(0, 100000 if cuda else 500, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()

start = time.perf_counter()
for pos in range(0, prompt_len, chunk):     # chunked prefill
    out = runner.step([fg.SeqChunk(token_ids=prompt[pos:pos + chunk], start_pos=pos, block_ids=blocks)])
token = int(out.logits[0].argmax())
print(f"prefill: {prompt_len} tokens in {chunk}-token chunks, {time.perf_counter() - start:.2f} s (GPU: with capture)")

generated, latencies = [token], []
for pos in range(prompt_len, prompt_len + new_tokens - 1):
    t0 = time.perf_counter()
    out = runner.step([fg.SeqChunk(token_ids=[token], start_pos=pos, block_ids=blocks)])
    token = int(out.logits[0].argmax())     # syncs: the latency includes the whole step
    latencies.append(time.perf_counter() - t0)
    generated.append(token)
lat = sorted(latencies)
print(f"decode ({out.mode}): median {lat[len(lat) // 2] * 1e3:.2f} ms/step, min {lat[0] * 1e3:.2f} ms")
print("tokens:", generated)
print(runner.stats_line())
