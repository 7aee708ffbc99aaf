"""Address selection for the per-run network namespace (pure functions, no namespace is created)."""

from __future__ import annotations

import json
from ipaddress import IPv4Network

import pytest

from drills.stack.netns import POOL, NetNamespace, NetnsError, host_networks, pick_subnet

ADDR = json.dumps([
    {"ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]},
    {"ifname": "eth0", "addr_info": [{"family": "inet", "local": "192.0.2.2", "prefixlen": 24}]},
    {"ifname": "kvdhaaaa", "addr_info": [{"family": "inet", "local": "10.254.7.1", "prefixlen": 30}]},
])
ROUTE = json.dumps([
    {"dst": "default", "gateway": "192.0.2.1", "dev": "eth0"},
    {"dst": "192.0.2.0/24", "dev": "eth0"},
    {"dst": "10.254.9.0/24", "dev": "wg0"},
    {"type": "local", "dst": "10.254.200.5", "dev": "lo", "table": "local"},
])


def test_host_networks_reads_addresses_and_routes_but_not_the_default_route():
    nets = host_networks(ADDR, ROUTE)
    assert IPv4Network("127.0.0.0/8") in nets and IPv4Network("192.0.2.0/24") in nets
    assert IPv4Network("10.254.7.0/30") in nets and IPv4Network("10.254.9.0/24") in nets
    assert IPv4Network("10.254.200.5/32") in nets
    assert all(n.prefixlen > 0 for n in nets)


def test_pick_is_a_slash30_in_the_pool_that_overlaps_nothing():
    used = host_networks(ADDR, ROUTE)
    for seed in ("kvd-1", "kvd-2", "kvd-abcdef01"):
        net = pick_subnet(used, seed)
        assert net.prefixlen == 30 and net.subnet_of(POOL)
        assert not any(net.overlaps(u) for u in used)


def test_pick_skips_taken_subnets_from_the_seeded_start():
    first = pick_subnet([], "kvd-x")
    assert pick_subnet([], "kvd-x") == first  # deterministic for a seed
    second = pick_subnet([first], "kvd-x")
    assert second != first and not second.overlaps(first)
    # a covering route blocks everything it covers
    assert not pick_subnet([IPv4Network("10.254.0.0/17")], "kvd-x").overlaps(IPv4Network("10.254.0.0/17"))


def test_a_default_route_does_not_block_and_a_full_pool_is_an_error():
    assert pick_subnet([IPv4Network("0.0.0.0/0")], "kvd-y").subnet_of(POOL)
    with pytest.raises(NetnsError, match="no free /30"):
        pick_subnet([IPv4Network("10.0.0.0/8")], "kvd-y")


def test_names_addresses_and_the_delete_guard():
    ns = NetNamespace(name="kvd-0123abcd", subnet=IPv4Network("10.254.1.4/30"))
    assert (str(ns.host_addr), str(ns.ns_addr)) == ("10.254.1.5", "10.254.1.6")
    assert len(ns.host_if) <= 15 and len(ns.ns_if) <= 15 and ns.host_if != ns.ns_if
    assert ns.exec_prefix() == ["ip", "netns", "exec", "kvd-0123abcd"]
    with pytest.raises(NetnsError, match="refusing"):
        NetNamespace(name="other", subnet=ns.subnet).delete()
