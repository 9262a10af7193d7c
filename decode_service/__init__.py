"""Decode worker: admits prefilled requests, pulls their KV, and streams the remaining tokens."""
