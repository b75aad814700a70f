"""Shared test fixtures. Data from ../shared is optional: tests that need it skip cleanly."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
DRIVELM = SHARED / "drivelm_sample"


@pytest.fixture(scope="session")
def drivelm_dir() -> Path:
    if not (DRIVELM / "samples").is_dir():
        pytest.skip("../shared/drivelm_sample is absent")
    return DRIVELM
