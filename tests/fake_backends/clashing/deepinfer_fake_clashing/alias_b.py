"""fakealias_b: declares the alias 'fakeaccel', as fakealias_a does."""

from deepinfer_core.hookspecs import BackendInfo, ProbeResult, hookimpl


@hookimpl
def deepinfer_backend():
    return BackendInfo(name="fakealias_b", priority=8, min_spec_version=3, max_spec_version=3, aliases=("fakeaccel",))


@hookimpl
def deepinfer_probe():
    return ProbeResult(True, detail="fake, always here")


@hookimpl
def deepinfer_platform():
    from deepinfer_core.platform import Platform

    return Platform(name="fake-clashing", device="cpu", backend="fakealias_b")
