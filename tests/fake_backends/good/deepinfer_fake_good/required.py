"""fakerequired: available, but declares mla_decode_attention as required and does not provide it."""

from deepinfer_core.hookspecs import BackendInfo, ProbeResult, hookimpl

NAME = "fakerequired"


@hookimpl
def deepinfer_backend():
    return BackendInfo(
        name=NAME,
        priority=10,
        min_spec_version=3,
        max_spec_version=3,
        required_ops=frozenset({"mla_decode_attention"}),
        description="test fake: requires an op it lacks",
    )


@hookimpl
def deepinfer_probe():
    return ProbeResult(True, detail="fake")


@hookimpl
def deepinfer_platform():
    from deepinfer_core.platform import Platform

    return Platform(name="fake-required", device="cpu", backend=NAME)


@hookimpl
def deepinfer_ops(platform, model_config):
    from deepinfer_core.ops import REFERENCE_OPS

    return {"rms_norm": REFERENCE_OPS["rms_norm"]}
