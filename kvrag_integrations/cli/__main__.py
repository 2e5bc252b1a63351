"""``python -m kvrag_integrations.cli``: the ``kvrag`` command line."""

from __future__ import annotations

import sys

from kvrag_integrations.cli import main

if __name__ == "__main__":
    sys.exit(main())
