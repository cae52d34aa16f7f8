"""moe_fuse: a torch.compile backend that fuses Mixture-of-Experts blocks.

Use it as ``torch.compile(model, backend="moe_fuse")`` (registered through the
``torch_dynamo_backends`` entry point; no import needed). This module stays
small and imports torch lazily: ``TORCH_LOGS=+moe_fuse`` imports it while
``import torch`` is still running.
"""

__all__ = ["config", "explain", "moe_fuse_backend", "register_experts_implementation"]


def __getattr__(name):
    if name == "explain":
        from .backend import explain

        return explain
    if name == "moe_fuse_backend":
        from .backend import moe_fuse_backend

        return moe_fuse_backend
    if name == "config":
        import importlib

        return importlib.import_module(".config", __name__)
    if name == "register_experts_implementation":
        from .integrations.transformers import register_experts_implementation

        return register_experts_implementation
    raise AttributeError(f"module 'moe_fuse' has no attribute {name!r}")
