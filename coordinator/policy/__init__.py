"""The coordinator's policy."""
