"""Optional dependencies: planning, simulation and plots need packages a training node does not.

``pip install unbroken`` brings what training, checkpoints, diagnosis, the supervisor and the
demo need. Three extras add the rest: ``[plan]`` (networkx and scipy, for ``unbroken plan`` and
``unbroken bench planner``), ``[sim]`` (scipy, for ``unbroken simulate``) and ``[report]``
(matplotlib, for the plots of the demo's report and ``unbroken simulate --plot``); ``[k8s]``
(jsonschema and kubernetes-validate) checks ``unbroken k8s render``'s manifests offline. A package that
needs one calls :func:`require` before importing it, so that a missing one is an error that
names the extra to install rather than a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# extra -> the top-level modules it installs (pyproject.toml's optional-dependencies).
EXTRAS: dict[str, tuple[str, ...]] = {
    "plan": ("networkx", "scipy"),
    "sim": ("scipy",),
    "report": ("matplotlib",),
    "examples": ("transformers",),
    # `unbroken k8s render --validate` and the manifests' tests: the schemas, checked offline
    "k8s": ("jsonschema", "kubernetes_validate"),
}


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message says which extra installs it."""


def require(module: str, extra: str, needed_for: str) -> ModuleType:
    """Imports ``module`` (a top-level package of ``extra``), or raises :class:`MissingExtra`.

    ``needed_for`` names what the user tried, e.g. ``"unbroken plan"``.
    """
    if module not in EXTRAS.get(extra, ()):
        raise ValueError(f"{module!r} is not a module of the extra {extra!r} (see unbroken.extras.EXTRAS)")
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is not None and e.name.partition(".")[0] != module:
            raise  # the package is there but one of its own dependencies is broken: show that
        raise MissingExtra(
            f"{needed_for} needs {module}, which is not installed: pip install 'unbroken[{extra}]'",
            name=module,
        ) from e
