"""Benchmark metrics as the public benchmarks define them: TOFU, MUSE and WMDP-style accuracy."""
