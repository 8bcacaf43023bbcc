"""Experiment configs (ml_collections); every config starts from default.py and overrides fields."""
