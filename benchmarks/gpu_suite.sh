#!/usr/bin/env bash
# One GPU session in few calls: `bash benchmarks/gpu_suite.sh PART...` with PART in
#   env tests tests-all targets kernels linear pdl-ab sdpa-ab diag profile profile-phi3 core core-fast phi3 phi3-fast capture
#   capture-ahead compile compile-time final
#   peers (the decode table beside a naive whole-model graph and reduce-overhead) window serve engine (sampling, mask) sanitize
#   sanitize-probe (initcheck: producer -> consumer pairs; toy-llama with PDL on and off) long (100K tokens through fg.LLM)
#   mask (structured output on the GPU; TOKENIZER=dir for the vocabulary) capture-cold (empty Triton caches, ahead and serial)
#   serve-prefix (a shared 1,024-token system prompt, prefix caching on and off) server-load (HTTP server vs in-process;
#   needs fastapi, starlette, pydantic, pydantic-core, uvicorn, httptools, annotated-types, typing-inspection,
#   typing-extensions and opentelemetry-api carried as wheels)
#   sanitize-fresh (initcheck over producer -> consumer probes on fresh memory; racecheck over toy Phi-3-Small)
#   sanitize-control (initcheck, every matrix product written into zero-filled memory first) race-sdpa (racecheck, sdpa phases)
#   big-steps (mixed steps of 512-2048 tokens: graph vs padded-eager) host (a step's host work by stage)
#   decode-ab, decode-ab-big (decode rows of the tree in .base/, e.g. `git archive <commit> fullgraph | tar -x -C .base`,
#   and ours back to back) fusions (FULLGRAPH_FUSE variants beside .base/) sweep-skinny (linear configs, rows 1-64)
#   sampling (the sampling kernel's passes and undecided-zone sizes) sampling-ab (.base/'s sampling kernel, then ours) reduce-ab (FULLGRAPH_FUSE=reduce against the default)
#   skinny (the split-K linear's GPU tests; decode at 2-64 rows by default, with cuBLAS and with the split-K kernel)
#   skinny-big (default and cuBLAS for Llama-8B and Phi-3-Small; a profiled batch-32 step) skinny-sweep (its configurations against cuBLAS)
#   attn-ab (decode attention now against unsplit with the earlier tiles and the earlier rule)
#   layernorm-ab (Phi-3-Small with its LayerNorms applied on load, FULLGRAPH_FUSE=layer,rope,layernorm, and without)
#   layernorm-sweep (those two projections with the LayerNorm on load over launch configurations)
#   b32-h200 (llama-1b at 8 and 32 rows: the split-K linear against cuBLAS, each also with split decode attention, and profiles)
#   sweep-attention (decode attention's splits and launch configs)
#   kv-layout (decode attention over token-major and head-major cache pages)
#   host-calls (the cost of one Python, numpy and CUDA call on the machine)
#   loop-profile (the overlapped decode loop's device timeline: ops outside the graph, idle time)
#   head32-ab (the LM head's GEMM writing float32 logits, FULLGRAPH_FUSE=...,head32, against the default)
#   loop-ab (decode loops and the overlapped loop's timeline of .base/, MORE_TREES and this tree)
#   host-ab (the host stages of .base/ and this tree, alternating)
#   stage-ab (the stage-in's event on a branch against in line, FULLGRAPH_STAGE_EVENT=inline: tests, decode rows)
#   forms (linears of 2-32 rows timed at capture, split-K or cuBLAS kept, against each pinned: tests, decode rows)
#   pdl-batch (programmatic dependent launch off and on, decode at 1-64 rows, llama-1b, SmolLM2, Llama-8B)
#   forms-diag (timed against cuBLAS at llama-1b's 32 rows: alone in the process, the stage-in event in line)
#   forms-loop (the overlapped loop's device timeline at 32 rows with FULLGRAPH_LINEAR=timed, cublas and auto)
# Logs and JSON land in $OUT (or ./out); each part has its own time limit so a call stays bounded.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: parts that compare trees run from .base/
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

run() {  # run NAME LIMIT_S CMD...: tee to $OUT/NAME.log, report status and seconds
    local name=$1 limit=$2; shift 2
    local start=$(date +%s)
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
}

for part in "$@"; do
case $part in
decode-ab)  # the decode rows of issue 31 at an earlier commit (.base) and now, back to back, PDL on; each
    # tree runs from its own directory (python -m puts the working directory ahead of PYTHONPATH)
    for tree in .base .; do
        tag=$([ "$tree" = . ] && echo new || echo old)
        for preset in llama-1b smollm2-135m; do
            (cd $tree && PYTHONPATH=. run "ab_${preset}_$tag" 100 python3 -m fullgraph.bench decode --preset $preset \
                --batch 1 32 --context 1024 --modes full --steps 40 --loop sync overlap --out "$OUT/ab_${preset}_$tag.json")
        done
    done
    ;;
fusions)  # what the decoder-layer fusions (FULLGRAPH_FUSE) are worth, beside .base/ (its own defaults) and
    # none, with the linears' dependents started right after their wait (early) or after their last tile (late)
    for variant in "old .base - 1" "unfused . none early" "default . layer,rope late" "fused-early . layer,rope early" \
                   "all . layer,rope,reduce late"; do
        [ -n "${NO_BASE:-}" ] && [ "${variant#old }" != "$variant" ] && continue   # NO_BASE=1: the default is the baseline
        set -- $variant
        tag=$1 tree=$2 fuse=${3#-} pdl=$4
        for preset in smollm2-135m llama-1b; do
            (cd $tree && FULLGRAPH_PDL=$pdl FULLGRAPH_FUSE=$fuse PYTHONPATH=. run "fuse_${preset}_$tag" 60 \
                python3 -m fullgraph.bench decode --preset $preset --batch 1 32 --context 1024 --modes full --steps 30 \
                --loop overlap --out "$OUT/fuse_${preset}_$tag.json")
        done
        (cd $tree && FULLGRAPH_PDL=$pdl FULLGRAPH_FUSE=$fuse PYTHONPATH=. run "fuse_llama8b_$tag" 60 \
            python3 -m fullgraph.bench decode --preset llama-8b --batch 1 --context 1024 --modes full --steps 30 \
            --loop overlap --out "$OUT/fuse_llama8b_$tag.json")
    done
    for variant in "old .base -" "default . layer,rope" "reduce . layer,rope,reduce"; do   # the block-sparse merge too
        [ -n "${NO_BASE:-}" ] && [ "${variant#old }" != "$variant" ] && continue
        set -- $variant
        (cd $2 && FULLGRAPH_FUSE=${3#-} PYTHONPATH=. run "fuse_phi3_$1" 60 python3 -m fullgraph.bench decode \
            --preset phi3-small-8k --batch 1 --context 2048 --modes full --steps 30 --loop overlap \
            --out "$OUT/fuse_phi3_$1.json")
    done
    ;;
reduce-ab)  # the split-KV merge in the attention launch (FULLGRAPH_FUSE=reduce) against the reduce launch
    for fuse in layer,rope layer,rope,reduce; do
        tag=$([ "$fuse" = layer,rope ] && echo default || echo reduce)
        for preset in smollm2-135m llama-1b; do
            FULLGRAPH_FUSE=$fuse run "fuse_${preset}_$tag" 60 python3 -m fullgraph.bench decode --preset $preset \
                --batch 1 32 --context 1024 --modes full --steps 30 --loop overlap --out "$OUT/fuse_${preset}_$tag.json"
        done
        FULLGRAPH_FUSE=$fuse run "fuse_phi3_$tag" 60 python3 -m fullgraph.bench decode --preset phi3-small-8k \
            --batch 1 --context 2048 --modes full --steps 30 --loop overlap --out "$OUT/fuse_phi3_$tag.json"
    done
    for per_sm in 2 1; do  # merged in the launch, fewer splits (split_kv_reduce.SPLIT_PROGRAMS_PER_SM, default 4)
        for preset in smollm2-135m llama-1b; do
            FULLGRAPH_FUSE=layer,rope,reduce run "fuse_${preset}_reduce_sm$per_sm" 60 python3 -c "
import sys
from fullgraph.kernels import split_kv_reduce
split_kv_reduce.SPLIT_PROGRAMS_PER_SM = $per_sm
from fullgraph.bench.__main__ import main
sys.argv = ['bench', 'decode', '--preset', '$preset', '--batch', '1', '32', '--context', '1024', '--modes', 'full',
            '--steps', '30', '--loop', 'overlap', '--out', '$OUT/fuse_${preset}_reduce_sm$per_sm.json']
main()"
        done
    done
    ;;
attn-ab)  # decode attention as it is (unsplit on a full GPU, long programs with 128-key tiles: NEW), unsplit with
    # the earlier tiles (UNSPLIT), and split at every batch with the earlier tiles (OLD), back to back
    run attn_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_kernels.py -k "unsplit or split or replay"
    for ctx in 1024 4096; do
        for v in new:1:1024 old:1000000:1000000000 unsplit:1:1000000000; do
            IFS=: read tag unsplit keys <<< "$v"
            for preset in smollm2-135m llama-1b; do
                run "attn_${preset}_${ctx}_$tag" 90 python3 -c "
import sys
from fullgraph.kernels import split_kv_reduce
import importlib
importlib.import_module('fullgraph.kernels.attention_config').LONG_PROGRAM_KEYS = $keys
split_kv_reduce.UNSPLIT_PROGRAMS_PER_SM = $unsplit
from fullgraph.bench.__main__ import main
sys.argv = ['bench', 'decode', '--preset', '$preset', '--batch', '32', '64', '--context', '$ctx',
            '--modes', 'full', '--steps', '30', '--loop', 'overlap', '--out', '$OUT/attn_${preset}_${ctx}_$tag.json']
main()"
            done
        done
    done
    ;;
decode-ab-big)  # the same for the 7-8B shapes
    for tree in .base .; do
        tag=$([ "$tree" = . ] && echo new || echo old)
        (cd $tree && PYTHONPATH=. run "ab_llama8b_$tag" 120 python3 -m fullgraph.bench decode --preset llama-8b \
            --batch 1 32 --context 1024 --modes full --steps 30 --loop sync overlap --out "$OUT/ab_llama8b_$tag.json")
        (cd $tree && PYTHONPATH=. run "ab_phi3_$tag" 120 python3 -m fullgraph.bench decode --preset phi3-small-8k \
            --batch 1 --context 2048 --modes full --steps 30 --loop sync overlap --out "$OUT/ab_phi3_$tag.json")
    done
    ;;
sweep-skinny)  # our linear's launch configurations against cuBLAS: one row and a few, plain and with the norm on load
    run sweep_rows 240 python3 benchmarks/sweep_linear.py --rows 1 8 32 64 --block-k 256 512 1024 \
        --out "$OUT/sweep_rows.json"
    run sweep_norm 150 python3 benchmarks/sweep_linear.py --norm --rows 1 32 --block-n 4 8 32 --block-k 512 1024 \
        --warps 8 --stages 3 --out "$OUT/sweep_norm.json"
    ;;
skinny)  # the split-K linear for 2-64 rows (kernels.skinny_linear): its GPU tests, then decode steps with it pinned
    # (auto: split-K for 2-32 rows, cuBLAS above; the default, timed, picks per size), with cuBLAS for every step of 2-64 rows (the layer unfused) and with
    # the split-K kernel for all of them, back to back (one row takes the one-row kernel in each)
    run skinny_tests 150 python3 -m pytest -q -m gpu tests/test_skinny_linear.py tests/test_linear_kernel.py
    for impl in cublas auto skinny; do
        FULLGRAPH_LINEAR=$impl run "skinny_llama1b_$impl" 120 python3 -m fullgraph.bench decode --preset llama-1b \
            --batch 2 8 16 32 48 64 --context 1024 --modes full --steps 30 --loop overlap --out "$OUT/skinny_llama1b_$impl.json"
        FULLGRAPH_LINEAR=$impl run "skinny_smollm2_$impl" 90 python3 -m fullgraph.bench decode --preset smollm2-135m \
            --batch 2 8 16 32 48 64 --context 1024 --modes full --steps 30 --loop overlap --out "$OUT/skinny_smollm2_$impl.json"
    done
    ;;
skinny-big)  # the same A/B for Llama-8B and Phi-3-Small, and the kernels of a batch-32 llama-1b step by default
    for impl in cublas auto; do
        FULLGRAPH_LINEAR=$impl run "skinny_llama8b_$impl" 150 python3 -m fullgraph.bench decode --preset llama-8b \
            --batch 8 32 --context 1024 --modes full --steps 30 --loop overlap --out "$OUT/skinny_llama8b_$impl.json"
        FULLGRAPH_LINEAR=$impl run "skinny_phi3_$impl" 150 python3 -m fullgraph.bench decode --preset phi3-small-8k \
            --batch 8 16 --context 2048 --modes full --steps 30 --loop overlap --out "$OUT/skinny_phi3_$impl.json"
    done
    FULLGRAPH_PDL=0 run skinny_profile 70 python3 benchmarks/profile_step.py --preset llama-1b \
        --batch 32 --context 1024 --out "$OUT/skinny_profile.json"
    ;;
skinny-sweep)  # the split-K kernel's configurations against cuBLAS at 1-64 rows (one row: and the one-row kernel), plain and normed
    run skinny_sweep 300 python3 benchmarks/sweep_linear.py --skinny --rows 32 --stages 3 4 --out "$OUT/skinny_sweep.json"
    # 48-64 rows, where cuBLAS still wins in the model (2026-12-06): is there a split-K config that does not?
    run skinny_sweep_rows 240 python3 benchmarks/sweep_linear.py --skinny --rows 48 64 --stages 4 \
        --shapes llama1b.qkv llama1b.o llama1b.gate_up llama1b.down smollm2.qkv smollm2.o smollm2.gate_up smollm2.down \
        --out "$OUT/skinny_sweep_rows.json"
    run skinny_sweep_norm 200 python3 benchmarks/sweep_linear.py --skinny --norm --rows 32 --stages 4 \
        --shapes llama1b.qkv llama1b.o llama1b.gate_up llama1b.down smollm2.qkv smollm2.gate_up \
        --out "$OUT/skinny_sweep_norm.json"
    ;;
peers)  # each row beside the naive whole-model CUDA graph and torch.compile(mode="reduce-overhead")
    run peers_llama1b 150 python3 -m fullgraph.bench decode --preset llama-1b --batch 1 32 --context 1024 --modes full \
        --steps 30 --loop sync overlap --peers --out "$OUT/peers_llama1b.json"
    run peers_smollm2 180 python3 -m fullgraph.bench decode --preset smollm2-135m --batch 1 32 --context 1024 \
        --modes full --steps 30 --loop sync overlap --peers --out "$OUT/peers_smollm2.json"
    run peers_llama8b 150 python3 -m fullgraph.bench decode --preset llama-8b --batch 1 --context 1024 --modes full \
        --steps 30 --loop sync overlap --peers --out "$OUT/peers_llama8b.json"
    run peers_phi3 150 python3 -m fullgraph.bench decode --preset phi3-small-8k --batch 1 --context 2048 --modes full \
        --steps 30 --loop sync overlap --peers --out "$OUT/peers_phi3.json"
    ;;
window)  # Mistral-7B shape at 16K: a 4096-token sliding window skips pages; the same model without it
    for preset in mistral-7b mistral-7b-dense; do
        run "window_$preset" 120 python3 -m fullgraph.bench decode --preset $preset --batch 1 8 --context 16384 \
            --modes full --steps 20 --out "$OUT/window_$preset.json"
    done
    ;;
serve)
    run serve_llama1b 240 python3 -m fullgraph.bench serve --preset llama-1b --requests 256 --input-len 512 \
        --output-len 128 --max-num-seqs 64 --max-num-tokens 2048 --peer-hf --out "$OUT/serve_llama1b.json"
    run serve_phi3 200 python3 -m fullgraph.bench serve --preset phi3-small-8k --requests 256 --input-len 512 \
        --output-len 128 --max-num-seqs 64 --max-num-tokens 2048 --out "$OUT/serve_phi3.json"
    # the same requests arriving at a Poisson rate (requests/s) near what each model sustains
    run serve_llama1b_poisson 120 python3 -m fullgraph.bench serve --preset llama-1b --requests 256 --input-len 512 \
        --output-len 128 --max-num-seqs 64 --max-num-tokens 2048 --rate 150 --out "$OUT/serve_llama1b_poisson.json"
    run serve_phi3_poisson 150 python3 -m fullgraph.bench serve --preset phi3-small-8k --requests 256 \
        --input-len 512 --output-len 128 --max-num-seqs 64 --max-num-tokens 2048 --rate 25 \
        --out "$OUT/serve_phi3_poisson.json"
    ;;
engine)
    run engine_overhead 150 python3 benchmarks/engine_overhead.py --out "$OUT/engine_overhead.json"
    run sampling 90 python3 benchmarks/bench_sampling.py --out "$OUT/sampling.json"
    run mask 60 python3 benchmarks/bench_mask.py --out "$OUT/mask.json"
    ;;
layernorm-ab)  # Phi-3-Small's LayerNorms applied on load in one-row steps (FULLGRAPH_FUSE=...,layernorm) against
    # the default (a LayerNorm kernel each), back to back; the kernels' GPU tests; the profile with it on
    run layernorm_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_linear_kernel.py \
        tests/test_linear_rope_kv.py tests/test_layer_norm_on_load.py -k "layer_norm or flash_rule"
    for fuse in layer,rope layer,rope,layernorm; do
        FULLGRAPH_FUSE=$fuse run "layernorm_phi3_${fuse//,/_}" 120 python3 -m fullgraph.bench decode \
            --preset phi3-small-8k --batch 1 --context 2048 --modes full --steps 30 --loop sync overlap \
            --out "$OUT/layernorm_phi3_${fuse//,/_}.json"
    done
    for fuse in layer,rope layer,rope,layernorm; do  # PDL off: each kernel's own time
        FULLGRAPH_FUSE=$fuse FULLGRAPH_PDL=0 run "layernorm_profile_${fuse//,/_}" 90 python3 benchmarks/profile_step.py \
            --preset phi3-small-8k --batch 1 --context 2048 --out "$OUT/layernorm_profile_${fuse//,/_}.json"
    done
    ;;
b32-h200)  # llama-1b at 32 rows on the H200 ran 1.565 ms overlapped at 48bf847 against 1.439 at 751020d: the
    # split-K linear pinned (auto; the default, timed, picks per size) beside cuBLAS for 2-32 rows, back to back; then
    # each one's kernels with PDL off (times that add up). decode-ab with .base/ at 751020d bisects further
    for variant in "splitk auto layer,rope" "cublas cublas layer,rope"; do
        set -- $variant
        FULLGRAPH_LINEAR=$2 FULLGRAPH_FUSE=$3 run "b32_$1" 90 python3 -m fullgraph.bench decode --preset llama-1b \
            --batch 8 32 --context 1024 --modes full --steps 30 --loop sync overlap --out "$OUT/b32_$1.json"
    done
    # decode attention split at every batch with the earlier tiles (the rule of d067413), each linear form
    for linear in auto cublas; do
        run "b32_splitattn_$linear" 90 env FULLGRAPH_LINEAR=$linear python3 -c "
import sys, importlib
from fullgraph.kernels import split_kv_reduce
importlib.import_module('fullgraph.kernels.attention_config').LONG_PROGRAM_KEYS = 1000000000
split_kv_reduce.UNSPLIT_PROGRAMS_PER_SM = 1000000
from fullgraph.bench.__main__ import main
sys.argv = ['bench', 'decode', '--preset', 'llama-1b', '--batch', '8', '32', '--context', '1024', '--modes', 'full',
            '--steps', '30', '--loop', 'sync', 'overlap', '--out', '$OUT/b32_splitattn_$linear.json']
main()"
    done
    for variant in "splitk auto layer,rope" "cublas cublas layer,rope"; do
        set -- $variant
        FULLGRAPH_LINEAR=$2 FULLGRAPH_FUSE=$3 FULLGRAPH_PDL=0 run "b32_profile_$1" 70 python3 benchmarks/profile_step.py \
            --preset llama-1b --batch 32 --context 1024 --out "$OUT/b32_profile_$1.json"
    done
    ;;
layernorm-sweep)  # one row of Phi-3-Small's QKV (+ RoPE + KV write) and GeGeLU up projection: the LayerNorm
    # kernel + the projection against the LayerNorm on load over launch configurations
    run layernorm_sweep 300 python3 benchmarks/sweep_layer_norm.py --out "$OUT/layernorm_sweep.json"
    ;;
sampling-ab)  # the sampling kernel of .base/ and of this tree back to back (the same flags, so the same logits),
    # after its GPU tests; then this tree's passes and undecided zones
    run sampling_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sampling.py
    (cd .base && PYTHONPATH=. run sampling_old 120 python3 ../benchmarks/bench_sampling.py --skip-reference \
        --out "$OUT/sampling_old.json")
    for tree in ${MORE_TREES:-}; do   # MORE_TREES="dir ...": other trees (carried), each as sampling_<dir>
        (cd $tree && PYTHONPATH=. run "sampling_${tree#.}" 120 python3 ../benchmarks/bench_sampling.py --skip-reference \
            --passes --out "$OUT/sampling_${tree#.}.json")
    done
    run sampling_new 120 python3 benchmarks/bench_sampling.py --skip-reference --out "$OUT/sampling_new.json"
    run sampling_passes 120 python3 benchmarks/bench_sampling.py --skip-reference --zones --passes \
        --out "$OUT/sampling_passes.json"
    ;;
sampling)  # the sampling kernel alone: undecided tokens per row, each pass at batch 32, the table (no sort reference)
    run sampling_passes 240 python3 benchmarks/bench_sampling.py --skip-reference --zones --passes --sweep \
        --out "$OUT/sampling.json"
    ;;
sanitize)  # quick: triton and block-sparse kernels, with programmatic dependent launch and without
    run sanitize 200 python3 benchmarks/sanitize.py --quick --tools initcheck memcheck --timeout 90 --out "$OUT/sanitize.json"
    FULLGRAPH_PDL=0 run sanitize_nopdl 120 python3 benchmarks/sanitize.py --quick --tools initcheck --timeout 100 \
        --out "$OUT/sanitize_nopdl.json"
    ;;
serve-prefix)
    # bench serve's own defaults (64 requests of 1,024 shared + ~256 own tokens, 64 running, a 1,024-token budget)
    run serve_prefix_default 200 python3 -m fullgraph.bench serve --preset llama-1b --shared-prefix 1024 \
        --out "$OUT/serve_prefix_default.json"
    run serve_prefix 300 python3 -m fullgraph.bench serve --preset llama-1b --shared-prefix 1024 --requests 256 \
        --input-len 512 --output-len 128 --max-num-seqs 64 --max-num-tokens 2048 --out "$OUT/serve_prefix.json"
    # every request admitted at once: its first token waits for prefill, not for a decode slot
    run serve_prefix_256 300 python3 -m fullgraph.bench serve --preset llama-1b --shared-prefix 1024 --requests 256 \
        --input-len 512 --output-len 128 --max-num-seqs 256 --max-num-tokens 2048 --out "$OUT/serve_prefix_256.json"
    # a chat turn: the shared 1,024-token system prompt and a 128-token user message
    run serve_prefix_chat 300 python3 -m fullgraph.bench serve --preset llama-1b --shared-prefix 1024 --requests 256 \
        --input-len 128 --output-len 128 --max-num-seqs 64 --max-num-tokens 2048 --out "$OUT/serve_prefix_chat.json"
    run serve_prefix_chat_256 300 python3 -m fullgraph.bench serve --preset llama-1b --shared-prefix 1024 --requests 256 \
        --input-len 128 --output-len 128 --max-num-seqs 256 --max-num-tokens 2048 --out "$OUT/serve_prefix_chat_256.json"
    # requests arriving at 32 a second (Poisson) instead of all at once
    run serve_prefix_rate 300 python3 -m fullgraph.bench serve --preset llama-1b --shared-prefix 1024 --requests 256 \
        --input-len 512 --output-len 128 --rate 32 --max-num-seqs 64 --max-num-tokens 2048 --out "$OUT/serve_prefix_rate.json"
    ;;
server-load)
    run server_load 300 python3 benchmarks/load_test.py --preset llama-1b --requests 256 --concurrency 256 \
        --input-len 512 --output-len 128 --max-num-seqs 64 --max-num-tokens 2048 --engine-too --out "$OUT/server_load.json"
    # the engine on a thread of the server's process, for the comparison
    run server_load_thread 200 python3 benchmarks/load_test.py --preset llama-1b --requests 256 --concurrency 256 \
        --input-len 512 --output-len 128 --max-num-seqs 64 --max-num-tokens 2048 --server-arg=--engine-in-process \
        --out "$OUT/server_load_thread.json"
    ;;
sanitize-probe)
    run sanitize_probe 200 python3 benchmarks/sanitize.py --probe --tools initcheck --timeout 180 --out "$OUT/sanitize_probe.json"
    for pdl in 1 0; do
        FULLGRAPH_PDL=$pdl run "sanitize_llama_pdl$pdl" 200 python3 benchmarks/sanitize.py --only "toy-llama triton" \
            --tools initcheck --timeout 180 --out "$OUT/sanitize_llama_pdl$pdl.json"
    done
    ;;
long)
    run long_context 300 python3 benchmarks/long_context.py --out "$OUT/long_context.json"
    ;;
mask)
    run mask_gpu 240 python3 benchmarks/bench_mask.py ${TOKENIZER:+--tokenizer "$TOKENIZER"} --out "$OUT/mask_gpu.json"
    ;;
capture-cold)  # every default size on an empty Triton cache: compiled ahead, then serially (per-kernel compile seconds)
    for preset in phi3-small-8k llama-1b; do
        for workers in 16 0; do
            cache=$(mktemp -d)
            TRITON_CACHE_DIR=$cache FULLGRAPH_COMPILE_WORKERS=$workers run "capture_${preset}_w$workers" 150 \
                python3 benchmarks/capture_breakdown.py --preset $preset --out "$OUT/capture_${preset}_w$workers.json"
        done
    done
    ;;
sanitize-fresh)  # initcheck over the probes, every finding printed: does the tool see cuBLAS's writes into fresh memory?
    SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    run sanitize_fresh 60 "$SAN" --tool initcheck --show-backtrace no --print-limit 5000 python3 benchmarks/sanitize.py \
        --driver --probe
    grep "^driver\|^probe\|^=========     at" "$OUT/sanitize_fresh.log" | uniq -c | tee "$OUT/sanitize_fresh_summary.txt"
    run race_phi3 100 python3 benchmarks/sanitize.py --only "toy-phi3-small triton" --tools racecheck --timeout 95 \
        --out "$OUT/race_phi3.json"
    ;;
sanitize-control)  # initcheck with every matrix product written into zero-filled memory: what cuBLAS's stores do not explain
    run sanitize_control 100 python3 benchmarks/sanitize.py --tools initcheck --zero-matmul-outputs --timeout 90 \
        --out "$OUT/sanitize_control.json"
    ;;
race-sdpa)  # racecheck over the reference backend's phases (cuDNN's attention kernel) of both toy models
    for model in toy-phi3-small toy-llama; do
        run "race_${model}_sdpa" 140 python3 benchmarks/sanitize.py --tools racecheck --only "$model sdpa" --timeout 130 \
            --out "$OUT/race_${model}_sdpa.json"
    done
    ;;
host)  # a decode step's host work by stage (plan, ledger, upload, launch, outputs, record), batch 1 / 32 / 256
    run host_llama1b 60 python3 -m fullgraph.bench host --preset llama-1b --out "$OUT/host_llama1b.json"
    run host_phi3 90 python3 -m fullgraph.bench host --preset phi3-small-8k --out "$OUT/host_phi3.json"
    # the engine's step by phase on the same machine (the forward runs: collect includes the wait)
    run engine_host_llama1b 200 python3 -m fullgraph.bench engine-host --preset llama-1b --batch 1 64 256 \
        --output-kind cumulative delta --steps 100 --out "$OUT/engine_host_llama1b.json"
    ;;
loop-profile)  # the device timeline of the overlapped decode loop: what runs outside the graph, and idle time
    run loop_profile_llama1b 150 python3 benchmarks/profile_loop.py --preset llama-1b --batch 1 32 \
        --out "$OUT/loop_profile_llama1b.json"
    run loop_profile_smollm2 90 python3 benchmarks/profile_loop.py --preset smollm2-135m --batch 1 \
        --out "$OUT/loop_profile_smollm2.json"
    # the engine's graph (ids fed back, greedy sampling inside) kernel by kernel, PDL off (times that add up) and on
    for pdl in 0 1; do
        FULLGRAPH_PDL=$pdl run "profile_sampling_pdl$pdl" 90 python3 benchmarks/profile_step.py --preset llama-1b \
            --batch 1 32 --context 1024 --sampling --top 40 --out "$OUT/profile_sampling_pdl$pdl.json"
    done
    ;;
loop-ab)  # the decode loops of .base/ (then MORE_TREES="dir ...", carried) and of this tree, back to back, each tree
    # from its own directory; then the overlapped loop's device timeline (ops outside the graph, idle) of .base/ and ours
    for tree in .base ${MORE_TREES:-} .; do
        tag=$([ "$tree" = . ] && echo new || echo "${tree#.}")
        for preset in llama-1b smollm2-135m; do
            (cd $tree && PYTHONPATH=. run "loopab_${preset}_$tag" 100 python3 -m fullgraph.bench decode --preset $preset \
                --batch 1 32 --context 1024 --modes full --steps 40 --loop sync overlap --out "$OUT/loopab_${preset}_$tag.json")
        done
    done
    for tree in .base .; do
        tag=$([ "$tree" = . ] && echo new || echo base)
        (cd $tree && PYTHONPATH=. run "loopab_profile_$tag" 120 python3 "$OLDPWD/benchmarks/profile_loop.py" --preset llama-1b \
            --batch 1 32 --out "$OUT/loopab_profile_$tag.json")
    done
    ;;
host-ab)  # a decode step's host stages in .base/ and in this tree, alternating, twice each (hosts drift within a call)
    for i in 1 2; do
        for tree in .base .; do
            tag=$([ "$tree" = . ] && echo new || echo base)
            (cd $tree && PYTHONPATH=. run "hostab_${tag}_$i" 60 python3 -m fullgraph.bench host --preset llama-1b \
                --out "$OUT/hostab_${tag}_$i.json")
        done
    done
    ;;
stage-ab)  # the stage-in's event recorded on a branch beside the step's kernels (the default) or in line
    # (FULLGRAPH_STAGE_EVENT=inline): the capture tests in line, then decode rows alternating
    FULLGRAPH_STAGE_EVENT=inline run stage_inline_tests 150 python3 -m pytest -q -p no:cacheprovider \
        tests/test_stage_in.py tests/test_device_token_ids.py tests/test_runner.py
    for i in 1 2; do
        for ev in inline branch; do
            for preset in ${STAGE_PRESETS:-llama-1b smollm2-135m}; do  # STAGE_PRESETS="...": fewer
                FULLGRAPH_STAGE_EVENT=$ev run "stageab_${preset}_${ev}_$i" 90 python3 -m fullgraph.bench decode \
                    --preset $preset --batch 1 32 --context 1024 --modes full --steps 40 --loop sync overlap \
                    --out "$OUT/stageab_${preset}_${ev}_$i.json"
            done
        done
    done
    ;;
forms)  # the linears of 2-32 rows timed at capture (FULLGRAPH_LINEAR=timed: each size captured with the split-K
    # kernel and with cuBLAS, the faster kept) against either form pinned (auto is the split-K one), llama-1b and
    # SmolLM2 at 8 and 32 rows, each its process
    run forms_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_capture_forms.py  # unfiltered: the forced forms on the GPU too
    for impl in timed auto cublas; do
        for preset in ${FORMS_PRESETS:-llama-1b smollm2-135m}; do  # FORMS_PRESETS="...": fewer
            FULLGRAPH_LINEAR=$impl run "forms_${preset}_$impl" 90 python3 -m fullgraph.bench decode --preset $preset \
                --batch 8 32 --context 1024 --modes full --steps 30 --loop sync overlap --out "$OUT/forms_${preset}_$impl.json"
        done
    done
    ;;
forms-loop)  # where the timed process's overlapped step loses 20-60 us against its replay (H100, 2026-12-07): the
    # overlapped loop's device timeline (ops outside the graph, idle time) with FULLGRAPH_LINEAR=timed beside the pinned forms
    for impl in timed cublas auto; do
        for preset in llama-1b smollm2-135m; do
            FULLGRAPH_LINEAR=$impl run "forms_loop_${preset}_$impl" 90 python3 benchmarks/profile_loop.py --preset $preset \
                --batch 32 --loops logits --out "$OUT/forms_loop_${preset}_$impl.json"
        done
    done
    ;;
forms-diag)  # is the timed process's slower overlapped step at llama-1b's 32 rows the 8-row runner before it,
    # the stage-in event's branch, or the two forms themselves? timed and cuBLAS with --batch 32 alone, timed
    # with the event in line, and timed --batch 8 32 as before
    for v in "timed 32 branch" "cublas 32 branch" "timed 32 inline" "timed 8_32 branch" "cublas 8_32 branch"; do
        set -- $v
        FULLGRAPH_LINEAR=$1 FULLGRAPH_STAGE_EVENT=$3 run "forms_diag_$1_$2_$3" 60 python3 -m fullgraph.bench decode \
            --preset llama-1b --batch ${2//_/ } --context 1024 --modes full --steps 60 --loop sync overlap \
            --out "$OUT/forms_diag_$1_$2_$3.json"
    done
    ;;
head32-ab)  # the LM head writing float32 logits itself (FULLGRAPH_FUSE=...,head32) against the default, back to back
    run head32_tests 90 python3 -m pytest -q -p no:cacheprovider tests/test_head32.py
    for fuse in layer,rope layer,rope,head32; do
        FULLGRAPH_FUSE=$fuse run "head32_${fuse//,/_}" 90 python3 -m fullgraph.bench decode --preset llama-1b \
            --batch 1 32 --context 1024 --modes full --steps 40 --loop sync overlap --out "$OUT/head32_${fuse//,/_}.json"
    done
    ;;
host-calls)  # what one Python / numpy / CUDA call costs on this machine (the host stages' ingredients)
    run host_calls 60 python3 benchmarks/host_calls.py --out "$OUT/host_calls.json"
    ;;
big-steps)  # large mixed steps: captured graph vs padded-eager, and what capturing up to 2048 tokens costs
    run big_steps 240 python3 benchmarks/bench_big_steps.py --out "$OUT/big_steps.json"
    ;;
tp)  # nvidia-h200-x2: tensor parallel against one process in "full" mode (NCCL in the graphs), Llama-8B TP=2 vs TP=1
    for model in toy-llama toy-phi3-small; do
        run "tp_check_$model" 120 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
            -m fullgraph.testing.parallel --model "$model" --mode full --out "$OUT/tp_check_$model.json"
    done
    run tp_decode_llama8b_tp1 150 python3 -m fullgraph.bench decode --preset llama-8b --batch 1 32 --context 1024 \
        --modes full --loop sync overlap --out "$OUT/tp_decode_llama8b_tp1.json"
    run tp_decode_llama8b_tp2 200 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
        -m fullgraph.bench decode --preset llama-8b --batch 1 32 --context 1024 --modes full --loop sync overlap \
        --tensor-parallel-size 2 --out "$OUT/tp_decode_llama8b_tp2.json"
    ;;
sanitize-all)
    run sanitize_all 580 python3 benchmarks/sanitize.py --timeout 140 --out "$OUT/sanitize_all.json"
    ;;
env)
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/env.txt"
    ;;
tests)
    run gpu_tests 420 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=25 --timeout 150 tests
    ;;
tests-all)
    run gpu_tests 420 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=15 tests
    ;;
targets)  # the decode-step rows the issues set targets for (full graphs, no compile)
    run decode_llama1b_triton 90 python3 -m fullgraph.bench decode --preset llama-1b --batch 1 32 --context 1024 \
        --attention triton --modes full --steps 30 --loop sync overlap --out "$OUT/decode_llama1b_triton.json"
    run decode_phi3 120 python3 -m fullgraph.bench decode --preset phi3-small-8k --batch 1 16 --context 2048 \
        --modes full --steps 30 --loop sync overlap --out "$OUT/decode_phi3.json"
    run decode_phi3_dense 90 python3 -m fullgraph.bench decode --preset phi3-small-8k-dense --batch 1 --context 2048 \
        --modes full --steps 30 --out "$OUT/decode_phi3_dense.json"
    ;;
kv-layout)  # decode attention over the token-major cache pages (today's) and head-major ones, pages in order or shuffled
    run kv_layout 120 python3 benchmarks/sweep_kv_layout.py --out "$OUT/kv_layout.json"
    ;;
sweep-attention)  # decode attention's split counts and launch configs at batch 1-64 (llama-1b, SmolLM2, Phi-3-Small)
    run sweep_attention 200 python3 benchmarks/sweep_decode_attention.py --out "$OUT/sweep_attention.json"
    ;;
kernels)
    run bench_attention 150 python3 benchmarks/bench_attention.py --out "$OUT/bench_attention.json"
    run bench_blocksparse 140 python3 benchmarks/bench_blocksparse.py --quick --out "$OUT/bench_blocksparse.json"
    ;;
diag)
    run doctor 100 python3 -m fullgraph doctor --attention sdpa --modes none padded full compile compile-padded
    run profile_llama1b 60 python3 benchmarks/profile_step.py --preset llama-1b --batch 1 32 --out "$OUT/profile_llama1b.json"
    ;;
profile)  # the decode step's kernels counted and timed by kind (benchmarks/profile_step.py)
    run profile_llama1b 70 python3 benchmarks/profile_step.py --preset llama-1b --batch 1 32 --context 1024 \
        --out "$OUT/profile_llama1b.json"
    run profile_smollm2 60 python3 benchmarks/profile_step.py --preset smollm2-135m --batch 1 32 --context 1024 \
        --out "$OUT/profile_smollm2.json"
    run profile_llama8b 90 python3 benchmarks/profile_step.py --preset llama-8b --batch 1 --context 1024 \
        --out "$OUT/profile_llama8b.json"
    run profile_phi3 90 python3 benchmarks/profile_step.py --preset phi3-small-8k --batch 1 --context 2048 \
        --out "$OUT/profile_phi3.json"
    for preset in llama-1b smollm2-135m llama-8b; do  # times that add up: no programmatic dependent launch
        FULLGRAPH_PDL=0 run "profile_${preset}_nopdl" 70 python3 benchmarks/profile_step.py --preset $preset --batch 1 32 \
            --context 1024 --out "$OUT/profile_${preset}_nopdl.json"
    done
    ;;
linear)
    run bench_linear 90 python3 benchmarks/bench_linear.py --out "$OUT/bench_linear.json"
    run sweep_linear 200 python3 benchmarks/sweep_linear.py --rows 1 16 --warps 4 8 --out "$OUT/sweep_linear.json"
    ;;
pdl-ab)  # programmatic dependent launch off / on (fullgraph.kernels.pdl), batch-1 decode steps
    for pdl in 0 1; do
        FULLGRAPH_PDL=$pdl run "llama1b_triton_pdl$pdl" 60 python3 -m fullgraph.bench decode --preset llama-1b --batch 1 \
            --context 1024 --attention triton --modes full --steps 30 --out "$OUT/llama1b_triton_pdl$pdl.json"
        FULLGRAPH_PDL=$pdl run "phi3_pdl$pdl" 90 python3 -m fullgraph.bench decode --preset phi3-small-8k --batch 1 \
            --context 2048 --modes full --steps 30 --out "$OUT/phi3_pdl$pdl.json"
    done
    run llama1b_sdpa 60 python3 -m fullgraph.bench decode --preset llama-1b --batch 1 --context 1024 --attention sdpa \
        --modes full --steps 30 --out "$OUT/llama1b_sdpa.json"
    ;;
pdl-batch)  # programmatic dependent launch off / on at 1-64 rows (the kernel profiles of 2026-12-07 had llama-1b's
    # 32-row replay 2.5% shorter with it off on an H100, SmolLM2's 8% longer; on the H200 PDL cost the split-K flow
    # 0.12 ms at 32 rows): one process a setting and preset, the split-K form pinned for 2-32 rows (auto, untimed)
    for preset in llama-1b smollm2-135m llama-8b; do
        for pdl in 0 1; do
            FULLGRAPH_LINEAR=auto FULLGRAPH_PDL=$pdl run "pdl_batch_${preset}_$pdl" 120 python3 -m fullgraph.bench decode --preset $preset \
                --batch 1 8 16 32 64 --context 1024 --modes full --steps 30 --loop overlap --out "$OUT/pdl_batch_${preset}_$pdl.json"
        done
    done
    ;;
sdpa-ab)  # the reference backend's decode variants (SdpaBackend.decode_gather / decode_attention), llama-1b batch 1
    for gather in rows slots; do
        for attn in matmul matmul_keys; do
            run "sdpa_${gather}_${attn}" 60 python3 -c "
from fullgraph.attention.backends.sdpa import SdpaBackend
from fullgraph.bench import main
variant = type('SdpaVariant', (SdpaBackend,), {'decode_gather': '$gather', 'decode_attention': '$attn'})
main(['decode', '--preset', 'llama-1b', '--batch', '1', '--context', '1024', '--modes', 'full', '--steps', '30',
      '--out', '$OUT/sdpa_${gather}_${attn}.json'], attention=variant)"
        done
    done
    ;;
profile-phi3)
    for preset in phi3-small-8k phi3-small-8k-dense; do
        run "profile_$preset" 60 python3 benchmarks/profile_step.py --preset $preset --batch 1 --context 2048 \
            --out "$OUT/profile_$preset.json"
    done
    ;;
core-fast)
    run decode_llama1b_sdpa 100 python3 -m fullgraph.bench decode --preset llama-1b --batch 1 32 --context 1024 \
        --attention sdpa --modes none full --out "$OUT/decode_llama1b_sdpa.json"
    run decode_llama1b_triton 80 python3 -m fullgraph.bench decode --preset llama-1b --batch 1 32 --context 1024 \
        --attention triton --modes full --out "$OUT/decode_llama1b_triton.json"
    run host 40 python3 -m fullgraph.bench host --preset llama-1b --out "$OUT/host.json"
    ;;
phi3-fast)
    run decode_phi3 150 python3 -m fullgraph.bench decode --preset phi3-small-8k --batch 1 16 --context 2048 8000 \
        --modes none full --steps 20 --out "$OUT/decode_phi3.json"
    run decode_phi3_dense 60 python3 -m fullgraph.bench decode --preset phi3-small-8k-dense --batch 1 --context 2048 \
        --modes full --steps 20 --out "$OUT/decode_phi3_dense.json"
    ;;
final)
    run gpu_tests_compile 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_compile.py tests/test_debug.py \
        tests/test_blocksparse.py tests/test_fused_kernels.py tests/test_regression.py -k "compile or host_scalar or s12 or bf16 or half or graph"
    run decode_llama1b_triton 40 python3 -m fullgraph.bench decode --preset llama-1b --batch 1 32 --context 1024 \
        --attention triton --modes full --out "$OUT/decode_llama1b_triton.json"
    run capture_phi3 90 python3 -m fullgraph.bench capture --preset phi3-small-8k --out "$OUT/capture_phi3.json"
    run decode_phi3_128k 90 python3 -m fullgraph.bench decode --preset phi3-small-128k --batch 1 --context 32768 130000 \
        --modes full --steps 20 --out "$OUT/decode_phi3_128k.json"
    run bench_blocksparse 150 python3 benchmarks/bench_blocksparse.py --out "$OUT/bench_blocksparse.json"
    ;;
core)
    run decode_toy 60 python3 -m fullgraph.bench decode --preset toy --batch 1 32 --context 1024 --out "$OUT/decode_toy.json"
    for attn in sdpa triton; do
        run "decode_llama1b_$attn" 150 python3 -m fullgraph.bench decode --preset llama-1b --batch 1 32 --context 1024 \
            --attention "$attn" --out "$OUT/decode_llama1b_$attn.json"
    done
    run plan 60 python3 -m fullgraph.bench plan --out "$OUT/plan.json"
    ;;
capture)  # Phi-3-Small first on a fresh machine (cold Triton cache), then again (warm on-disk cache)
    run capture_phi3 200 python3 -m fullgraph.bench capture --preset phi3-small-8k --out "$OUT/capture_phi3.json"
    run capture_phi3_warm 200 python3 -m fullgraph.bench capture --preset phi3-small-8k --out "$OUT/capture_phi3_warm.json"
    run capture_llama1b 150 python3 -m fullgraph.bench capture --preset llama-1b --out "$OUT/capture_llama1b.json"
    ;;
capture-ahead)  # Phi-3-Small capture on empty Triton caches, kernels compiled ahead (kernels.compile_ahead) or not, then warm
    on=$(mktemp -d) off=$(mktemp -d)
    for case in "cold_ahead $on 16" "cold_serial $off 0" "warm_ahead $on 16" "warm_serial $off 0"; do
        set -- $case
        TRITON_CACHE_DIR=$2 FULLGRAPH_COMPILE_WORKERS=$3 run "capture_$1" 200 python3 benchmarks/capture_breakdown.py \
            --preset phi3-small-8k --out "$OUT/capture_$1.json"
    done
    ;;
phi3)
    run decode_phi3_dense 150 python3 -m fullgraph.bench decode --preset phi3-small-8k-dense --batch 1 --context 2048 \
        --modes none full --out "$OUT/decode_phi3_dense.json"
    for ctx in 2048 8000; do
        run "decode_phi3_$ctx" 150 python3 -m fullgraph.bench decode --preset phi3-small-8k --batch 1 16 --context "$ctx" \
            --modes none full --out "$OUT/decode_phi3_$ctx.json"
    done
    run decode_phi3_128k 200 python3 -m fullgraph.bench decode --preset phi3-small-128k --batch 1 --context 32768 131000 \
        --modes full --out "$OUT/decode_phi3_128k.json"
    ;;
compile)
    run decode_llama1b_compile 300 python3 -m fullgraph.bench decode --preset llama-1b --batch 1 --context 1024 \
        --modes full --compile --steps 30 --loop sync overlap --out "$OUT/decode_llama1b_compile.json"
    run decode_phi3_compile 300 python3 -m fullgraph.bench decode --preset phi3-small-8k --batch 1 --context 2048 \
        --modes full --compile --steps 30 --loop sync overlap --out "$OUT/decode_phi3_compile.json"
    ;;
compile-time)  # compile time of a fresh process, then of the next one (Inductor's on-disk caches warm)
    for preset in llama-1b phi3-small-8k; do
        for start in first cached; do
            run "compile_${preset}_$start" 120 python3 -m fullgraph.bench compile --preset $preset \
                --out "$OUT/compile_${preset}_$start.json"
        done
    done
    ;;
*) echo "unknown part $part"; exit 2 ;;
esac
done
cat "$OUT/summary.txt" 2>/dev/null
