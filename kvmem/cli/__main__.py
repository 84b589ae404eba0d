"""`python -m kvmem.cli ...`, as the `kvmem` console script (replicas and servers are started so)."""

import sys

if __name__ == "__main__":  # guarded: multiprocessing "spawn" re-imports this module as __mp_main__
    from kvmem.cli import main

    sys.exit(main())
