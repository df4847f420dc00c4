"""fakegood: an available backend, priority 50 (above the reference's 0), that provides two ops.

Its ops are written differently from the reference but follow the same contract, so a model
would run correctly on it; the other ten ops fall back to the reference. It also observes
engine steps, recording them in STEPS.
"""

from __future__ import annotations

from deepinfer_core.hookspecs import BackendInfo, ProbeResult, hookimpl

NAME = "fakegood"
STEPS: list = []


def rms_norm(x, weight, eps):
    import torch

    x32 = x.float()
    inv = 1.0 / torch.sqrt((x32 * x32).sum(-1, keepdim=True) / x.shape[-1] + eps)
    return (weight * (x32 * inv).to(x.dtype)).to(x.dtype)


def silu_and_mul(x):
    import torch

    half = x.shape[-1] // 2
    gate, up = x[..., :half], x[..., half:]
    return gate * torch.sigmoid(gate) * up


@hookimpl
def deepinfer_backend():
    return BackendInfo(
        name=NAME,
        priority=50,
        min_spec_version=3,
        max_spec_version=3,
        description="test fake: two ops of its own, the rest from the reference",
    )


@hookimpl
def deepinfer_probe():
    return ProbeResult(True, detail="fake device, always here")


@hookimpl
def deepinfer_platform():
    from deepinfer_core.platform import Platform

    return Platform(name="fake-good", device="cpu", backend=NAME)


@hookimpl
def deepinfer_ops(platform, model_config):
    return {"rms_norm": rms_norm, "silu_and_mul": silu_and_mul}


@hookimpl
def deepinfer_step_observer(stats):
    STEPS.append(stats)
