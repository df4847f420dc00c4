"""fakeversion: built for hookspec version 0 only, which this core does not speak."""

from deepinfer_core.hookspecs import BackendInfo, ProbeResult, hookimpl


@hookimpl
def deepinfer_backend():
    return BackendInfo(name="fakeversion", priority=3000, min_spec_version=0, max_spec_version=0)


@hookimpl
def deepinfer_probe():
    return ProbeResult(True, detail="would run, if its contract matched")
