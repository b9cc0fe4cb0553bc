"""The Envoy protocol: the ext_proc gRPC server, its health service and its worker processes."""
