"""The target tier: verifies draft tokens with the large model."""
