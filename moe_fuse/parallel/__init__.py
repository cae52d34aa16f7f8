"""Distributed building blocks for MoE models (expert parallelism). See ``ep``."""

from .ep import shard_experts

__all__ = ["shard_experts"]
