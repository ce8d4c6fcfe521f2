"""Build steps for setup.py and make: build_hooks/grpc_stubs.py generates the gRPC stubs."""
