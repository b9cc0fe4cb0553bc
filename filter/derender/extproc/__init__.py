"""The Envoy protocol: the ext_proc gRPC server and what an exchange asks of it."""
