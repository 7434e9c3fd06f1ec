"""Test setup: Triton runs in its interpreter when no GPU is present; `gpu` and `slow` markers."""
import os

import torch

# Must happen before anything imports triton: the interpreter is chosen at import time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite tests/golden/*.json from this machine's results (a deliberate act: "
                          "say in the commit message why the numbers moved)")


@pytest.fixture(autouse=True, scope="session")
def user_cache(tmp_path_factory):
    """The default dataset cache (data.cache_dir=auto) of this test session: a temporary folder, so
    that no test reads or fills the user's own cache. Subprocesses inherit it through the environment."""
    with pytest.MonkeyPatch.context() as mp:
        folder = tmp_path_factory.mktemp("user-cache")
        mp.setenv("SCAFFOLD_CACHE", str(folder))
        yield folder


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A dataset cache folder shared by the tests of one module (each dataset is generated once)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def update_golden(request):
    return request.config.getoption("--update-golden")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped cleanly without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on the 2-core CPU machine")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
