"""Upstream's blacklist: non-NVIDIA GL libraries and the wrong ``libnvidia-tls`` are never mirrored."""

from __future__ import annotations

import logging
import re

from gpumanager.volume.elffacts import ElfFacts

log = logging.getLogger(__name__)

_LIB_NAME = re.compile(r"^.*/lib([\w-]+)\.so[\d.]*\Z", re.ASCII)
GL_NAMES = frozenset({"EGL", "GLESv1_CM", "GLESv2", "GL"})
_NVIDIA_GL_DEPENDENCY = re.compile(r"libnvidia-e?glcore\.so|libGLdispatch\.so")
TLS_NAME = "nvidia-tls"
TLS_ABI = (2, 3, 99)


def blacklist_reason(path: str, facts: ElfFacts) -> str | None:
    """Why the library at ``path`` (its full path) must not be mirrored, or None to mirror it.

    - ``libEGL``, ``libGLESv1_CM``, ``libGLESv2``, ``libGL``: only NVIDIA or GLVND builds, i.e. those
      needing ``libnvidia-glcore``/``libnvidia-eglcore`` or ``libGLdispatch`` (a Mesa ``libGL`` would
      shadow the driver's);
    - ``libnvidia-tls``: only the build whose ``.note.ABI-tag`` says ABI 2.3.99.
    """
    match = _LIB_NAME.match(path)
    if match is None:
        return None
    name = match.group(1)
    if name in GL_NAMES:
        if any(_NVIDIA_GL_DEPENDENCY.search(needed) for needed in facts.needed):
            return None
        return "a GL library that needs neither libnvidia-glcore/eglcore nor libGLdispatch (not NVIDIA's)"
    if name == TLS_NAME:
        if facts.abi_tag is None:
            if facts.has_abi_tag_section:
                return "libnvidia-tls with an unreadable .note.ABI-tag"
            return "libnvidia-tls without a .note.ABI-tag section"
        if facts.abi_tag.version != TLS_ABI:
            return f"libnvidia-tls for ABI {facts.abi_tag} (want {'.'.join(map(str, TLS_ABI))})"
    return None
