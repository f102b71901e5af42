"""Rewards that see the sample: task.reward_fn in both forms, async ones awaited together, group
rewards, and a remote reward service (a real HTTP server on this machine) that answers, answers
garbage, or dies mid-run."""

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from relax.errors import ConfigError, RolloutError
from relax.logger import read_metrics
from relax.sample import Sample
from relax.task.rewards import Rewards

from .conftest import run_loop


def samples(n=8, group=4):
    return [Sample(i, i // group, f"q{i}", [1, 2, 3], 1, response=str(i % 3), label="1",
                   metadata={"bonus": i / 10}) for i in range(n)]


def numpy_reward(response, label):  # a scorer that computes with numpy
    import numpy as np

    return np.float32(0.5)


def with_bonus(sample):  # the whole Sample
    return float(sample.response == sample.label) + sample.metadata["bonus"]


IN_FLIGHT = {"now": 0, "max": 0}


async def slow_async(response, label):
    IN_FLIGHT["now"] += 1
    IN_FLIGHT["max"] = max(IN_FLIGHT["max"], IN_FLIGHT["now"])
    await asyncio.sleep(0.05)
    IN_FLIGHT["now"] -= 1
    return len(response)


def ranks(group):  # a group reward: each response's rank among its group's
    order = sorted(range(len(group)), key=lambda i: (group[i].response, i))
    return [float(order.index(i)) for i in range(len(group))]


def wrong_length(group):
    return [1.0]


def raises(response, label):
    if response == "2":
        raise ZeroDivisionError("bad digit")
    return 1.0


def a_string(response, label):
    return "1.0"


def score(rewards, items=None, group=4):
    items = items or samples()
    rewards.score(items, group)
    return [s.reward for s in items]


def test_reward_fn_takes_response_and_label_or_the_whole_sample():
    assert score(Rewards("relax.task.arithmetic.exact_match")) == [0, 1, 0, 0, 1, 0, 0, 1]
    assert score(Rewards("tests.test_rewards.with_bonus")) == pytest.approx(
        [0, 1.1, 0.2, 0.3, 1.4, 0.5, 0.6, 1.7])
    rewards = score(Rewards("tests.test_rewards.numpy_reward"))  # any real number, as a float
    assert rewards == [0.5] * 8 and all(type(r) is float for r in rewards)


def test_exact_match_ignores_surrounding_whitespace_and_an_infinite_reward_stops_the_rollout():
    from relax.errors import NonFiniteError
    from relax.task import check_rewards
    from relax.task.arithmetic import exact_match

    assert exact_match(" 46\n", "46") == 1.0 and exact_match("46", " 46 ") == 1.0
    assert exact_match("4 6", "46") == 0.0
    items, message = samples(3), r"1 non-finite reward\(s\) from src; first: reward={} for sample 1"
    for reward in (float("inf"), float("-inf")):
        items[1].reward = reward
        with pytest.raises(NonFiniteError, match=message.format(reward)):
            check_rewards(items, "src")


def test_async_rewards_are_awaited_concurrently():
    IN_FLIGHT.update(now=0, max=0)
    assert score(Rewards("tests.test_rewards.slow_async")) == [1] * 8
    assert IN_FLIGHT["max"] == 8  # all eight were in flight at once


def test_group_rewards_score_a_prompts_samples_together():
    assert score(Rewards("unused", group_reward_fn="tests.test_rewards.ranks")) == [0, 2, 3, 1, 1, 3, 0, 2]
    with pytest.raises(RolloutError, match=r"task.group_reward_fn=tests.test_rewards.wrong_length returned "
                                           r"\[1.0\] for the 4 samples of group 0: expected a list of 4"):
        score(Rewards("unused", group_reward_fn="tests.test_rewards.wrong_length"))


def test_a_raising_or_non_numeric_reward_is_named():
    with pytest.raises(RolloutError) as e:
        score(Rewards("tests.test_rewards.raises"))
    message = str(e.value)
    assert message.startswith("task.reward_fn=tests.test_rewards.raises raised on sample 2 (prompt='q2', "
                              "response='2', label='1')")
    assert "Traceback" in message and 'raise ZeroDivisionError("bad digit")' in message
    with pytest.raises(RolloutError, match=r"returned '1.0' \(a str\) for sample 0 .*: a reward must be a "
                                           r"number"):
        score(Rewards("tests.test_rewards.a_string"))


@pytest.mark.parametrize("kwargs,message", [
    ({"reward_fn": "tests.test_rewards.samples"}, "takes 0 required arguments"),
    ({"reward_fn": "tests.test_rewards.nope"}, "task.reward_fn='tests.test_rewards.nope' does not import"),
    ({"reward_fn": "x", "group_reward_fn": "tests.test_rewards.ranks", "reward_url": "http://h"}, "both set"),
    ({"reward_fn": "x", "reward_url": "http://h", "reward_batch_size": 0}, "reward_batch_size=0"),
    ({"reward_fn": "x", "reward_url": "http://h", "reward_timeout_s": 0},
     r"reward_timeout_s=0: expected a number of seconds > 0"),
])
def test_bad_reward_settings_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Rewards(**kwargs)


# -- a remote reward service ----------------------------------------------------------------------

class RewardServer:
    """A real HTTP reward service on a free local port: exact match, or garbage, and it can stop
    itself after `serve` requests (a killed service: connections refused from then on)."""

    def __init__(self, mode="exact", serve=None):
        self.mode, self.left, self.requests, self.sent = mode, serve, [], []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(len(body["samples"]))
                rewards = [float(s["response"] == s["label"]) for s in body["samples"]]
                server.sent.append(rewards)
                answer = json.dumps({"rewards": rewards}).encode() if server.mode == "exact" else b"not json"
                self.send_response(200)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)
                if server.left is not None:
                    server.left -= 1
                    if server.left == 0:
                        threading.Thread(target=server.kill).start()

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/score"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def kill(self):
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def server():
    servers = []

    def start(*args, **kwargs):
        servers.append(RewardServer(*args, **kwargs))
        return servers[-1]
    yield start
    for s in servers:
        s.kill()


def test_remote_rewards_come_in_batches(server):
    s = server()
    items = samples(10)
    rewards = score(Rewards("x", reward_url=s.url, reward_batch_size=4), items, 2)
    assert rewards == [0, 1, 0, 0, 1, 0, 0, 1, 0, 0]
    assert sorted(s.requests) == [2, 4, 4]


def test_garbage_or_no_service_is_an_error_after_the_retries_never_a_zero(server, monkeypatch):
    s = server("garbage")
    with pytest.raises(RolloutError, match=rf"task.reward_url={s.url}: no usable answer for samples 0..7 "
                                           r"after 3 attempts .* JSONDecodeError"):
        score(Rewards("x", reward_url=s.url, reward_retries=2))
    assert s.requests == [8, 8, 8]
    s.kill()  # nobody listens on that port now
    waits, sleep = [], asyncio.sleep

    async def recorded_sleep(seconds, *args, **kwargs):  # the backoffs, not the clock: no timing flakes
        waits.append(seconds)
        return await sleep(seconds, *args, **kwargs)

    monkeypatch.setattr(asyncio, "sleep", recorded_sleep)
    with pytest.raises(RolloutError, match=r"after 3 attempts .*ConnectError"):
        score(Rewards("x", reward_url=s.url, reward_retries=2))
    assert [w for w in waits if w >= 0.1] == [0.5, 1.0]  # before each retry, doubling; none after the last


def test_a_run_scored_remotely_stops_clearly_when_the_service_dies(tmp_path, server):
    """Three rollouts scored by the service; it dies; the fourth rollout stops the run after the
    retries, before anything trains on it."""
    s = server(serve=3)
    with pytest.raises(RolloutError, match=rf"task.reward_url={s.url}: no usable answer .* after 2 attempts"):
        run_loop(tmp_path, f"task.reward_url={s.url}", "task.reward_retries=1", "rollout.num_rollout=5",
                 "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
                 "checkpoint.save_interval=1", "checkpoint.keep_last=null")
    rollouts, steps = read_metrics(tmp_path)
    assert [r["rollout_id"] for r in rollouts] == [0, 1, 2] and len(steps) == 3
    assert [r["rollout/raw_reward"] for r in rollouts] == [sum(x) / 16 for x in s.sent]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "rollout_000000", "rollout_000001", "rollout_000002"]  # nothing of rollout 3
