"""fakebadinfo: deepinfer_backend() returns a BackendInfo whose priority is a string."""

from deepinfer_core.hookspecs import BackendInfo, ProbeResult, hookimpl


@hookimpl
def deepinfer_backend():
    return BackendInfo(name="fakebadinfo", priority="high", min_spec_version=3, max_spec_version=3)  # type: ignore[arg-type]


@hookimpl
def deepinfer_probe():
    return ProbeResult(True, detail="would run, if its BackendInfo were right")
