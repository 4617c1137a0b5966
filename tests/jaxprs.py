"""Walking a jaxpr and the jaxprs nested in its equations (cond/switch branches, loop bodies, pallas_call kernels),
for tests that read what a traced program contains."""

from __future__ import annotations


def sub_jaxprs(eqn):
    """The jaxprs inside one equation's parameters (a ClosedJaxpr's own jaxpr)."""
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            v = v if hasattr(v, "eqns") else getattr(v, "jaxpr", None)
            if hasattr(v, "eqns"):
                yield v


def equations(jaxpr, skip=None, outer: tuple[str, ...] = ()):
    """(equation, the primitives of the equations enclosing it) for every equation of `jaxpr` (or a ClosedJaxpr)
    and the jaxprs nested in it, depth first; the equation `skip` and everything inside it are left out."""
    jaxpr = jaxpr if hasattr(jaxpr, "eqns") else jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        if eqn is skip:
            continue
        yield eqn, outer
        for sub in sub_jaxprs(eqn):
            yield from equations(sub, skip, outer + (eqn.primitive.name,))


def pallas_call_names(jaxpr) -> list[str]:
    """The kernel name of every `pallas_call` in `jaxpr` and the jaxprs nested in it, in order (e.g. "stream_matmul",
    "tree_build")."""
    names = []
    for eqn, _ in equations(jaxpr):
        if eqn.primitive.name == "pallas_call":
            info = eqn.params.get("name") or eqn.params.get("name_and_src_info")
            names.append(getattr(info, "name", None) or str(info).split(" ")[0])
    return names
