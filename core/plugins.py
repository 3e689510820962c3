"""The plugin host: loads built-in and third-party plugins and indexes their records.

Built-in plugins come from an explicit list of module names handed in by the
caller (the launcher owns that list, so core/ never imports a backend). Third
party plugins come from the entry-point group ``dsv4.plugins``. Rules:

* a hook implementation whose name matches no hook specification is rejected
  (pluggy's validation), so a misspelled ``dsv4_kernel_backend`` never silently
  does nothing;
* two records with the same name on one axis are an error naming both providers;
* an unknown name is answered with the valid choices;
* a third-party plugin that fails to import or validate is isolated with a
  warning, unless ``strict`` is set (or DSV4_STRICT_PLUGINS=1), which turns that
  into an error;
* ``third_party=False`` (or DSV4_NO_THIRD_PARTY_PLUGINS=1) loads built-ins only.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import os
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Iterable, Optional

import pluggy

from core import hookspecs
from core.records import AXES, AXIS_OPTION, RECORD_TYPES, BackendRecord

BUILTIN_PROVIDER = "dsv4"
STRICT_ENV = "DSV4_STRICT_PLUGINS"
NO_THIRD_PARTY_ENV = "DSV4_NO_THIRD_PARTY_PLUGINS"


class PluginError(RuntimeError):
    """A plugin is malformed (bad hook, bad record, duplicate name)."""


class DuplicateBackendError(PluginError):
    """Two plugins registered the same name on one axis (never isolated: ambiguous)."""


class UnknownBackendError(ValueError):
    """A name given for an axis matches no registered backend."""


class ThirdPartyPluginWarning(UserWarning):
    """A third-party plugin was skipped because it failed to load."""


@dataclass(frozen=True)
class PluginSource:
    """Where a plugin module came from, for messages and `dsv4 plugins`."""

    module: str
    distribution: str
    builtin: bool


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


class PluginHost:
    """Holds the loaded plugins and their records, indexed by axis and name."""

    def __init__(
        self,
        builtin_modules: Iterable[str],
        *,
        third_party: Optional[bool] = None,
        strict: Optional[bool] = None,
    ):
        self.strict = _env_flag(STRICT_ENV) if strict is None else strict
        self.third_party = (not _env_flag(NO_THIRD_PARTY_ENV)) if third_party is None else third_party
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._sources: dict[str, PluginSource] = {}
        self.skipped: list[tuple[PluginSource, str]] = []
        self._records: dict[str, dict[str, BackendRecord]] = {axis: {} for axis in AXES}
        self._rules: dict[str, object] = {}     # rule name -> core.combinations.Rule, in load order

        for module_name in builtin_modules:
            source = PluginSource(module_name, BUILTIN_PROVIDER, builtin=True)
            self._add(importlib.import_module(module_name), source)
        if self.third_party:
            self._load_entry_points()

    # -- loading -----------------------------------------------------------

    def _load_entry_points(self) -> None:
        seen = set()
        for ep in importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else "unknown distribution"
            if (ep.value, dist) in seen:  # the same dist found twice on sys.path
                continue
            seen.add((ep.value, dist))
            source = PluginSource(ep.value, dist, builtin=False)
            try:
                module = ep.load()
                self._add(module, source)
            except DuplicateBackendError:
                raise
            except Exception as exc:  # isolate a broken third-party plugin
                message = f"third-party plugin {ep.name!r} ({ep.value}) from distribution {dist!r} failed to load: {exc}"
                if self.strict:
                    raise PluginError(message + f" (strict plugin loading is on: unset {STRICT_ENV} or drop --strict-plugins to skip it)") from exc
                warnings.warn(message + "; it is skipped (set DSV4_STRICT_PLUGINS=1 to make this an error)", ThirdPartyPluginWarning, stacklevel=2)
                self.skipped.append((source, str(exc)))

    def _add(self, module: ModuleType, source: PluginSource) -> None:
        name = f"{source.distribution}:{source.module}"
        try:
            self._pm.register(module, name=name)
            try:
                self._pm.check_pending()
            except pluggy.PluginValidationError as exc:
                raise PluginError(
                    f"plugin {source.module} ({source.distribution}) implements a hook that does not exist: {exc}. "
                    f"Valid hooks: {', '.join(sorted([*hookspecs.HOOK_AXIS, hookspecs.RULES_HOOK]))}"
                ) from exc
            records = self._collect(module, source)
            self._check_unique(records, source)
            rules = self._collect_rules(module, source)
        except Exception:
            if self._pm.is_registered(module):
                self._pm.unregister(module)
            raise
        for record in records:
            self._records[record.axis][record.name] = record
        for rule in rules:
            self._rules[rule.name] = rule
        self._sources[name] = source

    def _collect(self, module: ModuleType, source: PluginSource) -> list[BackendRecord]:
        records = []
        for hook_name, axis in hookspecs.HOOK_AXIS.items():
            impls = [i for i in getattr(self._pm.hook, hook_name).get_hookimpls() if i.plugin is module]
            if not impls:
                continue
            produced = impls[0].function() or []
            expected = RECORD_TYPES[axis]
            for record in produced:
                if not isinstance(record, expected):
                    raise PluginError(
                        f"plugin {source.module} ({source.distribution}): {hook_name} returned "
                        f"{type(record).__name__}, expected {expected.__name__} records"
                    )
                records.append(record.with_provider(source.distribution))
        return records

    def _collect_rules(self, module: ModuleType, source: PluginSource) -> list:
        """The module's ``dsv4_job_rules``: Rule records whose names no loaded plugin took."""
        from core.combinations import CAPABILITY_RULES, Rule

        impls = [i for i in self._pm.hook.dsv4_job_rules.get_hookimpls() if i.plugin is module]
        rules = list(impls[0].function() or []) if impls else []
        taken = {r.name for r in CAPABILITY_RULES} | set(self._rules)
        for rule in rules:
            if not isinstance(rule, Rule):
                raise PluginError(f"plugin {source.module} ({source.distribution}): {hookspecs.RULES_HOOK} returned "
                                  f"{type(rule).__name__}, expected core.combinations.Rule records")
            if rule.name in taken:
                raise PluginError(f"plugin {source.module} ({source.distribution}): rule {rule.name!r} is already "
                                  f"in the combination table; rename the rule")
            taken.add(rule.name)
        return rules

    def _check_unique(self, records: list[BackendRecord], source: PluginSource) -> None:
        seen: dict[tuple[str, str], str] = {}
        for record in records:
            key = (record.axis, record.name)
            existing = self._records[record.axis].get(record.name)
            other = existing.provider if existing is not None else seen.get(key)
            if other is not None:
                raise DuplicateBackendError(
                    f"duplicate {record.axis} {record.name!r}: provided by {other} and by "
                    f"{source.distribution} ({source.module}); uninstall one of them or rename the backend"
                )
            seen[key] = f"{source.distribution} ({source.module})"

    # -- queries -----------------------------------------------------------

    def names(self, axis: str) -> list[str]:
        return sorted(self._records[axis])

    def records(self, axis: str) -> list[BackendRecord]:
        return [self._records[axis][n] for n in self.names(axis)]

    def get(self, axis: str, name: str) -> BackendRecord:
        try:
            return self._records[axis][name]
        except KeyError:
            choices = self.names(axis)
            close = difflib.get_close_matches(name, choices, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise UnknownBackendError(
                f"unknown {AXIS_OPTION[axis]} {name!r}; valid choices: {', '.join(choices)}.{hint}"
            ) from None

    def job_rules(self) -> list:
        """The job rules the plugins added to the combination table (``dsv4_job_rules``), in load order."""
        return list(self._rules.values())

    def sources(self) -> list[PluginSource]:
        return list(self._sources.values())

    def describe(self, probe: bool = False) -> dict:
        """JSON-friendly view of every axis, for `dsv4 plugins --json`.

        With ``probe`` each record's availability probe runs, which may import
        heavy packages (torch) to look for devices and libraries.
        """

        def entry(r: BackendRecord) -> dict:
            out = {
                "name": r.name,
                "description": r.description,
                "distribution": r.provider,
                "factory": r.factory,
                "capabilities": r.capabilities(),
                # declared but not built (or rules only): in no supported row, refused with this reason
                "runnable": r.not_runnable is None,
                "not_runnable_reason": r.not_runnable,
            }
            if probe:
                reason = r.unavailable_reason()
                out["available"] = reason is None
                out["unavailable_reason"] = reason
            return out

        return {axis: [entry(r) for r in self.records(axis)] for axis in AXES}
