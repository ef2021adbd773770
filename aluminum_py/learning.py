"""``algorithm="auto"`` checks itself in use (AL_AUTO_LEARN): during the first calls of each size
class of a communicator's Allreduce / Iallreduce it rotates among a few contenders, times them,
and commits to the fastest, the same choice on every rank.

Why: the tuning table is measured once, in the state the machine was in then; a node's memory
bandwidth, its page placement and its neighbours change (docs/tuning.md, "Learning in use").

How, for one size class (the powers of two: a message of n bytes is in the class of the
smallest power of two >= n) and one element size:

* the contenders: the two best of the table's (or the cost model's) ranking at that size, and
  the best of each transport not among them ("shm", the node's segment; the MPI library's
  point-to-point for every other algorithm), at most :data:`CONTENDERS`;
* a schedule of ``rounds + 1`` rounds, each running every contender :data:`RUN` (3) times in
  a row, the contenders in an order drawn from the round's number (the same on every rank);
  only the last call of each run is timed, and round 0 is a warm-up, not timed.  The first
  call of a run finds the user's buffers (and the segment's slots) as the *previous*
  contender left them, not as the same algorithm leaves them call after call once committed:
  timed that way (one call per contender per round), "shm" took 45 us at 256 KiB where it
  takes 18 us after itself, as hierarchical's point-to-point messages had left the buffers'
  lines in the other core's cache, and learning chose Rabenseifner or hierarchical at 128 KiB-
  4 MiB where shm was 1.5-3x faster in the timing that followed (issue 31, set K).  Where
  the two ranks share no cache, the second call still paid: shm after ring into the same
  recvbuf took 3-4.5x its time at 1-4 MiB, then 1.08-1.13x, then 1.0x, so the third is timed
  (with two, learning kept ring at 4 MiB where shm was 1.22x faster, issue 31, set Z);
* each call is timed on each rank: a blocking call from its start to its return, a
  nonblocking one from the op's start to its completion (read when the schedule is over; an op
  not complete by then gives no sample, on any rank: then the call has none).  Where every rank
  runs on one machine (one kernel: the ranks share ``CLOCK_MONOTONIC``), a call's sample is
  the time from the last rank's start to the last rank's end: what the call adds to the
  program's critical path, and what a loop of back-to-back calls of one algorithm costs per
  call.  A call's own span on a rank also holds the wait for the ranks that the previous call
  left behind, and that depends on the *previous* call's algorithm (MPI's point-to-point
  algorithms let the ranks leave apart, shm together): timed that way, "shm" was charged the
  others' skew and looked 2-3x slower than it is from 64 KiB to 512 KiB (issue 31).  A
  barrier before each timed call removed the bias too, but made a call whose peer never comes
  wait past the call's own timeout.  On several machines (no common clock) the sample is the
  longest span over the ranks, skew and all;
* at the first call of the class after the schedule, the ranks exchange their samples (one
  small MPI_Allreduce of the max, see Learning.exchange, on a communicator of its own) and
  every rank decides from the same numbers.  Each other contender's lead over the table's
  choice is the larger of two estimates: the median over the rounds of the table's choice's
  time over its own (paired by round, as the machine's state changes between rounds), and the
  ratio of the two medians.  (The ratio of the medians alone had hierarchical 3% ahead of shm
  at 1 MiB where it was 7% ahead round by round and 1.11x faster in the timing that followed;
  the paired ratio alone had shm 1% ahead of Rabenseifner at 16 MiB where its median was 7%
  lower and it was 1.35x faster in the timing.  Over 128 size classes of 1-64 MiB decided at
  20 rounds, 2 ranks, the choice was 1.10x slower than the fastest in the timing in 9 with the
  medians' ratio, 7 with the paired one and 5 with the larger of the two: issue 31,
  bench/results/issue31_learn_longer.txt.)  The challengers, largest lead first, are those with
  a lead above :data:`KEEP` that were faster in at least half the rounds; each
  - is chosen where it was faster in at least :data:`WINS` of the rounds, in so many that
    chance would give as many at most :data:`SURE` of the time (:func:`sure`, a sign test: 5
    of 5, 9 of 10, 15 of 20);
  - otherwise its lead could be chance: the schedule doubles (more rounds, the same on every
    rank, drawn from their numbers) and the ranks exchange and decide again, up to
    :data:`MORE_ROUNDS` times the rounds; there, faster in most rounds is enough.
  Against every other contender, the table's choice holds at once only where it was surely
  faster (the same sign test) or the contender :data:`CLOSE` (1.25x) slower; where neither,
  the contest is in doubt and the schedule doubles as well, and at the longest schedule the
  table's choice stays.  (At 1-64 MiB the calls varied by 15-25% from round to round; with 5
  rounds, learning kept shm where it had been faster in 3 of 5 rounds and the timing that
  followed had ring or hierarchical 1.12-1.22x faster; of the size classes of 1-64 MiB that
  committed after 5 rounds, 8.2% (24 of 292) chose an algorithm 1.10x slower than the fastest
  in the timing that followed, of those that learned 20 rounds 5.5% (6 of 110): issue 31.)
  The table's choice stays where no challenger is chosen.  With five rounds, faster in 4 of 5
  (by chance one time in five) had moved 32 MiB from shm to ring, 4843 against 5350 us, where
  the timing then had shm at 4181 us and ring at 4574 (issue 31, set X).  Where the machine's
  memory was slow the calls of 4-64 MiB varied widely from call to call, and a contender 1.24x
  faster in the timing won only 6 of 10 rounds: stopping there (under WINS) kept ring at 32
  MiB where shm was 1.24x faster (issue 31, 2 ranks), and kept Rabenseifner at 64 MiB (4
  ranks) where shm was 1.41x faster; such a lead now learns longer, to a majority of 20
  rounds.  A
  call's time includes the wait for the last rank to arrive, which between back-to-back calls
  of a program varies by tens of microseconds: five samples of a 2 us allreduce compare those
  waits, not the algorithms, and a median alone chose recursive doubling where shm was 1.5x
  faster (issue 31).  Size classes up to :data:`CHEAP_BYTES` (whose calls cost microseconds)
  therefore learn for :data:`CHEAP_ROUNDS` times as many rounds.  From then on the class costs
  what any "auto" call costs: the launcher caches the committed name.

Before each decision the class looks for a change of the machine's state during learning
(:func:`state_change`): pairing by round cancels a change that slows every contender alike,
not one that moves them apart (in one run shm took 13.5-20 ms at 64 MiB in rounds 1-15 and
11.7-14.0 ms in rounds 16-20; the 20 rounds together kept Rabenseifner, and shm was 1.11x
faster in the timing that followed: issue 31, set AO3).  Where some contender's last rounds
are shifted against those before them, and the rounds after the shift lasted
:data:`CHANGE_SECONDS` or more (a shift in 6 rounds of 32 KiB calls, about 10 ms, was a blip:
shm stayed slow for 30 rounds, then ran 1.7x faster than what those rounds chose, set AP; one
in 5 rounds of 4 MiB calls, about 0.34 s, was not: shm 1.2x faster in the timing that
followed where learning, without the rule, kept Rabenseifner, set AQ), the class
decides from the rounds after the shift and first learns as many rounds again as its first
schedule had; the doubling then counts from the change.  Once per Learner: a later change is
left to the re-checks.

A committed class learns again later (AL_AUTO_RECHECK, :func:`config.auto_recheck`): after that
many calls of the class (CHEAP_ROUNDS times as many up to CHEAP_BYTES; counted by the launcher,
one counter per class, so the count is the same on every rank), a new Learner starts with the
committed choice as its prior and the same contenders, and decides by the same rules.  The
machine changes state after a class has committed (in one run shm's time at 64 MiB fell by a
quarter in the last rounds of learning, which then kept hierarchical where shm was 1.25x
faster: issue 31, bench/results/issue31_run_length.txt).  A re-check that keeps the choice
doubles the calls to the next one, up to :data:`RECHECK_LONGEST` times AL_AUTO_RECHECK; one
that changes it starts over at AL_AUTO_RECHECK.

The calls of one class must be the same sequence on every rank (MPI's rule for collectives):
then every rank runs the same contender at every call, and nothing can diverge.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import replace

import numpy as np

from . import config
from .algorithms import REGISTRY
from .errors import Error, TimeoutError

CONTENDERS = 3          # algorithms tried per size class at most
KEEP = 1.05             # a challenger leads by more than this, or not at all
WINS = 0.75             # a challenger faster in this share of the rounds (or more) ...
CHEAP_BYTES = 64 << 10  # size classes up to this learn for CHEAP_ROUNDS x AL_AUTO_LEARN rounds
CHEAP_ROUNDS = 4
RUN = 3                 # calls of a contender in a row; the last is timed (see the docstring)
SURE = 0.05             # ... and in so many that chance gives as many at most this often: chosen
MORE_ROUNDS = 4         # else, if faster in half or more, the schedule doubles, up to this factor
CLOSE = 1.25            # the table's choice holds early against a contender this much slower
RECHECK_LONGEST = 32    # calls between re-checks of a class grow to this x AL_AUTO_RECHECK
NEVER = 2 ** 62         # calls before a re-check that never comes
CHANGE_LEAST = 4        # a change of state: the last k >= this rounds of a contender against
CHANGE_P = 1e-3         # the 2k or more before them, shifted as chance would do this rarely,
CHANGE_SECONDS = 0.1    # and the rounds after the shift lasting this long (not a blip)


def size_class(nbytes: int) -> int:
    """The class of a message of `nbytes` bytes: the smallest power of two >= nbytes."""
    return 1 << max(0, int(nbytes) - 1).bit_length()


def transport(algorithm: str) -> str:
    """What moves an algorithm's data: "shm" (the node's segment) or "mpi" (MPI messages)."""
    return "shm" if REGISTRY[algorithm].one_node else "mpi"


def sure(wins: int, n: int) -> bool:
    """Whether one contender faster than another in `wins` of `n` paired rounds is surely the
    faster: in at least WINS of them, and in so many that chance gives as many at most SURE of
    the time (5 of 5, 9 of 10, 15 of 20)."""
    return n > 0 and wins >= WINS * n and by_chance(wins, n) <= SURE


def by_chance(wins: int, n: int) -> float:
    """The chance that a contender no faster than another wins at least `wins` of `n` paired
    rounds (the sign test's one-sided p-value)."""
    return sum(math.comb(n, w) for w in range(wins, n + 1)) / 2.0 ** n


@functools.lru_cache(maxsize=None)
def rank_sum_counts(k: int, m: int) -> np.ndarray:
    """The null distribution of the rank-sum (Mann-Whitney) statistic U of k samples against m
    others (U: the pairs where one of the k is the larger): counts[u], u = 0 .. k m, of the
    C(k + m, k) orders with that U.  They are the coefficients of the Gaussian binomial
    [k + m choose k](q) = prod over i = 1 .. k of (1 - q^(m + i)) / (1 - q^i), built one factor
    at a time (each partial product is a polynomial).  In floats (the counts reach 1e25 at k 26,
    m 54) the low half is exact to rounding (its coefficients are sums of smaller ones); the
    high end is not, and :func:`shifted` reads the low half only (U is symmetric)."""
    c = np.zeros(k * m + 1)
    c[0] = 1.0
    for i in range(1, k + 1):
        c[m + i:] -= c[:len(c) - m - i].copy()     # times (1 - q^(m + i))
        for r in range(i):                          # over (1 - q^i): a running sum, stride i
            c[r::i] = np.cumsum(c[r::i])
    return c


def shifted(later, earlier) -> float:
    """The chance that `later` lies at least as far above or below `earlier` as it does if both
    came from one distribution (the rank-sum test's two-sided p-value; ties count half)."""
    later, earlier = np.asarray(later)[:, None], np.asarray(earlier)[None, :]
    k, m = later.shape[0], earlier.shape[1]
    u = float(np.sum(later > earlier) + 0.5 * np.sum(later == earlier))
    tail = min(math.floor(u), math.floor(k * m - u))   # U's distribution is symmetric
    low = rank_sum_counts(k, m)[:tail + 1].sum() / math.comb(k + m, k)
    return min(1.0, 2 * low)


def state_change(table: np.ndarray) -> int | None:
    """Where the machine changed state during learning, from the rounds' samples (rows: rounds,
    columns: contenders, nan: none): the row from which some contender's last k >= CHANGE_LEAST
    samples are shifted against the 2k or more before them (rank-sum p <= CHANGE_P; per
    contender, the k of the smallest p), the latest such row over the contenders; None where
    no contender shifted.  A state change that moves the contenders unequally (shm's slot
    placement, a neighbour's job) makes the rounds before it a contest of another machine."""
    rows = []
    for column in table.T:
        at = np.flatnonzero(np.isfinite(column))
        v = column[at]
        best = None
        for k in range(CHANGE_LEAST, len(v) // 3 + 1):
            p = shifted(v[len(v) - k:], v[:len(v) - k])
            if p <= CHANGE_P and (best is None or p < best[0]):
                best = (p, int(at[len(v) - k]))
        if best is not None:
            rows.append(best[1])
    return max(rows) if rows else None


def contenders(ranked, k: int = CONTENDERS) -> tuple:
    """From `ranked` (the chosen algorithm first, then the others fastest first): the two
    first, then the first of each transport not yet among them, at most `k`."""
    ranked = tuple(ranked)
    pick = list(ranked[:2])
    for a in ranked[2:]:
        if len(pick) >= k:
            break
        if transport(a) not in {transport(b) for b in pick}:
            pick.append(a)
    return tuple(pick[:k])


class Learner:
    """The schedule and the samples of one size class (see the module's docstring)."""

    def __init__(self, exchange, nbytes: int, itemsize: int, choice, rounds: int,
                 one_clock: bool = False, recheck: int = 0, previous: Learner | None = None):
        self.exchange = exchange            # an array -> its max over ranks (collective)
        self.one_clock = one_clock          # every rank on one machine: starts/ends comparable
        self.size_class = size_class(nbytes)
        self.itemsize = itemsize
        self.first_rounds = rounds
        # AL_AUTO_RECHECK; and where this Learner re-checks a committed class, what that one
        # decided and the calls it waited before this re-check
        self.recheck = recheck
        self.rechecks = 0 if previous is None else previous.rechecks + 1
        self.previous_result = None if previous is None else previous.result
        self.previous_wait = 0 if previous is None else previous.recheck_after
        if previous is None:
            self.prior = choice.algorithm   # the table's (or the model's) choice
            self.source = choice.source
            self.names = contenders(choice.ranked or (choice.algorithm,))
        else:                               # the committed choice first, the same contenders
            self.prior, self.source = previous.committed, "learned"
            self.names = (self.prior,) + tuple(a for a in previous.names if a != self.prior)
        # call i of the schedule runs names[order[i]]: per round each contender RUN times in a
        # row, in an order drawn from the round's number; cell[i] is where call i's sample goes
        # in the (round - 1, contender) table: the last call of each run, round 0 (a warm-up)
        # none.  Per call of the schedule, its start and end on this rank (time.monotonic's
        # clock); an end of inf: no sample (and none for the call, whatever the other ranks
        # have)
        self.order = np.zeros(0, dtype=int)
        self.cell = []
        self.round_first = []               # per round of the schedule: its first call's index
        self.starts = np.zeros(0)
        self.ends = np.zeros(0)
        self.rounds = 0
        self.max_rounds = rounds * MORE_ROUNDS     # counted from `since`
        # the table's row from which the machine was in a new state (see state_change), and
        # the rounds before it are not decided on: at most one change per Learner; None: none
        self.change = None
        # every shift state_change saw at a decision: its round (1-based), how long the rounds
        # after it lasted (s), and whether it was taken as a change (else a blip, let go)
        self.shifts = []
        self.extend(0, rounds)
        self.pending = {}                   # call index -> the NativeOp of a nonblocking call
        self.calls = 0
        self.committed = None if len(self.names) > 1 else self.prior
        self.result = None                  # what `learned` reports once committed
        self.recheck_after = NEVER          # once committed: its calls before the re-check
        self.decided = None                 # the launcher's cache entry once committed

    def extend(self, first: int, last: int) -> None:
        """Add rounds `first` to `last` to the schedule (round 0: the warm-up, not timed)."""
        perms = [np.random.default_rng(r).permutation(len(self.names))
                 for r in range(first, last + 1)]
        self.round_first += [len(self.order) + i * len(self.names) * RUN
                             for i in range(len(perms))]
        self.order = np.concatenate([self.order, np.repeat(np.concatenate(perms), RUN)])
        self.cell += [(r - 1, int(j)) if r > 0 and t == RUN - 1 else None
                      for r, perm in enumerate(perms, first) for j in perm for t in range(RUN)]
        more = len(self.order) - len(self.starts)
        self.starts = np.concatenate([self.starts, np.zeros(more)])
        self.ends = np.concatenate([self.ends, np.full(more, np.inf)])
        self.rounds = last

    def next(self) -> str:
        """The algorithm of the next call of this class: a contender while the schedule runs,
        then (after the exchange, at the first call past it) the committed choice, or, where
        the exchanged samples leave it in doubt, the next contender of a longer schedule."""
        if self.committed is not None:
            return self.committed
        if self.pending:
            self.harvest()
        i = self.calls
        if i >= len(self.order) and self.commit() is not None:
            return self.committed
        self.calls = i + 1
        return self.names[self.order[i]]

    def record(self, start: float, end: float) -> None:
        """The last call's start and end (a blocking call timed by the caller, al_now)."""
        self.starts[self.calls - 1] = start
        self.ends[self.calls - 1] = end

    def record_op(self, op) -> None:
        """The last call was nonblocking: its op, read once complete (by :meth:`harvest` at the
        class's next call, at the latest when the schedule is over)."""
        self.pending[self.calls - 1] = op

    def harvest(self) -> None:
        """Read the times of the pending nonblocking calls that are complete, and let their ops
        go: an op keeps the user's buffers alive, and a class that learns slowly (a soak test's
        random mix: 189 calls to its decision) held 12 MB of them (issue 31)."""
        for i in [i for i, op in self.pending.items() if op.times is not None]:
            op = self.pending.pop(i)
            t = op.times
            if op.error is None and t[1] > t[0] > 0:
                self.starts[i], self.ends[i] = t

    def payload(self) -> np.ndarray:
        """What this rank contributes to the exchange (whose max over ranks every rank gets):
        per call its span, start and end."""
        return np.concatenate([self.ends - self.starts, self.starts, self.ends])

    def samples(self, every: np.ndarray) -> np.ndarray:
        """Per call of the schedule, from the exchanged maxima: its time (see the module's
        docstring), nan where some rank has no sample."""
        spans, starts, ends = np.split(every, 3)
        t = ends - starts if self.one_clock else spans
        return np.where(np.isfinite(t), t, np.nan)

    def learn_longer(self) -> None:
        """Double the rounds decided on (up to max_rounds): the same on every rank, decided from
        the exchanged samples.  None: not committed."""
        n = self.rounds - self.since
        self.extend(self.rounds + 1, self.since + min(2 * n, self.max_rounds))
        return None

    @property
    def since(self) -> int:
        """The first row of the table decided on: 0, or the change of state's."""
        return 0 if self.change is None else self.change

    def longer(self) -> bool:
        """Whether the rounds decided on may still double."""
        return self.rounds - self.since < self.max_rounds

    def lasted(self, exchanged: np.ndarray, row: int) -> float:
        """Seconds from the first call of the table's round `row` (0-based: the schedule's round
        row + 1) to the last call's end, from the exchanged maxima (see payload)."""
        _, starts, ends = np.split(exchanged, 3)
        first = self.round_first[row + 1]
        timed = np.isfinite(ends[first:]) & (ends[first:] > 0)
        if not timed.any():
            return 0.0
        return float(ends[first:][timed].max() - starts[first:][timed].min())

    def commit(self) -> str | None:
        """Decide from every rank's samples (one exchange): the choice, committed; or None where
        a challenger's lead could be chance and the schedule may still grow (it has doubled)."""
        self.harvest()
        self.pending.clear()                    # not complete yet: no sample
        exchanged = self.exchange(self.payload())
        every = self.samples(exchanged)         # the same on every rank
        # by round (rows) and contender (columns); nan: no sample
        table = np.full((self.rounds, len(self.names)), np.nan)
        for i, cell in enumerate(self.cell):
            if cell is not None:
                table[cell] = every[i]
        if self.change is None:
            row = state_change(table)
            if row is not None:
                seconds = self.lasted(exchanged, row)
                taken = seconds >= CHANGE_SECONDS
                self.shifts.append({"round": row + 1, "seconds": seconds, "taken": taken})
                if taken:                       # the rounds before it were another machine's:
                    self.change = row           # decide on those after it, and as many
                    self.extend(self.rounds + 1, self.rounds + self.first_rounds)  # again
                    return None
        everything, table = table, table[self.since:]
        per = {a: table[:, j][table[:, j] >= 0] for j, a in enumerate(self.names)}
        medians = {a: float(np.median(s)) for a, s in per.items() if len(s)}
        wins = {}
        best = self.prior
        doubt = []                              # contenders the prior kept its place against
        if self.prior not in medians:
            best = min(medians, key=medians.get) if medians else self.prior
        else:
            mine = table[:, self.names.index(self.prior)]
            rivals = []
            for a in medians:
                if a == self.prior:
                    continue
                theirs = table[:, self.names.index(a)]
                both = (mine >= 0) & (theirs >= 0)      # nan compares False
                if not both.any():
                    continue
                won = int(np.sum(theirs[both] < mine[both]))
                lost, n = int(np.sum(theirs[both] > mine[both])), int(np.sum(both))
                wins[a] = (won, n)
                # its lead: the larger of the median over the rounds of the table's choice's
                # time over its own (paired by round: the machine's state changes between
                # rounds) and the ratio of the two medians
                lead = max(float(np.median(mine[both] / theirs[both])),
                           medians[self.prior] / medians[a])
                rivals.append((lead, a, won, lost, n))
            for lead, a, won, lost, n in sorted(rivals, reverse=True):
                if lead > KEEP and 2 * won >= n:
                    if sure(won, n):
                        best = a
                        break
                    if self.longer():           # could be chance: learn longer
                        return self.learn_longer()
                    if 2 * won > n:             # the longest schedule: faster in most rounds
                        best = a
                        break
                # the table's choice holds against `a` where it was surely faster, or where
                # `a` was CLOSE times slower; otherwise the contest is in doubt
                if not (sure(lost, n) or lead * CLOSE <= 1):
                    doubt.append(a)
            else:
                if doubt and self.longer():
                    return self.learn_longer()
            if best != self.prior:
                doubt = []
        self.committed = best
        self.recheck_after = self.calls_to_recheck()
        self.result = {"bytes": self.size_class, "itemsize": self.itemsize, "choice": best,
                       "prior": self.prior, "source": self.source,
                       "rounds": self.rounds - self.since,
                       "state_change": None if self.change is None else self.change + 1,
                       "shifts": [dict(x) for x in self.shifts],
                       "rechecks": self.rechecks, "recheck_after": self.recheck_after,
                       "medians": medians, "samples": {a: len(s) for a, s in per.items()},
                       "wins": wins, "in_doubt": doubt,
                       "times": {a: [float(t) for t in everything[:, j]]
                                 for j, a in enumerate(self.names)}}
        return best

    def calls_to_recheck(self) -> int:
        """Once committed: the class's calls before it learns again (AL_AUTO_RECHECK; doubled
        after a re-check that kept the choice, up to RECHECK_LONGEST times; NEVER: off)."""
        if self.recheck <= 0:
            return NEVER
        if self.rechecks == 0 or self.committed != self.prior:
            return self.recheck
        return min(2 * self.previous_wait, RECHECK_LONGEST * self.recheck)


class Learning:
    """The learners of one communicator: the launcher's chooser while AL_AUTO_LEARN is on.
    `explain(nbytes, itemsize)` is the Chooser's; `comm` an MPI communicator used by nothing
    else (the exchanges); `state` the CommState (a broken communicator ends a wait);
    `one_clock`: every rank runs on one machine (the samples' clock is the same on every
    rank)."""

    def __init__(self, explain, comm, state, rounds: int, one_clock: bool = False,
                 recheck: int = 0):
        self.explain = explain
        self.one_clock = one_clock
        self.comm = comm
        self.state = state
        self.rounds = rounds
        self.recheck = recheck              # AL_AUTO_RECHECK (rank 0's)
        self.learners = {}                  # (size class, itemsize) -> Learner

    def __call__(self, nbytes: int, itemsize: int):
        """The launcher's chooser: the class's Learner (the launcher asks it for each call's
        algorithm until it has committed)."""
        key = (size_class(nbytes), itemsize)
        learner = self.learners.get(key)
        if learner is None:
            # a cheap class learns CHEAP_ROUNDS times longer, and re-checks as much later
            scale = CHEAP_ROUNDS if key[0] <= CHEAP_BYTES else 1
            learner = Learner(self.exchange, nbytes, itemsize, self.explain(key[0], itemsize),
                              self.rounds * scale, self.one_clock, self.recheck * scale)
            self.learners[key] = learner
        return learner

    def recheck_class(self, old: Learner) -> Learner:
        """The committed class of `old` learns again (the launcher asks, at the same call of
        the class on every rank): a new Learner with `old`'s choice as its prior."""
        new = Learner(self.exchange, old.size_class, old.itemsize, None, old.first_rounds,
                      self.one_clock, old.recheck, old)
        self.learners[(old.size_class, old.itemsize)] = new
        return new

    def explain_learned(self, choice, nbytes: int, itemsize: int):
        """`choice` (the Chooser's, for explain) with what learning in use did for the class of
        `nbytes`: committed (to what, from which medians) or still learning."""
        learner = self.learners.get((size_class(nbytes), itemsize))
        if learner is None:
            return choice
        r = learner.result
        if r is None:
            if learner.previous_result is not None:
                return replace(choice, algorithm=learner.prior, source="learned",
                               detail=f"re-checking in use among {', '.join(learner.names)} "
                                      f"({learner.calls} calls so far; re-check "
                                      f"{learner.rechecks}); before: {choice}")
            return replace(choice, detail=choice.detail + f"; learning in use among "
                           f"{', '.join(learner.names)} ({learner.calls} calls so far)")
        medians = ", ".join(f"{a} {t * 1e6:.1f} us" for a, t in
                            sorted(r["medians"].items(), key=lambda kv: kv[1]))
        return replace(choice, algorithm=r["choice"], source="learned",
                       detail=f"learned in use for messages up to {r['bytes']} B (medians of "
                              f"the calls' times: {medians}); before: {choice}")

    def exchange(self, payload: np.ndarray) -> np.ndarray:
        """The max over ranks of `payload` (Learner.payload: spans, starts and ends), waited for
        at most AL_HANG_TIMEOUT (or until a peer breaks the communicator).  From the maxima
        every rank computes the same samples: a call costs the program what its slowest rank
        spends in it (the longest span; on one clock, the last rank's start to the last end).
        The min (the last rank to arrive) was tried first and is biased: with MPI's eager
        messages the early ranks' data is already waiting for the last one, so the
        point-to-point algorithms looked cheaper than they are
        (bench/results/issue31_acceptance.txt, 16-64 KiB)."""
        from mpi4py import MPI
        every = np.empty_like(payload)
        wait_exchange(self.comm.Iallreduce(payload, every, op=MPI.MAX), self.state,
                      "Allreduce (auto, AL_AUTO_LEARN)", "the exchange of what auto learned")
        return every

    def learned(self) -> list:
        """What was committed so far: one dict per size class (bytes: the class's power of two,
        itemsize, choice, prior: the table's choice, source, medians: seconds per contender,
        wins: per other contender (rounds faster than the prior, rounds compared),
        samples: how many timed calls each, rounds: the timed rounds decided on, state_change:
        the round they begin from where the machine changed state during learning (None: no
        change), in_doubt: the contenders whose contest with the prior was still in doubt at
        the longest schedule, where the prior stayed (a tie; empty otherwise), shifts: every
        shift of state_change's seen at a decision (round: where it began, 1-based; seconds:
        how long the rounds after it lasted; taken: whether it was the change, else a blip of
        under CHANGE_SECONDS let go), times: per contender its sample in each round (every
        round, before a change too), seconds, nan where none, rechecks: how many times the
        class had learned before this decision (0: the first), recheck_after: the class's
        calls from this decision to the next re-check).  A class that is re-checking reports
        its last decision."""
        out = []
        for key, lr in sorted(self.learners.items()):
            r = lr.result if lr.result is not None else lr.previous_result
            if r is not None:
                out.append(dict(r))
        return out


def wait_exchange(req, state, name: str, what: str) -> None:
    """Wait for the MPI request `req` of a library-internal exchange: raise if a peer broke the
    communicator (it will never join) or after AL_HANG_TIMEOUT."""
    timeout = config.hang_timeout()
    start = time.monotonic()
    polls = 0
    while not req.Test():
        polls += 1
        if polls % 64 == 0:
            why = state.broken
            if why is not None:
                raise Error(f"{name}: this communicator is unusable: {why}")
            if timeout is not None and time.monotonic() - start > timeout:
                raise TimeoutError(f"{name}: {what} not complete after {timeout:g} s (a peer "
                                   f"that never called?)")
        time.sleep(0 if polls < 1000 else 1e-4)


__all__ = ["Learner", "Learning", "contenders", "size_class", "transport"]
