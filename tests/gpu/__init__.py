"""Data-plane tests (see conftest.py)."""
