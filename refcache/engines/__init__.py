"""Adapters that drive other engines' own HiCache code through the operation alphabet."""
