"""Where the repository is, for tests that read its files or run its scripts."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def python_path(*first: os.PathLike | str) -> str:
    """A subprocess's PYTHONPATH: ``first`` (default the repository), then the caller's own, so packages
    the caller finds only through its PYTHONPATH (a GPU machine's wheels) are found there too."""
    parts = [str(p) for p in (first or (REPO,))]
    return os.pathsep.join([*parts, *filter(None, [os.environ.get("PYTHONPATH")])])
