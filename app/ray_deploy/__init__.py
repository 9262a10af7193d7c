"""pdserve on a Ray cluster: Ray places and restarts the same services as process mode."""
