"""Speculative decoding: proposers (n-gram, draft model, EAGLE head) behind one protocol.

Verification (rejection sampling) is an op: `shared/ops/rejection_sampler.py`.
"""
