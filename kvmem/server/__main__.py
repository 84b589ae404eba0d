"""`python -m kvmem.server [--host --port --home --model --config ...]`."""

import sys

if __name__ == "__main__":  # guarded: multiprocessing "spawn" re-imports this module as __mp_main__
    from kvmem.server import main

    sys.exit(main())
