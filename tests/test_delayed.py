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
