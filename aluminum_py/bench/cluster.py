"""``python -m aluminum_py bench cluster --ranks N --nodes M --rate 2gbit [-- command ...]``:
emulate M nodes on this machine and run a command (default: the crossover sweep) across them
under mpiexec (root only; docs/cluster.md).

Each node is a network namespace with one veth "NIC" whose other end is on a bridge in a hub
namespace, shaped both ways with tc's tbf, plus a UTS namespace holding the node's hostname.
A rank wrapper script enters the namespaces of its rank's node (``$PMI_RANK``) and execs the
command; Hydra's PMI connection is an inherited descriptor, so mpiexec itself stays outside.
MPICH is told which ranks share a node (block cliques; ``MPIR_CVAR_NOLOCAL`` with one rank per
node) and UCX to talk TCP over the NIC only.  Names carry a random run id, so a leftover never
collides with a new run; teardown always runs (try/finally; SIGINT and SIGTERM are turned into
exceptions).  Afterwards the bytes each NIC sent and received (``tc -s qdisc``) are reported,
next to what the algorithm must move when ``--expect-algorithm`` is given.

:class:`Emulation` only plans (names, commands, the wrapper, the environment) and is tested
without root; :func:`run` executes a plan.
"""
from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field

from .timing import human, parse_bytes

@dataclass(frozen=True)
class Emulation:
    """The plan of one emulated cluster: `ranks` ranks in blocks over `nodes` nodes."""

    ranks: int
    nodes: int
    rate: str = "2gbit"
    run_id: str = field(default_factory=lambda: secrets.token_hex(3))
    burst: str = "64kb"
    latency: str = "100ms"      # tbf's queue limit, not added latency (netem is not available)

    def __post_init__(self):
        if self.nodes < 1 or self.ranks < self.nodes:
            raise ValueError(f"--nodes {self.nodes}: need 1 <= nodes <= ranks ({self.ranks})")
        if self.ranks % self.nodes:
            raise ValueError(f"--ranks {self.ranks} is not a multiple of --nodes {self.nodes} "
                             f"(ranks are placed in equal blocks, as MPICH's block cliques are)")
        if not re.fullmatch(r"[0-9a-f]{1,6}", self.run_id):
            raise ValueError(f"run id {self.run_id!r}: 1 to 6 hex digits")

    # ------------------------------------------------------------------ names
    @property
    def per_node(self) -> int:
        return self.ranks // self.nodes

    @property
    def tag(self) -> str:
        return f"al{self.run_id}"

    @property
    def hub(self) -> str:
        return f"{self.tag}hub"

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def rundir(self) -> str:
        return f"/run/aluminum_py-cluster-{self.run_id}"

    @property
    def wrapper_path(self) -> str:
        return f"{self.rundir}/rank"

    def ns(self, node: int) -> str:
        return f"{self.tag}n{node}"

    def nic(self, node: int) -> str:
        """The node's NIC (in the node's namespace); interface names are at most 15 bytes."""
        return f"{self.tag}e{node}"

    def port(self, node: int) -> str:
        """The NIC's other end, on the hub's bridge."""
        return f"{self.tag}p{node}"

    def uts(self, node: int) -> str:
        return f"{self.rundir}/uts{node}"

    def hostname(self, node: int) -> str:
        return f"{self.tag}-node{node}"

    def address(self, node: int) -> str:
        return f"10.77.{node // 250}.{node % 250 + 1}/16"

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def layout(self) -> tuple[int, ...]:
        return tuple(self.node_of(r) for r in range(self.ranks))

    # ------------------------------------------------------------------ commands
    def _tbf(self, ns: str, dev: str) -> list[str]:
        return ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                "rate", self.rate, "burst", self.burst, "latency", self.latency]

    def setup_commands(self) -> list[list[str]]:
        """Commands that build the emulation, in order (each must succeed)."""
        cmds = [["mkdir", "-p", self.rundir],
                ["ip", "netns", "add", self.hub],
                ["ip", "-n", self.hub, "link", "add", self.bridge, "type", "bridge"],
                ["ip", "-n", self.hub, "link", "set", self.bridge, "up"]]
        for i in range(self.nodes):
            ns = self.ns(i)
            cmds += [["ip", "netns", "add", ns],
                     ["ip", "-n", ns, "link", "set", "lo", "up"],
                     ["ip", "link", "add", self.nic(i), "netns", ns, "type", "veth",
                      "peer", "name", self.port(i), "netns", self.hub],
                     ["ip", "-n", ns, "addr", "add", self.address(i), "dev", self.nic(i)],
                     ["ip", "-n", ns, "link", "set", self.nic(i), "up"],
                     ["ip", "-n", self.hub, "link", "set", self.port(i), "master", self.bridge],
                     ["ip", "-n", self.hub, "link", "set", self.port(i), "up"],
                     self._tbf(ns, self.nic(i)),             # what the node sends
                     self._tbf(self.hub, self.port(i)),      # what the node receives
                     ["touch", self.uts(i)],
                     ["unshare", f"--uts={self.uts(i)}", "hostname", self.hostname(i)]]
        return cmds

    def teardown_commands(self) -> list[list[str]]:
        """Commands that remove everything setup made, each tried even if another fails
        (deleting a namespace deletes its veth ends and qdiscs)."""
        cmds = []
        for i in range(self.nodes):
            cmds += [["umount", self.uts(i)], ["ip", "netns", "del", self.ns(i)]]
        return cmds + [["ip", "netns", "del", self.hub], ["rm", "-rf", self.rundir]]

    def wrapper_script(self) -> str:
        """The rank wrapper: enter the namespaces of $PMI_RANK's node, export its NIC, exec."""
        lines = ["#!/bin/sh", "# aluminum_py bench cluster: rank -> node namespaces",
                 'case "$PMI_RANK" in']
        for i in range(self.nodes):
            ranks = "|".join(str(r) for r in range(self.ranks) if self.node_of(r) == i)
            lines.append(f"  {ranks}) NODE_NS={self.ns(i)}; NODE_UTS={self.uts(i)}; "
                         f"NODE_NIC={self.nic(i)} ;;")
        lines += ['  *) echo "rank wrapper: no node for PMI_RANK=$PMI_RANK" >&2; exit 2 ;;',
                  "esac",
                  'export UCX_NET_DEVICES="$NODE_NIC"',
                  # ip netns exec, not nsenter --net: it also mounts the namespace's /sys, where
                  # UCX looks for the NIC
                  'exec nsenter --uts="$NODE_UTS" -- ip netns exec "$NODE_NS" "$@"', ""]
        return "\n".join(lines)

    def rank_env(self) -> dict[str, str]:
        """Environment of every rank (mpiexec passes its own on): TCP over the NIC for UCX,
        and which ranks share a node for MPICH (shared memory inside a node only)."""
        env = {"UCX_TLS": "tcp,self",
               # without it UCX's rendezvous handshake halves large-message throughput when
               # ranks outnumber cores
               "UCX_RNDV_THRESH": "inf"}
        if self.per_node == 1:
            env["MPIR_CVAR_NOLOCAL"] = "1"
        else:
            # Hydra sees one host; block cliques make MPICH (and MPI_Comm_split_type(SHARED))
            # see `nodes` nodes of consecutive ranks
            env.update(MPIR_CVAR_NUM_CLIQUES=str(self.nodes), MPIR_CVAR_CLIQUES_BY_BLOCK="1")
        return env

    def mpiexec_command(self, command: list[str], mpiexec: str = "mpiexec") -> list[str]:
        return [mpiexec, "-n", str(self.ranks), self.wrapper_path, *command]

    def counter_commands(self) -> list[tuple[int, str, list[str]]]:
        """(node, "sent" or "received", tc command) per NIC direction."""
        out = []
        for i in range(self.nodes):
            out.append((i, "sent", ["ip", "netns", "exec", self.ns(i), "tc", "-s", "qdisc",
                                    "show", "dev", self.nic(i)]))
            out.append((i, "received", ["ip", "netns", "exec", self.hub, "tc", "-s", "qdisc",
                                        "show", "dev", self.port(i)]))
        return out


def sent_bytes(tc_output: str) -> int:
    """The byte counter of the root qdisc in ``tc -s qdisc show dev X`` output."""
    m = re.search(r"Sent (\d+) bytes", tc_output)
    if m is None:
        raise ValueError(f"no 'Sent N bytes' in tc output: {tc_output!r}")
    return int(m.group(1))


def expected_nic_bytes(algorithm: str, layout, count: int, itemsize: int,
                       inplace: bool = False) -> list[tuple[int, int]]:
    """Per node (numbered as in :func:`topology.canonical_layout`), the payload bytes its NIC must
    send and receive for one allreduce of `count` elements: the sum over every rank's schedule
    (``schedules.build``) of the transfers between ranks on different nodes.  Headers (TCP, IP,
    Ethernet) come on top on the wire."""
    from .. import schedules
    from ..topology import canonical_layout
    layout = canonical_layout(layout)
    p = len(layout)
    sent = [0] * (max(layout) + 1)
    received = [0] * len(sent)
    for r in range(p):
        steps, _ = schedules.build(algorithm, p, r, count, inplace,
                                   layout if algorithm in schedules.NEEDS_LAYOUT else None)
        for st in steps:
            if st.send_peer >= 0 and layout[st.send_peer] != layout[r]:
                sent[layout[r]] += st.send_cnt * itemsize
                received[layout[st.send_peer]] += st.send_cnt * itemsize
    return list(zip(sent, received))


# ---------------------------------------------------------------------------- running
class _Stop(Exception):
    """Raised by the signal handlers, so that teardown runs."""


def _run_all(cmds, check: bool) -> list[str]:
    """Run commands in order; with check, stop at the first failure (raised), else collect."""
    errors = []
    for cmd in cmds:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            msg = f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}"
            if check:
                raise RuntimeError(msg)
            errors.append(msg)
    return errors


def counters(emu: Emulation) -> dict[tuple[int, str], int]:
    out = {}
    for node, way, cmd in emu.counter_commands():
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[(node, way)] = sent_bytes(proc.stdout)
    return out


def check_root() -> str | None:
    """Why the emulation cannot run here, or None."""
    if os.geteuid() != 0:
        return "bench cluster: must run as root (it creates network namespaces and tc qdiscs)"
    for tool in ("ip", "tc", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"bench cluster: {tool!r} not found (iproute2, util-linux)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode:
        return "bench cluster: 'ip netns' does not work here"
    return None


def run(emu: Emulation, command: list[str], mpiexec: str = "mpiexec", timeout=None,
        log=print) -> tuple[int, dict[tuple[int, str], int]]:
    """Set up `emu`, run `command` on every rank under mpiexec through the wrapper, tear down.
    Returns (mpiexec's exit status, bytes per (node, "sent"/"received") from tc)."""
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def stop(signum, frame):
        raise _Stop(signal.Signals(signum).name)

    for s in old:
        signal.signal(s, stop)
    proc = None
    try:
        _run_all(emu.setup_commands(), check=True)
        with open(emu.wrapper_path, "w") as f:
            f.write(emu.wrapper_script())
        os.chmod(emu.wrapper_path, 0o755)
        before = counters(emu)
        # its own session: a signal for us reaches the ranks only through the handler below
        proc = subprocess.Popen(emu.mpiexec_command(command, mpiexec),
                                env=dict(os.environ, **emu.rank_env()), start_new_session=True)
        rc = proc.wait(timeout=timeout)
        after = counters(emu)
        return rc, {k: after[k] - before[k] for k in after}
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        errors = _run_all(emu.teardown_commands(), check=False)
        for e in errors:
            if "No such file" not in e and "not mounted" not in e:
                log(f"bench cluster: teardown: {e}", file=sys.stderr)
        for s, h in old.items():
            signal.signal(s, h)


def report(emu: Emulation, measured, expected=None) -> str:
    """The per-NIC table: measured bytes (tc, payload plus headers) and expected payload."""
    rows = [f"{'node':>4} {'nic':>12} {'sent':>14} {'received':>14}"
            + (f" {'expected sent':>14} {'expected recv':>14} {'wire/payload':>12}"
               if expected else "")]
    for i in range(emu.nodes):
        s, r = measured[(i, "sent")], measured[(i, "received")]
        line = f"{i:>4} {emu.nic(i):>12} {s:>14} {r:>14}"
        if expected:
            es, er = expected[i]
            ratio = f"{(s + r) / (es + er):.3f}" if es + er else "-"
            line += f" {es:>14} {er:>14} {ratio:>12}"
        rows.append(line)
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m aluminum_py bench cluster",
        description="Emulate a cluster (network namespaces, shaped veth links) and run a command "
                    "on it under mpiexec (default: the crossover sweep). Root only.")
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--rate", default="2gbit", help="per NIC and direction, tc units (2gbit)")
    ap.add_argument("--burst", default="64kb", help="tbf burst (default 64kb)")
    ap.add_argument("--mpiexec", default=None, help="mpiexec to use (default: next to python)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds for the command")
    ap.add_argument("--expect-algorithm", default=None,
                    help="report the bytes this algorithm must move per NIC next to tc's")
    ap.add_argument("--expect-bytes", default="64MiB", help="message size of --expect-algorithm")
    ap.add_argument("--expect-calls", type=int, default=1, help="allreduce calls the command makes")
    ap.add_argument("--dtype", default="float32", help="element type of --expect-bytes")
    ap.add_argument("command", nargs=argparse.REMAINDER,
                    help="-- command ... (default: python -m aluminum_py bench crossover)")
    return ap


def default_mpiexec() -> str:
    return (shutil.which("mpiexec", path=os.path.dirname(sys.executable))
            or shutil.which("mpiexec") or "mpiexec")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        command = [sys.executable, "-m", "aluminum_py", "bench", "crossover"]
    try:
        emu = Emulation(args.ranks, args.nodes, args.rate, burst=args.burst)
    except ValueError as e:
        print(f"bench cluster: {e}", file=sys.stderr)
        return 2
    why = check_root()
    if why:
        print(why, file=sys.stderr)
        return 2
    expected = None
    if args.expect_algorithm:
        import numpy as np
        itemsize = np.dtype(args.dtype).itemsize
        per_call = expected_nic_bytes(args.expect_algorithm, emu.layout(),
                                      parse_bytes(args.expect_bytes) // itemsize, itemsize)
        expected = [(s * args.expect_calls, r * args.expect_calls) for s, r in per_call]
    print(f"bench cluster: {emu.ranks} ranks on {emu.nodes} nodes ({emu.per_node} per node), "
          f"{emu.rate} per NIC and direction, run id {emu.run_id}", flush=True)
    try:
        rc, measured = run(emu, command, args.mpiexec or default_mpiexec(), args.timeout)
    except _Stop as e:
        print(f"bench cluster: stopped by {e}; torn down", file=sys.stderr)
        return 130
    except subprocess.TimeoutExpired:
        print(f"bench cluster: the command ran past --timeout {args.timeout:g} s; stopped and "
              f"torn down", file=sys.stderr)
        return 124
    except RuntimeError as e:
        print(f"bench cluster: setup failed: {e}", file=sys.stderr)
        return 1
    what = (f" (expected: {args.expect_calls} x {args.expect_algorithm} of "
            f"{human(parse_bytes(args.expect_bytes))}, payload only)" if expected else "")
    print(f"bytes per NIC from tc{what}:\n{report(emu, measured, expected)}")
    return rc
