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


def test_the_debootstrap_mirror_is_debian_s_main_archive_not_a_third_party_repo(tmp_path, monkeypatch):
    from drills.stack import images

    one_line = ("deb [arch=amd64 signed-by=/k.gpg] https://download.docker.com/linux/debian bookworm stable\n"
                "deb http://deb.debian.org/debian-security bookworm-security main\n"
                "deb http://mirror.example/debian bookworm main contrib\n")
    assert [u for u, s, c in images._entries(one_line) if images.SUITE in s and "main" in c
            and "security" not in u] == ["http://mirror.example/debian"]
    deb822 = ("Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\n"
              "Types: deb\nURIs: http://deb.debian.org/debian-security\nSuites: bookworm-security\nComponents: main\n")
    assert images._entries(deb822)[0] == ("http://deb.debian.org/debian", ["bookworm", "bookworm-updates"], ["main"])
    monkeypatch.setenv("KVDRILL_DEBIAN_MIRROR", "http://override.example/debian")
    assert images.mirror() == "http://override.example/debian"
