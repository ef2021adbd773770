"""Planners for gradient communication: LIBRA (contention-aware threads), OSF, DeFT; the model zoo."""
