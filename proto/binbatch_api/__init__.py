"""binbatch gRPC API (generated stubs). Built in the sidecar issue."""
