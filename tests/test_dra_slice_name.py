"""The ResourceSlice's name stays a valid object name for any valid node name.

``<node>-<driver>`` passed 253 characters for a long node name (a DNS subdomain of up to 253), and
the API server refused the slice: the node published no devices. A name that would be too long is
now the node name cut short plus a hash of the whole node name; a normal name is unchanged (an
upgraded agent finds its slice).
"""

from __future__ import annotations

import re

from gpumanager.dra import constants as c
from gpumanager.dra.publisher import SlicePublisher
from simnode.apiserver import ApiServerSimulator

DRIVER = "vcuda.tencent.com"
SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LONG = [".".join(["n" * 59] * 4), "a" * 253, ".".join(["b" * 63] * 3) + "." + "c" * 61, "x" * 230 + ".-"[0] + "y" * 22]


def test_a_normal_node_keeps_its_slice_name() -> None:
    assert c.slice_name("gpu-node-1", DRIVER) == f"gpu-node-1-{DRIVER}"
    exact = "n" * (253 - len(DRIVER) - 1)
    assert c.slice_name(exact, DRIVER) == f"{exact}-{DRIVER}"


def test_a_long_node_name_gives_a_valid_distinct_slice_name() -> None:
    names = [c.slice_name(node, DRIVER) for node in LONG]
    for node, name in zip(LONG, names, strict=True):
        assert len(name) <= 253 and SUBDOMAIN.match(name), name
        assert name.endswith(f"-{DRIVER}")
        assert c.slice_name(node, DRIVER) == name, "the same node gets the same name each time"
    assert len(set(names)) == len(names)
    # Two long names that differ only past the cut get different slices.
    a, b = "n" * 240 + "a", "n" * 240 + "b"
    assert c.slice_name(a, DRIVER) != c.slice_name(b, DRIVER)


def test_a_node_with_a_long_name_publishes_its_slice() -> None:
    node = LONG[0]
    with ApiServerSimulator() as api:

        def content(gen: int) -> dict[str, object]:
            pool = {"name": node, "generation": gen, "resourceSliceCount": 1}
            return {"driver": DRIVER, "nodeName": node, "pool": pool, "devices": []}

        pub = SlicePublisher(api.component_client("dra"), node=node, driver=DRIVER, content=content)
        pub.sync()
        assert len(pub.name) <= 253
