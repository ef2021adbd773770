"""torch's own distributed test suite (``DistributedTest._DistTestBase``, shipped in the torch
wheel) on the backend "aluminum" or on gloo, the way torch's CI runs it for an MPI-launched
backend: every rank runs the test class in-process under mpiexec, with the environment the
suite reads (BACKEND, WORLD_SIZE, INIT_METHOD, TEMP_DIR).

    mpiexec -n 2 python tests/torch_suite/run.py --backend gloo
    mpiexec -n 2 python tests/torch_suite/run.py --backend aluminum [-k all_reduce] [--json F]

BACKEND is ``gloo`` in both runs, so the suite's skip decisions are gloo's; the default
process group is the backend asked for (``dist.get_backend()`` then names it, and the suite's
profiler checks, which the runner applies to it as to gloo, look for its events:
``aluminum:all_reduce``, ...); only the two tests of the backend's name (NAME_TESTS) see
BACKEND as the backend under test.  The ranks come from
mpiexec and the store from the ``mpi://`` rendezvous.  A test passes when it passes on every
rank; every test that ran gets a fresh default group after it (torch's CI starts processes
per test); the summary (rank 0) lists the counts and every test that did not pass.  A test the
suite skips by exiting the process (``sys.exit(TEST_SKIPS[...].exit_code)``) counts as
skipped.  Needs ``expecttest`` (the suite imports it).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import unittest
from datetime import timedelta

from mpi4py import MPI

WORLD = MPI.COMM_WORLD
NAME_TESTS = ("test_get_backend", "test_Backend_enum_class")


def environment() -> None:
    """TEMP_DIR (rank 0 makes it, with the suite's barrier/ and test_dir/), WORLD_SIZE,
    BACKEND=gloo (the suite's skip decisions), INIT_METHOD=mpi://."""
    tmp = tempfile.mkdtemp(prefix="torch_suite_") if WORLD.rank == 0 else None
    tmp = WORLD.bcast(tmp, root=0)
    if WORLD.rank == 0:
        for sub in ("barrier", "test_dir", "init_dir"):
            os.mkdir(os.path.join(tmp, sub))
    WORLD.Barrier()
    os.environ.update(TEMP_DIR=tmp, WORLD_SIZE=str(WORLD.size), BACKEND="gloo",
                      INIT_METHOD="mpi://", PYTORCH_PRINT_REPRO_ON_FAILURE="0")
    for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)


def error_line(traceback_text: str) -> str:
    """The exception line of a traceback (its last line naming an error), shortened."""
    lines = [ln for ln in traceback_text.strip().splitlines() if ln.strip()]
    named = [ln for ln in lines if not ln.startswith(" ") and ("Error" in ln or "Exception" in ln)]
    return (named or lines)[-1][:300]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("aluminum", "gloo"), required=True)
    parser.add_argument("-k", action="append", default=[],
                        help="run only the tests whose name contains this (repeatable)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="the default group's timeout in seconds (default 120)")
    parser.add_argument("--json", help="write the per-test outcomes here (rank 0)")
    parser.add_argument("-v", action="store_true", help="each rank prints each test's outcome")
    args = parser.parse_args()
    environment()

    import torch.distributed as dist
    from torch.testing._internal.common_distributed import TEST_SKIPS
    from torch.testing._internal.common_utils import TestCase
    from torch.testing._internal.distributed import distributed_test as dt
    import aluminum_py.torch  # noqa: F401  (registers "aluminum" and mpi://)

    skip_codes = {s.exit_code: s.message for s in TEST_SKIPS.values()}
    # the suite's profiler checks apply to the backend under test (its events are named
    # "<backend>:<collective>", as gloo's)
    for allowed in (dt.PROFILING_SUPPORTED_BACKENDS, dt.CUDA_PROFILING_SUPPORTED_BACKENDS,
                    dt.SEND_RECV_PROFILING_SUPPORTED_BACKENDS):
        if args.backend not in allowed:
            allowed.append(args.backend)

    class TestAluminumSuite(TestCase, dt.DistributedTest._DistTestBase):
        rank = WORLD.rank                           # what torch's spawning base class sets
        world_size = os.environ["WORLD_SIZE"]       # (a string there too)

        def _callTestMethod(self, method):
            try:
                method()
            except SystemExit as e:     # the suite's skips exit the (spawned) process
                if e.code in skip_codes:
                    raise unittest.SkipTest(skip_codes[e.code]) from None
                raise

    dt.Barrier.init()
    loader = unittest.TestLoader()
    names = [n for n in loader.getTestCaseNames(TestAluminumSuite)
             if not args.k or any(k in n for k in args.k)]
    outcomes = {}
    t0 = time.monotonic()
    fresh = True
    for name in names:
        result = unittest.TestResult()
        WORLD.Barrier()
        seconds = min(dt.CUSTOM_PG_TIMEOUT.get(name, args.timeout), args.timeout)
        if dist.is_initialized() and (seconds != args.timeout or not WORLD.allreduce(
                int(fresh), op=MPI.LAND)):
            dist.destroy_process_group()
        if not dist.is_initialized():
            dist.init_process_group(args.backend, init_method="mpi://",
                                    timeout=timedelta(seconds=seconds))
        # the tests of the backend's name compare it with BACKEND: the backend under test's
        dt.BACKEND = args.backend if name in NAME_TESTS else "gloo"
        TestAluminumSuite(name).run(result)
        # the group stays for the next test only if this one was skipped: a test that ran may
        # have left it changed or broken (torch's CI starts processes per test)
        fresh = bool(result.skipped) and seconds == args.timeout
        if result.skipped:
            outcome = "skip"
        elif result.errors or result.failures:
            (_, text), = (result.errors + result.failures)[:1]
            outcome = "fail: " + error_line(text)
        else:
            outcome = "pass"
        outcomes[name] = outcome
        if args.v:
            print(f"[rank {WORLD.rank}] {name}: {outcome}", flush=True)
    every = WORLD.gather(outcomes, root=0)
    if WORLD.rank == 0:
        merged = {}
        for name in names:
            per_rank = [o[name] for o in every]
            fails = [f"rank {r}: {o}" for r, o in enumerate(per_rank) if o.startswith("fail")]
            merged[name] = ("pass" if all(o == "pass" for o in per_rank) else
                            "skip" if all(o == "skip" for o in per_rank) else
                            "fail" if fails else "mixed: " + ", ".join(per_rank))
            if merged[name] != "pass" and merged[name] != "skip":
                print(f"NOT PASSED {name}: {merged[name]} " + " | ".join(fails), flush=True)
        counts = {k: sum(1 for v in merged.values() if v.split(":")[0] == k)
                  for k in ("pass", "skip", "fail", "mixed")}
        print(f"torch suite on {args.backend} at {WORLD.size} ranks: {len(names)} tests, "
              f"{counts['pass']} passed, {counts['skip']} skipped, {counts['fail']} failed, "
              f"{counts['mixed']} mixed ({time.monotonic() - t0:.0f} s)", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"backend": args.backend, "ranks": WORLD.size, "tests": merged},
                          f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()
    WORLD.Barrier()
    if WORLD.rank == 0:
        shutil.rmtree(os.environ["TEMP_DIR"], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
