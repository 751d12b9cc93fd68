"""Helpers for tests, demos and benchmarks of mesh_cp: local gloo groups, peak memory, expected errors, and
the tiny model shapes they share (:mod:`mesh_cp.testing.models`).

Not needed to train; nothing in :mod:`mesh_cp.runtime` imports it.
"""

from mesh_cp.testing.errors import expect_error
from mesh_cp.testing.memory import MemoryPeak
from mesh_cp.testing.spawn import gloo_exit_workaround, run_sections, section_results, spawn_gloo

__all__ = ["MemoryPeak", "expect_error", "gloo_exit_workaround", "run_sections", "section_results", "spawn_gloo"]
