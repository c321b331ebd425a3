"""What the sidecar talks to: the engine client, vLLM's metrics, and the async driver of the scheduler."""
