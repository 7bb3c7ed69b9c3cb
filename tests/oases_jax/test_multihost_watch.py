"""The multi-process watch (`oases_jax.multihost`) against a fake coordination store: which
silences end the process, with which line and code, and which do not."""

import threading
import time

import pytest

from oases_jax import multihost

PREFIX = multihost._PREFIX
TIMEOUT = 0.5  # seconds; the watch polls every TIMEOUT / 5


class Store:
    """The two calls of jax's coordination client the watch uses; `down` makes them fail."""

    def __init__(self):
        self.kv, self.down = {}, False

    def key_value_set(self, key, value, allow_overwrite):
        if self.down:
            raise RuntimeError("UNAVAILABLE")
        self.kv[key] = value

    def key_value_dir_get(self, prefix):
        if self.down:
            raise RuntimeError("UNAVAILABLE")
        return [(k, v) for k, v in list(self.kv.items()) if k.startswith(prefix)]


@pytest.fixture
def watch(monkeypatch):
    """A watch of process 0 of 2; yields (watch, store, ended), `ended` filled by its verdict."""
    ended = []

    def die(message, code):
        ended.append((message, code))
        threading.Event().wait()  # as os._exit would, this thread goes no further

    monkeypatch.setattr(multihost, "_die", die)
    store = Store()
    w = multihost._Watch(store, 0, 2, TIMEOUT, "10.0.0.1:1234")
    w.start()
    yield w, store, ended
    # End this watch under the fake _die: its threads would otherwise reach the real one.
    w.leaving = w.leaving if w.leaving is not None else 0
    store.down = True
    end = time.monotonic() + 3 * TIMEOUT
    while not w.verdict.locked() and time.monotonic() < end:
        time.sleep(0.02)
    assert w.verdict.locked()


def beat(store, j, seconds):
    def run():
        end, n = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            store.kv[f"{PREFIX}beat/{j}"] = str(n)
            n += 1
            time.sleep(TIMEOUT / 10)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def wait_for(ended, seconds):
    end = time.monotonic() + seconds
    while not ended and time.monotonic() < end:
        time.sleep(0.02)
    return ended[:1]


def test_a_peer_that_stops_beating_is_named(watch):
    w, store, ended = watch
    cleaned = []
    w.hooks.append(lambda: cleaned.append(True))
    beat(store, 1, 0.6).join()
    stopped = time.monotonic()
    (message, code), = wait_for(ended, 3 * TIMEOUT)
    assert TIMEOUT * 0.8 < time.monotonic() - stopped < TIMEOUT + 0.5
    assert code == multihost.EXIT_PEER_LOST and cleaned == [True]
    assert message.startswith("process 1 of 2 was lost (no heartbeat for 0.5 s, --peer-timeout)"
                              "; this process stops too. Completed checkpoints are kept")


def test_beating_peers_and_finished_peers_are_not_lost(watch):
    w, store, ended = watch
    beat(store, 1, 1.5).join()
    assert not ended
    store.kv[f"{PREFIX}exit/1"] = "0"  # finished its work; silent from now on
    assert not wait_for(ended, 3 * TIMEOUT)


def test_a_peer_that_failed_stops_this_one(watch):
    _, store, ended = watch
    beat(store, 1, 0.3)
    store.kv[f"{PREFIX}exit/1"] = "2"
    (message, code), = wait_for(ended, 2 * TIMEOUT)
    assert code == multihost.EXIT_PEER_LOST
    assert message.startswith("process 1 of 2 ended with exit code 2, so this run cannot go on")


def test_a_silent_store_means_the_coordinator_is_lost(watch):
    _, store, ended = watch
    beat(store, 1, 3.0)
    time.sleep(0.2)
    store.down = True
    (message, code), = wait_for(ended, 3 * TIMEOUT)
    assert code == multihost.EXIT_PEER_LOST
    assert message.startswith("lost contact with the coordinator (process 0, 10.0.0.1:1234) "
                              "for 0.5 s")


def test_after_its_own_work_a_process_leaves_quietly(watch):
    w, store, ended = watch
    beat(store, 1, 0.3)
    multihost._WATCH = w
    try:
        multihost.leave(0)
        assert store.kv[f"{PREFIX}exit/0"] == "0"
        assert wait_for(ended, 3 * TIMEOUT) == [(None, 0)]  # a peer's silence: exit 0, no line
    finally:
        multihost._WATCH = None
