"""Prefill worker: computes prompts' KV and first tokens, and leases the blocks to decode."""
