"""Print pip constraints pinning each version-bounded dependency to its declared lowest.

CI's "lowest" lane installs with these, so a lower bound in pyproject.toml is
one that CI has tested: lowering it there moves the lane with it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

# The dependencies whose internals or APIs we build on: each one's lowest is tested.
BOUNDED = ("transformers", "langchain-core", "llama-index-core")


def main() -> None:
    project = tomllib.loads(Path(sys.argv[1]).read_text())["project"]
    for requirement in project["dependencies"]:
        name = re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0]
        if name in BOUNDED:
            lowest = re.search(r">=\s*([\w.]+)", requirement)
            if lowest is None:
                sys.exit(f"{requirement!r} declares no lower bound")
            print(f"{name}=={lowest.group(1)}")


if __name__ == "__main__":
    main()
