"""One step's flow: the autograd hooks, gradients collected into buckets, the local route, speculation, the host worker and its jobs, the waits, and step()'s validation and commit."""
