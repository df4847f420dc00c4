"""DeepInfer backend for NVIDIA sm_90 (H100/H200) and sm_100 (B200/B300/GB200) GPUs.

The backend module, registered as the ``nvidia`` entry point of the ``deepinfer.backends``
group, is ``deepinfer_nvidia_sm100.backend``. This package imports nothing at import time.
"""

__version__ = "0.1.0"
