"""Framework adapters, installed as ``mesh_cp.integrations.<framework>``.

Each adapter uses only the public API of :mod:`mesh_cp` and its own framework; adapters never
import each other.
"""
