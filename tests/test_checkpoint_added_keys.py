"""A checkpoint written before a configuration key existed resumes only for the keys listed as
added later, at the value that keeps the earlier behaviour; anything else missing is refused."""

from __future__ import annotations

import pytest

from graphfl.common.config import parse_run_config
from graphfl.server.checkpoint import ADDED_KEYS, CheckpointError, check_config, fingerprint

CFG = parse_run_config({"strategy": "fedavg", "task": "digits", "nodes": 3, "rounds": 4})


def _meta(config: dict) -> dict:
    return {"config": config, "round": 2}


def test_a_key_added_later_may_be_missing_while_at_its_listed_value():
    old = {k: v for k, v in fingerprint(CFG).items() if k not in ADDED_KEYS}
    check_config(_meta(old), CFG)
    changed = parse_run_config({"strategy": "fedavg", "task": "digits", "nodes": 3, "rounds": 4,
                                "data.cluster-std": 0.3})
    with pytest.raises(CheckpointError, match="data.cluster-std"):
        check_config(_meta(old), changed)


def test_an_empty_or_truncated_configuration_is_refused():
    with pytest.raises(CheckpointError, match="names no strategy"):
        check_config(_meta({}), CFG)
    truncated = {k: v for k, v in fingerprint(CFG).items() if k != "train.lr"}
    with pytest.raises(CheckpointError, match="train.lr"):
        check_config(_meta(truncated), CFG)


def test_keys_added_later_leave_the_config_hash_of_runs_that_do_not_use_them_unchanged():
    from graphfl.common.config import HASH_OMIT_AT_DEFAULT, config_hash

    assert set(ADDED_KEYS) <= set(HASH_OMIT_AT_DEFAULT)
    assert all(HASH_OMIT_AT_DEFAULT[k] == v for k, v in ADDED_KEYS.items())
    base = {"strategy": "fedavg", "task": "digits", "nodes": 3, "rounds": 4}
    for key, value in ADDED_KEYS.items():
        assert config_hash(parse_run_config({**base, key: value})) == config_hash(parse_run_config(base))
    assert config_hash(parse_run_config({**base, "data.client-samples": 5})) != config_hash(parse_run_config(base))
