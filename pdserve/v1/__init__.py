"""Generated protobuf and gRPC code for ``proto/pdserve/v1`` (``make proto``; do not edit)."""
