"""deploy/flower_malloc.py: with GRAPHFL_FLOWER_MALLOC=release graphfl's SuperLink and SuperNode wrappers
start with glibc's 1 MiB mmap threshold (unless the user set one); their children (ServerApp,
workers) do not get it; off by default."""

from __future__ import annotations

import sys

import pytest

from graphfl.deploy.federation import FederationError, LocalFederation, superlink_argv, supernode_argv
from graphfl.deploy.flower_malloc import (
    MMAP_THRESHOLD_ENV,
    OWN_ENV,
    SWITCH_ENV,
    describe,
    flower_malloc_env,
    keep_to_this_process,
    process_env,
)

ON = {MMAP_THRESHOLD_ENV: "1048576"}
REL = {SWITCH_ENV: "release"}
WRAPPED = {**ON, OWN_ENV: MMAP_THRESHOLD_ENV}
SUPERLINK = [sys.executable, "-m", "graphfl.deploy.superlink", "--", "--host", "127.0.0.1"]
SUPERNODE = ["ip", "netns", "exec", "ns0", sys.executable, "-m", "graphfl.deploy.supernode", "--", "--insecure"]


def test_off_by_default() -> None:
    for environ in ({}, {"PATH": "/usr/bin"}, {SWITCH_ENV: "default"}, {SWITCH_ENV: ""}):
        assert flower_malloc_env(environ) == {}
        assert process_env(SUPERLINK, environ) == {}
    assert "glibc's default" in describe({}, {})


def test_added_when_asked() -> None:
    assert flower_malloc_env(REL) == ON
    assert flower_malloc_env({SWITCH_ENV: " Release "}) == ON
    assert flower_malloc_env({**REL, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == ON
    assert "for the SuperLink and SuperNodes" in describe(REL, ON)


def test_bad_switch_is_refused(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="GRAPHFL_FLOWER_MALLOC must be one of .*'on'"):
        flower_malloc_env({SWITCH_ENV: "on"})
    monkeypatch.setenv(SWITCH_ENV, "yes")
    with pytest.raises(FederationError, match="GRAPHFL_FLOWER_MALLOC"):
        LocalFederation(tmp_path, 2)


@pytest.mark.parametrize("environ", [
    {**REL, MMAP_THRESHOLD_ENV: "65536"},                                  # the user's own value is kept
    {**REL, MMAP_THRESHOLD_ENV: ""},
    {**REL, "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=2097152"},      # or the tunable form
])
def test_not_added_when_the_user_set_a_threshold(environ: dict[str, str]) -> None:
    assert flower_malloc_env(environ) == {}
    assert process_env(SUPERLINK, environ) == {}
    assert "from the environment" in describe(environ, {})


def test_only_graphfls_wrappers_get_it() -> None:
    assert process_env(SUPERLINK, REL) == WRAPPED
    assert process_env(SUPERNODE, REL) == WRAPPED     # behind a prefix too
    assert process_env(["flower-superlink", "--insecure"], REL) == {}   # stock: its children would inherit it
    assert process_env(["flower-supernode", "--insecure"], REL) == {}
    assert process_env([sys.executable, "-m", "graphfl.deploy.warm", "executor"], REL) == {}


def test_the_wrapper_keeps_it_to_itself() -> None:
    env = {"PATH": "/bin", **WRAPPED}
    assert keep_to_this_process(env) == ON
    assert env == {"PATH": "/bin"}                   # what the ServerApp / workers inherit
    user = {MMAP_THRESHOLD_ENV: "65536"}             # the user's own setting (no marker) reaches everyone
    assert keep_to_this_process(user) == {} and user == {MMAP_THRESHOLD_ENV: "65536"}
    odd = {OWN_ENV: "PATH,MALLOC_ARENA_MAX", "PATH": "/bin", "MALLOC_ARENA_MAX": "2"}
    assert keep_to_this_process(odd) == {"MALLOC_ARENA_MAX": "2"} and odd == {"PATH": "/bin"}


def test_federation_process_env(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the launcher hands to its SuperLink and SuperNodes (no process is started)."""
    for name in (MMAP_THRESHOLD_ENV, SWITCH_ENV, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    sl = superlink_argv("127.0.0.1", 9092, None)
    fed = LocalFederation(tmp_path / "a", 2)                   # default: nothing added anywhere
    assert process_env(sl, fed.group.base_env()) == {} and not fed.malloc_added
    monkeypatch.setenv(SWITCH_ENV, "release")
    fed = LocalFederation(tmp_path / "b", 2)
    base = fed.group.base_env()
    assert MMAP_THRESHOLD_ENV not in base                      # not for every process of the group
    assert process_env(sl, base) == WRAPPED
    assert process_env(supernode_argv("127.0.0.1:9092", 9094, 0, 2, None, clientapp_mode="warm"), base) == WRAPPED
    assert process_env(superlink_argv("127.0.0.1", 9092, None, middleware="stock"), base) == {}
    assert fed.malloc_added == ON
    # a caller's explicit env wins (and then reaches every process, as the user's own setting does)
    fed = LocalFederation(tmp_path / "c", 2, env={MMAP_THRESHOLD_ENV: "4194304"})
    assert fed.group.base_env()[MMAP_THRESHOLD_ENV] == "4194304"
    assert process_env(sl, fed.group.base_env()) == {}
