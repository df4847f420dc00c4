"""fakegood: the name deepinfer-fake-backends registers too (priority 60, above its 50)."""

from deepinfer_core.hookspecs import BackendInfo, ProbeResult, hookimpl


@hookimpl
def deepinfer_backend():
    return BackendInfo(name="fakegood", priority=60, min_spec_version=3, max_spec_version=3, aliases=())


@hookimpl
def deepinfer_probe():
    return ProbeResult(True, detail="fake, always here")


@hookimpl
def deepinfer_platform():
    from deepinfer_core.platform import Platform

    return Platform(name="fake-clashing", device="cpu", backend="fakegood")
