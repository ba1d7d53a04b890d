"""Benchmarking: serving metrics as vLLM defines them, workloads and runners, the roofline, the `bench` command."""
