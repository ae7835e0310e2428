"""Shared building blocks of the example trainers (data sets, splits and loaders)."""
