"""The draft tier: proposes γ tokens per round from a small model."""
