"""Benchmarks of the NVIDIA backend's kernels, one module per kernel module of
``deepinfer_nvidia_sm100.kernels`` and named after it: each defines ``bench(device)``, which times
that module's ops (and, where installed, the peer libraries beside them: cuBLAS FP8, FlashMLA,
DeepGEMM) at DeepSeek-V3 and V2-Lite shapes and returns cases ``{name, shape, ms, bytes, flops}``.
They live here, outside the plugin, so that no kernel module imports a provider module (the
providers import the kernel modules). ``python -m benchmarks.kernels`` runs them and writes
kernels.json (see its docstring for the timing and the L2 handling).
"""
