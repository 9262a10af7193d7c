"""``pdserve bench``: a load generator for the public Generate API, measured at the client."""
