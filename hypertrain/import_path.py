"""A component named by its import path (`module.NAME`), as a table open to code outside the package
takes it (outer.compress, data.name, model.arch, outer.schedule, outer.optimizer): `is_import_path` says
whether a name is one (without importing), `entry_at` imports it and checks its kind, or raises one line
naming the field, the path and what is valid. Imports nothing of hypertrain.
"""

from __future__ import annotations

import importlib


def is_import_path(name: object) -> bool:
    """Whether a table's field value names a component by its import path (a dot in it), not an entry."""
    return "." in str(name)


def entry_at(field: str, path: str, kind: type, noun: str, valid: str, error: type[Exception]):
    """The `kind` instance at `path`; `error` (one line: `field`=`path` does not import, and why, or names
    something that is not a `noun`; valid: `valid`) otherwise."""
    module, _, attribute = path.rpartition(".")
    try:
        entry = getattr(importlib.import_module(module), attribute)
    except Exception as e:  # a missing module or attribute, or a module that fails as it imports
        reason = " ".join(str(e).split()) or type(e).__name__
        raise error(f"{field}={path!r} does not import ({reason}); valid: {valid}") from None
    if not isinstance(entry, kind):
        raise error(f"{field}={path!r} names a {type(entry).__name__}, not {noun}; valid: {valid}")
    return entry
