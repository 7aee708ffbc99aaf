"""What kvdrill takes away after its own dockerd (drills/stack/dockerd.py): only what is new since the
engine started *and* Docker's; the real engine is tests/real/test_docker_engine.py."""

from __future__ import annotations

from drills.stack.dockerd import HostNetState, restore_plan

BEFORE_FILTER = ["-P INPUT ACCEPT", "-P FORWARD ACCEPT", "-P OUTPUT ACCEPT"]


def state(filter_rules: list[str], nat_rules: list[str], links: set[str]) -> HostNetState:
    return HostNetState({"filter": frozenset(filter_rules), "nat": frozenset(nat_rules)}, "0", frozenset(links),
                        frozenset())


def test_docker_s_rules_chains_policy_and_bridges_go_and_nothing_else():
    before = state(BEFORE_FILTER, ["-P PREROUTING ACCEPT"], {"lo", "eth0"})
    after = state(["-P INPUT ACCEPT", "-P FORWARD DROP", "-P OUTPUT ACCEPT", "-N DOCKER", "-N DOCKER-USER",
                   "-A FORWARD -j DOCKER-USER", "-A DOCKER-USER -j RETURN",
                   "-A FORWARD -o docker0 -j DOCKER",
                   # a fault rule someone else added meanwhile: not Docker's, so it stays
                   "-A FORWARD -s 10.254.3.8/30 -j DROP"],
                  ["-P PREROUTING ACCEPT", "-N DOCKER", "-A POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE"],
                  {"lo", "eth0", "docker0", "br-1a2b3c", "kvd-veth0"})
    plan = [" ".join(a) for a in restore_plan(before, after)]
    deletes = [i for i, c in enumerate(plan) if " -D " in c]
    chains = [i for i, c in enumerate(plan) if " -X " in c]
    assert max(deletes) < min(chains)  # no chain is deleted while a rule still jumps to it
    assert "iptables -t filter -D FORWARD -j DOCKER-USER" in plan
    assert "iptables -t nat -D POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE" in plan
    assert {"iptables -t filter -X DOCKER", "iptables -t filter -X DOCKER-USER", "iptables -t nat -X DOCKER"} <= set(plan)
    assert "iptables -t filter -P FORWARD ACCEPT" in plan
    assert "ip link delete docker0" in plan and "ip link delete br-1a2b3c" in plan
    assert not any("10.254.3.8" in c or "kvd-veth0" in c for c in plan)


def test_a_host_docker_never_touched_needs_nothing():
    same = state(BEFORE_FILTER, [], {"lo"})
    assert restore_plan(same, same) == []
