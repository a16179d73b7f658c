"""Speculative decoding: the draft proposers (proposers.py: n-gram and suffix; draft_model.py: a
draft model's), the rejection sampler that verifies drafts (rejection.py) and the verify-cost
model that chooses how many to verify (cost.py)."""
