"""fakecpu: declares the alias 'cpu', reserved for the reference backend (priority -1)."""

from deepinfer_core.hookspecs import BackendInfo, ProbeResult, hookimpl


@hookimpl
def deepinfer_backend():
    return BackendInfo(name="fakecpu", priority=-1, min_spec_version=3, max_spec_version=3, aliases=("cpu",))


@hookimpl
def deepinfer_probe():
    return ProbeResult(True, detail="fake, always here")


@hookimpl
def deepinfer_platform():
    from deepinfer_core.platform import Platform

    return Platform(name="fake-clashing", device="cpu", backend="fakecpu")
