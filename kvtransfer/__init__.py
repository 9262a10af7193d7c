"""Planned: see docs/architecture.md (services issue)."""
