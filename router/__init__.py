"""Router: the public Generate API; picks workers, relays tokens, detokenizes."""
