import os

import pytest
import torch

# Without a GPU every Triton kernel runs in Triton's interpreter on CPU tensors.
# Set before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Folders whose tests compile whole models, spawn process groups or run benchmark scripts: ``-m "not slow"``
# leaves them out for a quick run.
SLOW_FOLDERS = ("e2e", "distributed", "bench")


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests skip without CUDA; ``distributed`` is every test under tests/distributed; ``slow`` every test
    under SLOW_FOLDERS."""
    for item in items:
        folder = os.path.relpath(str(item.fspath), os.path.dirname(__file__)).split(os.sep)[0]
        if folder == "distributed":
            item.add_marker(pytest.mark.distributed)
        if folder in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def pytest_configure(config):
    """A checkout run without ``pip install`` (a GPU machine) has no entry point: register the backend by name."""
    import torch._dynamo

    if "moe_fuse" not in torch._dynamo.list_backends(exclude_tags=()):
        from torch._dynamo.backends.registry import register_backend

        from moe_fuse.backend import moe_fuse_backend

        register_backend(name="moe_fuse", compiler_fn=moe_fuse_backend)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles afresh: Dynamo's per-function cache (8 entries) would otherwise fill across tests that
    compile the same model code, and a full cache runs the function uncompiled, silently."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
