"""``mpcomm doctor``'s check of the MPComm provider (libmpcomm.so, for Mooncake TENT); CLI only."""

from __future__ import annotations

from mpcomm.cli.nodecheck import Check, Status

from .build import native_status


def native_provider_check() -> Check:
    """Present (and its version and MPCOMM_ROOT), present but unusable, or why it is absent."""
    st = native_status()
    if st["built"] and st.get("warning"):
        return Check("plugins", "mpcomm_provider", Status.WARN, f"libmpcomm.so {st['version']}: {st['warning']}",
                     "a host without Python of its own could not start the provider")
    if st["built"]:
        return Check("plugins", "mpcomm_provider", Status.PASS,
                     f"libmpcomm.so {st['version']} (MPCOMM_ROOT={st['root']})")
    return Check("plugins", "mpcomm_provider", Status.INFO, f"not built: {st['reason']}",
                 "only Mooncake TENT's MPCOMM transport needs it; `python -m mpcomm.tent.build` builds it")
