"""``python -m pdserve.cli``: the command line lives in ``pdserve.app.cli``."""

from __future__ import annotations

import sys

from pdserve.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
