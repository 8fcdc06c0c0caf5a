"""Finding an environment by name, as tasks are found: a built-in, a dotted path, or an
installed entry point (group `posttrain.environments`); or a `verifiers` environment,
"verifiers:<taskset id>", whose options are its verifiers env config (see
`posttrain.environments.verifiers_adapter`).

The spec names a factory (a class or a function) that the runner calls with the options as
keyword arguments once per episode, each episode having its own environment. A class is
checked for `reset` and `step` without being built; a function is called once here, to check
that it returns an environment (that one is closed, if it has a plain `close()`, and dropped:
keep construction cheap and do an episode's setup in `reset`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from posttrain.environments.calculator import CalculatorEnv
from posttrain.environments.protocol import ENVIRONMENT_METHODS, Environment, missing_methods
from posttrain.finder import Kind, NotFound, find, target_of
from posttrain.finder import entry_points as installed
from posttrain.tasks.resolve import TaskError, check_options

ENTRY_POINT_GROUP = "posttrain.environments"
EnvironmentKind = Literal["builtin", "path", "entry_point", "verifiers"]
VERIFIERS_PREFIX = "verifiers:"
BUILTIN_ENVIRONMENTS: dict[str, type] = {"calculator": CalculatorEnv}
ENVIRONMENTS = Kind(
    "environment", BUILTIN_ENVIRONMENTS, ENTRY_POINT_GROUP, example="mypkg.envs:MyEnv"
)


class EnvironmentSpecError(ValueError):
    """An environment spec that does not resolve; the message says what to fix."""


@dataclass(frozen=True)
class ResolvedEnvironment:
    """A factory of environments and how it was found (what job.json records)."""

    make: Callable[[], Environment]  # a new environment for each episode
    spec: str  # as given: "calculator", "mypkg.envs:make_env", an entry-point name
    kind: EnvironmentKind
    target: str  # module:qualname of the factory
    options: Mapping[str, object] = field(default_factory=dict[str, object])
    demonstrates: bool = False  # its environments have demonstration() (`Demonstrating`)

    def record(self) -> dict[str, object]:
        return {"spec": self.spec, "kind": self.kind, "target": self.target}


def entry_points() -> dict[str, str]:
    """Installed environments: name -> dotted path, from the entry-point group."""
    return installed(ENTRY_POINT_GROUP)


def environment_kind(spec: str) -> EnvironmentKind:
    """Which kind of spec this is, without importing anything; an unknown name lists the
    known ones."""
    if spec.startswith(VERIFIERS_PREFIX):
        taskset = spec.removeprefix(VERIFIERS_PREFIX)
        if not taskset or any(c.isspace() or c == ":" for c in taskset):
            raise EnvironmentSpecError(
                f"environment {spec!r}: name the verifiers taskset after the prefix, as "
                "'verifiers:<taskset id>' (an installed package or a module exporting its "
                "vf.Taskset, e.g. 'verifiers:my_taskset')"
            )
        return "verifiers"
    try:
        return find(spec, ENVIRONMENTS).source
    except NotFound as exc:
        raise EnvironmentSpecError(str(exc)) from None


def resolve_environment(
    spec: str,
    options: Mapping[str, object] | None = None,
    *,
    search: Path | None = None,
    options_name: str = "options",
) -> ResolvedEnvironment:
    """The environment factory `spec` names, with `options` bound (its keyword arguments).

    `search` is a directory to import dotted paths from after `sys.path` (the job passes its
    config file's); `options_name` is how errors name the options (the job's `[environment]`).
    """
    options = dict(options or {})
    kind = environment_kind(spec)
    if kind == "verifiers":
        from posttrain.environments.verifiers_adapter import resolve_verifiers_environment

        return resolve_verifiers_environment(spec, options, search=search)
    try:
        factory = find(spec, ENVIRONMENTS).load(search=search)
    except NotFound as exc:
        raise EnvironmentSpecError(str(exc)) from exc
    made = _check_factory(factory, spec, options, options_name)
    make = functools.partial(factory, **options)  # pyright: ignore[reportArgumentType]  # checked callable
    demonstrates = callable(getattr(made, "demonstration", None))
    return ResolvedEnvironment(make, spec, kind, target_of(factory), options, demonstrates)


def _check_factory(
    factory: object, spec: str, options: dict[str, object], options_name: str
) -> object:
    """A factory taking `options` whose environments have reset and step; returns the class,
    or the environment the function made."""
    if not isinstance(factory, type) and not missing_methods(factory):
        raise EnvironmentSpecError(
            f"environment {spec!r} is an environment object; name its class or a function that "
            "makes one: each episode needs an environment of its own"
        )
    if not callable(factory):
        raise EnvironmentSpecError(
            f"environment {spec!r} is a {type(factory).__name__}, not a class or function that "
            "makes environments"
        )
    label = getattr(factory, "__qualname__", repr(factory))
    try:
        check_options(factory, spec, label, options, options_name, what="environment")
    except TaskError as exc:
        raise EnvironmentSpecError(str(exc)) from exc
    if isinstance(factory, type):
        made: object = factory  # its methods are checked on the class, nothing built
    else:
        try:
            made = factory(**options)
        except Exception as exc:  # user code may fail in any way: say whose and how
            raise EnvironmentSpecError(
                f"environment {spec!r}: {label}(...) raised {type(exc).__name__}: {exc}"
            ) from exc
        _close_quietly(made)
    missing = missing_methods(made)
    if missing:
        what = (
            f"class {label} is"
            if isinstance(made, type)
            else f"{label}() returned a {type(made).__name__}, which is"
        )
        raise EnvironmentSpecError(
            f"environment {spec!r}: {what} not an Environment: it lacks "
            f"{', '.join(missing)} (an Environment has {', '.join(ENVIRONMENT_METHODS)}; see "
            "posttrain.environments.Environment)"
        )
    return made


def _close_quietly(env: object) -> None:
    """Close the environment built only to be checked, if it closes synchronously."""
    close = getattr(env, "close", None)
    if callable(close) and not inspect.iscoroutinefunction(close):
        close()
