#!/usr/bin/env bash
# On a GPU host: the GPU tests, the main job and the benchmark sweep, with logs and JSON in OUTDIR.
#   scripts/gpu_check.sh OUTDIR [PART ...]      PART: check tests bench pybench sanitize
#                                                smallshapes sanitize-small mutants warm hf
#                                                integrations bwd bwd-wide sanitize-bwd varlen
#                                                varlen-bwd kvcache decode-route
#                                                fwd-candidates fwd-short bwd-candidates
#                                                fp8-blocks step spec fwd-sweep
#                                                (default: check tests bench)
# Environment knobs:
#   PYTEST_ARGS   extra pytest arguments for `tests`, shell-quoted (e.g. "-k 'fa1 or tma' -x")
#   TEST_SHARD    i/n: `tests` runs every n-th test file from the i-th (the suite in n calls)
#   BENCH_ARGS    arguments for `flashsuite bench` (default "--quick"; "" for the full sweep)
#   FWD_CANDIDATE_ROWS   `fwd-candidates`' A/B rows, ';'-separated (e.g. "64;128 --causal")
#   SPEC_ROWS / SWEEP_ROWS   the same for `spec` and `fwd-sweep`
#   SPEC_TESTS=0  `spec` runs its A/B rows only (the bitwise tests ran in an earlier call)
#   SANITIZE_VARIANT / SANITIZE_HEAD_DIM   the fa3 persistent variant and head_dim that
#                 `sanitize` runs (default new_skip, 64: the shipped causal D = 64 config)
# fa3 needs the CuTe DSL installed (the `cute` extra; docs/gpu.md shows an offline install).
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUTDIR [check|tests|bench|pybench ...]}
shift
parts=${*:-check tests bench}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export FLASHSUITE_COMMIT=${FLASHSUITE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
status=0
# compute-sanitizer counts device errors only: the CuTe DSL's compiler probes the driver's entry
# points (cuGetProcAddress, CUDA_ERROR_INVALID_VALUE on a name it lacks), which the default
# --report-api-errors would count as errors too.
sanitizer=(compute-sanitizer --report-api-errors no --error-exitcode 1)
{
  echo "commit $FLASHSUITE_COMMIT, $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>/dev/null
} | tee "$out/machine.txt"
# One fa3 kernel's GPU part: the test FILE (junit XML and log as NAME), then the tests matching
# FILTER under compute-sanitizer memcheck (any out-of-bounds access fails), then
# benchmarks/decode_bench.py BENCH_FLAG (JSON in OUTDIR/NAME-bench).
tests_memcheck_bench() {
  local name=$1 file=$2 filter=$3 bench_flag=$4
  python3 -m pytest "$file" -v -rfEs -p no:cacheprovider --junitxml "$out/$name.xml" 2>&1 \
    | tee "$out/$name.log" || status=1
  FLASHSUITE_HANG_SCALE=${FLASHSUITE_HANG_SCALE:-8} timeout "${SANITIZE_TIMEOUT:-540}" \
    "${sanitizer[@]}" --tool memcheck \
    python3 -m pytest "$file" -q -p no:cacheprovider -k "$filter" \
    > "$out/sanitize-$name.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|Invalid|passed|failed" "$out/sanitize-$name.log" | tail -12
  python3 benchmarks/decode_bench.py --out "$out/$name-bench" "$bench_flag" 2>&1 \
    | tee "$out/$name-bench.log" || status=1
}
for part in $parts; do
  case $part in
    check)
      python3 -m flashsuite.dispatch check 2>&1 | tee "$out/check.log" || status=1 ;;
    tests)
      # Parallel workers (pytest-xdist, if installed) hide the Triton/CuTe compile times.
      # --dist loadgroup: the tests marked xdist_group("gpu_memory") (float64 oracles of
      # 2-4 GB per N x N product, 32k-token caches) run one after another in a single worker
      # instead of filling the GPU's memory from every worker at once.
      xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-8} --dist loadgroup")
      eval "extra=(${PYTEST_ARGS:-})"  # keeps quoted words together: -k 'fa1 or tma'
      # -v: one line per test as it finishes, so a run cut off midway still names every
      # failure so far; -rfE: the failures' and errors' short summaries at the end.
      # TEST_SHARD=i/n: only every n-th test file from the i-th (0-based, sorted by name), for
      # running the whole suite in n calls that each fit a device command's time limit
      # (tests/benchmarks, the pytest-benchmark cases, is the `pybench` part then).
      targets=(tests)
      if [ -n "${TEST_SHARD:-}" ]; then
        i=${TEST_SHARD%/*} n=${TEST_SHARD#*/}
        mapfile -t targets < <(ls tests/test_*.py | sort | awk -v i="$i" -v n="$n" '(NR - 1) % n == i')
      fi
      # shellcheck disable=SC2086
      python3 -m pytest "${targets[@]}" -v -rfE -p no:cacheprovider --junitxml "$out/junit.xml" \
        -m "not timing" $xdist "${extra[@]}" 2>&1 | tee "$out/tests.log" || status=1
      # The tests marked `timing` (wall-clock bounds, e.g. a fresh process's first call on a
      # warm cache) run after the rest, one at a time: beside a dozen workers compiling
      # kernels they measure the machine's load. Exit status 5 is "none selected" (a shard).
      python3 -m pytest "${targets[@]}" -v -rfE -p no:cacheprovider -m timing \
        --junitxml "$out/junit-timing.xml" "${extra[@]}" 2>&1 | tee -a "$out/tests.log"
      rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || [ "$rc" = 5 ] || status=1
      grep -E "(FAILED|ERROR)( |$)" "$out/tests.log" | sort -u > "$out/tests-failed.txt" ;;
    bench)
      # shellcheck disable=SC2086
      python3 -m flashsuite.dispatch bench --out "$out" ${BENCH_ARGS---quick} 2>&1 \
        | tee "$out/bench.log" || status=1 ;;
    pybench)
      python3 -m pytest tests/benchmarks -q -p no:cacheprovider --benchmark-only \
        --benchmark-json "$out/pytest-bench.json" 2>&1 | tee "$out/pybench.log" || status=1 ;;
    sanitize)
      # compute-sanitizer memcheck, then racecheck, on fa3's smoke cases (3 small problems
      # checked against the oracle: one tile, keyless tiles, several tiles per CTA). The hang
      # watchdog's limits are stretched: racecheck slows the oracle's matmuls many times over.
      for tool in memcheck racecheck; do
        FLASHSUITE_HANG_SCALE=${FLASHSUITE_HANG_SCALE:-8} timeout "${SANITIZE_TIMEOUT:-280}" "${sanitizer[@]}" --tool "$tool" \
          python3 -m benchmarks.fa3_ablate --out "$out/sanitize-$tool" --persistent --smoke \
          --variant "${SANITIZE_VARIANT:-new_skip}" --head-dim "${SANITIZE_HEAD_DIM:-64}" \
          > "$out/sanitize-$tool.log" 2>&1 || status=1
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Hazard|correctness" "$out/sanitize-$tool.log" | tail -8
      done ;;
    smallshapes)
      # The small/odd-shape sweep (tests/test_small_shapes.py) in a process of its own: a
      # memory fault loses the CUDA context, and every later test in that process would fail.
      python3 -m pytest tests/test_small_shapes.py -q -p no:cacheprovider -rs \
        --junitxml "$out/smallshapes.xml" 2>&1 | tee "$out/smallshapes.log" || status=1 ;;
    sanitize-small)
      # compute-sanitizer memcheck over a subset of that sweep: every version, forward and
      # backward, D 64 / Dv 32 at N = 8 ... 48 and Nq = 1, 17, 65, 129. Any error counts,
      # also a read past a tensor's end whose value is never used.
      FLASHSUITE_HANG_SCALE=${FLASHSUITE_HANG_SCALE:-8} timeout "${SANITIZE_TIMEOUT:-540}" \
        "${sanitizer[@]}" --tool memcheck \
        python3 -m pytest tests/test_small_shapes.py -q -p no:cacheprovider -rs \
        -k "head_dim_v_smaller or nq001 or nq017 or nq065 or nq129" \
        > "$out/sanitize-small.log" 2>&1 || status=1
      grep -E "ERROR SUMMARY|Invalid|passed|failed" "$out/sanitize-small.log" | tail -12 ;;
    hf)
      # The transformers adapter (tests/test_hf.py): the CPU cases with the torch version and
      # the bf16 GPU case with "auto" (fa3 dense, fa2 packed and KV-cache on sm90). A missing
      # transformers is a failure here, not a skip.
      python3 -c "import transformers" 2>/dev/null \
        || { echo "hf: transformers is not installed (pip install .[hf])" | tee "$out/hf.log"; status=1; continue; }
      python3 -m pytest tests/test_hf.py -v -rs -p no:cacheprovider 2>&1 | tee "$out/hf.log" || status=1 ;;
    integrations)
      # The ways in other than dispatch.attention, with fa3 on the GPU (a subset of `tests`):
      # torch.compile with dynamic shapes and torch.export, the SDPA plug-in under unmodified
      # F.scaled_dot_product_attention and nn.MultiheadAttention, flash-attn's names, the
      # route to PyTorch's SDPA.
      python3 -m pytest tests/test_compile.py tests/test_sdpa_plugin.py \
        tests/test_flash_attn_api.py tests/test_fallback.py -v -rfEs -p no:cacheprovider \
        --junitxml "$out/integrations.xml" 2>&1 | tee "$out/integrations.log" || status=1 ;;
    mutants)
      # The fa3 / fp8 mutants (scripts/mutants.py --gpu), MUTANT_JOBS (6) at a time: each
      # must be killed by the tests.
      python3 scripts/mutants.py --gpu --jobs "${MUTANT_JOBS:-6}" --out "$out/mutants-gpu.md" 2>&1 \
        | tee "$out/mutants-gpu.log" || status=1 ;;
    bwd)
      # fa3's own backward: the shipped variants and the deterministic ones against the oracle
      # and timed beside cuDNN and FA4, bitwise stability under torch's deterministic flag, then
      # the shipped path through dispatch at N 1k / 4k / 16k and a training step
      # (benchmarks/fa3_bwd_check.py; JSON in OUTDIR/bwd and OUTDIR/bwd-smoke).
      python3 -m benchmarks.fa3_bwd_check --out "$out/bwd" --variant pipe_stm --variant pipe128 \
        --variant pipe3 --variant pipe_lpt --variant pipe128_lpt --variant det --variant det_pipe \
        --bench \
        --stability 2>&1 | tee "$out/bwd.log" || status=1
      python3 -m benchmarks.fa3_bwd_check --out "$out/bwd-smoke" --smoke --bench 2>&1 \
        | tee "$out/bwd-smoke.log" || status=1 ;;
    bwd-wide)
      # fa3's own backward at D = 96 (pipe_stm), 192 and 256 (the dkv_t layout), which dispatch
      # takes only with FLASHSUITE_FA3_BWD=1 until run here: every variant against the oracle and
      # timed beside cuDNN and FA4, then bitwise stability of the deterministic builds, then the
      # dispatch path's smoke cases (JSON in OUTDIR/bwd-wide and OUTDIR/bwd-wide-smoke).
      python3 -m benchmarks.fa3_bwd_check --out "$out/bwd-wide" --variant wide192 \
        --variant wide256 --variant pipe_stm --variant wide192_serial --variant wide256_serial \
        --variant wide192_det --variant wide256_det --variant wide192_ring --variant wide192_n80 \
        --bench --stability 2>&1 | tee "$out/bwd-wide.log" || status=1
      python3 -m benchmarks.fa3_bwd_check --out "$out/bwd-wide-smoke" --smoke 2>&1 \
        | tee "$out/bwd-wide-smoke.log" || status=1 ;;
    sanitize-bwd)
      # compute-sanitizer memcheck, then racecheck, on the shipped fa3 backward's smoke cases.
      for tool in memcheck racecheck; do
        FLASHSUITE_HANG_SCALE=${FLASHSUITE_HANG_SCALE:-8} timeout "${SANITIZE_TIMEOUT:-280}" \
          "${sanitizer[@]}" --tool "$tool" \
          python3 -m benchmarks.fa3_bwd_check --out "$out/sanitize-bwd-$tool" --smoke \
          > "$out/sanitize-bwd-$tool.log" 2>&1 || status=1
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Hazard|FAIL" "$out/sanitize-bwd-$tool.log" | tail -8
      done ;;
    fwd-candidates)
      # The fa3 forward's schedule options, built but off (Fa3Config.wg_slice, loop_mask_test,
      # split_loops; docs/design.md, "What else moves P·V's wait"): their GPU tests (out and
      # LSE within rounding of the table build, 16-bit and e4m3, causal and not), then each
      # timed against the shipped build, passes interleaved (each variant passes its oracle
      # cases first). "new": descriptors from the warpgroup's slice and no mask test in the
      # non-causal loop; "split": the causal loop in two; at D = 128 also the in-place softmax
      # (softmax_apart off), at D = 256 also without ping-pong (FA4's D = 256 schedule); "pin":
      # pin_pv_wait alone (a never-taken branch before P·V's wait; pv_wait_after_max, which moves
      # the same wait, off) in every row; e4m3 rows also
      # FA3's fp8 tiles with the pin ("fa3t": 192 x 160 on three warpgroups at D = 64, 128 x 224 at
      # D = 128 and 128 x 128 at D = 256, both with V transposed on the host); causal e4m3 also
      # the persistent scheduler v2 ("pv2", host Vᵀ, at D = 128 and 256). spec_exps has a part
      # of its own (`spec`).
      xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-8}")
      # shellcheck disable=SC2086
      python3 -m pytest tests/test_fa3_softmax_options.py -v -rfEs -p no:cacheprovider $xdist \
        -k "gpu and schedule_options" 2>&1 | tail -40 | tee "$out/fwd-candidates.log" || status=1
      # FWD_CANDIDATE_ROWS: the rows to time, ';'-separated (all thirteen take about 18 minutes;
      # a device command gets 10).
      new=wg_slice=1,loop_mask_test=0
      rows=${FWD_CANDIDATE_ROWS:-64;96;128;192;256;128 --fp8;256 --fp8;64 --fp8;128 --fp8 --causal;256 --fp8 --causal;64 --causal;128 --causal;256 --causal}
      IFS=';' read -r -a rows <<< "$rows"
      for row in "${rows[@]}"; do
        read -r d flags <<< "$row"
        vars=(--variant "new:$new" --variant pin:pin_pv_wait=1,pv_wait_after_max=0)
        case "$row" in
          "64 --fp8") vars+=(--variant fa3t:tile_m=192,num_consumer_wgs=3,tile_n=160,pin_pv_wait=1) ;;
          "128 --fp8")  # FA3's tile on two warpgroups, in V's key order
            vars+=(--variant fa3t:tile_m=128,num_consumer_wgs=2,tile_n=224,permute_v_keys=0,pin_pv_wait=1) ;;
          "256 --fp8") vars+=(--variant fa3t:tile_n=128,v_transpose=host,pin_pv_wait=1) ;;
          "128 --fp8 --causal")
            vars+=(--variant fa3t:tile_n=224,v_transpose=host,pin_pv_wait=1
              --variant pv2:persistent=1,overlap_tiles=1,balanced_order=1,v_transpose=host) ;;
          "256 --fp8 --causal")
            vars+=(--variant pv2:persistent=1,overlap_tiles=1,balanced_order=1,v_transpose=host) ;;
          *causal*)
            vars=(--variant split:split_loops=1,wg_slice=1 --variant wgs:wg_slice=1
              --variant pin:pin_pv_wait=1,pv_wait_after_max=0)
            [ "$d" = 256 ] && vars+=(--variant splitnopp:split_loops=1,wg_slice=1,pingpong=0) ;;
          128) vars+=(--variant "newip:$new,softmax_apart=0") ;;
          256) vars+=(--variant "newnopp:$new,pingpong=0") ;;
        esac
        python3 -m benchmarks.fa3_fwd_ab "${vars[@]}" --head-dim "$d" ${flags:-} \
          --seqlen 4096 --seqlen 16384 --passes 5 2>&1 | grep -v Warning | tail -20 \
          | tee -a "$out/fwd-candidates-ab.log" || status=1
      done
      # The decode kernel without the loop's mask test (its oracle cases: the kvcache part's
      # "no-loop-test" build), on the decode sweep beside SDPA.
      python3 -m benchmarks.decode_switch_ab --switch DECODE_LOOP_MASK_TEST --passes 3 2>&1 \
        | grep -v Warning | tail -12 | tee -a "$out/fwd-candidates-ab.log" || status=1 ;;
    fwd-short)
      # Short non-causal problems (N = 1k, 2k), where the fa3 forward trails the faster peer
      # most: at D = 64 two warpgroups of 128 rows (1k rows fill 192-row tiles to 5.3 of 6),
      # at D = 128 the persistent scheduler with the in-place softmax (softmax_apart on it
      # makes ptxas recompute exponentials: docs/design.md), each with the schedule options.
      new=wg_slice=1,loop_mask_test=0
      python3 -m benchmarks.fa3_fwd_ab --head-dim 64 --seqlen 1024 --seqlen 2048 --passes 5 \
        --variant "new:$new" --variant "short:tile_m=128,num_consumer_wgs=2,stages=2,$new" \
        --variant "short192:tile_m=128,num_consumer_wgs=2,stages=2,tile_n=192,$new" 2>&1 \
        | grep -v Warning | tail -20 | tee "$out/fwd-short.log" || status=1
      python3 -m benchmarks.fa3_fwd_ab --head-dim 128 --seqlen 1024 --seqlen 2048 --passes 5 \
        --variant "new:$new" \
        --variant "pv2ip:persistent=1,overlap_tiles=1,balanced_order=1,o_alias_q=0,softmax_apart=0,wg_slice=1" \
        2>&1 | grep -v Warning | tail -20 | tee -a "$out/fwd-short.log" || status=1 ;;
    bwd-candidates)
      # The shipped D = 64 path (FA4's route, bwd_configs.D64_FA4_ROUTE) through dispatch against
      # the oracle; then D = 96 / 128 with that route (FA4's elementwise work, dV before the
      # fence, and on the causal 64-row tile LSE and D by warp shuffle): their oracle cases and
      # the backward call by call beside the shipped builds, cuDNN and FA4 (step_ab).
      python3 -m benchmarks.fa3_bwd_check --out "$out/bwd-d64" --match d64- 2>&1 | tail -8 \
        | tee "$out/bwd-candidates.log" || status=1
      cands=(pipe_sec4_wgs_sout_ng_wgdq_tma_dvf pipe_sec4_wgs_sout_ng_shfl_wgdq_tma_dvf
        pipe80_wgs_sout_ng_wgdq_tma_dvf)
      python3 -m benchmarks.fa3_bwd_check --out "$out/bwd-candidates" \
        "${cands[@]/#/--variant=}" 2>&1 | tail -12 | tee -a "$out/bwd-candidates.log" || status=1
      for d in 128 96; do
        python3 -m benchmarks.step_ab --backward --head-dim $d --causal --seqlen 4096 \
          --seqlen 16384 --reps 30 --variant "${cands[0]}" --variant "${cands[1]}" 2>&1 \
          | grep -v Warning | tee -a "$out/bwd-candidates-ab.log" || status=1
      done
      python3 -m benchmarks.step_ab --backward --head-dim 128 --seqlen 4096 --seqlen 16384 \
        --reps 30 --variant "${cands[2]}" 2>&1 | grep -v Warning \
        | tee -a "$out/bwd-candidates-ab.log" || status=1 ;;
    fp8-blocks)
      # The e4m3 wgmma's accumulator read off the kernel (benchmarks/fp8_acc_probe: the model
      # of common.testing.mma_truncated should match every row), then fa3's fp8 suites: the
      # per-head one and the per-block build (moderate scores; outlier inputs an expected
      # failure), the probe on both inputs (errors per block of rows, the kernel against its
      # emulation, the same values through the per-head build), then the GPU mutants that
      # plant its three faults.
      python3 -m benchmarks.fp8_acc_probe --json "$out/fp8-acc-probe.json" 2>&1 \
        | grep -v Warning | head -40 | tee "$out/fp8-acc-probe.log" || status=1
      xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-8}")
      # shellcheck disable=SC2086
      python3 -m pytest tests/test_fp8.py tests/test_fp8_blocks.py -v -rfEx -p no:cacheprovider \
        $xdist 2>&1 | tail -60 | tee "$out/fp8-blocks.log" || status=1
      for inputs in "" --moderate; do
        # shellcheck disable=SC2086
        python3 -m benchmarks.fa3_fp8_blocks_probe $inputs --cases 0,6 2>&1 | grep -v Warning \
          | tee -a "$out/fp8-blocks-probe.log" || status=1
      done
      python3 scripts/mutants.py --gpu --only "fp8 blocks" --out "$out/fp8-blocks-mutants.md" \
        2>&1 | tail -8 || status=1 ;;
    step)
      # The backward's speed, each contender timed call by call in rotation (step_ab): the
      # training step at N = 8k (D 64 / 128 / 256, causal at 128, one profiled step of each at
      # D 128) and the backward alone at N = 4k / 16k (D 64 / 128 / 256, causal and not).
      python3 -m benchmarks.step_ab --seqlen 8192 --reps 40 --profile 2>&1 | grep -v Warning \
        | tee "$out/step.log" || status=1
      for args in "--causal" "--head-dim 64" "--head-dim 256"; do
        # shellcheck disable=SC2086
        python3 -m benchmarks.step_ab $args --seqlen 8192 --reps 20 2>&1 | grep -v Warning \
          | tee -a "$out/step.log" || status=1
      done
      for d in 64 128 256; do
        for causal in "" --causal; do
          # shellcheck disable=SC2086
          python3 -m benchmarks.step_ab --backward --head-dim $d $causal --seqlen 4096 \
            --seqlen 16384 --reps 20 2>&1 | grep -v Warning | tee -a "$out/bwd.log" || status=1
        done
      done ;;
    varlen)
      # fa3's varlen forward: per-sequence oracle, NaN guard rows around out and lse, one binary
      # for every batch composition, autograd through fa2's backward; timed beside fa2's
      # varlen, fa3 dense and SDPA cuDNN.
      tests_memcheck_bench varlen tests/test_fa3_varlen.py "gpu and not large" --varlen ;;
    varlen-bwd)
      # fa3's own varlen backward: per-sequence oracle with NaN guard rows around the inputs
      # and dq / dk / dv, random batch compositions, autograd through dispatch with
      # FLASHSUITE_FA3_VARLEN_BWD=1, 64k mixed tokens against fa2's error; fwd + bwd timed
      # beside fa2's varlen and SDPA's dense backends.
      tests_memcheck_bench varlen-bwd tests/test_fa3_varlen_bwd.py \
        "gpu and not large and not random" --varlen-bwd ;;
    kvcache)
      # fa3's split-KV decode: per-row oracle, NaN in unused cache slots and spare pages, NaN
      # guard rows around out and lse; the decode sweep beside fa2 and SDPA.
      tests_memcheck_bench kvcache tests/test_fa3_kvcache.py "gpu_decode" --decode ;;
    decode-route)
      # Decode steps that do not come through attention_with_kvcache: dense calls of few query
      # rows on fa3's and fa2's decode kernels (interface.decode_route), cache_leftpad (fa3,
      # fa2, torch; transformers' left-padded decode), the paged varlen decode batch, a float8
      # cache on fa2's decode, transformers' sliding-window models; their GPU tests, the
      # leftpad GPU mutant, then benchmarks/decode_route_ab.py (fa3, then fa2) beside SDPA and
      # FA4.
      xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-8}")
      # shellcheck disable=SC2086
      python3 -m pytest tests/test_fa3_kvcache.py tests/test_inference.py \
        tests/test_flash_attn_api.py tests/test_hf.py tests/test_fa2_decode_route.py \
        tests/test_kvcache_fp8.py -v -rfE -p no:cacheprovider $xdist \
        -k "leftpad or dense or decode_route or block_table or gpu_bf16 or left_padding or gpu_fp8" \
        2>&1 | tee "$out/decode-route.log" | tail -30 || status=1
      python3 scripts/mutants.py --gpu --only "cache_leftpad" --out "$out/decode-route-mutants.md" \
        2>&1 | tail -3 || status=1
      for version in fa3 fa2; do
        python3 -m benchmarks.decode_route_ab --version "$version" --passes "${ROUTE_PASSES:-3}" \
          2>&1 | grep -v Warning | tee -a "$out/decode-route-ab.log" || status=1
      done ;;
    spec)
      # Fa3Config.spec_exps (each row's exponentials against its running max beside the row
      # max; docs/design.md) and the causal e4m3 D = 128 candidates: first the bitwise tests
      # (spec_exps against the build without it, e4m3 and bf16) and the windowed / softcapped
      # e4m3 D = 128 problems past the smem-Vᵀ route, then each row's A/B against the shipped
      # build (fa3_fwd_ab, 5 interleaved passes). SPEC_ROWS: ';'-separated "D [--fp8]
      # [--causal]" rows (default all seven, about 15 minutes; a device command gets 10).
      # "spec" adds spec_exps with what it needs (a rescale threshold, the in-place softmax),
      # "thr" / "ip" that same build without it; causal e4m3 D = 128 also "spr" (the
      # non-causal entry's softmax: 1-bit threshold, four row chains), "sprs" (spr + spec) and
      # "t3r" (the non-causal entry's 192 x 96 tile on three warpgroups, V's keys permuted).
      xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-8}")
      # shellcheck disable=SC2086
      [[ ${SPEC_TESTS:-1} == 0 ]] || python3 -m pytest tests/test_fp8.py \
        tests/test_fa3_softmax_options.py -v -rfEs -p no:cacheprovider $xdist \
        -k "spec_exps or past_the_smem_route" 2>&1 | tail -30 | tee "$out/spec.log" || status=1
      rows=${SPEC_ROWS:-128 --fp8;128 --fp8 --causal;256 --fp8;256 --fp8 --causal;64;128;256}
      IFS=';' read -r -a rows <<< "$rows"
      for row in "${rows[@]}"; do
        read -r d flags <<< "$row"
        seqs=(--seqlen 4096 --seqlen 16384)
        case "$row" in
          "128 --fp8 --causal")
            sm=rescale_threshold=1,row_chains=1
            vars=(--variant "spr:$sm" --variant "sprs:$sm,spec_exps=1"
              --variant "t3r:tile_m=192,num_consumer_wgs=3,tile_n=96,permute_v_keys=1,$sm") ;;
          64) vars=(--variant spec:spec_exps=1,rescale_threshold=8,pv_wait_after_max=0,pv_wait_exps=0
              --variant thr:rescale_threshold=8) ;;
          128) vars=(--variant spec:spec_exps=1,rescale_threshold=8,softmax_apart=0
              --variant thr:rescale_threshold=8) ;;
          256) vars=(--variant spec:spec_exps=1,pv_wait_after_max=0 --variant ip:pv_wait_after_max=0)
            seqs=(--seqlen 1024 --seqlen 4096) ;;
          "128 --fp8")  # fa3_fwd_ab's oracle cases include a causal one: its build has no threshold
            vars=(--variant spec:spec_exps=1,rescale_threshold=1) ;;
          *) vars=(--variant spec:spec_exps=1) ;;
        esac
        # shellcheck disable=SC2086
        python3 -m benchmarks.fa3_fwd_ab "${vars[@]}" --head-dim "$d" ${flags:-} "${seqs[@]}" \
          --passes 5 2>&1 | grep -v Warning | tail -22 | tee -a "$out/spec-ab.log" || status=1
      done ;;
    fwd-sweep)
      # The standard forward table (#17's points): fa3 through dispatch beside FA4's SM90
      # forward and SDPA's cuDNN backend, bf16, B·N = 16k, Hq·D = 2048, N = 1k / 4k / 16k, 3
      # interleaved passes; then the e4m3 table at N = 16k (fa3_fwd_ab --fp8: the whole call,
      # V as it lies and keys-major, next to the bf16 peers). SWEEP_ROWS: ';'-separated
      # "D [--causal] [--fp8]" rows (default the six bf16 rows, then four e4m3 ones).
      rows=${SWEEP_ROWS:-64;64 --causal;128;128 --causal;256;256 --causal;128 --fp8;128 --fp8 --causal;256 --fp8;256 --fp8 --causal}
      IFS=';' read -r -a rows <<< "$rows"
      for row in "${rows[@]}"; do
        read -r d flags <<< "$row"
        seqs=(--seqlen 1024 --seqlen 4096 --seqlen 16384)
        [[ "$row" == *--fp8* ]] && seqs=(--seqlen 16384)
        # shellcheck disable=SC2086
        python3 -m benchmarks.fa3_fwd_ab --head-dim "$d" ${flags:-} "${seqs[@]}" --passes 3 2>&1 \
          | grep -v Warning | tail -16 | tee -a "$out/fwd-sweep.log" || status=1
      done ;;
    warm)
      # A new process's first fa3 call with an empty, then a filled on-disk compile cache.
      python3 -m benchmarks.warm_start --backward --fp8 --json "$out/warm-start.json" 2>&1 \
        | tee "$out/warm-start.log" || status=1 ;;
    *) echo "unknown part: $part"; status=2 ;;
  esac
done
exit $status
