"""Cluster state shared through Redis: the prefix-cache index (and, next, the worker registry).

Redis accelerates routing; it is never needed for correctness.
"""
