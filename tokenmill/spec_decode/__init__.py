"""Speculative decoding: the draft proposers (proposers.py: n-gram and suffix; draft_model.py: a
draft model's), the rejection sampler that verifies drafts (rejection.py) and the step cost
measured at start (cost.py), from which core/draft_plan.py chooses how many to verify."""
