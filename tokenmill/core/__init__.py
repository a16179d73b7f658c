"""Pure-Python engine core: requests, blocks, KV-cache accounting and scheduling. No torch here."""
