"""DeepInfer backend for Huawei Ascend 950 NPUs.

The backend module, registered as the ``ascend`` entry point of the ``deepinfer.backends``
group, is ``deepinfer_ascend_950.backend``. This package imports nothing at import time, and
nothing in it imports ``torch_npu`` except ``backend.deepinfer_platform`` and, inside each call,
the op callables of ``npu_ops`` (the stock CANN operators); ``op_plan`` says op by op what runs.
"""

__version__ = "0.1.0"
