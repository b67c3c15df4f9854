"""Shared by tests/cpu and tests/gpu. Pytest puts the folder of a conftest.py that is not in a package on
sys.path, so the helper modules beside this file (error_bounds, philox_reference) import by name from
either suite."""
