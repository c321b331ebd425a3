"""Engines the sidecar talks to: the engine client, vLLM metrics and the vLLM emulator."""
