"""The choice of a trajectory's vLLM server (``proxy.gateway.upstream._placement``), on hand-made servers and loads."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from proxy.gateway.upstream._placement import choose, load_bound, rank, score, server_salt


@dataclass
class Box:
    url: str
    in_flight: int = 0
    salt: bytes = field(init=False)

    def __post_init__(self) -> None:
        self.salt = server_salt(self.url)


def boxes(n: int) -> list[Box]:
    return [Box(f"http://vllm-{i}.vllm:8000/v1") for i in range(n)]


IDS = [f"traj-{i:04d}" for i in range(3000)]


def test_scores_are_pinned_so_proxies_of_two_releases_agree_during_a_rolling_upgrade() -> None:
    # Changing the hash (its salt, digest size or encoding) re-homes every trajectory: do it on purpose only.
    assert score("run-42", server_salt("http://vllm-0.vllm:8000/v1")).hex() == "dc2278d21b999942"
    assert server_salt("http://vllm-0.vllm:8000/v1").hex() == "ae8ee5d6baee61723a97e212e67dc16c"


def test_the_choice_does_not_depend_on_the_order_a_proxy_lists_its_servers() -> None:
    servers = boxes(4)
    shuffled = random.Random(7).sample(servers, len(servers))
    for trajectory in IDS[:200]:
        assert choose(trajectory, servers) is choose(trajectory, shuffled) is rank(trajectory, servers)[0]


def test_new_trajectories_spread_evenly_over_idle_servers() -> None:
    servers = boxes(3)
    counts = Counter(choose(t, servers).url for t in IDS)
    assert len(counts) == 3
    assert all(900 <= n <= 1100 for n in counts.values()), counts  # 1000 each, binomial sd ~26


def test_a_server_leaving_moves_only_its_trajectories_each_to_the_next_of_its_own_ranking() -> None:
    servers = boxes(3)
    gone = servers[1]
    left = [servers[0], servers[2]]
    moved = 0
    for trajectory in IDS[:600]:
        before = choose(trajectory, servers)
        after = choose(trajectory, left)
        if before is gone:
            moved += 1
            assert after is rank(trajectory, servers)[1]
        else:
            assert after is before
    assert 150 < moved < 250  # about a third


def test_a_server_coming_back_takes_back_only_the_trajectories_that_rank_it_first() -> None:
    servers = boxes(3)
    back = servers[2]
    for trajectory in IDS[:600]:
        before = choose(trajectory, servers[:2])
        after = choose(trajectory, servers)
        assert after is (back if rank(trajectory, servers)[0] is back else before)


@pytest.mark.parametrize(
    ("in_flight", "servers", "bound"),
    [(0, 2, 1), (1, 2, 2), (2, 2, 3), (3, 2, 3), (10, 4, 5), (0, 8, 1), (99, 3, 50)],
)
def test_the_load_bound_is_half_again_the_mean_counting_the_new_call(in_flight: int, servers: int, bound: int) -> None:
    assert load_bound(in_flight, servers) == bound


def test_a_server_at_its_bound_passes_the_call_to_the_next_of_the_trajectorys_ranking() -> None:
    servers = boxes(3)
    trajectory = "run-7"
    first, second, _ = rank(trajectory, servers)
    first.in_flight = 2  # total 2 over 3 servers: bound ceil(1.5 * 3 / 3) = 2, so the first is full
    assert choose(trajectory, servers) is second
    second.in_flight = 2  # total 4: bound ceil(1.5 * 5 / 3) = 3, both take calls again
    assert choose(trajectory, servers) is first
    first.in_flight = 5  # total 7: bound ceil(1.5 * 8 / 3) = 4
    assert choose(trajectory, servers) is second


def test_with_two_servers_a_call_leaves_its_server_only_once_that_holds_half_again_the_mean() -> None:
    servers = boxes(2)
    trajectory = "run-8"
    first, second = rank(trajectory, servers)
    # Over the bound when busy >= ceil(1.5 * (busy + idle + 1) / 2).
    for busy, idle, expected in [(1, 0, first), (2, 0, first), (3, 0, second), (5, 1, first), (6, 1, second)]:
        first.in_flight, second.in_flight = busy, idle
        assert choose(trajectory, servers) is expected, (busy, idle)


def test_one_busy_call_does_not_move_a_trajectory_off_its_server() -> None:
    servers = boxes(2)
    for trajectory in IDS[:100]:
        first = rank(trajectory, servers)[0]
        first.in_flight = 1  # bound ceil(1.5 * 2 / 2) = 2: one call in flight leaves room
        assert choose(trajectory, servers) is first
        first.in_flight = 0


def test_a_burst_of_new_trajectories_never_loads_a_server_past_its_bound() -> None:
    servers = boxes(4)
    for n, trajectory in enumerate(IDS[:400]):
        bound = load_bound(n, len(servers))
        chosen = choose(trajectory, servers)
        assert chosen.in_flight < bound
        chosen.in_flight += 1  # none finishes: the worst case for balance
    assert max(s.in_flight for s in servers) <= load_bound(399, 4)
    assert min(s.in_flight for s in servers) >= 80  # 100 each on average


def test_a_single_server_takes_every_call_whatever_its_load() -> None:
    (only,) = servers = boxes(1)
    only.in_flight = 1000
    assert choose("any", servers) is only


def test_ids_with_lone_surrogates_or_any_length_are_placed() -> None:
    servers = boxes(2)
    for trajectory in ("", "\udcff", "é" * 1000, "x" * 100_000):
        assert choose(trajectory, servers) in servers


def test_no_candidate_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no candidate"):
        choose("t", [])
