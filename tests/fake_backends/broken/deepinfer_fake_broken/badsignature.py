"""fakebadsignature: its rms_norm takes (x, weight) where the contract is (x, weight, eps)."""

from deepinfer_core.hookspecs import BackendInfo, ProbeResult, hookimpl


def rms_norm(x, weight):
    return x * weight


@hookimpl
def deepinfer_backend():
    return BackendInfo(name="fakebadsignature", priority=-5, min_spec_version=3, max_spec_version=3)


@hookimpl
def deepinfer_probe():
    return ProbeResult(True, detail="fake")


@hookimpl
def deepinfer_platform():
    from deepinfer_core.platform import Platform

    return Platform(name="fake-bad-signature", device="cpu", backend="fakebadsignature")


@hookimpl
def deepinfer_ops(platform, model_config):
    return {"rms_norm": rms_norm}
