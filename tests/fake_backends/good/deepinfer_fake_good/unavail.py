"""fakeunavail: the highest priority of the loadable fakes, but its probe says "not here"."""

from deepinfer_core.hookspecs import BackendInfo, ProbeResult, hookimpl

REASON = "fake accelerator not present (/dev/fakeaccel0 missing)"
FIX = "plug in a fake accelerator, or choose DEEPINFER_ACCELERATOR=cpu"


@hookimpl
def deepinfer_backend():
    return BackendInfo(
        name="fakeunavail",
        priority=1000,
        min_spec_version=3,
        max_spec_version=3,
        description="test fake: never available",
    )


@hookimpl
def deepinfer_probe():
    return ProbeResult(False, reason=REASON, fix=FIX)


@hookimpl
def deepinfer_platform():
    raise AssertionError("fakeunavail must never be loaded: its probe said it cannot run")
