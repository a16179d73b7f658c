"""Speculative decoding: draft proposers (the rejection sampler is `Sampler.verify`)."""
