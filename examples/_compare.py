"""Shared by the examples: report data-parallel vs single-process training and decide the exit
status (0 only if the parameters match within `tol` and are identical on every rank)."""
import sys


def verdict(steps, final_loss, diff, spread, tol, elapsed) -> int:
    print(f"after {steps} steps: final full-batch loss {final_loss:.6f}; "
          f"max |data-parallel - single-process| = {diff:.3e} (tol {tol:.0e}); "
          f"max difference between ranks = {spread:.3e}; "
          f"{elapsed / max(1, steps) * 1e3:.2f} ms/step", flush=True)
    if not diff <= tol:
        print("FAIL: data-parallel parameters differ from single-process training", file=sys.stderr)
        return 1
    if spread != 0.0:
        print("FAIL: parameters differ between ranks", file=sys.stderr)
        return 1
    print("OK", flush=True)
    return 0
