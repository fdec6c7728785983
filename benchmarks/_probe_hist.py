# TEMPORARY probe (deleted after one device run): cost of bucketing strategies at batch 32, V = 128256.
import torch, triton, triton.language as tl
from fullgraph.kernels import sampling as K

@triton.jit
def probe(x_ptr, h_ptr, vocab, chunk, NB: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr):
    row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    acc = tl.zeros([NB], tl.int32)
    accf = tl.zeros([NB], tl.float32)
    z = tl.zeros([], tl.float32)
    for off in range(0, chunk, BLOCK):
        idx = c * chunk + off + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * vocab + idx, mask=idx < vocab, other=float("-inf"))
        s = x * 0.5
        d = 8.0 - s
        e = tl.exp(s - 8.0)
        b = tl.where(d < (NB - 1) / 16.0, d * 16.0, NB - 1).to(tl.int32)
        b = tl.minimum(tl.maximum(b, 0), NB - 1)
        if MODE == 0:
            acc += tl.histogram(b, NB)
        elif MODE == 1:
            tl.atomic_add(h_ptr + row * NB + b, 1, mask=idx < vocab, sem="relaxed")
        elif MODE == 2:
            rung = 8.0 - tl.arange(0, NB).to(tl.float32) * 0.25
            ge = s[:, None] >= rung[None, :]
            acc += tl.sum(ge.to(tl.int32), 0)
            accf += tl.sum(tl.where(ge, e[:, None], 0.0), 0)
        elif MODE == 3:
            g = K._noise_block(c * chunk + off, row, c, BLOCK)
            z += tl.max(s + g, 0)
        else:
            z += tl.sum(e, 0)
    if MODE == 0 or MODE == 2:
        tl.atomic_add(h_ptr + row * NB + tl.arange(0, NB), acc, sem="relaxed")
        z += tl.sum(accf, 0)
    tl.store(h_ptr + row * NB, z.to(tl.int32))

def main():
    R, V = 32, 128256
    x = torch.randn(R, V, device="cuda")
    for C, BLOCK, warps in [(8, 4096, 8), (16, 2048, 8), (32, 1024, 4)]:
        chunk = triton.cdiv(triton.cdiv(V, C), BLOCK) * BLOCK
        for mode, nb in [(4, 16), (3, 16), (0, 64), (0, 256), (0, 1024), (0, 2048), (1, 256), (1, 2048), (2, 8), (2, 16), (2, 32)]:
            h = torch.zeros(R, nb, dtype=torch.int32, device="cuda")
            f = lambda: probe[(R, triton.cdiv(V, chunk))](x, h, V, chunk, NB=nb, MODE=mode, BLOCK=BLOCK, num_warps=warps)
            f(); torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(20): f()
            g.replay(); torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); g.replay(); e.record(); e.synchronize()
            print(f"C={C:3d} BLOCK={BLOCK:5d} mode={mode} nb={nb:5d}: {s.elapsed_time(e) * 1e3 / 20:8.1f} us", flush=True)

if __name__ == "__main__":
    main()
