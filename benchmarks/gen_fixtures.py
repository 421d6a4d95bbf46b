"""Generate every workload's fixture: ``python benchmarks/gen_fixtures.py``."""

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fixtures import main  # noqa: E402

if __name__ == "__main__":
    main()
