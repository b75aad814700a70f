"""Shared test fixtures, for the tests of every folder (their helpers are the `helpers` package beside
this file; pytest.ini puts tests/ on the import path). Data from ../shared is optional: tests that need
it skip cleanly."""

from __future__ import annotations

from pathlib import Path

import pytest

import litevlm_runtime  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads; threads.py)

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
DRIVELM = SHARED / "drivelm_sample"


@pytest.fixture(scope="session", autouse=True)
def digest_cache(tmp_path_factory):
    """Digests of verified model files go to a folder of this session, not the user's ~/.cache/litevlm
    (subprocesses the tests start inherit it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LITEVLM_CACHE", str(tmp_path_factory.mktemp("litevlm_cache")))
        yield


@pytest.fixture(scope="session")
def drivelm_dir() -> Path:
    if not (DRIVELM / "samples").is_dir():
        pytest.skip("../shared/drivelm_sample is absent")
    return DRIVELM


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A random-weight checkpoint of the `tiny` preset in the real InternVL2.5 layout."""
    from helpers import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("models") / "tiny")


# The fleet's (tests/fleet/): small bags of the DriveLM sample and the node parameters on the tiny model,
# built once per test module that asks for them.
@pytest.fixture(scope="module")
def bags(tmp_path_factory, drivelm_dir):
    from helpers.fleet import make_bags

    return make_bags(tmp_path_factory.mktemp("bags"), drivelm_dir)


@pytest.fixture(scope="module")
def params(tiny_model):
    from helpers.fleet import tiny_params

    return tiny_params(tiny_model)
