"""fakedictplatform: probes fine, but deepinfer_platform() returns a dict instead of a Platform."""

from deepinfer_core.hookspecs import BackendInfo, ProbeResult, hookimpl


@hookimpl
def deepinfer_backend():
    return BackendInfo(name="fakedictplatform", priority=-5, min_spec_version=3, max_spec_version=3)


@hookimpl
def deepinfer_probe():
    return ProbeResult(True, detail="fake")


@hookimpl
def deepinfer_platform():
    return {"name": "fake-dict", "device": "cpu"}
