"""The examples (examples/*.py) under mpiexec: data-parallel training with the
GradientSynchronizer must match single-process full-batch training (each example checks that
itself on rank 0 and exits non-zero on a mismatch)."""
import os
import re
import subprocess
import sys

import pytest

from test_mpi_suite import mpiexec

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def run_example(name, nranks, *args, timeout=120, env=None):
    cmd = [mpiexec(), "-n", str(nranks), sys.executable, os.path.join(EXAMPLES, name), *args]
    proc = subprocess.run(cmd, env=dict(env or os.environ, PYTHONUNBUFFERED="1"),
                          capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-6000:]}"
    return proc.stdout


def check_match(out, nranks):
    assert f"{nranks} ranks x" in out, out
    m = re.search(r"max \|data-parallel - single-process\| = (\S+)", out)
    assert m and float(m.group(1)) <= 1e-10, out
    assert "max difference between ranks = 0.000e+00" in out, out
    assert out.rstrip().endswith("OK"), out


@pytest.mark.parametrize("policy", ["adafusion", "fixed", "auto"])
@pytest.mark.parametrize("nranks", [2, 3])
def test_mlp_numpy(nranks, policy):
    steps = "40" if policy == "auto" else "6"        # auto: tuning takes up to 6 x 6 steps
    out = run_example("mlp_numpy.py", nranks, "--steps", steps, "--policy", policy)
    check_match(out, nranks)
    if policy == "auto":
        assert "auto: chose " in out, out
    if policy == "fixed":                   # fused buckets: reduced in place as arena ranges
        assert f"buckets (model indices, launch order): {fixed_buckets()}" in out, out


def fixed_buckets(features=16, hidden=64, classes=5, threshold=8 << 10, itemsize=8):
    """The buckets policy "fixed" must form for the example's default MLP: gradients in
    backward order, a bucket closed once it holds `threshold` bytes (docs/overlap.md)."""
    sizes = [features, hidden, hidden, classes]
    counts = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        counts += [fan_in * fan_out, fan_out]            # W, b of each layer
    buckets, current, acc = [], [], 0
    for i in reversed(range(len(counts))):
        current.append(i)
        acc += counts[i] * itemsize
        if acc >= threshold:
            buckets.append(current)
            current, acc = [], 0
    return buckets + ([current] if current else [])


@pytest.mark.parametrize("nranks,hook", [(2, "auto"), (3, "auto"), (2, "tensor")])
def test_torch_ddp_hooks(nranks, hook):
    pytest.importorskip("torch")
    out = run_example("torch_ddp_hooks.py", nranks, "--steps", "5", "--hook", hook)
    check_match(out, nranks)


@pytest.mark.parametrize("nranks", [2, 3])
def test_torch_ddp_cnn(nranks):
    pytest.importorskip("torch")
    out = run_example("torch_ddp_cnn.py", nranks, "--steps", "4", "--samples", "48")
    check_match(out, nranks)
    assert "DDP + allreduce_hook" in out, out


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_torch_ddp_cnn_compressing_hooks(hook):
    """docs/overlap.md's command line as written (default steps and tolerance): the compressed
    gradients make the run differ from single-process training, within the tolerance derived
    from the wire dtype's rounding (CompressionBound), which is far from a blanket 1e-2."""
    pytest.importorskip("torch")
    if hook == "bf16":
        pytest.importorskip("ml_dtypes")            # bfloat16 host buffers
    out = run_example("torch_ddp_cnn.py", 2, "--hook", hook)
    m = re.search(r"max \|data-parallel - single-process\| = (\S+) \(tol (\S+)\)", out)
    assert m, out
    diff, tol = float(m.group(1)), float(m.group(2))
    assert 1e-9 < diff <= tol < 1e-2, out
    assert f"{hook}_compress_hook, torch" in out, out
    assert "max difference between ranks = 0.000e+00" in out, out
    assert out.rstrip().endswith("OK"), out


@pytest.mark.parametrize("algorithm", ["", "nccl", "ht_ring"])
def test_standin_allreduce_with_only_al_cuda_library_set(algorithm):
    """docs/gpu.md's stand-in commands: AL_CUDA_LIBRARY alone (no AL_NCCL_LIBRARY) runs a GPU
    buffer's allreduce, NCCL included (the default algorithm went to the real NCCL wheel
    and failed: "CUDA driver version is insufficient")."""
    from aluminum_py.testing import cuda_standin
    env = {k: v for k, v in os.environ.items() if k != "AL_NCCL_LIBRARY"}
    env["AL_CUDA_LIBRARY"] = cuda_standin.path()
    out = run_example("standin_allreduce.py", 2, *filter(None, [algorithm]), env=env)
    for rank in range(2):
        assert f"rank {rank}: OK: x[:4] = [3. 3. 3. 3.]" in out, out
    if algorithm != "ht_ring":
        assert out.count(f"(NCCL: {cuda_standin.path()})") == 2, out
