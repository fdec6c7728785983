"""In-graph sampling: the RNG, the reference against exact float64 distributions, the Triton kernel
(interpreter on CPU) against the reference, capture and compile.

The statistical tests draw N single-token samples of one row (offsets 0 .. N-1) and compare the
counts with the filtered distribution computed here in float64 by a chi-square bound that a wrong
filter order fails (shown by `test_wrong_order_fails_the_bound`).
"""
from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from fullgraph.kernels import sampling as kernel
from fullgraph.kernels.sampling_chain import _rough_gumbel
from fullgraph.sampling import gumbel_noise, philox4x32, sample, sample_reference, token_logprobs

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INF = float("inf")
gpu = pytest.mark.gpu


def make_params(rows: int, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234, offsets=None,
                device=DEVICE) -> dict[str, torch.Tensor]:
    full = lambda v, dt: (v.to(device, dt) if torch.is_tensor(v) else torch.full((rows,), v, dtype=dt, device=device))
    return dict(temperature=full(temperature, torch.float32), top_k=full(top_k, torch.int32),
                top_p=full(top_p, torch.float32), min_p=full(min_p, torch.float32), seeds=full(seed, torch.int64),
                offsets=full(0, torch.int64) if offsets is None else offsets.to(device, torch.int64))


def run_kernel(logits: torch.Tensor, params: dict, **knobs) -> torch.Tensor:
    """The kernel's launcher with tuning knobs, on DEVICE (the interpreter on CPU); ids on logits' device."""
    out = kernel.launch(logits.to(DEVICE), *(v.to(DEVICE) for v in params.values()), **knobs)
    return out.to(logits.device)


def realistic_logits(vocab: int, seed: int) -> torch.Tensor:
    """A spread like a language model's: a Gaussian bulk, a few dominant tokens, some masked ids."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=g) * 2.0
    x[torch.randperm(vocab, generator=g)[:12]] += torch.linspace(3.0, 7.0, 12)
    x[torch.randperm(vocab, generator=g)[:5]] = -INF
    return x


def exact_probs(logits: torch.Tensor, t: float, k: int = 0, p: float = 1.0, min_p: float = 0.0,
                order: str = "kpm", minp_scaled: bool = True) -> torch.Tensor:
    """The filtered distribution in float64. ``order`` lists the filters as applied (k, p, m);
    the spec is "kpm" with min-p relative to the temperature-scaled distribution."""
    s = logits.double() / t
    keep = torch.isfinite(s)
    for f in order:
        live = torch.where(keep, s, -INF)
        if f == "k" and 0 < k < len(s):
            keep &= s >= live.sort(descending=True).values[k - 1]
        elif f == "p" and p < 1:
            e = torch.exp(live - live.max())
            srt = e.sort(descending=True).values
            j = int((srt.cumsum(0) < p * srt.sum()).sum().clamp(max=len(s) - 1))
            keep &= e >= srt[j]
        elif f == "m" and min_p > 0:
            ref = s if minp_scaled else logits.double()
            keep &= torch.exp(ref - ref[keep].max()) >= min_p
    probs = torch.where(keep, torch.exp(s - s[keep].max()), 0.0)
    return probs / probs.sum()


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, bound): bins of expected count >= 5, the rest pooled; a sampled token of
    probability 0 gives an infinite statistic. The bound is df + 6 sqrt(2 df) + 10."""
    n = tokens.numel()
    counts = torch.bincount(tokens.cpu(), minlength=len(probs)).double()
    if counts[probs == 0].sum() > 0:
        return INF, 0.0
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big & (probs > 0)].sum()[None]])
    exp = torch.cat([expected[big], expected[~big & (probs > 0)].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    df = len(exp) - 1
    return float(((obs - exp) ** 2 / exp).sum()), df + 6 * math.sqrt(2 * df) + 10


SETTINGS = {  # name: (temperature, top_k, top_p, min_p)
    "t0.5": (0.5, 0, 1.0, 0.0), "t1": (1.0, 0, 1.0, 0.0), "t2": (2.0, 0, 1.0, 0.0),
    "top_k": (1.0, 20, 1.0, 0.0), "top_p": (1.3, 0, 0.8, 0.0), "min_p": (1.5, 0, 1.0, 0.05),
    "k+p": (1.0, 25, 0.6, 0.0), "k+p+m": (0.8, 50, 0.9, 0.02), "p+m": (2.0, 0, 0.7, 0.01),
}
N_SAMPLES = 8000


def draw(logits_row: torch.Tensor, setting, n: int = N_SAMPLES, sampler=sample_reference, seed: int = 7):
    t, k, p, m = setting
    params = make_params(n, temperature=t, top_k=k, top_p=p, min_p=m, seed=seed, offsets=torch.arange(n),
                         device=torch.device("cpu"))
    return sampler(logits_row[None].expand(n, -1).contiguous(), **params)


# --------------------------------------------------------------------------------------------- RNG
def test_philox_known_answers():
    """Random123's known-answer vectors for Philox4x32-10."""
    vectors = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
               ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
               ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
                (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, want in vectors:
        got = philox4x32(tuple(torch.tensor([c]) for c in ctr), tuple(torch.tensor([k]) for k in key))
        assert [int(w) for w in got] == list(want)


@triton.jit
def _triton_philox_kernel(ctr_ptr, out_ptr, seed, N: tl.constexpr):
    i = tl.arange(0, N)
    r0, r1, r2, r3 = tl.philox(seed, tl.load(ctr_ptr + i).to(tl.uint32), tl.load(ctr_ptr + N + i).to(tl.uint32),
                               tl.load(ctr_ptr + 2 * N + i).to(tl.uint32), tl.load(ctr_ptr + 3 * N + i).to(tl.uint32))
    tl.store(out_ptr + i, r0.to(tl.int64))
    tl.store(out_ptr + N + i, r1.to(tl.int64))
    tl.store(out_ptr + 2 * N + i, r2.to(tl.int64))
    tl.store(out_ptr + 3 * N + i, r3.to(tl.int64))


def test_philox_matches_triton_philox():
    """An independent implementation: Triton's own tl.philox on the same counters and key."""
    n, seed = 64, -0x123456789ABCDEF
    ctr = torch.randint(0, 2**32, (4, n), dtype=torch.int64)
    out = torch.zeros(4, n, dtype=torch.int64, device=DEVICE)
    _triton_philox_kernel[(1,)](ctr.to(DEVICE), out, seed, N=n)
    want = philox4x32(tuple(ctr), (torch.tensor(seed & 0xFFFFFFFF), torch.tensor((seed >> 32) & 0xFFFFFFFF)))
    assert torch.equal(out.cpu(), torch.stack(want))


@triton.jit
def _rough_gumbel_kernel(out_ptr, start, step, n, FAST: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, _rough_gumbel(start + i * step, FAST), mask=i < n)


def rough_gumbel_error(start: int, step: int, n: int, fast: bool) -> float:
    """Largest |rough - reference| Gumbel noise over m = start, start + step, ... (n values)."""
    m = start + step * torch.arange(n, dtype=torch.int64, device=DEVICE)
    out = torch.empty(n, device=DEVICE)
    _rough_gumbel_kernel[(triton.cdiv(n, 1024),)](out, start, step, n, FAST=fast, BLOCK=1024)
    u = (m * 2 + 1).float() * 2.0 ** -24
    return (out - (-torch.log(-torch.log(u)))).abs().max().item()


def test_rough_gumbel_is_close_on_cpu():
    """The chain's scan ranks tokens by a cheap Gumbel noise (kernels/sampling_chain.py) and bounds
    its error by ``_slack``: its series and branches here (np.log2 in the interpreter; every m on the GPU)."""
    edges = [(0, 1, 4096), (2**23 - 4096, 1, 4096), (2**22 - 2048, 1, 4096), (0, 2**23 // 8192, 8192),
             (2**23 - 2**18 - 2048, 1, 4096)]                                     # d = 1/32: the branch
    assert max(rough_gumbel_error(*e, fast=False) for e in edges) < 2e-5


@gpu
def test_rough_gumbel_is_close_for_every_draw():
    """lg2.approx on the GPU: every one of the 2**23 noise values within 2e-5 of the reference's
    (``_slack`` allows 1e-4 plus the roundings of the score)."""
    assert rough_gumbel_error(0, 1, 2**23, fast=True) < 2e-5


def test_gumbel_noise_is_counter_based_and_gumbel():
    seeds, offsets = torch.tensor([5, 5, -9]), torch.tensor([0, 1, 2**40 + 3])
    g = gumbel_noise(seeds, offsets, 20_001)                                # (3, V)
    assert torch.equal(g[1, :777], gumbel_noise(seeds[1:2], offsets[1:2], 777)[0])   # no dependence on V, row
    assert not torch.equal(g[0], g[1])
    assert torch.isfinite(g).all()
    assert abs(g.mean().item() - 0.5772) < 0.02 and abs(g.var().item() - math.pi ** 2 / 6) < 0.05


# ------------------------------------------------------------------------------ the reference's law
@pytest.mark.parametrize("name", list(SETTINGS))
def test_reference_matches_the_exact_distribution(name):
    logits = realistic_logits(1000, seed=3)
    t, k, p, m = SETTINGS[name]
    stat, bound = chi_square(draw(logits, SETTINGS[name]), exact_probs(logits, t, k, p, m))
    assert stat < bound, f"{name}: chi-square {stat:.1f} >= bound {bound:.1f}"


WRONG = {  # name: (setting, how the wrong implementation differs)
    "top-p before top-k": ((1.0, 25, 0.6, 0.0), dict(order="pkm")),
    "min-p before top-p": ((1.3, 0, 0.7, 0.03), dict(order="mp")),
    "min-p on unscaled logits": ((2.0, 0, 1.0, 0.1), dict(minp_scaled=False)),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_wrong_order_fails_the_bound(name):
    """A Gumbel-max sampler over a wrongly filtered set fails the bound the reference passes."""
    logits = realistic_logits(1000, seed=3)
    (t, k, p, m), how = WRONG[name]
    right, wrong = exact_probs(logits, t, k, p, m), exact_probs(logits, t, k, p, m, **how)
    assert (right - wrong).abs().sum() / 2 > 0.02                       # the orders really differ here
    s = logits / t
    keep = wrong > 0
    tokens = torch.where(keep, s + gumbel_noise(torch.full((N_SAMPLES,), 7), torch.arange(N_SAMPLES), 1000),
                         -INF).argmax(-1)
    stat, bound = chi_square(tokens, right)
    assert stat > bound, f"{name}: the wrong order passed (chi-square {stat:.1f} < {bound:.1f})"
    stat, bound = chi_square(draw(logits, (t, k, p, m)), right)
    assert stat < bound


# --------------------------------------------------------------------------- rows, seeds, padding
SAMPLERS = {"reference": sample_reference, "kernel": lambda x, **p: run_kernel(x, p, block=512)}


@pytest.mark.parametrize("impl", list(SAMPLERS))
def test_greedy_rows_are_the_argmax(impl):
    logits = torch.randn(6, 1500, device=DEVICE) * 3
    logits[1, [40, 900]] = 50.0                           # a tie: the lowest id wins
    logits[2, 1400] = 40.0                                # the max in a later chunk
    logits[3] = -INF
    logits[4, :] = -INF
    logits[4, 1234] = -3.0                                # one finite
    logits[5, ::3] = float("nan")                         # NaN counts as -inf
    got = SAMPLERS[impl](logits, **make_params(6, temperature=torch.tensor([0.0, 0.0, -1.0, 0.0, 0.0, 0.0])))
    want = torch.where(torch.isnan(logits), -INF, logits).argmax(-1)
    assert got.tolist() == want.tolist() and got[1] == 40 and got[3] == 0 and got[4] == 1234


@pytest.mark.parametrize("impl", list(SAMPLERS))
def test_padded_and_degenerate_rows_stay_in_range(impl):
    rows, vocab = 8, 1100
    logits = torch.randn(rows, vocab, device=DEVICE)
    logits[0] = 0.0                                       # a padded row of zeros
    logits[1] = -INF                                      # nothing finite
    logits[2] = float("nan")
    logits[3, :] = -INF
    logits[3, 777] = 1.0                                  # one finite token: always sampled
    logits[4, ::2] = float("nan")
    params = make_params(rows, temperature=torch.tensor([0.0, 1.0, 0.7, 1.0, 1.0, 0.0, 1e-6, 5.0]),
                         top_k=torch.tensor([0, 5, 0, 3, 0, 0, 0, 1]), top_p=0.9, min_p=0.05)
    got = SAMPLERS[impl](logits, **params)
    assert ((got >= 0) & (got < vocab)).all()
    assert got[1] == 0 and got[2] == 0 and got[3] == 777
    assert torch.isfinite(logits[4, got[4]]) and got[6] == logits[6].argmax()


@pytest.mark.parametrize("impl", list(SAMPLERS))
def test_seeds_reproduce_across_batch_composition(impl):
    """(seed, offset) alone picks the token: alone in a batch of 1 or at rows 17/30/63 of a batch of 64
    mixed with other settings; other seeds give other tokens."""
    sampler, vocab = SAMPLERS[impl], 1200
    row = realistic_logits(vocab, seed=11).to(DEVICE)
    g = torch.Generator().manual_seed(5)
    batch = (torch.randn(64, vocab, generator=g) * 3).to(DEVICE)
    temperature = torch.where(torch.arange(64) % 2 == 0, 0.0, torch.rand(64, generator=g) * 2)   # half greedy
    params = make_params(64, temperature=temperature, top_k=torch.randint(0, 100, (64,), generator=g),
                         top_p=torch.rand(64, generator=g) * 0.5 + 0.5, min_p=torch.rand(64, generator=g) * 0.1,
                         seed=torch.randint(0, 2**62, (64,), generator=g), offsets=torch.randint(0, 9999, (64,), generator=g))
    settings = {17: (1.0, 0, 1.0, 0.0), 30: (0.8, 40, 0.9, 0.0), 63: (1.5, 0, 0.95, 0.02)}
    singles = {}
    for r, (t, k, p, m) in settings.items():
        batch[r] = row
        for name, v in dict(temperature=t, top_k=k, top_p=p, min_p=m, seeds=99 + r, offsets=123 + r).items():
            params[name][r] = v
        singles[r] = sampler(row[None], **make_params(1, temperature=t, top_k=k, top_p=p, min_p=m, seed=99 + r,
                                                      offsets=torch.tensor([123 + r])))
    got = sampler(batch, **params)
    assert {r: int(got[r]) for r in settings} == {r: int(v[0]) for r, v in singles.items()}
    rows = row[None].expand(12, -1).contiguous()
    a = sampler(rows, **make_params(12, temperature=2.0, seed=1, offsets=torch.arange(12)))
    b = sampler(rows, **make_params(12, temperature=2.0, seed=2, offsets=torch.arange(12)))
    assert (a != b).sum() >= 6


# ------------------------------------------------------------------------------ kernel == reference
def random_batch(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, dict]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * (torch.rand(rows, 1, generator=g) * 4 + 0.5)
    logits[:, torch.randperm(vocab, generator=g)[:20]] = -INF
    logits[::5, :vocab // 2] = torch.round(logits[::5, :vocab // 2] * 4) / 4      # bf16-like ties
    kind = torch.randint(0, 8, (rows,), generator=g)          # greedy, temperature, k, p, m, k+p, k+m, all
    on = lambda *kinds: torch.isin(kind, torch.tensor(kinds))
    params = make_params(
        rows, temperature=torch.where(kind == 0, 0.0, torch.rand(rows, generator=g) * 1.8 + 0.2),
        top_k=torch.where(on(2, 5, 6, 7), torch.randint(1, 200, (rows,), generator=g), 0),
        top_p=torch.where(on(3, 5, 7), torch.rand(rows, generator=g) * 0.7 + 0.3, 1.0),
        min_p=torch.where(on(4, 6, 7), torch.rand(rows, generator=g) * 0.3, 0.0),
        seed=torch.randint(-2**62, 2**62, (rows,), generator=g), offsets=torch.randint(0, 2**40, (rows,), generator=g),
        device=torch.device("cpu"))
    return logits, params


@pytest.mark.parametrize("vocab,knobs", [
    (1000, dict(block=1024)),                                   # one chunk
    (2500, dict(block=512, num_chunks=3, refine_above=8)),      # several chunks, a short last one; level 2
    (1537, dict(block=512, num_chunks=3, cand_block=16)),       # undecided lists past the registers
])
def test_kernel_matches_reference(vocab, knobs):
    logits, params = random_batch(20 if knobs.get("cand_block") else 28, vocab, seed=vocab)
    ws: dict = {}
    assert run_kernel(logits, params, workspace=ws, **knobs).tolist() == sample_reference(logits, **params).tolist()
    sampled = params["temperature"] > 0
    if "cand_block" in knobs:                                   # the refined (and slow) select paths ran
        assert (ws["part_i"][..., 2].sum(-1).cpu()[sampled] > knobs["cand_block"]).sum() >= 3
    if "refine_above" in knobs:                                 # some rows took the level-2 histogram
        filtered = sampled & ((params["top_k"] > 0) | (params["top_p"] < 1))
        assert (ws["zones"][:, 2].cpu()[filtered] > 0).sum() >= 3


@pytest.mark.parametrize("vocab,knobs", [
    (2000, dict(block=512, num_chunks=3)),                        # the default chain and lists
    (1200, dict(block=128, num_chunks=8, chain=2, list_top=2)),   # short chain, short lists: more fallbacks
    (2000, dict(block=512, num_chunks=2, chain=1, list_top=1)),   # one link: every rejected draw falls back
])
def test_chain_rows_match_reference_on_every_path(vocab, knobs):
    """Rows with top-p alone (or no filter) take the chain of Gumbel winners (kernels/sampling_chain.py):
    decided at its first link, at a later one, or fallen back to the histogram path (every link under
    the top-p cut rejected, or a link the chunk lists cannot prove). Every path gives the reference's
    token, ties and -inf included."""
    g = torch.Generator().manual_seed(sum(knobs.values()))
    rows = 48
    logits = torch.randn(rows, vocab, generator=g) * (torch.rand(rows, 1, generator=g) * 3 + 0.5)
    logits[::4, :vocab // 2] = torch.round(logits[::4, :vocab // 2] * 4) / 4       # bf16-like ties
    logits[1::7, ::3] = -INF
    top_p = torch.where(torch.arange(rows) % 6 == 0, 1.0, torch.rand(rows, generator=g) * 0.9 + 0.05)
    params = make_params(rows, temperature=torch.rand(rows, generator=g) * 1.5 + 0.3, top_p=top_p,
                         seed=torch.randint(-2**62, 2**62, (rows,), generator=g),
                         offsets=torch.randint(0, 2**40, (rows,), generator=g), device=torch.device("cpu"))
    ws: dict = {}
    assert run_kernel(logits, params, workspace=ws, **knobs).tolist() == sample_reference(logits, **params).tolist()
    state = ws["zones"][:, 8].cpu()
    assert set(state.tolist()) == {1, 2}, "every chain row is decided (1) or falls back (2), and both happen"
    sums = ws["chain_f"].sum(1).cpu()                            # (rows, links + 1): masses above links, Z
    later = (state == 1) & (top_p < 1) & (sums[:, 0] >= top_p * sums[:, -1])
    assert later.sum() >= (3 if knobs.get("chain", 4) > 1 else 0), "rows decided past the first link"


@pytest.mark.parametrize("knobs", [dict(block=256, num_chunks=4), dict(block=256, num_chunks=4, cand_block=16)])
def test_topk_rows_match_reference_on_every_path(knobs):
    """Rows with a top-k the chunks' value lists reach (k <= 8 * 4 here) list their candidates in
    level 1 (kernels/sampling_topk.py) with top-p and min-p on top; a list longer than cand_block
    (k > 16 in the second case) falls back to the histograms; larger k keeps the histogram path.
    Every path gives the reference's token, wide ties at the listed threshold included."""
    g = torch.Generator().manual_seed(11 + len(knobs))
    rows, vocab = 40, 2000
    logits = torch.randn(rows, vocab, generator=g) * (torch.rand(rows, 1, generator=g) * 3 + 0.5)
    logits[::4] = torch.round(logits[::4] * 2) / 2                                # wide ties
    logits[1::9, ::5] = -INF
    top_k = torch.randint(1, 45, (rows,), generator=g)
    params = make_params(rows, temperature=torch.rand(rows, generator=g) * 1.5 + 0.3, top_k=top_k,
                         top_p=torch.where(torch.arange(rows) % 3 == 0, torch.rand(rows, generator=g) * 0.8 + 0.1, 1.0),
                         min_p=torch.where(torch.arange(rows) % 5 == 1, 0.05, 0.0),
                         seed=torch.randint(-2**62, 2**62, (rows,), generator=g), device=torch.device("cpu"))
    ws: dict = {}
    assert run_kernel(logits, params, workspace=ws, **knobs).tolist() == sample_reference(logits, **params).tolist()
    state = ws["zones"][:, 8].cpu()
    listed = top_k <= 32
    n_list = ws["part_i"][..., 2].sum(-1).cpu()
    # a short list's token is taken in level 1 (state 1: decided), a longer one's in the select pass (3)
    assert (n_list[state == 1] <= 128).all() and (n_list[state == 3] > 128).all() and (state[listed] == 1).sum() >= 8
    assert (state[~listed] == 0).all()
    check_thresholds(logits, params, ws["zones"], torch.nonzero(listed & (state == 1)).flatten())
    if "cand_block" in knobs:
        assert (state[listed] == 2).sum() >= 3, "lists past cand_block fall back"


def check_thresholds(logits: torch.Tensor, params: dict, zones: torch.Tensor, rows: torch.Tensor) -> None:
    """The select pass's v_k (zones column 10) is the row's k-th largest scaled logit, exactly; its
    v_p (column 11) the top-p cut over the tokens at or above v_k, in float64 to 1e-5 of the mass
    (-inf: the cut lies below every token min-p keeps)."""
    bits = zones[:, 10:12].contiguous().view(torch.float32).cpu()
    for r in rows.tolist():
        t = params["temperature"][r].float()
        s = logits[r].float() * (torch.tensor(1.0) / t)               # as the kernel scales (no FMA)
        k, top_p = int(params["top_k"][r]), float(params["top_p"][r])
        v_k, v_p = bits[r].tolist()
        want_k = torch.topk(s, k).values[-1].item() if 0 < k < len(s) else -INF
        assert v_k == want_k, f"row {r}: v_k {v_k} against the {k}-th largest {want_k}"
        s64 = s.double()
        kept = s64 >= v_k
        e = torch.exp(s64 - s64.max())
        q = top_p * e[kept].sum().item()
        if top_p >= 1.0:
            assert v_p == -INF, f"row {r}: v_p {v_p} without a top-p"
            continue
        if v_p == -INF:   # top-p keeps every listed token: its cut lies below min-p's
            survivors = e[kept & (e >= float(params["min_p"][r]))].sum().item()
            assert survivors < q * (1 + 1e-5), f"row {r}: no top-p cut, but min-p keeps {survivors} of {q}"
            continue
        mass = lambda v: e[kept & (s64 >= v)].sum().item()           # noqa: E731
        assert v_p in s[kept].tolist() and mass(v_p) >= q * (1 - 1e-5), f"row {r}: v_p {v_p} keeps too little"
        above = s64[kept & (s64 > v_p)]
        assert len(above) == 0 or mass(above.min().item()) < q * (1 + 1e-5), f"row {r}: v_p {v_p} is not the cut"


def test_select_pass_thresholds_match_float64():
    """The select pass's key search finds the exact top-k and top-p thresholds and the reference's
    token on every row it serves (histogram-path top-k rows, whose threshold falls inside the list,
    listed top-k rows, ties, -inf logits, min-p), over short lists and long ones."""
    g = torch.Generator().manual_seed(29)
    rows, vocab = 48, 2000
    logits = torch.randn(rows, vocab, generator=g) * (torch.rand(rows, 1, generator=g) * 3 + 0.5)
    logits[::3] = torch.round(logits[::3] * 2) / 2                                # wide ties
    logits[1::8, ::4] = -INF
    top_k = torch.randint(1, 300, (rows,), generator=g)
    top_k[::7] = 0                                                                # top-p alone
    params = make_params(rows, temperature=torch.rand(rows, generator=g) * 1.5 + 0.3, top_k=top_k,
                         top_p=torch.where(torch.arange(rows) % 2 == 0, torch.rand(rows, generator=g) * 0.8 + 0.1, 1.0),
                         min_p=torch.where(torch.arange(rows) % 5 == 2, 0.05, 0.0),
                         seed=torch.randint(-2**62, 2**62, (rows,), generator=g), device=torch.device("cpu"))
    want = sample_reference(logits, **params).tolist()
    ws: dict = {}
    assert run_kernel(logits, params, workspace=ws, block=256, num_chunks=4).tolist() == want
    n_list = ws["part_i"][..., 2].sum(-1).cpu()
    chain = (top_k == 0) & (params["min_p"].cpu() == 0)
    selected = ~chain & (n_list > 0)     # the chain's rows list nothing; listed top-k rows' thresholds are kept too
    check_thresholds(logits, params, ws["zones"], torch.nonzero(selected).flatten())
    assert (selected & (n_list <= 128)).sum() >= 8, "short lists (a top-k of 50)"
    assert (selected & (n_list > 128)).sum() >= 3, "longer lists"


def test_chain_decides_rows_with_chunks_of_few_finite_logits():
    """A chunk with no more finite logits than it lists (a structured-output mask, say) bounds the
    rest by -inf: the chain still proves its links and decides the row."""
    vocab = 2048
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3))
    logits[:, 512:1536] = -INF                                     # chunks 1 and 2 of 4 entirely masked
    logits[1::2, 1024] = 2.0                                       # one finite token in chunk 2
    params = make_params(6, top_p=torch.tensor([0.9, 0.9, 0.5, 0.5, 1.0, 1.0]), seed=torch.arange(6),
                         device=torch.device("cpu"))
    ws: dict = {}
    assert run_kernel(logits, params, workspace=ws, block=512, num_chunks=4).tolist() == \
        sample_reference(logits, **params).tolist()
    assert (ws["zones"][:, 8] == 1).all()
    assert not ws["list_f"][..., -1].isnan().any(), "a masked chunk's bound is -inf, not NaN"


def test_chain_needs_the_runner_up_bound():
    """A chunk's list must bound the tokens it does not list, runner-ups of a position included.
    Built from the noise itself (block 32: position 0 of chunk 0 sees ids 0, 32, ..., 992): the
    best score is token a (value 3, rejected by top-p 0.9), the runner-up of its position is r (value
    5, kept), and chunk 1's best is b (value 4.9, kept, a lower score than r). The chain's second link,
    from the lists alone, would be b; only the runner-up bound shows r may beat it."""
    vocab = 2048
    for seed in range(100):
        g = gumbel_noise(torch.tensor([seed]), torch.tensor([0]), vocab)[0]
        pos0 = torch.arange(0, 1024, 32)
        a = int(pos0[g[pos0].argmax()])
        r = int(pos0[torch.where(pos0 == a, INF, g[pos0]).argmin()])
        chunk1 = torch.arange(1024, vocab)
        fits = chunk1[(g[chunk1] + 4.9 < g[r] + 5.0) & (g[chunk1] + 4.9 > g[r] + 4.0)]
        if g[a] + 3.0 > g[r] + 5.0 and len(fits):
            break
    b = int(fits[0])
    logits = torch.full((1, vocab), -20.0)
    logits[0, [a, r, b]] = torch.tensor([3.0, 5.0, 4.9])
    params = make_params(1, top_p=0.9, seed=seed, device=torch.device("cpu"))
    ws: dict = {}
    got = run_kernel(logits, params, workspace=ws, block=32, num_chunks=2, list_top=1)
    assert sample_reference(logits, **params).tolist() == [r]
    assert got.tolist() == [r] and int(ws["zones"][0, 8]) == 2, "the unproven link falls back"


def test_kernel_slow_path_on_a_huge_tie():
    """A tie of 300 tokens straddling the k-th largest: one bucket holds more than the select pass's
    registers, so it falls back to re-reading the row; every tied token is kept (the tie rule)."""
    vocab, rows = 1200, 6
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(rows, vocab, generator=g) - 3.0
    logits[:, :10] = 5.0 + torch.rand(rows, 10, generator=g)
    logits[:, 100:400] = 3.0
    params = make_params(rows, temperature=1.0, top_k=torch.tensor([50, 50, 200, 0, 50, 311]),
                         top_p=torch.tensor([1.0, 0.9999, 1.0, 0.9999, 0.5, 1.0]), seed=torch.arange(rows),
                         device=torch.device("cpu"))
    got = run_kernel(logits, params, block=512, cand_block=64)
    assert got.tolist() == sample_reference(logits, **params).tolist()
    many = make_params(16, temperature=1.0, top_k=50, offsets=torch.arange(16), device=torch.device("cpu"))
    tokens = run_kernel(logits[:1].expand(16, -1).contiguous(), many, block=512, cand_block=64)
    assert ((tokens >= 100) & (tokens < 400)).sum() > 6 and ((tokens < 10) | (tokens >= 100) & (tokens < 400)).all()


def test_kernel_default_config_matches_reference():
    logits, params = random_batch(24, 3000, seed=1)
    assert run_kernel(logits, params).tolist() == sample_reference(logits, **params).tolist()


# ---------------------------------------------------------------------------- compile and capture
def test_compile_fullgraph_reference_matches_eager():
    logits, params = random_batch(16, 1000, seed=4)
    logits, params = logits.to(DEVICE), {k: v.to(DEVICE) for k, v in params.items()}
    eager = sample_reference(logits, **params)
    assert torch.compile(sample_reference, fullgraph=True)(logits, **params).tolist() == eager.tolist()


def test_compile_fullgraph_sample_and_kernel_match_eager():
    """``sample`` (the reference on CPU, the kernel on CUDA) and the kernel op itself: on CPU
    Inductor calls the op, which runs the Triton interpreter."""
    logits, params = random_batch(8, 1000, seed=4)
    logits, params = logits.to(DEVICE), {k: v.to(DEVICE) for k, v in params.items()}
    eager = sample_reference(logits, **params)
    assert torch.compile(sample, fullgraph=True)(logits, **params).tolist() == eager.tolist()
    op = torch.compile(lambda x, p: torch.ops.fullgraph.sample(x, *p.values()), fullgraph=True)
    assert op(logits, params).tolist() == eager.tolist()


@gpu
def test_cuda_graph_replay_matches_eager():
    rows, vocab = 48, 32_000
    static_logits, static_params = random_batch(rows, vocab, seed=0)
    static_logits, static_params = static_logits.cuda(), {k: v.cuda() for k, v in static_params.items()}
    for _ in range(2):
        sample(static_logits, **static_params)                  # JIT outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = sample(static_logits, **static_params)
    for seed in (1, 2, 3):
        logits, params = random_batch(rows, vocab, seed=seed)
        static_logits.copy_(logits)
        for k, v in params.items():
            static_params[k].copy_(v)
        graph.replay()
        assert static_out.tolist() == sample(static_logits, **static_params).tolist()


@gpu
@pytest.mark.parametrize("rows,vocab,knobs", [
    (96, 128_256, {}),                                          # the launch shape of 64+ rows: more programs than fit
    (32, 128_256, {}),
    (40, 32_000, dict(refine_above=8)),                         # level 2 in most filtered rows
    (40, 32_000, dict(cand_block=16)),                          # chain and top-k rows falling back
])
def test_fused_tail_matches_split_launches(rows, vocab, knobs):
    """Passes 3 and 4 in one launch, their programs meeting at a per-row barrier (the GPU's default),
    pick the same tokens and leave the same zones as the two launches the interpreter runs (which
    the CPU tests check against the reference), over every kind of row, fresh logits each round."""
    for seed in range(3):
        logits, params = random_batch(rows, vocab, seed=100 + seed)
        logits, params = logits.cuda(), {k: v.cuda() for k, v in params.items()}
        ws_fused: dict = {}
        ws_split: dict = {}
        fused = run_kernel(logits, params, fuse_tail=True, workspace=ws_fused, **knobs)
        split = run_kernel(logits, params, fuse_tail=False, workspace=ws_split, **knobs)
        assert fused.tolist() == split.tolist()
        assert torch.equal(ws_fused["zones"][:, :12], ws_split["zones"][:, :12])
        fell_back = int((ws_split["zones"][:, 8] == 2).sum())
        if knobs:
            assert fell_back or int((ws_split["zones"][:, 2] > 0).sum()), "no row reached level 2"


def test_fused_tail_refused_under_the_interpreter():
    if not kernel.INTERPRET:
        pytest.skip("only under TRITON_INTERPRET (the CPU tests)")
    logits, params = random_batch(2, 300, seed=0)
    with pytest.raises(ValueError, match="fuse_tail=True needs a GPU"):
        run_kernel(logits, params, fuse_tail=True)


@gpu
@pytest.mark.parametrize("vocab", [32_000, 128_256])
def test_kernel_matches_reference_on_gpu(vocab):
    """Same tokens up to float ties: GPU exp/log differ from PyTorch's in the last bit."""
    logits, params = random_batch(96, vocab, seed=vocab)
    logits, params = logits.cuda(), {k: v.cuda() for k, v in params.items()}
    got, want = sample(logits, **params), sample_reference(logits, **params)
    assert (got != want).sum() <= 1


# -------------------------------------------------------------------------------------- logprobs
def test_token_logprobs_match_float64():
    logits = torch.randn(5, 300, device=DEVICE) * 4
    logits[1, :100] = -INF
    logits[2] = -INF
    ids = torch.tensor([3, 150, 0, 299, 7], device=DEVICE)
    chosen, top, top_ids = token_logprobs(logits, ids, 4)
    ref = torch.log_softmax(logits.double(), -1)
    ok = torch.arange(5, device=DEVICE) != 2
    torch.testing.assert_close(chosen[ok].double(), ref[ok].gather(1, ids[ok, None])[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(top[ok].double(), ref[ok].topk(4, -1).values, rtol=1e-5, atol=1e-5)
    assert torch.equal(top_ids[ok], ref[ok].topk(4, -1).indices)
    assert (chosen[2] == -INF) and (top[2] == -INF).all() and not torch.isnan(top).any()


def test_sample_rejects_bad_parameters():
    logits = torch.randn(3, 50)
    params = make_params(3, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="top_k must be \\(3,\\) torch.int32"):
        sample(logits, **{**params, "top_k": params["top_k"].long()})
    with pytest.raises(ValueError, match="logits must be a floating"):
        sample(logits[0], **params)
