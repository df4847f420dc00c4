"""fakebroken_probe: its probe raises (a bug, not an ordinary "not here"). Its step observer
must never run: a broken plugin takes no part in the engine."""

from deepinfer_core.hookspecs import BackendInfo, hookimpl

STEPS: list = []


@hookimpl
def deepinfer_backend():
    return BackendInfo(
        name="fakebroken_probe",
        priority=2000,
        min_spec_version=3,
        max_spec_version=3,
        description="test fake: probe raises",
    )


@hookimpl
def deepinfer_probe():
    raise RuntimeError("fake probe exploded")


@hookimpl
def deepinfer_step_observer(stats):
    STEPS.append(stats)
