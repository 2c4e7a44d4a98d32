"""The core: hooks by layer name, model state, layer lookup, targets and heatmap arithmetic.

Nothing here knows about CAM methods, files or pictures; every other part builds on it.
"""
