"""Backend discovery, probing, selection and op-table resolution.

Every installed distribution may register backend modules under the entry-point group
``deepinfer.backends``. Discovery imports each module (they are cheap by contract), registers
it with pluggy (which checks hook names and signatures against ``hookspecs``), asks it for its
BackendInfo and probe result. Selection honours ``DEEPINFER_ACCELERATOR`` (or an explicit
name) strictly: a backend that was asked for and cannot load is an error, never a silent
fallback. Without a request, the available backend with the highest priority wins.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable

import pluggy

from deepinfer_core import hook_checks, hookspecs
from deepinfer_core.hookspecs import SPEC_VERSION, BackendInfo, OpPlan, ProbeResult, SchedulerLimits, StepStats
from deepinfer_core.ops import OP_NAMES, OPTIONAL_OPS, REFERENCE_OPS, OpTable, reference_ops

log = logging.getLogger("deepinfer")

ENTRY_POINT_GROUP = "deepinfer.backends"
REFERENCE_BACKEND = "reference"
CORE_DISTRIBUTION = "deepinfer"  # the distribution that ships the reference backend
# Names no other backend may take, as its name or an alias: the reference backend's own and
# the selection keyword.
RESERVED_NAMES = ("reference", "cpu", "auto")


class BackendError(RuntimeError):
    """A backend that cannot be used, with the reason and the fix."""


@dataclass
class Backend:
    """One discovered backend: where it came from, what it says, whether it can run here."""

    name: str
    module: Any
    source: str  # "module (distribution version)"
    distribution: str = ""  # the distribution's normalised name ("" when registered in-process)
    info: BackendInfo | None = None
    probe: ProbeResult | None = None
    error: str | None = None  # a broken plugin: import failure, bad hooks, probe raised

    @property
    def available(self) -> bool:
        return self.error is None and self.probe is not None and self.probe.available

    def status(self) -> str:
        if self.error:
            return f"broken: {self.error}"
        assert self.probe is not None
        if self.probe.available:
            return "available" + (f" ({self.probe.detail})" if self.probe.detail else "")
        return f"unavailable: {self.probe.reason}" + (f" -- fix: {self.probe.fix}" if self.probe.fix else "")


class PluginManager:
    """Holds every discovered backend; resolves the selected one into Platform + OpTable."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs.BackendSpec)
        self.backends: dict[str, Backend] = {}
        # backends that lost a name to another (a reserved name, or a name registered twice):
        # listed by `deepinfer backends` as broken, never selectable
        self.rejected: list[Backend] = []

    # ---- discovery -------------------------------------------------------------------------
    def discover(self) -> dict[str, Backend]:
        """Import, register and probe every installed backend; then make every name or alias that
        two backends claim (or that a backend other than the core's reference claims from
        RESERVED_NAMES) an error of each claimant, naming both distributions."""
        found = []
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "unknown distribution"
            source = f"{ep.value} ({dist})"
            if all(b.source != source or b.name != ep.name for b, _ in found):  # one distribution seen twice on sys.path
                found.append((Backend(name=ep.name, module=None, source=source, distribution=_normalise(ep.dist.name if ep.dist else "")), ep))
        # the core's reference first, then by name: it keeps its name whatever else is installed
        found.sort(key=lambda item: (not _is_core_reference(item[0]), item[0].name, item[0].source))
        for backend, ep in found:
            if backend.name in self.backends:
                self._reject(backend, f"the name {backend.name!r} is already taken by {self.backends[backend.name].source}")
                continue
            self.backends[backend.name] = backend
            try:
                backend.module = ep.load()
            except Exception as e:  # a plugin's import error must not take the others down
                backend.error = f"importing {ep.value} failed: {type(e).__name__}: {e}"
                continue
            self._register(backend)
        self._check_claims()
        return self.backends

    def _reject(self, backend: Backend, why: str) -> None:
        """A backend that lost its name: broken (never imported), and the holder, unless it is the
        core's reference, broken too (neither may be picked silently)."""
        holder = self.backends[backend.name]
        if _is_core_reference(holder):
            backend.error = f"the name {backend.name!r} is reserved for the built-in reference backend ({holder.source}); rename this backend"
        else:
            backend.error = f"{why}; uninstall one of them"
        self.rejected.append(backend)
        if not _is_core_reference(holder):
            self._break(holder, f"the name {holder.name!r} is registered twice, by {holder.source} and by {backend.source}; "
                                f"uninstall one of them")

    def _break(self, backend: Backend, why: str) -> None:
        if backend.error is None:
            backend.error = why
        if self.pm.has_plugin(backend.name):  # a broken backend takes no further part (no observer runs)
            self.pm.unregister(name=backend.name)

    def _check_claims(self) -> None:
        """Names and aliases: each selects exactly one backend, and the reserved ones the core's reference."""
        claims: dict[str, list[Backend]] = {}
        for b in self.backends.values():
            for label in {b.name.lower(), *(a.strip().lower() for a in (b.info.aliases if b.info else ()))}:
                claims.setdefault(label, []).append(b)
        for label, owners in sorted(claims.items()):
            if label in RESERVED_NAMES:
                for b in owners:
                    if not _is_core_reference(b) or label == "auto":
                        whose = "automatic selection" if label == "auto" else "the built-in reference backend (deepinfer_core.backends.reference)"
                        self._break(b, f"it claims the name {label!r}, which is reserved for {whose}; rename it or drop the alias")
            elif len(owners) > 1:
                for b in owners:
                    others = " and ".join(o.source for o in owners if o is not b)
                    self._break(b, f"the name or alias {label!r} is claimed by {b.source} and by {others}; uninstall one of them "
                                   f"or change the alias")

    def add(self, name: str, module: Any, source: str = "registered in-process") -> Backend:
        """Register a backend module directly (used when no distribution is installed)."""
        backend = Backend(name=name, module=module, source=source)
        self.backends[name] = backend
        self._register(backend)
        return backend

    def _register(self, backend: Backend) -> None:
        try:
            self.pm.register(backend.module, name=backend.name)
        except pluggy.PluginValidationError as e:
            backend.error = f"invalid hook implementation: {e}"
            return
        except ValueError as e:
            backend.error = f"could not register: {e}"
            return
        self._inspect(backend)
        if backend.error:
            # A broken backend takes no further part: none of its hooks (e.g. a step observer)
            # may run once it has been reported as broken.
            self.pm.unregister(name=backend.name)

    def _inspect(self, backend: Backend) -> None:
        """Ask a registered backend for its BackendInfo and probe; set ``backend.error`` if broken."""
        try:
            info = self._call(backend.name, "deepinfer_backend")
        except Exception as e:
            backend.error = f"deepinfer_backend() raised {type(e).__name__}: {e}"
            return
        if info is None:
            backend.error = "does not implement deepinfer_backend() returning a BackendInfo"
            return
        problems = hook_checks.info_problems(info, OP_NAMES)
        if problems:
            backend.error = f"deepinfer_backend(): {'; '.join(problems)}"
            return
        backend.info = info
        if info.name != backend.name:
            backend.error = f"entry point is named {backend.name!r} but deepinfer_backend() says {info.name!r}"
            return
        if not info.min_spec_version <= SPEC_VERSION <= info.max_spec_version:
            backend.error = (
                f"supports hookspec versions {info.min_spec_version}..{info.max_spec_version}, but this "
                f"deepinfer core speaks version {SPEC_VERSION}; install a release of the plugin built for it"
            )
            return
        try:
            probe = self._call(backend.name, "deepinfer_probe")
        except Exception as e:
            backend.error = f"deepinfer_probe() raised {type(e).__name__}: {e}"
            return
        if probe is None:
            backend.error = "does not implement deepinfer_probe() returning a ProbeResult"
            return
        problems = hook_checks.probe_problems(probe)
        if problems:
            backend.error = f"deepinfer_probe(): {'; '.join(problems)}"
            return
        backend.probe = probe

    def _call(self, backend_name: str, hook: str, **kwargs: Any) -> Any:
        """Call one backend's implementation of ``hook`` (None if it has none), with the arguments
        it takes (pluggy lets an implementation take a subset of the spec's)."""
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            if impl.plugin_name == backend_name:
                return impl.function(**{name: kwargs[name] for name in impl.argnames})
        return None

    # ---- selection -------------------------------------------------------------------------
    def find(self, requested: str) -> Backend:
        wanted = requested.strip().lower()
        if wanted in RESERVED_NAMES:  # whoever else claims them (and is broken for it)
            core = next((b for b in self.backends.values() if _is_core_reference(b)), None)
            if core is not None:
                return core
        for backend in self.backends.values():  # a backend's own name wins over another's alias
            if backend.name.lower() == wanted:
                return backend
        for backend in self.backends.values():
            if wanted in {a.lower() for a in (backend.info.aliases if backend.info else ())}:
                return backend
        known = ", ".join(self._names()) or "none"
        raise BackendError(
            f"backend {requested!r} is not installed (installed backends: {known}). Install its plugin, e.g. "
            f"`pip install deepinfer[nvidia]` or `pip install deepinfer[ascend]`, or unset DEEPINFER_ACCELERATOR "
            f"to choose automatically."
        )

    def _names(self) -> list[str]:
        out = []
        for b in self.backends.values():
            aliases = b.info.aliases if b.info else ()
            out.append(b.name + (f" (alias {', '.join(aliases)})" if aliases else ""))
        return out

    def select(self, requested: str | None = None) -> Backend:
        """The backend to use: the requested one (strict) or the best available one."""
        if not self.backends:
            self.discover()
        if requested and requested.strip().lower() not in ("", "auto"):
            backend = self.find(requested)
            if backend.error:
                raise BackendError(f"backend {backend.name!r} ({backend.source}) is broken: {backend.error}")
            if not backend.available:
                assert backend.probe is not None
                raise BackendError(
                    f"backend {backend.name!r} was requested but cannot run here: {backend.probe.reason}. "
                    f"Fix: {backend.probe.fix or 'see the plugin documentation'}. Or choose another backend "
                    f"with DEEPINFER_ACCELERATOR (available: {', '.join(self.available_names()) or 'none'})."
                )
            return backend
        candidates = [b for b in self.backends.values() if b.available]
        if not candidates:
            raise BackendError(
                "no usable backend found; `deepinfer backends` shows why each one cannot run. Reinstall "
                "deepinfer (the reference backend ships with it)."
            )
        # the highest priority; between equals the reference, then the name that sorts first
        best = min(candidates, key=lambda b: (-b.info.priority, not _is_core_reference(b), b.name))  # type: ignore[union-attr]
        log.info("auto-selected backend %r (priority %d)", best.name, best.info.priority)  # type: ignore[union-attr]
        return best

    def available_names(self) -> list[str]:
        return [b.name for b in self.backends.values() if b.available]

    def op_plan(self, backend: Backend) -> OpPlan:
        """The backend's ``deepinfer_op_plan`` (whether or not it can run here): what its op table would
        hold on its own hardware. BackendError when it is broken, has no plan, or breaks the contract."""
        if backend.error:
            raise BackendError(f"backend {backend.name!r} ({backend.source}) is broken: {backend.error}")
        try:
            plan = self._call(backend.name, "deepinfer_op_plan")
        except Exception as e:
            raise BackendError(f"backend {backend.name!r}: deepinfer_op_plan() raised {type(e).__name__}: {e}") from e
        if plan is None:
            raise BackendError(f"backend {backend.name!r} does not describe its op table without loading it (it has no "
                               f"deepinfer_op_plan hook); on its own hardware `deepinfer backends --accelerator "
                               f"{backend.name}` shows the table it builds")
        self._require(backend, "deepinfer_op_plan()", hook_checks.op_plan_problems(plan, OP_NAMES))
        return plan

    # ---- loading -----------------------------------------------------------------------------
    def load(self, backend: Backend, model_config: Any = None, batch_invariant: bool = False) -> tuple[Any, OpTable, SchedulerLimits | None, list[str]]:
        """Platform, OpTable, scheduler limits, and the list of ops that fell back to the reference.
        ``batch_invariant``: the backend's batch-invariant table (BackendError if it has none)."""
        try:
            platform = self._call(backend.name, "deepinfer_platform")
        except BackendError:
            raise
        except Exception as e:
            raise BackendError(f"backend {backend.name!r} failed to load its platform: {type(e).__name__}: {e}") from e
        if platform is None:
            raise BackendError(f"backend {backend.name!r} does not implement deepinfer_platform()")
        self._require(backend, "deepinfer_platform()", hook_checks.platform_problems(platform, backend.name))
        if batch_invariant and not platform.batch_invariant:
            able = [b.name for b in self.backends.values() if b.available and b.name != backend.name]
            raise BackendError(
                f"backend {backend.name!r} ({platform.name}) does not support batch-invariant inference (its platform "
                f"says batch_invariant=False); run without batch_invariant / DEEPINFER_BATCH_INVARIANT, or choose a "
                f"backend that supports it with DEEPINFER_ACCELERATOR (the reference backend, cpu, always does; "
                f"available here: {', '.join(able) or 'none other'})"
            )
        ops = self.resolve_ops(backend, platform, model_config, batch_invariant)
        limits = None
        if model_config is not None:
            try:
                limits = self._call(backend.name, "deepinfer_scheduler_limits", platform=platform, model_config=model_config)
            except Exception as e:
                raise BackendError(f"backend {backend.name!r}: deepinfer_scheduler_limits() raised {type(e).__name__}: {e}") from e
            self._require(backend, "deepinfer_scheduler_limits()", hook_checks.limits_problems(limits))
        fallback = [name for name, who in ops.providers.items() if who != backend.name]
        run_by_reference = [name for name in fallback if name not in OPTIONAL_OPS]  # a missing fusion never runs
        if run_by_reference and backend.name != REFERENCE_BACKEND:
            log.warning(
                "backend %r does not provide ops %s; they run the reference implementations (`deepinfer backends` lists them)",
                backend.name, ", ".join(run_by_reference),
            )
        return platform, ops, limits, fallback

    def resolve_ops(self, backend: Backend, platform: Any, model_config: Any = None, batch_invariant: bool = False) -> OpTable:
        """The backend's ops, completed with reference ones (batch-invariant ones for a
        batch-invariant table); required ops must be the backend's own."""
        try:
            provided: dict[str, Callable] = self._call(backend.name, "deepinfer_ops", platform=platform, model_config=model_config,
                                                       batch_invariant=batch_invariant) or {}
        except Exception as e:
            raise BackendError(f"backend {backend.name!r}: deepinfer_ops() raised {type(e).__name__}: {e}") from e
        if not isinstance(provided, dict):
            raise BackendError(f"backend {backend.name!r}: deepinfer_ops() returned a {type(provided).__name__}, not a dict "
                               f"{{op name: callable}}")
        unknown = sorted(set(provided) - set(OP_NAMES))
        if unknown:
            raise BackendError(
                f"backend {backend.name!r} provides unknown ops {unknown}; the ops of hookspec version "
                f"{SPEC_VERSION} are: {', '.join(OP_NAMES)}"
            )
        not_callable = sorted(name for name, fn in provided.items() if not callable(fn))
        if not_callable:
            raise BackendError(f"backend {backend.name!r} provides non-callable ops {not_callable}")
        wrong = [f"op {name!r} {why}" for name, fn in provided.items()
                 if (why := hook_checks.signature_problem(fn, REFERENCE_OPS[name]))]
        if wrong:
            raise BackendError(f"backend {backend.name!r}: deepinfer_ops() returned callables that break their contract "
                               f"(deepinfer_core.ops): {'; '.join(wrong)}")
        assert backend.info is not None
        missing_required = sorted(set(backend.info.required_ops) - set(provided))
        if missing_required:
            raise BackendError(
                f"backend {backend.name!r} declares ops {missing_required} as required (no fallback allowed) "
                f"but its op table lacks them"
            )
        fallback = reference_ops(batch_invariant)
        impls = {name: provided.get(name, fallback[name]) for name in OP_NAMES}
        providers = {name: backend.name if name in provided else REFERENCE_BACKEND for name in OP_NAMES}
        return OpTable(impls, providers, batch_invariant)

    @staticmethod
    def _require(backend: Backend, hook: str, problems: list[str]) -> None:
        if problems:
            raise BackendError(f"backend {backend.name!r} ({backend.source}): {hook} broke its contract "
                               f"(deepinfer_core.hookspecs): {'; '.join(problems)}")

    # ---- per-step hooks --------------------------------------------------------------------
    def step_observer(self) -> Callable[[StepStats], None] | None:
        """A callable notifying every observer, or None when no plugin observes steps. An
        observer that raises is named in one logged traceback and not called again: it must
        never take the engine down, nor fill the log once per step."""
        observers = {impl.plugin_name: impl for impl in self.pm.hook.deepinfer_step_observer.get_hookimpls()}
        if not observers:
            return None

        def notify(stats: StepStats) -> None:
            for name, impl in list(observers.items()):
                try:
                    impl.function(**{arg: stats for arg in impl.argnames})  # "stats", or nothing
                except Exception:
                    del observers[name]
                    log.exception("the deepinfer_step_observer of backend %r (%s) raised at step %d; it is not called again",
                                  name, self.backends[name].source if name in self.backends else "?", stats.step)

        return notify


def _normalise(distribution: str) -> str:
    return distribution.lower().replace("_", "-")


def _is_core_reference(backend: Backend) -> bool:
    """The reference backend the core ships (not another distribution using its name)."""
    return backend.name == REFERENCE_BACKEND and backend.distribution in (CORE_DISTRIBUTION, "")


def load_backend(requested: str | None = None, model_config: Any = None, batch_invariant: bool = False):
    """Discover, select and load. Returns (PluginManager, Backend, Platform, OpTable, SchedulerLimits|None)."""
    manager = PluginManager()
    manager.discover()
    backend = manager.select(requested)
    platform, ops, limits, _ = manager.load(backend, model_config, batch_invariant)
    return manager, backend, platform, ops, limits
