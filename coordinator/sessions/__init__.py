"""The coordinator's sessions."""
