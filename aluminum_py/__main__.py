"""``python -m aluminum_py bench crossover ...`` (under mpiexec), ``bench cluster ...`` (root:
an emulated cluster), ``bench map ...``, ``timeline merge|plot ...``."""
import sys

USAGE = """usage: python -m aluminum_py bench crossover [options]   (run under mpiexec)
       python -m aluminum_py bench map RUN.json [RUN.json ...] [--plot FILE.png]
       python -m aluminum_py bench overlap --model NAME --policy all   (run under mpiexec)
       python -m aluminum_py bench cluster --ranks N --nodes M [--rate 2gbit] [-- command ...]
       python -m aluminum_py plan libra --model NAME [options]
       python -m aluminum_py timeline merge RANK.json [RANK.json ...] -o ALL.json
       python -m aluminum_py timeline plot ALL.json -o STEP.png [--steps A-B]
Run a command with --help for its options."""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "bench":
        if argv[1] == "crossover":
            from .bench.crossover import main as crossover
            return crossover(argv[2:])
        if argv[1] == "overlap":
            from .bench.overlap import main as overlap
            return overlap(argv[2:])
        if argv[1] == "cluster":
            from .bench.cluster import main as cluster
            return cluster(argv[2:])
        if argv[1] == "map":
            from .bench.plots import map_main
            return map_main(argv[2:])
    if len(argv) >= 1 and argv[0] == "timeline":
        from .timeline.cli import main as timeline
        return timeline(argv[1:])
    if len(argv) >= 2 and argv[0] == "plan" and argv[1] == "libra":
        from .planning.cli import main as plan_libra
        return plan_libra(argv[2:])
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
