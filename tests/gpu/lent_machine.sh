#!/usr/bin/env bash
# Everything owed on a lent GPU machine, in two device calls of at most 8 minutes each
# (docs/gpu.md, "On a lent GPU machine"):
#
#   bash tests/gpu/lent_machine.sh 1   # build, the GPU suite at 1 rank and at 2 ranks sharing the GPU
#   bash tests/gpu/lent_machine.sh 2   # build (skipped if built), the torch backend on CUDA
#                                      # tensors, extras, the benchmark
#
# Each step has a time limit (below); the limits of a part add up to 450 s at most.
#
# The GPU suite includes the point-to-point batches (tests/gpu/test_gpu_p2p.py) and the
# v-collectives with blocks beyond NCCL's point-to-point buffering (test_gpu_vcollectives.py,
# test_blocks_beyond_p2p_buffering). The image has Python, CuPy, nvidia-nccl, PyTorch, Cython,
# pytest; MPI comes from wheels carried in .whl/, with the commit: download them here first and
# write `git rev-parse HEAD` into .whl/COMMIT (the device copy may have no .git). Logs go to $OUT
# (or ./gpu-out): steps.log (the commit, each step's status and time, one PASS/FAIL/SKIP line per
# check of extras and torch), one log per step.
# Env: AL_LENT_STEPS (steps to run instead of a part: build suite1 suite2 torch extras bench,
# and hang: tests/gpu/diag_hang.py, the 2-rank host-transfer deadlock check), AL_PYTEST_EXTRA
# (more pytest arguments for suite1/suite2), AL_<STEP>_LIMIT (seconds), AL_EXTRAS (checks).
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-out}; mkdir -p "$out"
case ${1:-} in
1) steps="build suite1 suite2" ;;
2) steps="build torch extras bench" ;;
*) steps=${AL_LENT_STEPS:-"build suite1 suite2 torch extras hang bench"} ;;
esac
[ -n "${AL_LENT_STEPS:-}" ] && steps=$AL_LENT_STEPS
log() { echo "[$(date +%T)] $*" | tee -a "$out/steps.log"; }
commit=$(cat .whl/COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
log "commit $commit; steps: $steps"
export NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 NCCL_MULTI_RANK_GPU_ENABLE=1 PYTHONUNBUFFERED=1

two_ranks() {   # two_ranks LIMIT CMD...: CMD at 2 ranks sharing the GPU, each its own NCCL_HOSTID
    local limit=$1; shift
    timeout -k 5 "$limit" mpiexec -n 1 -env NCCL_HOSTID al-rank-0 "$@" : -n 1 -env NCCL_HOSTID al-rank-1 "$@"
}

checks() {      # checks STEP LOG NAME...: the PASS/FAIL/SKIP lines into steps.log; a check without one FAILs
    local step=$1 file=$2; shift 2
    grep -E "^(PASS|FAIL|SKIP) " "$file" | tee -a "$out/steps.log"
    for name in "$@"; do
        grep -qE "^(PASS|FAIL|SKIP) $name:" "$file" || log "FAIL $name: no result ($step ended early: see $(basename "$file"))"
    done
    ! grep -qE "^FAIL " "$file"
}

status=0
for step in $steps; do
    t0=$(date +%s)
    case $step in
    build)
        # Into the image's own environment (the python3 on PATH: CuPy, NCCL, PyTorch, Cython,
        # pytest); a venv made from it would not see its packages. Skipped when this tree's
        # extensions were built from the same sources (a warm machine keeps build/).
        stamp=$(cat setup.py $(find ext -type f | sort) | sha1sum | cut -c1-16)
        if [ "$(cat build/lent_stamp 2>/dev/null)" = "$stamp" ] &&
           python3 -c "import aluminum_py._core, aluminum_py._nccl, mpi4py" 2>/dev/null; then
            echo "built already ($stamp)" > "$out/build.log"; rc=0
        else
            { timeout -k 5 "${AL_BUILD_LIMIT:-150}" sh -c \
                'python3 -m pip install -q --no-index --no-deps --force-reinstall .whl/*.whl &&
                 python3 -m pip install -q --no-build-isolation --no-deps --no-index -e .'; } > "$out/build.log" 2>&1
            rc=$?
            [ $rc = 0 ] && mkdir -p build && echo "$stamp" > build/lent_stamp
        fi
        { nvidia-smi; python3 -c "import cupy, torch, aluminum_py as al; from aluminum_py import nccl; print('cupy', cupy.__version__, 'torch', torch.__version__, torch.version.cuda, 'nccl', nccl.get_version(), nccl.library_path())"; } >> "$out/build.log" 2>&1
        ;;
    suite1)
        AL_GPU_RANKS=1 AL_GPU_SUITE_TIMEOUT=${AL_SUITE1_LIMIT:-120} AL_GPU_TEST_TIMEOUT=60 \
            bash tests/gpu/run_one_gpu.sh --durations=15 --maxfail=30 ${AL_PYTEST_EXTRA:-} > "$out/suite1.log" 2>&1
        rc=$?; tail -n 3 "$out/suite1.log" >> "$out/steps.log" ;;
    suite2)
        AL_GPU_RANKS=2 AL_GPU_SUITE_TIMEOUT=${AL_SUITE2_LIMIT:-180} AL_GPU_TEST_TIMEOUT=60 \
            bash tests/gpu/run_one_gpu.sh --durations=15 --maxfail=30 ${AL_PYTEST_EXTRA:-} > "$out/suite2.log" 2>&1
        rc=$?; grep -E "passed|failed|error" "$out/suite2.log" | tail -n 2 >> "$out/steps.log" ;;
    torch)
        # the torch.distributed backend "aluminum" on CUDA tensors (tests/gpu/torch_checks.py)
        AL_TORCH_CHECK_LIMIT=90 two_ranks "${AL_TORCH_LIMIT:-150}" python3 tests/gpu/torch_checks.py > "$out/torch.log" 2>&1
        rc=$?
        checks torch "$out/torch.log" collectives uneven_all_to_all batch_p2p other_stream failing_call ddp || rc=1 ;;
    extras)
        # queued (hang timeout of a held-back host-transfer op), abandon, sigint (Ctrl-C in
        # GpuRequest.Wait), timeline (GPU ops), ddp (the DDP hook on cuda:0 against gloo DDP)
        two_ranks "${AL_EXTRAS_LIMIT:-90}" python3 tests/gpu/extras.py ${AL_EXTRAS:-} > "$out/extras.log" 2>&1
        rc=$?
        checks extras "$out/extras.log" ${AL_EXTRAS:-queued abandon sigint timeline ddp} || rc=1 ;;
    hang)
        # variants: algorithm:mode (mode plain, sync-first or nccl-first; see diag_hang.py)
        rc=0
        for v in ${AL_HANG_VARIANTS:-ht_mpi:plain ht_recursive_doubling:plain ht_ring:nccl-first}; do
            echo "== $v" >> "$out/hang.log"
            two_ranks 40 python3 tests/gpu/diag_hang.py ${v%%:*} ${v#*:} 30 >> "$out/hang.log" 2>&1
            r=$?; echo "== $v rc=$r" >> "$out/hang.log"; [ $r = 0 ] || rc=$r
        done ;;
    bench)
        two_ranks "${AL_BENCH_LIMIT:-60}" python3 bench/gpu_allreduce.py --quick > "$out/bench2.log" 2>&1
        rc=$? ;;
    *) log "unknown step $step"; rc=2 ;;
    esac
    log "$step rc=$rc in $(( $(date +%s) - t0 )) s"
    [ "$rc" = 0 ] || status=1
done
exit $status
