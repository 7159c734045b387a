"""Model runtime shared by the draft and target services (torch + transformers, no gRPC)."""
