"""fakebadhook: deepinfer_ops takes `model_cfg` where the hookspec says `model_config`;
pluggy's validation rejects it at registration."""

from deepinfer_core.hookspecs import BackendInfo, ProbeResult, hookimpl


@hookimpl
def deepinfer_backend():
    return BackendInfo(name="fakebadhook", priority=4000, min_spec_version=3, max_spec_version=3)


@hookimpl
def deepinfer_probe():
    return ProbeResult(True)


@hookimpl
def deepinfer_ops(platform, model_cfg):
    return {}
