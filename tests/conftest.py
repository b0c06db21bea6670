"""Shared fixtures: one small seeded problem, fast on two CPU cores."""

import pytest
import torch

import extkernels

N_REF = 500
GRID_SIDE = 6
N_FEATS = 4


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def p_ref():
    return extkernels.reference_cloud(N_REF, seed=0)


@pytest.fixture
def p_query():
    return extkernels.query_grid(GRID_SIDE)


@pytest.fixture
def feats():
    return extkernels.features(N_REF, N_FEATS, seed=0)


@pytest.fixture
def small_problem():
    """The CPU problem shrunk further, for timing and variant tests."""
    return extkernels.problem().with_sizes(
        n_ref=300, n_ref_radius=300, grid_side=4, n_warmup=1, n_iters=2
    )
