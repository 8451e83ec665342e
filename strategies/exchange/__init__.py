"""Gradient exchanges shared by the strategies: bucketed all-reduce overlapped with backward
(`buckets`) and the row-sparse exchange of embedding gradients (`sparse_gradients`).
"""
