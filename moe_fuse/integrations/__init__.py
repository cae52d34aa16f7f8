"""Integrations with other libraries (imported on demand, never by ``import moe_fuse``)."""
