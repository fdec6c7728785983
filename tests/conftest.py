"""Test setup: Triton's interpreter on machines without CUDA, and the `gpu` marker."""
import os

import torch

if not torch.cuda.is_available():
    # Must happen before anything imports triton: kernels then run on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on an H100/H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def registered_backend():
    """Register attention backends for one test (by name, as a user would); removed afterwards."""
    from fullgraph.attention.backends import register_backend, unregister_backend

    names = []

    def register(cls):
        register_backend(cls)
        names.append(cls.name)
        return cls

    yield register
    for name in names:
        unregister_backend(name)
