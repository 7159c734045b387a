"""The coordinator's api."""
