"""gRPC plumbing shared by the three servers: status mapping, server set-up, pb conversion."""
