#!/usr/bin/env bash
# Everything owed on a lent GPU machine, in one device call (docs/gpu.md, "On a lent GPU machine").
# The machine image has Python, CuPy, nvidia-nccl, Cython, pytest; MPI comes from wheels carried in .whl/
# (download them here first: see docs/gpu.md "On a lent GPU machine"). Logs go to $OUT (or ./gpu-out).
# Env: AL_LENT_STEPS (default "build suite1 bench suite2"; also "hang": tests/gpu/diag_hang.py, the
# 2-rank host-transfer deadlock check; "extras": tests/gpu/extras.py, issue 28's GPU checks at 2
# ranks, one PASS/FAIL line each in $OUT/extras.log), per-step limits below.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-out}; mkdir -p "$out"
steps=${AL_LENT_STEPS:-"build suite1 bench suite2"}
log() { echo "[$(date +%T)] $*" | tee -a "$out/steps.log"; }
for step in $steps; do
    t0=$(date +%s)
    case $step in
    build)
        # Into the image's own environment (the python3 on PATH: CuPy, NCCL, PyTorch, Cython, pytest);
        # a venv made from it would not see its packages.
        { python3 -m pip install -q --no-index --no-deps --force-reinstall .whl/*.whl &&
          python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . ; } > "$out/build.log" 2>&1
        rc=$?
        { nvidia-smi; python3 -c "import cupy, aluminum_py as al; from aluminum_py import nccl; print(cupy.__version__, nccl.get_version(), nccl.library_path())"; } >> "$out/build.log" 2>&1
        ;;
    suite1)
        AL_GPU_RANKS=1 AL_GPU_SUITE_TIMEOUT=${AL_SUITE1_LIMIT:-200} AL_GPU_TEST_TIMEOUT=60 \
            bash tests/gpu/run_one_gpu.sh --durations=15 --maxfail=30 ${AL_PYTEST_EXTRA:-} > "$out/suite1.log" 2>&1
        rc=$? ;;
    suite2)
        AL_GPU_RANKS=2 AL_GPU_SUITE_TIMEOUT=${AL_SUITE2_LIMIT:-240} AL_GPU_TEST_TIMEOUT=60 \
            bash tests/gpu/run_one_gpu.sh --durations=15 --maxfail=30 ${AL_PYTEST_EXTRA:-} ${AL_SUITE2_K:+-k "$AL_SUITE2_K"} > "$out/suite2.log" 2>&1
        rc=$? ;;
    bench)
        export NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1
        timeout -k 5 ${AL_BENCH_LIMIT:-150} mpiexec -n 1 -env NCCL_HOSTID al-rank-0 python3 bench/gpu_allreduce.py --quick : \
            -n 1 -env NCCL_HOSTID al-rank-1 python3 bench/gpu_allreduce.py --quick > "$out/bench2.log" 2>&1
        rc=$? ;;
    hang)
        export NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1
        # variants: algorithm:mode (mode plain, sync-first or nccl-first; see diag_hang.py)
        for v in ${AL_HANG_VARIANTS:-ht_mpi:plain ht_recursive_doubling:plain ht_ring:nccl-first}; do
            echo "== $v" >> "$out/hang.log"
            timeout -k 5 40 mpiexec -n 1 -env NCCL_HOSTID al-rank-0 python3 tests/gpu/diag_hang.py ${v%%:*} ${v#*:} 30 : \
                -n 1 -env NCCL_HOSTID al-rank-1 python3 tests/gpu/diag_hang.py ${v%%:*} ${v#*:} 30 >> "$out/hang.log" 2>&1
            echo "== $v rc=$?" >> "$out/hang.log"
        done
        rc=0 ;;
    extras)
        # queued (hang timeout of a held-back host-transfer op), abandon, sigint (Ctrl-C in
        # GpuRequest.Wait), timeline (GPU ops), ddp (the DDP hook on cuda:0 against gloo DDP)
        export NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1
        timeout -k 5 ${AL_EXTRAS_LIMIT:-240} mpiexec -n 1 -env NCCL_HOSTID al-rank-0 python3 tests/gpu/extras.py ${AL_EXTRAS:-} : \
            -n 1 -env NCCL_HOSTID al-rank-1 python3 tests/gpu/extras.py ${AL_EXTRAS:-} >> "$out/extras.log" 2>&1
        rc=$?
        grep -E "^(PASS|FAIL) " "$out/extras.log" | tee -a "$out/steps.log" ;;
    *) log "unknown step $step"; rc=2 ;;
    esac
    log "$step rc=$rc in $(( $(date +%s) - t0 )) s"
done
