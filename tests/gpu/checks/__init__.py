"""The bodies of the GPU checks, written for any device: tests/gpu/ and tools/gpu_check.sh's stages
(tools/bench_gpu.py, tools/grpo_precision.py, ...) run them on CUDA, tests/unit/tools/ runs them small
on CPU."""
