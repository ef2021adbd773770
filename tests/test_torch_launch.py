"""How the torch backend "aluminum" starts (docs/torch.md "Start-up"), each case in a fresh
subprocess (MPI as a singleton, or under mpiexec at 2 ranks): a torchrun-style launch (a
one-process MPI world told WORLD_SIZE=2) fails with an error saying to use mpiexec; a rank or
world size that is not MPI's is refused; ``mpi://`` under mpiexec needs no environment
variables; ``aluminum_py.torch.init_process_group`` does the same; the entry point
``torch.distributed.backends`` names ``aluminum_py.torch:register``."""
import configparser
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from test_mpi_suite import launcher  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# where a child starts: the directory holding the aluminum_py this process imports (the source
# tree, or site-packages for an installed package), so that `python -c` imports the same
HOME = Path(importlib.util.find_spec("aluminum_py").origin).parent.parent
TIMEOUT = 120
ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def run(code: str, env_extra: dict | None = None, ranks: int = 0):
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env.update(env_extra or {})
    cmd = [sys.executable, "-c", code]
    if ranks:
        cmd = [*launcher(), "-n", str(ranks), *cmd]
    return subprocess.run(cmd, cwd=HOME, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)


INIT = ("import torch.distributed as dist, aluminum_py.torch as alt\n"
        "dist.init_process_group('aluminum', init_method='mpi://'{args})\n")


def test_torchrun_style_launch_says_how_to_launch():
    """torchrun sets WORLD_SIZE and starts each worker as its own MPI world of one rank."""
    proc = run(INIT.format(args=""), {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    assert proc.returncode != 0
    assert "mpiexec -n N python prog.py" in proc.stderr, proc.stderr[-2000:]
    assert "WORLD_SIZE=2" in proc.stderr


def test_rank_or_world_size_other_than_mpi_is_refused():
    proc = run(INIT.format(args=", rank=1, world_size=2"))
    assert proc.returncode != 0
    assert "rank=1, but MPI's is 0" in proc.stderr, proc.stderr[-2000:]


def test_mpi_rendezvous_needs_no_environment():
    """Under mpiexec at 2 ranks, with none of RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set:
    ranks and size are MPI's, the store works (a store-based barrier of new_group), and an
    all_reduce equals the sum of every rank's input."""
    code = (INIT.format(args="") +
            "import os, torch\n"
            "from mpi4py import MPI\n"
            "assert dist.get_rank() == MPI.COMM_WORLD.rank and dist.get_world_size() == 2\n"
            "assert dist.get_backend() == 'aluminum'\n"
            "g = dist.new_group([0, 1], use_local_synchronization=False)\n"
            "t = torch.tensor([float(dist.get_rank() + 1)])\n"
            "dist.all_reduce(t, group=g)\n"
            "assert t.item() == 3.0, t\n"
            "dist.destroy_process_group()\n"
            "os.write(1, b'OK%d\\n' % MPI.COMM_WORLD.rank)\n")
    proc = run(code, ranks=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # One token per rank, each in one write; mpiexec may still join two ranks' lines
    # without a newline between them, so find the tokens rather than split lines.
    assert sorted(re.findall(r"OK(\d+)", proc.stdout)) == ["0", "1"], proc.stdout


def test_helper_init_process_group():
    code = ("import torch, torch.distributed as dist, aluminum_py.torch as alt\n"
            "alt.init_process_group()\n"
            "assert dist.get_backend() == 'aluminum' and dist.get_world_size() == 1\n"
            "t = torch.ones(3)\n"
            "dist.all_reduce(t, op=dist.ReduceOp.AVG)\n"
            "assert t.tolist() == [1.0, 1.0, 1.0]\n"
            "print(type(dist.group.WORLD).__name__)\n"
            "dist.destroy_process_group()\n")
    proc = run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ProcessGroupAluminum"


def test_entry_point_is_declared_and_resolves():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    group = cfg["options.entry_points"]["torch.distributed.backends"]
    entries = {k.strip(): v.strip() for k, v in
               (line.split("=", 1) for line in group.strip().splitlines())}
    module, func = entries["aluminum"].split(":")
    proc = run(f"import {module} as m; m.{func}(); m.{func}(); "
               f"import torch.distributed as d; print('ALUMINUM' in d.Backend._plugins)")
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr[-2000:]


# Exit after a failed step: the waiter thread completes Futures; one completed while the
# interpreter finalizes aborts the process ("terminate called without an active exception").
WAITER_AT_EXIT = '''
import atexit, threading
def check():                # registered first: runs after every other exit handler
    alive = [t.name for t in threading.enumerate()
             if t.name == "aluminum_py.torch waiter" and t.is_alive()]
    print("waiter after the exit handlers:", alive, flush=True)
atexit.register(check)
import datetime, torch, torch.distributed as dist
import aluminum_py.torch as alt
alt.init_process_group(timeout=datetime.timedelta(seconds=60))
if dist.get_rank() == 0:    # the waiter thread waits for it; rank 1 never calls
    dist.all_reduce(torch.ones(4), async_op=True).get_future()
'''


def test_waiter_thread_ends_before_the_interpreter_finalizes():
    """A Future still pending at exit (its call never matched): the exit handlers stop the
    waiter thread (the engine cancels the call after AL_EXIT_GRACE) and join it before Python
    finalizes, so it never touches torch then."""
    proc = run(WAITER_AT_EXIT, {"AL_EXIT_GRACE": "0.5"}, ranks=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("waiter after the exit handlers: []") == 2, proc.stdout


DDP_STEP_TIMES_OUT = '''
import datetime, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import aluminum_py.torch as alt
alt.init_process_group(timeout=datetime.timedelta(seconds=2))
rank = dist.get_rank()
torch.manual_seed(0)
net = torch.nn.Sequential(*[m for _ in range(8)
                            for m in (torch.nn.Linear(128, 128), torch.nn.ReLU())])
ddp = DDP(net, bucket_cap_mb=0.06)   # a bucket per layer: several in flight at the failure
def fail(module, grad_in, grad_out):
    if rank == 1:
        raise RuntimeError("rank 1 fails mid-backward")
net[7].register_full_backward_hook(fail)
ddp(torch.randn(16, 128)).sum().backward()
'''


def test_exit_after_a_ddp_step_that_timed_out_does_not_abort():
    """One rank raises mid-backward, the other's step times out (2 s) with buckets still in
    flight, and both exit with the error, several times: a Python error exit each time (status
    1), never an abort."""
    for _ in range(3):
        proc = run(DDP_STEP_TIMES_OUT, ranks=2)
        assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
        assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
        assert "rank 1 fails mid-backward" in proc.stderr
        assert "timed out after 2 s" in proc.stderr, proc.stderr[-3000:]
