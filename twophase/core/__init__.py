"""Backend-agnostic core: requests, KV-cache accounting, scheduling, sampling, the step loop."""
