"""The reference backend: the ops of ``deepinfer_core.ops`` in plain PyTorch, on any torch device.

Registered through the same entry point as any vendor backend (``deepinfer.backends``:
``reference``); selected with DEEPINFER_ACCELERATOR=cpu (or ``reference``) and chosen
automatically when no faster backend can run. Its platform is the CPU; the ops themselves are
device-agnostic, so other backends may fall back to them on their own device.
"""

from __future__ import annotations

from deepinfer_core.hookspecs import SPEC_VERSION, BackendInfo, ProbeResult, hookimpl

NAME = "reference"


@hookimpl
def deepinfer_backend() -> BackendInfo:
    return BackendInfo(
        name=NAME,
        priority=0,
        min_spec_version=SPEC_VERSION,  # the core's own backend speaks exactly the core's version
        max_spec_version=SPEC_VERSION,
        aliases=("cpu",),
        description="pure PyTorch reference ops (ground truth; CPU or any torch device)",
    )


@hookimpl
def deepinfer_probe() -> ProbeResult:
    return ProbeResult(True, detail="CPU, pure PyTorch")


@hookimpl
def deepinfer_platform():
    from deepinfer_core.platform import Platform

    return Platform(name="cpu-reference", device="cpu", backend=NAME, batch_invariant=True,
                    fp8_kv_cache=True)  # write_cache / sparse_attention take V4 FP8 KV records


@hookimpl
def deepinfer_ops(platform, model_config, batch_invariant):
    from deepinfer_core.ops import reference_ops

    return reference_ops(batch_invariant)
