import os

import pytest
import torch

# Deterministic, and polite on a shared 2-core machine.
torch.manual_seed(0)
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

TINY = "n_layer=2,d_model=32,n_head=2"


@pytest.fixture
def tiny_gpt_overrides() -> str:
    return TINY


@pytest.fixture(autouse=True, scope="session")
def _basis_cache(tmp_path_factory):
    """The planner's basis cache (probes.fastbasis) in a directory of this test session, not ~/.cache."""
    os.environ["TRAINFIT_CACHE_DIR"] = str(tmp_path_factory.mktemp("trainfit-cache"))
    yield
