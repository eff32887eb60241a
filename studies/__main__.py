"""Entry point: ``python -m studies list`` / ``python -m studies run NAME|all [--quick] ...``."""

import sys

from studies._engine import main

if __name__ == "__main__":
    sys.exit(main())
