"""Shared test helpers: where the real data in ../shared/data lives."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests import bert_reference

DATA = Path(os.environ.get("BERTFORGE_TEST_DATA", Path(__file__).parents[1] / ".." / "shared" / "data"))


def shared_data(relative: str) -> Path:
    """A file under ../shared/data, or a skip naming it when absent."""
    path = DATA / relative
    if not path.exists():
        pytest.skip(f"shared test data not found: {path} (set BERTFORGE_TEST_DATA)")
    return path
