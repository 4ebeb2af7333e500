"""Serving backends behind one interface (base.Backend): the embedded engine and an upstream SGLang server."""

from .base import Backend, Chunk, GenParams, Job, KVCacheUsage, SpecStats

__all__ = ["Backend", "Chunk", "GenParams", "Job", "KVCacheUsage", "SpecStats"]
