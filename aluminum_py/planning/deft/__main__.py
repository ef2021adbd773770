"""``python -m aluminum_py.planning.deft``: the simulated iteration times on DeFT's Table II."""
from .tables import main

if __name__ == "__main__":
    main()
