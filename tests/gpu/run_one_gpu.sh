#!/usr/bin/env bash
# The GPU suite on one GPU: at 1 rank, then at 2 ranks sharing the GPU.
#
# Two ranks can share one GPU under NCCL if each looks like its own node: a different
# NCCL_HOSTID per rank (read once, before the first NCCL call), traffic over the socket
# transport on the loopback interface (slow, but every code path runs). Every pytest run has a
# per-test --timeout (thread method: a hang dumps every thread's stack, then exits) and the whole
# run an outer `timeout`, so a hang fails instead of blocking.
#
# Usage: bash tests/gpu/run_one_gpu.sh [extra pytest args]   (env: AL_GPU_TEST_TIMEOUT, default 120 s
# per test; AL_GPU_SUITE_TIMEOUT, default 900 s per rank count; AL_GPU_RANKS, default "1 2")
# Exit status: 0 when every run passed.
set -u
cd "$(dirname "$0")/../.."
per_test=${AL_GPU_TEST_TIMEOUT:-120}
per_run=${AL_GPU_SUITE_TIMEOUT:-900}
ranks=${AL_GPU_RANKS:-"1 2"}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-1}
export NCCL_MULTI_RANK_GPU_ENABLE=${NCCL_MULTI_RANK_GPU_ENABLE:-1} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
pytest_args=(-m pytest tests/gpu --with-mpi -q -p no:cacheprovider --timeout="$per_test" --timeout-method=thread
             -o console_output_style=classic -rs "$@")
status=0
for n in $ranks; do
    echo "=== GPU suite at $n rank(s) on one GPU ==="
    if [ "$n" = 1 ]; then
        timeout -k 10 "$per_run" mpiexec -n 1 "$py" "${pytest_args[@]}" || status=1
    else
        cmd=()
        for ((r = 0; r < n; r++)); do
            [ "$r" -gt 0 ] && cmd+=(:)
            cmd+=(-n 1 -env NCCL_HOSTID "al-rank-$r" "$py" "${pytest_args[@]}")
        done
        timeout -k 10 "$per_run" mpiexec "${cmd[@]}" || status=1
    fi
done
exit $status
