"""Generated protobuf / gRPC stubs for specdec.v1 (see protos/generate.py)."""
