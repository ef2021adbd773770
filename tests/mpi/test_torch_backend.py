"""The "aluminum" torch.distributed backend, at every rank count of the suite.

The default process group is the backend under test, made the way users make it
(``init_process_group("aluminum", init_method="mpi://")`` under mpiexec); a gloo group of the same
ranks (``new_group(backend="gloo")``) runs every call again. Each collective x dtype x reduce op x
way of waiting (``async_op=False``; ``async_op=True`` then ``Work.wait()``; then
``Work.get_future().wait()``) is checked against numpy computed from every rank's input (each rank
rebuilds all of them: the inputs come from rank-seeded generators) and bit for bit against gloo.
Then what frameworks do on top: DDP against gloo DDP, FSDP2 against single-process training,
DTensor and the functional collectives, sub-groups, timeouts, errors raised from backward and
calls from other threads.

AL_TORCH_TEST_BACKEND=gloo makes gloo the backend under test (a check of the tests themselves:
everything but the aluminum-only requirements must pass with it).
"""
import os
import re
import tempfile
import threading
import time
from datetime import timedelta
from functools import partial

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402
from torch.distributed import ReduceOp  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import aluminum_py.torch  # noqa: E402,F401  (registers the "aluminum" backend and mpi://)

from conftest import WORLD, all_ranks_ok, at_this_count, every_rank, wait_for  # noqa: E402
# the DDP hook's tests: their data, model, single-process training and comparison
import test_torch as torch_hook_tests  # noqa: E402
from test_torch import max_diff, shard, train  # noqa: E402

BACKEND = os.environ.get("AL_TORCH_TEST_BACKEND", "aluminum")
RANK, SIZE = WORLD.rank, WORLD.size
ROOT = SIZE - 1                 # the root of rooted calls: not 0, so a root argument is honoured
WAIT_LIMIT = timedelta(seconds=60)   # every group's timeout: a mismatch fails, never hangs
torch.set_num_threads(1)

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"),      # the *_tensor names
              pytest.mark.filterwarnings("ignore::UserWarning")]        # non-member warnings

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
          "uint8": torch.uint8, "bool": torch.bool}
FLOATS = ("float32", "float64", "float16", "bfloat16")
# the dtypes the tests run at this rank count (every one at two ranks; conftest.at_this_count;
# uint8 is torch's one unsigned kind)
RUN_DTYPES = at_this_count(DTYPES, also=("uint8", "bool"))
# async_op=False; async_op=True then Work.wait(); then Work.get_future().wait(). The two async
# ways run each collective's main variants only (fewer sizes, ops and roots): the suite's
# time budget is a minute at 4 ranks on 2 cores.
MODES = ("sync", "wait", "future")
BITWISE = ("BAND", "BOR", "BXOR")


def ops_for(dtype: str):
    """The reduce ops torch allows on `dtype`: AVG on floating types only, the bitwise ones on
    integers and bool only."""
    if dtype in FLOATS:
        return ("SUM", "AVG", "PRODUCT", "MIN", "MAX")
    return ("SUM", "PRODUCT", "MIN", "MAX") + BITWISE


class Groups:
    """The default group (the backend under test) and a gloo group of the same ranks."""
    al = None
    gloo = None


G = Groups()


def init_default_group():
    if BACKEND == "aluminum":
        dist.init_process_group("aluminum", init_method="mpi://", timeout=WAIT_LIMIT)
        return
    path = None
    if RANK == 0:
        path = os.path.join(tempfile.mkdtemp(prefix="al-torch-backend-"), "store")
    path = WORLD.bcast(path, root=0)
    dist.init_process_group(BACKEND, init_method=f"file://{path}", rank=RANK, world_size=SIZE,
                            timeout=WAIT_LIMIT)


@pytest.fixture(scope="module", autouse=True)
def groups():
    init_default_group()
    G.al = dist.group.WORLD
    G.gloo = dist.new_group(backend="gloo", timeout=WAIT_LIMIT)
    yield G
    dist.destroy_process_group()
    G.al = G.gloo = None


def is_gloo(group) -> bool:
    """Whether `group` is gloo's (the reference, or the backend under test with
    AL_TORCH_TEST_BACKEND=gloo): the few calls gloo cannot make are made on the others only."""
    return dist.get_backend(group) == "gloo"


def both():
    return (("aluminum", G.al), ("gloo", G.gloo))


# ----------------------------------------------------------------------------- inputs, references
def values(dtype: str, n: int, rank: int, seed: int, op: str = "SUM") -> np.ndarray:
    """Rank `rank`'s input: float64 (floating dtypes), int64 or bool values that `dtype` holds
    exactly and whose reduction by `op` over <= 4 ranks is exact in `dtype` too."""
    rng = np.random.default_rng([seed, rank, n, list(DTYPES).index(dtype)])
    if dtype == "bool":
        return rng.integers(0, 2, size=n).astype(bool)
    unsigned = dtype == "uint8"
    if op in BITWISE:
        info = torch.iinfo(DTYPES[dtype])
        return rng.integers(info.min, info.max, size=n, endpoint=True, dtype=np.int64)
    if op == "PRODUCT":
        vals = [1, 2] if unsigned else [-2, -1, 1, 2]
    elif op in ("MIN", "MAX"):
        vals = range(0, 100) if unsigned else range(-50, 50)
    else:                                   # SUM, AVG
        vals = range(0, 9) if unsigned else range(-4, 5)
    out = rng.choice(np.array(list(vals), dtype=np.int64), size=n)
    return out.astype(np.float64) if dtype in FLOATS else out


def every_input(dtype, n, seed, op="SUM"):
    """Every rank's input, in rank order (each rank computes all of them)."""
    return [values(dtype, n, r, seed, op) for r in range(SIZE)]


def reduced(op: str, stack: np.ndarray) -> np.ndarray:
    """numpy's reduction of the stacked inputs over axis 0 (bool: SUM and MAX are "or", PRODUCT
    and MIN "and", as torch's backends define them); AVG divides the exact sum in float64."""
    if stack.dtype == bool:
        f = {"SUM": np.logical_or, "MAX": np.logical_or, "BOR": np.logical_or,
             "PRODUCT": np.logical_and, "MIN": np.logical_and, "BAND": np.logical_and,
             "BXOR": np.logical_xor}[op]
        return f.reduce(stack, axis=0)
    if op == "AVG":
        return stack.sum(axis=0) / len(stack)
    f = {"SUM": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum,
         "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op]
    return f.reduce(stack, axis=0)


def T(a, dtype: str) -> torch.Tensor:
    """numpy values as a new tensor of `dtype` (a copy: calls write to it; a single rounding
    for AVG's quotients)."""
    return torch.from_numpy(np.array(a, copy=True)).to(DTYPES[dtype])


def poison(expected: torch.Tensor) -> torch.Tensor:
    """An output buffer that differs from `expected` at every element, so an element the call
    does not write is caught."""
    return ~expected if expected.dtype == torch.bool else expected + 1


def blank(dtype: str) -> torch.Tensor:
    """A receive buffer of N elements: 100 (a value no input of the p2p tests holds; bool: True)."""
    return torch.full((N,), 100).to(DTYPES[dtype])


def splits(src: int, dst: int) -> int:
    """Elements rank `src` sends rank `dst` in the uneven all-to-alls (0 to 3: some are empty)."""
    return (src + 2 * dst + 1) % 4


GLOO_WITHOUT_FUTURE = ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
                       "isend/irecv")


def finish(mode: str, work, group, name: str = ""):
    """Complete call `name` made on `group` with async_op=(mode != "sync") the way `mode` says.
    On the backend under test, a Work must report completion after it. (gloo's reduce-scatter
    and point-to-point Works have no Future and some never report completion: there, gloo is
    waited on with wait() and is_completed() is not checked.)"""
    if mode == "sync":
        assert work is None, f"async_op=False returned {work!r}"
        return
    assert work is not None, "async_op=True returned no Work"
    if mode == "wait" or (is_gloo(group) and name in GLOO_WITHOUT_FUTURE):
        work.wait()
    else:
        fut = work.get_future()
        fut.wait()
        assert fut.done(), "the Work's Future is not done after Future.wait()"
    if not is_gloo(group):  # (a Work may learn of its completion a little after its Future)
        assert wait_for(work.is_completed), f"Work.is_completed() stays False after {mode}"


def call(mode: str, fn, *args, **kwargs):
    """fn(*args, **kwargs) with async_op per `mode`, completed (finish)."""
    finish(mode, fn(*args, async_op=mode != "sync", **kwargs), kwargs["group"], fn.__name__)


def tensor_differences(what: str, got, expected) -> list:
    """[] if `got` equals `expected` bit for bit (dtype, shape, every element), else a message."""
    if not isinstance(got, torch.Tensor):
        return [f"{what}: got {type(got).__name__}, expected a tensor"]
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return [f"{what}: got {got.dtype}{tuple(got.shape)}, "
                f"expected {expected.dtype}{tuple(expected.shape)}"]
    if torch.equal(got, expected):
        return []
    bad = (got != expected).reshape(-1).nonzero().reshape(-1)[:5]
    return [f"{what}: {int((got != expected).sum())} elements differ, at {bad.tolist()} got "
            f"{got.reshape(-1)[bad].tolist()} expected {expected.reshape(-1)[bad].tolist()}"]


def differential(case, *args) -> None:
    """Run `case(group, *args)` (a list of (name, result, expected) triples) on the backend
    under test and on gloo: every result must equal numpy's expected value, and the backend's
    must equal gloo's of the same name (where gloo can make the call), on every rank."""
    failures, results = [], {}
    for label, group in both():
        try:
            results[label] = case(group, *args)
        except Exception as e:          # noqa: BLE001 (reported, with every rank's, below)
            failures.append(f"{label}: {type(e).__name__}: {e}")
            continue
        for name, got, expected in results[label]:
            failures += tensor_differences(f"{label} {name}", got, expected)
    if len(results) == 2:
        gloo = {name: got for name, got, _ in results["gloo"]}
        for name, got, _ in results["aluminum"]:
            if name in gloo:
                failures += tensor_differences(f"aluminum vs gloo {name}", got, gloo[name])
    assert all_ranks_ok(not failures), every_rank(failures)


# ------------------------------------------------------------------------------ the collectives
# a scalar (a loss), empty, 2-D, and large enough (400 KB in float32) for other algorithms
SHAPES = ((), (0,), (1,), (7,), (3, 1001), (100003,))


def case_all_reduce(group, dtype, op, mode):
    out = []
    for shape in SHAPES if mode == "sync" else ((7,),):
        xs = [x.reshape(shape) for x in every_input(dtype, int(np.prod(shape)), 1, op)]
        t = T(xs[RANK], dtype)
        call(mode, dist.all_reduce, t, op=getattr(ReduceOp, op), group=group)
        out.append((f"all_reduce {op} shape {shape}", t, T(reduced(op, np.stack(xs)), dtype)))
    return out


ALL_REDUCE = [(d, op, m) for d in RUN_DTYPES for op in ops_for(d) for m in MODES]


@pytest.mark.parametrize("dtype,op,mode", ALL_REDUCE)
def test_all_reduce(dtype, op, mode):
    differential(case_all_reduce, dtype, op, mode)


N = 5                           # elements per rank's block in the other collectives


def case_all_gather(group, dtype, mode):
    xs = every_input(dtype, N, 2)
    mine = T(xs[RANK], dtype)
    flat = T(np.concatenate(xs), dtype)
    out = []
    blocks = [poison(T(x, dtype)) for x in xs]
    call(mode, dist.all_gather, blocks, mine, group=group)
    out += [(f"all_gather block {r}", b, T(x, dtype)) for r, (b, x) in enumerate(zip(blocks, xs))]
    for fn in (dist.all_gather_into_tensor, dist.all_gather_single):
        name = fn.__name__
        o = poison(flat)
        call(mode, fn, o, mine, group=group)
        out.append((name, o, flat))
        o = poison(flat).reshape(SIZE, N)           # 2-D: rows gathered along dim 0
        call(mode, fn, o, mine.reshape(1, N), group=group)
        out.append((f"{name} 2-D", o, flat.reshape(SIZE, N)))
        o = poison(flat)                            # in place: the input is block RANK (FSDP2)
        block = o[RANK * N:(RANK + 1) * N]
        block.copy_(mine)
        call(mode, fn, o, block, group=group)
        out.append((f"{name} in place", o, flat))
    return out


def case_reduce_scatter(group, dtype, mode):
    out = []
    ops = ("SUM", "MAX") if mode == "sync" else ("SUM",)
    for op in ops + (("AVG",) if dtype in FLOATS else ()):
        xs = every_input(dtype, SIZE * N, 3, op)
        expected = T(reduced(op, np.stack(xs))[RANK * N:(RANK + 1) * N], dtype)
        mine = T(xs[RANK], dtype)
        o = poison(expected)
        call(mode, dist.reduce_scatter, o, list(mine.split(N)), op=getattr(ReduceOp, op),
             group=group)
        out.append((f"reduce_scatter {op}", o, expected))
        for fn in (dist.reduce_scatter_tensor, dist.reduce_scatter_single):
            o = poison(expected)
            call(mode, fn, o, mine, op=getattr(ReduceOp, op), group=group)
            out.append((f"{fn.__name__} {op}", o, expected))
    return out


def case_all_to_all(group, dtype, mode):
    out = []
    xs = every_input(dtype, SIZE * N, 4)            # even splits: N elements to each rank
    expected = T(np.concatenate([x[RANK * N:(RANK + 1) * N] for x in xs]), dtype)
    o = poison(expected)
    call(mode, dist.all_to_all_single, o, T(xs[RANK], dtype), group=group)
    out.append(("all_to_all_single even", o, expected))
    # uneven: rank s sends splits(s, d) elements to rank d
    sent = [np.cumsum([0] + [splits(s, d) for d in range(SIZE)]) for s in range(SIZE)]
    xs = [values(dtype, int(sent[s][-1]), s, 5) for s in range(SIZE)]
    got_from = [xs[s][sent[s][RANK]:sent[s][RANK + 1]] for s in range(SIZE)]
    expected = T(np.concatenate(got_from), dtype)
    o = poison(expected)
    call(mode, dist.all_to_all_single, o, T(xs[RANK], dtype),
         output_split_sizes=[splits(s, RANK) for s in range(SIZE)],
         input_split_sizes=[splits(RANK, d) for d in range(SIZE)], group=group)
    out.append(("all_to_all_single uneven", o, expected))
    mine = T(xs[RANK], dtype)
    ins = [mine[sent[RANK][d]:sent[RANK][d + 1]].clone() for d in range(SIZE)]
    outs = [poison(T(g, dtype)) for g in got_from]
    if not is_gloo(group):              # gloo's all_to_all takes equal sizes only
        call(mode, dist.all_to_all, outs, ins, group=group)
        out += [(f"all_to_all uneven from {s}", o, T(g, dtype))
                for s, (o, g) in enumerate(zip(outs, got_from))]
    xs = every_input(dtype, SIZE * N, 13)
    outs = [poison(T(x[RANK * N:(RANK + 1) * N], dtype)) for x in xs]
    call(mode, dist.all_to_all, outs, list(T(xs[RANK], dtype).split(N)), group=group)
    return out + [(f"all_to_all even from {s}", o, T(x[RANK * N:(RANK + 1) * N], dtype))
                  for s, (o, x) in enumerate(zip(outs, xs))]


def case_rooted(group, dtype, mode):
    out = []
    xs = every_input(dtype, N, 6)
    for root in range(SIZE) if mode == "sync" else (ROOT,):
        t = T(xs[RANK], dtype)
        call(mode, dist.broadcast, t, src=root, group=group)
        out.append((f"broadcast from {root}", t, T(xs[root], dtype)))
    ops = ("SUM", "MAX") + (("AVG",) if dtype in FLOATS else ()) if mode == "sync" else ("SUM",)
    for op in ops:
        ys = every_input(dtype, N, 7, op)
        t = T(ys[RANK], dtype)
        call(mode, dist.reduce, t, dst=ROOT, op=getattr(ReduceOp, op), group=group)
        if RANK == ROOT:                    # elsewhere the buffer's content is unspecified
            out.append((f"reduce {op} to {ROOT}", t, T(reduced(op, np.stack(ys)), dtype)))
    blocks = [poison(T(x, dtype)) for x in xs] if RANK == ROOT else None
    call(mode, dist.gather, T(xs[RANK], dtype), blocks, dst=ROOT, group=group)
    if RANK == ROOT:
        out += [(f"gather block {r}", b, T(x, dtype)) for r, (b, x) in enumerate(zip(blocks, xs))]
    zs = every_input(dtype, N, 8)
    o = poison(T(zs[RANK], dtype))
    call(mode, dist.scatter, o, [T(z, dtype) for z in zs] if RANK == ROOT else None, src=ROOT,
         group=group)
    out.append((f"scatter from {ROOT}", o, T(zs[RANK], dtype)))
    return out


COLLECTIVES = {"all_gather": case_all_gather, "reduce_scatter": case_reduce_scatter,
               "all_to_all": case_all_to_all, "rooted": case_rooted}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", RUN_DTYPES)
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_collective(collective, dtype, mode):
    differential(COLLECTIVES[collective], dtype, mode)


def case_in_flight(group, dtype):
    """Calls in flight together on one group, blocking ones issued among them, waited for out
    of order: each still meets its match on the other ranks."""
    xs = every_input(dtype, SIZE * N, 60)
    ys = every_input(dtype, SIZE * N, 61, "MAX")
    block = slice(RANK * N, (RANK + 1) * N)
    summed = T(reduced("SUM", np.stack(xs)), dtype)
    gathered = T(np.concatenate([x[:N] for x in xs]), dtype)
    a = T(xs[RANK], dtype)
    first = dist.all_reduce(a, group=group, async_op=True)
    g = poison(gathered)
    second = dist.all_gather_into_tensor(g, T(xs[RANK][:N], dtype), group=group, async_op=True)
    b = T(xs[RANK][:N], dtype)
    dist.broadcast(b, src=ROOT, group=group)
    r = poison(summed[block])
    third = dist.reduce_scatter_tensor(r, T(xs[RANK], dtype), group=group, async_op=True)
    c = T(ys[RANK], dtype)
    dist.all_reduce(c, op=ReduceOp.MAX, group=group)
    for name, w in (("third", third), ("first", first), ("second", second)):
        finish("wait", w, group, name)
    return [("async all_reduce", a, summed), ("async all_gather_into_tensor", g, gathered),
            ("blocking broadcast", b, T(xs[ROOT][:N], dtype)),
            ("async reduce_scatter_tensor", r, summed[block]),
            ("blocking all_reduce MAX", c, T(reduced("MAX", np.stack(ys)), dtype))]


@pytest.mark.parametrize("dtype", ("float32", "bfloat16", "int32"))
def test_calls_in_flight_together(dtype):
    differential(case_in_flight, dtype)


@pytest.mark.parametrize("mode", MODES)
def test_barrier(mode):
    def case(group, mode):
        call(mode, dist.barrier, group=group)
        return []
    differential(case, mode)


# -------------------------------------------------------------------------------- point to point
needs_two = pytest.mark.skipif(SIZE < 2, reason="point to point needs two ranks")
NEXT, PREV = (RANK + 1) % SIZE, (RANK - 1) % SIZE


def case_send_recv(group, dtype):
    """Blocking send/recv around the ring (even ranks send first), then receives from any
    source on ROOT, which must return each sender's rank."""
    xs = every_input(dtype, N, 9)
    out = []
    t = poison(T(xs[PREV], dtype))
    if RANK % 2 == 0:
        dist.send(T(xs[RANK], dtype), NEXT, group=group)
        dist.recv(t, PREV, group=group)
    else:
        dist.recv(t, PREV, group=group)
        dist.send(T(xs[RANK], dtype), NEXT, group=group)
    out.append(("recv from the previous rank", t, T(xs[PREV], dtype)))
    if RANK == ROOT:
        senders = []
        for _ in range(SIZE - 1):
            t = blank(dtype)
            src = dist.recv(t, group=group)
            senders.append(src)
            if isinstance(src, int) and 0 <= src < SIZE:
                out.append((f"recv from any source (sender {src})", t, T(xs[src], dtype)))
        ok = sorted(senders) == list(range(SIZE - 1))
        out.append(("senders returned by recv(src=None)", torch.tensor(ok), torch.tensor(True)))
    else:
        dist.send(T(xs[RANK], dtype), ROOT, group=group)
    return out


def case_isend_irecv(group, dtype, mode):
    """isend/irecv around the ring in both directions, two tags received in the opposite order
    of sending, then batch_isend_irecv."""
    xs, ys = every_input(dtype, N, 10), every_input(dtype, N, 11)
    a, b = poison(T(xs[PREV], dtype)), poison(T(ys[PREV], dtype))
    works = [dist.isend(T(xs[RANK], dtype), NEXT, group=group, tag=1),
             dist.isend(T(ys[RANK], dtype), NEXT, group=group, tag=2)]
    works.insert(0, dist.irecv(b, PREV, group=group, tag=2))
    works.insert(1, dist.irecv(a, PREV, group=group, tag=1))
    for w in works:
        finish(mode, w, group, "isend/irecv")
    out = [("irecv tag 1", a, T(xs[PREV], dtype)), ("irecv tag 2", b, T(ys[PREV], dtype))]
    c, d = poison(T(xs[PREV], dtype)), poison(T(ys[NEXT], dtype))
    ops = [dist.P2POp(dist.isend, T(xs[RANK], dtype), NEXT, group, tag=3),   # at 2 ranks
           dist.P2POp(dist.isend, T(ys[RANK], dtype), PREV, group, tag=4),   # NEXT == PREV:
           dist.P2POp(dist.irecv, c, PREV, group, tag=3),                    # the tags tell
           dist.P2POp(dist.irecv, d, NEXT, group, tag=4)]                    # them apart
    for w in dist.batch_isend_irecv(ops):
        finish(mode, w, group, "isend/irecv")
    return out + [("batch_isend_irecv from previous", c, T(xs[PREV], dtype)),
                  ("batch_isend_irecv from next", d, T(ys[NEXT], dtype))]


@needs_two
@pytest.mark.parametrize("dtype", RUN_DTYPES)
def test_send_recv(dtype):
    differential(case_send_recv, dtype)


@needs_two
@pytest.mark.parametrize("mode", ("wait", "future"))
@pytest.mark.parametrize("dtype", RUN_DTYPES)
def test_isend_irecv(dtype, mode):
    differential(case_isend_irecv, dtype, mode)


# ---------------------------------------------------------------------- objects and coalescing
def test_object_collectives():
    def obj(r):
        return {"rank": r, "payload": list(range(r * 3)), "name": f"rank-{r}"}

    def case(group):
        out = []

        def same(name, got, expected):
            out.append((name, torch.tensor(got == expected), torch.tensor(True)))

        gathered = [None] * SIZE
        dist.all_gather_object(gathered, obj(RANK), group=group)
        same("all_gather_object", gathered, [obj(r) for r in range(SIZE)])
        lst = [obj(RANK), RANK]
        dist.broadcast_object_list(lst, src=ROOT, group=group)
        same("broadcast_object_list", lst, [obj(ROOT), ROOT])
        got = [None]
        dist.scatter_object_list(got, [obj(r) for r in range(SIZE)] if RANK == ROOT else None,
                                 src=ROOT, group=group)
        same("scatter_object_list", got[0], obj(RANK))
        into = [None] * SIZE if RANK == ROOT else None
        dist.gather_object(obj(RANK), into, dst=ROOT, group=group)
        if RANK == ROOT:
            same("gather_object", into, [obj(r) for r in range(SIZE)])
        if SIZE > 1:
            got = [None]
            if RANK % 2 == 0:
                dist.send_object_list([obj(RANK)], NEXT, group=group)
                dist.recv_object_list(got, PREV, group=group)
            else:
                dist.recv_object_list(got, PREV, group=group)
                dist.send_object_list([obj(RANK)], NEXT, group=group)
            same("send/recv_object_list", got[0], obj(PREV))
        return out
    differential(case)


LENGTHS = (3, 1, 8)              # the parts of a coalesced call


def case_all_reduce_coalesced(group, dtype):
    xs = [every_input(dtype, n, 12 + n) for n in LENGTHS]
    ts = [T(x[RANK], dtype) for x in xs]
    dist.all_reduce_coalesced(ts, group=group)
    return [(f"part {k}", t, T(reduced("SUM", np.stack(x)), dtype))
            for k, (t, x) in enumerate(zip(ts, xs))]


def case_all_gather_coalesced(group, dtype):
    """output_tensor_lists[r][k]: part k of rank r (torch's docstring)."""
    xs = [every_input(dtype, n, 14 + n) for n in LENGTHS]
    outs = [[poison(T(x[r], dtype)) for x in xs] for r in range(SIZE)]
    dist.all_gather_coalesced(outs, [T(x[RANK], dtype) for x in xs], group=group)
    return [(f"rank {r} part {k}", outs[r][k], T(x[r], dtype))
            for r in range(SIZE) for k, x in enumerate(xs)]


def coalescing(group, calls):
    """The calls (functions of no argument) inside one _coalescing_manager of `group`, then one
    wait for them all."""
    with dist._coalescing_manager(group=group, async_ops=True) as cm:
        for c in calls:
            c()
    cm.wait()


def case_manager_all_reduce(group, dtype):
    xs = [every_input(dtype, n, 16 + n) for n in LENGTHS]
    ts = [T(x[RANK], dtype) for x in xs]
    coalescing(group, [partial(dist.all_reduce, t, group=group) for t in ts])
    return [(f"part {k}", t, T(reduced("SUM", np.stack(x)), dtype))
            for k, (t, x) in enumerate(zip(ts, xs))]


def case_manager_all_gather(group, dtype):
    xs = [every_input(dtype, n, 18 + n) for n in LENGTHS]
    flats = [T(np.concatenate(x), dtype) for x in xs]
    outs = [poison(f) for f in flats]
    coalescing(group, [partial(dist.all_gather_into_tensor, o, T(x[RANK], dtype), group=group)
                       for o, x in zip(outs, xs)])
    return [(f"part {k}", o, f) for k, (o, f) in enumerate(zip(outs, flats))]


def case_manager_reduce_scatter(group, dtype):
    ys = [every_input(dtype, SIZE * n, 20 + n) for n in LENGTHS]
    exp = [T(reduced("SUM", np.stack(y))[RANK * n:(RANK + 1) * n], dtype)
           for y, n in zip(ys, LENGTHS)]
    outs = [poison(e) for e in exp]
    coalescing(group, [partial(dist.reduce_scatter_tensor, o, T(y[RANK], dtype), group=group)
                       for o, y in zip(outs, ys)])
    return [(f"part {k}", o, e) for k, (o, e) in enumerate(zip(outs, exp))]


COALESCED = {"all_reduce_coalesced": case_all_reduce_coalesced,
             "all_gather_coalesced": case_all_gather_coalesced,
             "manager all_reduce": case_manager_all_reduce,
             "manager all_gather_into_tensor": case_manager_all_gather,
             "manager reduce_scatter_tensor": case_manager_reduce_scatter}


@pytest.mark.parametrize("dtype", ("float32", "bfloat16", "int64"))
@pytest.mark.parametrize("form", list(COALESCED))
def test_coalesced(form, dtype):
    """The coalesced calls, and _coalescing_manager around all_reduce, all_gather_into_tensor
    and reduce_scatter_tensor (FSDP2's calls): every part is complete when the coalesced Work
    is."""
    differential(COALESCED[form], dtype)


@pytest.mark.skipif(BACKEND != "aluminum", reason="the aluminum backend's messages")
@pytest.mark.parametrize("call_, match", [
    (lambda g: dist.all_reduce(torch.ones(3, 2)[:, 0], group=g), "contiguous"),
    (lambda g: dist.all_gather_into_tensor(torch.empty(3 * SIZE + 1), torch.ones(3), group=g),
     "elements"),
    (lambda g: dist.reduce_scatter_tensor(torch.empty(3), torch.ones(3 * SIZE + 1), group=g),
     "elements"),
    (lambda g: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=ReduceOp.AVG, group=g),
     "AVG"),
    (lambda g: dist.all_reduce(torch.ones(4), op=dist._make_nccl_premul_sum(2.0), group=g),
     "PREMUL_SUM"),
    (lambda g: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * SIZE), group=g,
                                          op=dist._make_nccl_premul_sum(2.0)), "PREMUL_SUM"),
], ids=["non-contiguous", "all_gather output size", "reduce_scatter input size", "AVG of int",
        "PREMUL_SUM all_reduce", "PREMUL_SUM reduce_scatter_tensor"])
def test_bad_arguments_are_refused_clearly(call_, match):
    """Arguments every rank gets wrong alike, and PREMUL_SUM (a scaled sum NCCL has), raise a
    message that says what is wrong, before any communication; the group works afterwards."""
    with pytest.raises((ValueError, TypeError), match=match):
        call_(G.al)
    t = torch.ones(4)
    dist.all_reduce(t, group=G.al)
    assert all_ranks_ok(torch.equal(t, torch.full((4,), float(SIZE))))


# ----------------------------------------------------------------------- DDP, FSDP2, DTensor
def data():
    return torch_hook_tests.data(torch.float32)


def mlp():
    return torch_hook_tests.model(torch.float32)


def ddp(net, group):
    return DDP(net, process_group=group, bucket_cap_mb=0.0005)   # several buckets


def test_ddp_equals_gloo_ddp():
    """20 DDP steps on the backend equal 20 on gloo: bit for bit at 1 and 2 ranks (DDP divides
    each gradient by the size, then sums: two halves add exactly in any order), within float32
    rounding at 3 and 4; both equal single-process training on the whole batch."""
    X, Y = data()
    ours = train(ddp(mlp(), G.al), shard(X), shard(Y), 20)
    gloo = train(ddp(mlp(), G.gloo), shard(X), shard(Y), 20)
    whole = train(mlp(), X, Y, 20)
    diff = max_diff(ours, gloo)
    ok = diff == 0.0 if SIZE <= 2 else diff < 1e-6
    assert all_ranks_ok(ok and max_diff(ours, whole) < 1e-5), (diff, max_diff(ours, whole))


def test_fsdp2_matches_single_process():
    """FSDP2 (fully_shard per Linear and at the root, on a mesh over the backend's group):
    5 steps on each rank's part of the batch equal 5 single-process steps on the whole batch."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    X, Y = data()
    whole = train(mlp(), X, Y, 5)
    net = mlp()
    mesh = DeviceMesh.from_group(G.al, "cpu")
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    got = [p.full_tensor() for p in train(net, shard(X), shard(Y), 5)]
    diff = max_diff(got, whole)
    assert all_ranks_ok(diff < 1e-6), diff


def case_dtensor(group):
    """distribute_tensor (from rank 0's data, whatever the others pass), full_tensor(), and
    Partial -> Replicate / Shard(0) redistributions (all-reduce, reduce-scatter)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    mesh = DeviceMesh.from_group(group, "cpu")
    rows = 2
    xs = [x.reshape(rows * SIZE, 3) for x in every_input("float32", rows * SIZE * 3, 30)]
    x0 = T(xs[0], "float32")
    total = T(reduced("SUM", np.stack(xs)), "float32")
    part = slice(RANK * rows, (RANK + 1) * rows)
    # (a new input each time: Replicate broadcasts into the tensor it is given)
    sharded = distribute_tensor(T(xs[RANK], "float32"), mesh, [Shard(0)])
    replicated = distribute_tensor(T(xs[RANK], "float32"), mesh, [Replicate()])
    partial = DTensor.from_local(T(xs[RANK], "float32"), mesh, [Partial()])
    return [("distribute_tensor Shard(0) local", sharded.to_local(), x0[part]),
            ("Shard(0) full_tensor", sharded.full_tensor(), x0),
            ("distribute_tensor Replicate local", replicated.to_local(), x0),
            ("Partial full_tensor", partial.full_tensor(), total),
            ("Partial -> Shard(0)", partial.redistribute(mesh, [Shard(0)]).to_local(),
             total[part])]


def case_functional(group):
    """torch.distributed._functional_collectives on the group (what DTensor and compiled code
    call): all_reduce (sum, avg, max), all_gather_tensor, reduce_scatter_tensor,
    all_to_all_single."""
    out = []
    for op in ("sum", "avg", "max"):
        xs = every_input("float32", SIZE * N, 31, op.upper())
        got = funcol.wait_tensor(funcol.all_reduce(T(xs[RANK], "float32"), op, group))
        out.append((f"all_reduce {op}", got, T(reduced(op.upper(), np.stack(xs)), "float32")))
    xs = every_input("float32", SIZE * N, 32)
    mine = T(xs[RANK], "float32")
    got = funcol.wait_tensor(funcol.all_gather_tensor(mine[:N], 0, group))
    out.append(("all_gather_tensor", got, T(np.concatenate([x[:N] for x in xs]), "float32")))
    got = funcol.wait_tensor(funcol.reduce_scatter_tensor(mine, "sum", 0, group))
    out.append(("reduce_scatter_tensor",
                got, T(reduced("SUM", np.stack(xs))[RANK * N:(RANK + 1) * N], "float32")))
    got = funcol.wait_tensor(funcol.all_to_all_single(mine, None, None, group))
    out.append(("all_to_all_single", got,
                T(np.concatenate([x[RANK * N:(RANK + 1) * N] for x in xs]), "float32")))
    return out


def test_dtensor():
    differential(case_dtensor)


def test_functional_collectives():
    differential(case_functional)


# ----------------------------------------------------------------------------------- sub-groups
def test_new_group_subset_and_whole():
    """new_group of the even ranks and of the odd ones (both at work at once), and of every
    rank: results of the members' collectives; a non-member holds NON_GROUP_MEMBER, and a
    collective on it does nothing and returns None."""
    evens, odds = list(range(0, SIZE, 2)), list(range(1, SIZE, 2))
    even = dist.new_group(evens, timeout=WAIT_LIMIT)
    odd = dist.new_group(odds, timeout=WAIT_LIMIT) if odds else None
    whole = dist.new_group(list(range(SIZE)), timeout=WAIT_LIMIT)
    xs = every_input("float32", N, 40)
    failures = []

    def check(name, got, expected):
        failures.extend(tensor_differences(name, got, expected))

    mine, other = (evens, odd) if RANK % 2 == 0 else (odds, even)
    group = even if RANK % 2 == 0 else odd
    if dist.get_backend(group) != BACKEND:
        failures.append(f"new_group's backend is {dist.get_backend(group)}, expected {BACKEND}")
    if (dist.get_rank(group), dist.get_world_size(group)) != (mine.index(RANK), len(mine)):
        failures.append(f"rank/size in the sub-group: {dist.get_rank(group)}, "
                        f"{dist.get_world_size(group)}")
    t = T(xs[RANK], "float32")
    dist.all_reduce(t, group=group)
    check("sub-group all_reduce", t, T(reduced("SUM", np.stack([xs[r] for r in mine])), "float32"))
    t = T(xs[RANK], "float32")
    dist.broadcast(t, src=mine[-1], group=group)            # src: a global rank
    check("sub-group broadcast", t, T(xs[mine[-1]], "float32"))
    o = torch.empty(len(mine) * N)
    dist.all_gather_into_tensor(o, T(xs[RANK], "float32"), group=group)
    check("sub-group all_gather_into_tensor", o, T(np.concatenate([xs[r] for r in mine]),
                                                   "float32"))
    into = [poison(T(xs[r], "float32")) for r in mine] if RANK == mine[-1] else None
    dist.gather(T(xs[RANK], "float32"), into, dst=mine[-1], group=group)   # dst: global
    if into is not None:
        for r, got in zip(mine, into):
            check(f"sub-group gather from {r}", got, T(xs[r], "float32"))
    if len(mine) > 1:                                       # peers named by global rank
        if RANK == mine[0]:
            dist.send(T(xs[RANK], "float32"), mine[-1], group=group)
        elif RANK == mine[-1]:
            t = blank("float32")
            sender = dist.recv(t, group=group)
            check(f"sub-group recv from any source (sender {sender})", t, T(xs[mine[0]],
                                                                             "float32"))
            if sender != mine[0]:
                failures.append(f"sub-group recv returned sender {sender}, expected {mine[0]}")
    if other is not None:                                   # the group this rank is not in
        if other is not dist.GroupMember.NON_GROUP_MEMBER:
            failures.append(f"a non-member holds {other!r}, not NON_GROUP_MEMBER")
        t = T(xs[RANK], "float32")
        ret = dist.all_reduce(t, group=other)
        if ret is not None or dist.get_rank(other) != -1:
            failures.append(f"non-member all_reduce returned {ret!r}, get_rank "
                            f"{dist.get_rank(other)}")
        check("non-member all_reduce leaves the tensor", t, T(xs[RANK], "float32"))
    t = T(xs[RANK], "float32")
    dist.all_reduce(t, op=ReduceOp.MAX, group=whole)
    check("whole new_group all_reduce MAX", t, T(reduced("MAX", np.stack(xs)), "float32"))
    assert all_ranks_ok(not failures), every_rank(failures)


# ---------------------------------------------------------------- timeouts, errors, threads
TIMED_OUT = r"(?i)time[sd]? ?out"


def times_out(what: str, fn) -> list:
    """[] if fn() raises an error that says it timed out, else a message (also if the error
    took more than 120 s: far above the 1 s timeouts here, only a hang gets there)."""
    start = time.monotonic()
    try:
        fn()
        failure = f"{what} returned"
    except Exception as e:              # noqa: BLE001 (the error is the point)
        failure = (None if re.search(TIMED_OUT, str(e)) else
                   f"{what}: the error does not say it timed out: {type(e).__name__}: {e}")
    elapsed = time.monotonic() - start
    if failure is None and elapsed > 120:
        failure = f"{what}: the error came after {elapsed:.0f} s"
    return [failure] if failure else []


def lone_all_reduce(group, mode):
    """all_reduce on `group` completed the way `mode` says (wait_timeout: Work.wait(1 s))."""
    work = dist.all_reduce(torch.ones(4), group=group, async_op=mode != "sync")
    if mode == "wait":
        work.wait()
    elif mode == "future":
        work.get_future().wait()
    elif mode == "wait_timeout":
        work.wait(timedelta(seconds=1))


@needs_two
@pytest.mark.parametrize("mode", MODES + ("wait_timeout",))
def test_timeout_when_other_ranks_never_call(mode):
    """Rank 0 alone calls all_reduce on a group whose timeout is 1 s: the call (or the Work's
    wait(), or its Future's) raises an error saying so, instead of waiting for ever; so does
    Work.wait(timeout=1 s) on a group with the usual timeout. Afterwards the others make the
    matching call (it completes or times out in turn), and the group is never used again."""
    short = timedelta(seconds=1) if mode != "wait_timeout" else WAIT_LIMIT
    group = dist.new_group(timeout=short)
    failures = []
    if RANK == 0:
        failures += times_out(f"all_reduce ({mode}) with no partner",
                              lambda: lone_all_reduce(group, mode))
    WORLD.Barrier()
    if RANK != 0:
        try:
            dist.all_reduce(torch.ones(4), group=group)
        except Exception:               # noqa: BLE001 (a timeout here is fine too)
            pass
    assert all_ranks_ok(not failures), every_rank(failures)


def test_error_from_a_hook_reaches_backward():
    """DDP whose comm hook asks the backend for a bucket reduction it refuses (PREMUL_SUM):
    loss.backward() raises that error on every rank, it does not hang."""
    net = ddp(mlp(), G.al)
    premul = dist._make_nccl_premul_sum(0.5)

    def hook(state, bucket):
        return dist.all_reduce(bucket.buffer(), op=premul, group=G.al,
                               async_op=True).get_future()
    net.register_comm_hook(None, hook)
    X, Y = data()
    with pytest.raises(Exception, match="PREMUL_SUM"):
        torch.nn.functional.mse_loss(net(shard(X)), shard(Y)).backward()


@needs_two
def test_timeout_reaches_backward_through_the_future():
    """DDP over a group with a 1 s timeout where rank 0 alone runs backward: DDP's bucket
    all-reduce times out and the error reaches rank 0's loss.backward() (through the Work's
    Future), not a hang. The others then run backward too (matching rank 0's calls: they
    complete or time out in turn); the group is never used again."""
    group = dist.new_group(timeout=timedelta(seconds=1))
    net = DDP(mlp(), process_group=group)
    X, Y = data()
    failures = []
    if RANK == 0:
        failures += times_out("backward with no partner", lambda: torch.nn.functional.mse_loss(
            net(shard(X)), shard(Y)).backward())
    WORLD.Barrier()
    if RANK != 0:
        try:
            torch.nn.functional.mse_loss(net(shard(X)), shard(Y)).backward()
        except Exception:               # noqa: BLE001 (a timeout here is fine too)
            pass
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.skipif(BACKEND != "aluminum", reason="frees the aluminum group's Communicator")
def test_failed_call_reaches_backward():
    """DDP (its own all-reduce, no comm hook) over a group whose Communicator was freed: the
    bucket all-reduce fails to start, and loss.backward() raises that failure on every rank."""
    group = dist.new_group()
    net = ddp(mlp(), group)
    group.comm.Free()
    X, Y = data()
    with pytest.raises(Exception, match="free"):
        torch.nn.functional.mse_loss(net(shard(X)), shard(Y)).backward()


def test_collectives_from_other_threads():
    """The thread rule: a collective from another Python thread, then from the main thread
    again, and DDP training run entirely in another thread (its hooks on that thread and on
    autograd's), all give numpy's / single-process results."""
    xs = every_input("float32", N, 50)
    expected = T(reduced("SUM", np.stack(xs)), "float32")
    results, errors = {}, []

    def run(name, fn):
        try:
            results[name] = fn()
        except Exception as e:          # noqa: BLE001 (reported below)
            errors.append(f"{name}: {type(e).__name__}: {e}")

    def all_reduce():
        t = T(xs[RANK], "float32")
        dist.all_reduce(t, group=G.al)
        return t

    def ddp_training():
        X, Y = data()
        return train(ddp(mlp(), G.al), shard(X), shard(Y), 3)

    for name, fn in (("thread all_reduce", all_reduce), ("thread DDP", ddp_training)):
        t = threading.Thread(target=run, args=(name, fn))
        t.start()
        t.join(120)
        if t.is_alive():
            errors.append(f"{name}: still running after 120 s")
    run("main all_reduce", all_reduce)
    failures = list(errors)
    for name in ("thread all_reduce", "main all_reduce"):
        if name in results:
            failures += tensor_differences(name, results[name], expected)
    if "thread DDP" in results:
        X, Y = data()
        diff = max_diff(results["thread DDP"], train(mlp(), X, Y, 3))
        if not diff < 1e-5:
            failures.append(f"DDP in a thread differs from single-process training by {diff}")
    assert all_ranks_ok(not failures), every_rank(failures)
