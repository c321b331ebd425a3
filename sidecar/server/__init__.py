"""The sidecar process: gRPC servicers and the wiring of config, core and engine."""
