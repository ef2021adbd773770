"""DeFT pieces for the synchronizer (single process)."""
import pytest

from aluminum_py.overlap.delayed import Piece, split_pieces


def test_pieces_forward_order_and_partition():
    cost = lambda n: 1e-4 + n * 1e-6             # noqa: E731
    # launch order: bucket 0 is ready first; it is DeFT's last item
    pieces, comm, fwd, bwd = split_pieces([100, 1000], [4, 4], cost, [1e-3, 1e-3], [2e-3, 2e-3])
    limit = min(2e-3, 4e-3)
    assert all(c <= limit for c in comm)
    assert pieces[-1] == Piece(0, 0, 100) and comm[-1] == cost(400)
    big = [p for p in pieces if p.bucket == 1]
    assert len(big) == 4                              # 4000 B: 4.1 ms -> four pieces of 1.1 ms
    assert [p.start for p in big] == [0, 250, 500, 750] and big[-1].stop == 1000
    # the bucket's compute goes to its last piece in forward order
    assert fwd[:4] == [0, 0, 0, 1e-3] and bwd[:4] == [0, 0, 0, 2e-3]
    assert sum(p.stop - p.start for p in pieces) == 1100


def test_pieces_without_forward_times_use_backward_and_errors():
    cost = lambda n: n * 1e-6                     # noqa: E731
    pieces, comm, _, _ = split_pieces([3000], [1], cost, [0.0], [1e-3])
    assert len(pieces) == 4 and max(comm) <= 1e-3
    with pytest.raises(ValueError, match="exceeds"):
        split_pieces([10], [8], lambda n: 1.0, [1e-3], [1e-3])
    with pytest.raises(ValueError, match="compute_times"):
        split_pieces([10], [8], cost, [0.0], [0.0])


def test_measured_profile_of_one_step():
    """aluminum_py.overlap.profiled.measure: backward times from grad_ready timestamps."""
    from aluminum_py.overlap.profiled import measure
    ready = [10.0, 9.5, 9.25, 9.0]              # model order; backward runs 3, 2, 1, 0
    # with begin_backward at 8.5: the first gradient took 0.5 s, the forward pass 8.5 - 8.0
    compute, forward = measure(ready, 8.5, 8.0, [8, 8, 8, 8])
    assert compute == [0.5, 0.25, 0.25, 0.5] and forward == 0.5
    # without it: D = 1.0 from the previous wait(), the rest of backward B = 1.0; the first
    # gradient gets (2D - B) / 3 and the forward pass the rest of D
    compute, forward = measure(ready, None, 8.0, [8, 8, 8, 8])
    assert compute[:3] == [0.5, 0.25, 0.25]
    assert compute[3] == pytest.approx(1 / 3) and forward == pytest.approx(2 / 3)
    # a gradient reported before its predecessor in backward order counts 0
    compute, _ = measure([9.0, 9.5, 9.25, 9.0], 8.5, 8.0, [8, 8, 8, 8])
    assert compute[:3] == [0.0, 0.25, 0.25]
