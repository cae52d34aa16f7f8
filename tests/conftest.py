import os

import pytest
import torch

# Without a GPU every Triton kernel runs in Triton's interpreter on CPU tensors.
# Set before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests skip without CUDA; ``distributed`` is every test under tests/distributed."""
    for item in items:
        if "/distributed/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.distributed)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def pytest_configure(config):
    """A checkout run without ``pip install`` (a GPU machine) has no entry point: register the backend by name."""
    import torch._dynamo

    if "moe_fuse" not in torch._dynamo.list_backends(exclude_tags=()):
        from torch._dynamo.backends.registry import register_backend

        from moe_fuse.backend import moe_fuse_backend

        register_backend(name="moe_fuse", compiler_fn=moe_fuse_backend)
